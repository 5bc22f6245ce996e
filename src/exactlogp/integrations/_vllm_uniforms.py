"""One uniform per row from vLLM's per-request random stream (imported only with vLLM).

vLLM 0.34's V2 sampler draws its Gumbel noise from a counter-based hash of (request
seed, position, token id) (`murmur3_uniform64` in `vllm.v1.worker.gpu.sample.gumbel`).
The exact cut of `patch_vllm_sampler(cut="exact")` needs one float64 uniform per row for
exactlogp's inverse CDF; this kernel calls vLLM's own hash at the row's seed and position
with offset = the vocabulary size, a counter no token's noise uses. A seeded request
therefore draws the same token on every run, as vLLM's seeded sampling does.
"""

from __future__ import annotations

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.worker.gpu.sample.gumbel import murmur3_uniform64


@triton.jit
def _row_uniform_kernel(out_ptr, req_ptr, seeds_ptr, pos_ptr, offset):
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + row)
    seed = tl.load(seeds_ptr + req)
    pos = tl.load(pos_ptr + row)
    tl.store(out_ptr + row, murmur3_uniform64(seed, pos, offset))


def row_uniforms(
    seeds: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, offset: int
) -> torch.Tensor:
    """(n,) float64 in (0, 1): vLLM's uniform for request slot `req[i]` (its seed in
    `seeds`, the sampler's int64 per-slot tensor) at position `pos[i]`, counter `offset`."""
    req = req.to(torch.int64).contiguous()
    pos = pos.to(torch.int64).contiguous()
    out = torch.empty(req.shape, dtype=torch.float64, device=req.device)
    if req.numel():
        _row_uniform_kernel[(req.numel(),)](out, req, seeds, pos, offset)
    return out
