"""rl_kernel_ws2: RL-Kernel's published WS2 vocab-parallel logprob algorithm.

Re-implemented here from its published description (the real `rl_engine` package is
not called; see `note` in the report):

  1. one canonical padded vocabulary, independent of TP, cut into 64 fixed tiles;
     every shard boundary falls on a tile boundary (TP must divide 64)
  2. each rank: fp32 (max, sumexp) of each of its tiles, each tile reduced as the same
     contiguous [n, tile] shape on any rank
  3. all_gather of the tile partials (bytes only, no arithmetic)
  4. every rank merges the 64 tiles in fixed tile order over an [n, 64] shape:
     M = max_t m_t, LSE = M + log(sum_t s_t * exp(m_t - M))
  5. the target logit is copied from the rank that owns it, never summed
  6. logprob = target logit - LSE
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, all_gather_cat, owned_target, package_version, round_up

NUM_TILES = 64


class RLKernelWS2(Candidate):
    name = "rl_kernel_ws2"
    implementation = "re-implementation"
    summary = (
        "re-implementation of RL-Kernel's WS2 algorithm: 64 fixed vocab tiles, fp32 "
        "(max, sumexp) per tile, all_gather of partials, fixed-order merge, owner's target"
    )

    def __init__(self):
        version = package_version("rl_engine") or package_version("rl-engine")
        self.note = (
            "the real rl_engine is not installed"
            if version is None
            else f"rl_engine {version} is installed; this harness measures the "
            "re-implementation of the published algorithm"
        )

    def describe(self) -> dict:
        return {**super().describe(), "details": {"num_tiles": NUM_TILES}}

    def padded_vocab(self, vocab_size: int, tp: int) -> int:
        if NUM_TILES % tp:
            raise ValueError(f"WS2 needs tile-aligned shards: tp must divide {NUM_TILES}, got {tp}")
        return round_up(vocab_size, NUM_TILES)  # canonical: the same at every TP

    def build(self, ctx: ShardContext):
        tile = ctx.padded_vocab // NUM_TILES
        local_tiles = ctx.shard_width // tile
        return lambda logits, target: ws2_logprobs(logits, target, ctx, tile, local_tiles)


def tile_partials(x: torch.Tensor, tile: int, local_tiles: int) -> torch.Tensor:
    """(n, local_tiles, 2) fp32 (max, sumexp) per tile; (-inf, 0) for an all-padding tile."""
    tiles = x.view(x.shape[0], local_tiles, tile)  # (n, T_local, tile), contiguous tiles
    m = tiles.amax(dim=-1)
    live = m > float("-inf")
    shifted = tiles - torch.where(live, m, 0.0).unsqueeze(-1)
    s = shifted.exp().sum(dim=-1)
    return torch.stack((m, torch.where(live, s, 0.0)), dim=-1)


def ws2_logprobs(logits, target, ctx: ShardContext, tile: int, local_tiles: int) -> torch.Tensor:
    n = logits.shape[0]
    x = logits.to(torch.float32)
    # --- 2. per-tile partials, and this rank's copy of the target logit ---
    partials = tile_partials(x, tile, local_tiles).reshape(n, 2 * local_tiles)
    owned, local = owned_target(target, ctx)
    mine = torch.where(owned, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    packed = torch.cat((partials, mine.unsqueeze(-1)), dim=-1)  # (n, 2 T_local + 1)
    # --- 3. all_gather: rank order is tile order ---
    gathered = all_gather_cat(packed.unsqueeze(0), ctx, dim=0)  # (tp, n, 2 T_local + 1)
    stats = gathered[..., :-1].reshape(ctx.tp, n, local_tiles, 2)
    stats = stats.permute(1, 0, 2, 3).reshape(n, NUM_TILES, 2)  # (n, 64, 2)
    # --- 4. fixed-order merge over [n, 64] ---
    m_t, s_t = stats[..., 0], stats[..., 1]
    big_m = m_t.amax(dim=-1)
    lse = big_m + (s_t * (m_t - big_m.unsqueeze(-1)).exp()).sum(dim=-1).log()
    # --- 5. the owner's target logit, copied ---
    owner = (target // ctx.shard_width).clamp(0, ctx.tp - 1)
    target_logit = gathered[owner, torch.arange(n, device=target.device), -1]
    return target_logit - lse
