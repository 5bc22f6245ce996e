"""Train/rollout logprob parity as RL systems compute it: each side runs its own forward
passes and its own LM head.

A Qwen3-Next model (transformers' `Qwen3NextConfig` at small width, the real 151936-token
vocabulary, random weights built here from a seed: nothing is downloaded) plays both sides.

- rollout (TP=1): decodes a batch of prompts with its cache (K/V for the full-attention
  layer, conv and recurrent state for the gated-delta-net layers); sequence i stops after
  `new_tokens - stagger * i` tokens, so the decode batch shrinks as sequences finish. At
  every step it samples a token and records, from that step's hidden states and at that
  step's batch size, the token's logprob by every method below.
- trainer (TP=4, a real gloo process group): one prefill pass over the finished sequences
  (batch = all of them), then the LM head split over the vocabulary as Megatron splits it
  (rows padded with zeros to a multiple of 128 * TP), each rank multiplying by its shard.

Logprob methods, each run on both sides, for an LM head in bf16 and in fp32:
  (a) exactlogp.linear_selected_logprobs on each side's own hidden states (exact logits);
  (b) each side's own torch LM head (a matmul) + exactlogp.selected_logprobs;
  (c) the usual pair: megatron-core's vocab_parallel_cross_entropy on the trainer's shards
      vs a vLLM-style fp32 log_softmax of the rollout's logits;
  (d) TRL's selective_log_softmax on each side's full logits, when TRL imports.

A second run samples with a top-k / top-p / min-p cut (default top-k 50, top-p 0.9,
min-p 0.05): the rollout draws each token with `exactlogp.sample` (TP=1) on its exact
logits (`exactlogp.linear_logits`) and records `exactlogp.processed_logprobs`; the trainer
(TP=4) replays (p) `processed_logprobs` on its vocabulary shards, (m) the kept sets the
rollout returned (what vLLM's `--return-sampling-mask` returns: the ids each step kept,
as CSR) with `exactlogp.replay_logprobs`, and, beside them, (u) the unnormalised replay
TRL and verl do today: the log-softmax over the full vocabulary, whose logprob is log S
lower (S: the mass the cut keeps).

Two sources of mismatch are kept apart, token by token: the model body (outside this
library) may already hand the two sides different hidden states -- Qwen3-Next decodes its
linear-attention layers with the recurrent rule and prefills with the chunked one, and
the body's matmuls see other shapes -- and, given a bitwise-equal LM-head input (the final
hidden state in the head's dtype), the LM head and the logprob stage. The table reports
every method on both groups of tokens.

    python examples/train_rollout_parity.py                 # the default run below
    python examples/train_rollout_parity.py --scored bf16,fp32   # score the fp32 body too
    python examples/train_rollout_parity.py --top-k 0 --top-p 1 --min-p 0   # no cut run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import textwrap
import time
import warnings
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from exactlogp import (
    linear_logits,
    linear_selected_logprobs,
    processed_logprobs,
    replay_logprobs,
    sample,
    sampling_mask,
    selected_logprobs,
)
from exactlogp.integrations import kept_csr
from exactlogp.integrations.megatron import megatron_padded_vocab_size
from exactlogp.report.candidates.base import ShardContext, Unavailable, real_attribute
from exactlogp.report.candidates.megatron_ce import MegatronCE
from exactlogp.report.candidates.vllm_gather import VllmGather
from exactlogp.testing import run_gloo_world

VOCAB = 151936  # Qwen3-Next's real vocabulary
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EXACT = "(a) exact fused LM head"
TORCH = "(b) torch LM head + exactlogp"
BASELINE = "(c) Megatron CE TP4 / vLLM TP1"
TRL = "(d) TRL selective_log_softmax"
LOGITS = "    logits, own torch head"  # a row of the table, not a method
METHODS = (EXACT, TORCH, BASELINE, TRL)
PROCESSED = "(p) processed_logprobs TP4 / TP1"
REPLAY = "(m) replay of the rollout's kept sets TP4"
UNNORMALISED = "(u) unnormalised replay TP4"
CUT_METHODS = (PROCESSED, REPLAY, UNNORMALISED)
DROPPING = {PROCESSED: "dropped", REPLAY: "replay dropped"}  # their dropped targets
EQUAL, DIFFER = "equal", "differ"  # the two groups of tokens, by their LM-head input


@dataclass(frozen=True)
class DemoConfig:
    batch: int = 8
    prompt_len: int = 16
    new_tokens: int = 32  # the first sequence's; sequence i gets new_tokens - stagger * i
    stagger: int = 2
    layers: int = 4
    hidden: int = 128
    vocab: int = VOCAB
    tp: int = 4
    seed: int = 0
    # LM-head init std: logits then spread like a trained model's (std ~ 0.2 * sqrt(hidden)),
    # so sampled tokens range from near-certain to unlikely.
    head_std: float = 0.2
    bodies: tuple[str, ...] = ("bf16", "fp32")  # bodies whose hidden states are compared
    scored: tuple[str, ...] = ("bf16",)  # bodies whose logprobs are compared, every head
    heads: tuple[str, ...] = ("bf16", "fp32")  # LM-head dtypes
    # the processed-logprobs run (the bf16 body, sampled from the body-dtype head):
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.05

    def cut(self) -> dict:
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def has_cut(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def lengths(self) -> list[int]:
        """Sampled tokens per sequence (a batch's requests differ in max_tokens; a model
        with random weights practically never samples its end-of-text token)."""
        return [max(1, self.new_tokens - self.stagger * i) for i in range(self.batch)]


@dataclass(frozen=True)
class Stats:
    tokens: int
    equal: int  # tokens whose value is bitwise equal on both sides
    max_abs_diff: float
    mean_ratio_dev: float  # mean |exp(lp_train - lp_rollout) - 1|; NaN for the logits row
    max_ratio_dev: float
    mean_k3: float  # k3 = r - 1 - log r, r = exp(lp_train - lp_rollout): KL(rollout||train)
    mean_abs_diff: float = math.nan  # mean |lp_train - lp_rollout| = mean |log r|
    dropped: int = 0  # trainer targets outside its kept set (left out of the figures above)


@dataclass(frozen=True)
class Row:
    body: str
    head: str
    method: str  # one of METHODS, or LOGITS
    group: str  # EQUAL or DIFFER
    stats: Stats


@dataclass(frozen=True)
class HiddenAgreement:
    body: str
    tokens: int
    equal: int  # tokens whose final hidden state is bitwise equal on both sides
    first_equal: int  # of those, tokens sampled right after the prompt prefill
    first_tokens: int
    max_abs_diff: float


@dataclass
class Side:
    """One side's record, one row per sampled token (sequence-major)."""

    hidden: torch.Tensor  # (T, H) the body's final hidden states, the LM head's input
    logprobs: dict = field(default_factory=dict)  # (head, method) -> (T,) fp32
    logits: dict = field(default_factory=dict)  # head -> (T, V) the own torch head's


@dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    num_tokens: int
    padded_vocab: int
    hidden: dict[str, HiddenAgreement]
    rows: list[Row]
    vllm_impl: str  # what (c)'s rollout side ran
    trl: str | None  # why (d) did not run, None if it did
    seconds: float
    cut_rows: list[Row] = field(default_factory=list)  # the processed run, CUT_METHODS
    cut_hidden: HiddenAgreement | None = None

    def stats(self, body: str, head: str, method: str, group: str) -> Stats:
        for r in (*self.rows, *self.cut_rows):
            if (r.body, r.head, r.method, r.group) == (body, head, method, group):
                return r.stats
        raise KeyError((body, head, method, group))


# --- the model ---


def build_model(cfg: DemoConfig, dtype: torch.dtype):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Qwen3-Next's layout at small width: gated-delta-net (linear attention) layers with a
    # full-attention layer every fourth and last, MoE MLPs with a shared expert.
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 or i == cfg.layers - 1 else "linear_attention"
        for i in range(cfg.layers)
    ]
    config = Qwen3NextConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers, layer_types=layer_types, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=cfg.prompt_len + cfg.new_tokens,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)  # transformers initializes from the global generator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # absent optional kernels: the torch paths run
        model = Qwen3NextForCausalLM(config).eval()
    head = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, cfg.head_std, generator=head)
    return model.to(dtype)


def offsets_of(lengths: list[int]) -> torch.Tensor:
    """(B,) the row of each sequence's first sampled token in the (T, ...) records."""
    return torch.tensor([0, *lengths[:-1]]).cumsum(0)


# --- the rollout: TP=1, one decode step at a time ---


def rollout_scorers(vocab: int):
    """The rollout's logprob methods on one decode step: (A, H) hidden, (V, H) weight,
    (A,) sampled tokens -> ((A, V) own logits, {method: (A,) logprobs}); and how (c) runs."""
    vllm = VllmGather()  # vLLM's own Sampler when it imports, else the re-implementation
    ctx = ShardContext(0, 1, None, torch.device("cpu"), vocab, vocab, 0)
    vllm_logprobs = vllm.build(ctx)
    trl_logprobs, trl_missing = trl_selective_log_softmax()

    def score(hidden, weight, tokens):
        logits = F.linear(hidden, weight)  # (A, V): the rollout's LM head at this batch size
        out = {
            EXACT: linear_selected_logprobs(hidden, weight, tokens).logprobs,
            TORCH: selected_logprobs(logits, tokens).logprobs,
            BASELINE: vllm_logprobs(logits, tokens),
        }
        if trl_logprobs is not None:
            out[TRL] = trl_logprobs(logits, tokens).float()  # TRL gives the head dtype
        return logits, out

    return score, vllm.summary, trl_missing


def trl_selective_log_softmax():
    """(TRL's selective_log_softmax, None), or (None, why not)."""
    try:
        return real_attribute("trl.trainer.utils", "selective_log_softmax"), None
    except Unavailable as exc:
        return None, str(exc)


def _cache_arg() -> str:
    """transformers renamed past_key_values to cache (5.2x); take whichever this one has."""
    import inspect

    from transformers import Qwen3NextModel

    params = inspect.signature(Qwen3NextModel.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


CACHE_ARG = None  # set on first use: transformers is imported lazily


def processed_scorer(cut: dict):
    """The processed run's rollout: (h, w, tokens) -> (exact logits, {PROCESSED: (A,)})."""

    def score(hidden, weight, tokens):
        logits = linear_logits(hidden, weight)  # exact: the same bits at any batch size
        return logits, {PROCESSED: processed_logprobs(logits, tokens, **cut).logprobs}

    return score


def processed_sampler(cut: dict):
    """The processed run's sampler: exactlogp.sample on the exact logits (TP=1)."""

    def draw(hidden, weight, gen):
        return sample(linear_logits(hidden, weight), generator=gen, **cut)

    return draw


def returned_kept_sets(logits: torch.Tensor, cut: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept set of each sampled token, as an engine returns it (vLLM's
    `--return-sampling-mask`: the ids each step kept, sorted), from the exact logits the
    rollout sampled from, as CSR (kept_ids, kept_offsets)."""
    keep = sampling_mask(logits, **cut).keep_mask
    return kept_csr([row.nonzero().flatten() for row in keep])


def _multinomial(hidden, weight, gen):
    probs = F.linear(hidden, weight).float().softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def rollout(
    model, prompts, lengths, weights: dict, score, gen, draw=_multinomial, methods=METHODS
) -> tuple[torch.Tensor, Side]:
    """Decode with the cache, sampling from the body-dtype LM head (`draw`: multinomial on
    the torch head's softmax, or exactlogp.sample); returns the sampled tokens (T,) and the
    record, every value computed at its sampling step."""
    num_tokens, vocab = sum(lengths), model.lm_head.weight.shape[0]
    limit, row0 = torch.tensor(lengths), offsets_of(lengths)
    tokens = torch.empty(num_tokens, dtype=torch.int64)
    body_dtype = model.model.embed_tokens.weight.dtype  # the body's, whatever buffers it keeps
    side = Side(torch.empty(num_tokens, model.config.hidden_size, dtype=body_dtype))
    for head in weights:
        for method in methods:
            side.logprobs[head, method] = torch.empty(num_tokens)
    global CACHE_ARG
    CACHE_ARG = CACHE_ARG or _cache_arg()
    active = torch.arange(len(lengths))  # the sequences still decoding
    out = model.model(input_ids=prompts, use_cache=True)  # the prompt prefill
    for step in range(max(lengths)):
        h = out.last_hidden_state[:, -1]  # (A, H): what the LM head reads at this step
        sampled = draw(h, model.lm_head.weight, gen)  # (A,)
        rows = row0[active] + step
        tokens[rows], side.hidden[rows] = sampled, h
        for head, w in weights.items():
            logits, logprobs = score(h.to(w.dtype), w, sampled)
            if head not in side.logits:  # the scorer's logits dtype (the exact head's: fp32)
                side.logits[head] = logits.new_empty(num_tokens, vocab)
            side.logits[head][rows] = logits
            for method, lp in logprobs.items():
                side.logprobs[head, method][rows] = lp
        going = step + 1 < limit[active]
        if not going.any():
            break
        if not going.all():  # drop the finished rows from every layer's cache
            keep = going.nonzero().squeeze(-1)
            cache_of(out).reorder_cache(keep)
            active, sampled = active[keep], sampled[keep]
        out = model.model(input_ids=sampled[:, None], use_cache=True, **{CACHE_ARG: cache_of(out)})
    return tokens, side


# --- the trainer: one prefill pass, then TP ranks ---


@torch.no_grad()
def prefill(model, prompts, tokens, lengths) -> torch.Tensor:
    """(T, H): the final hidden states at the sampled positions, from one forward pass over
    the finished sequences (right-padded; causal, so padding changes no earlier position)."""
    batch, prompt_len = prompts.shape
    ids = torch.zeros(batch, prompt_len + max(lengths), dtype=torch.int64)
    ids[:, :prompt_len] = prompts
    row0 = offsets_of(lengths)
    for i, n in enumerate(lengths):
        ids[i, prompt_len : prompt_len + n] = tokens[row0[i] : row0[i] + n]
    states = model.model(input_ids=ids).last_hidden_state  # (B, S, H)
    # position prompt_len - 1 + t reads the prefix that sampled token t
    return torch.cat(
        [states[i, prompt_len - 1 : prompt_len - 1 + n] for i, n in enumerate(lengths)]
    )


def _trainer_rank(rank, world_size, group, vocab, jobs):
    """Each job's LM head and logprobs on this rank's vocabulary shard."""
    warnings.filterwarnings("ignore")  # megatron-core warns about absent optional packages
    padded = jobs[0]["weight"].shape[0]
    width = padded // world_size
    cols = slice(rank * width, (rank + 1) * width)
    is_padding = torch.arange(cols.start, cols.stop) >= vocab
    ctx = ShardContext(rank, world_size, group, torch.device("cpu"), vocab, padded, cols.start)
    megatron = MegatronCE()  # the real megatron-core function on Megatron's parallel state
    megatron_ce = megatron.build(ctx)
    try:
        out = []
        for job in jobs:
            hidden, weight, target = job["hidden"], job["weight"][cols], job["target"]
            if job.get("cut") is not None:  # the processed run: exact logits on the shard
                z = linear_logits(hidden, weight)
                shard = {"tp_group": group, "vocab_start": cols.start, "vocab_size": vocab}
                res = processed_logprobs(z, target, **shard, **job["cut"])
                kept = replay_logprobs(z, target, *job["kept"], **shard)  # the rollout's sets
                plain = selected_logprobs(z, target, **shard).logprobs
                out.append({"logits": z, PROCESSED: res.logprobs, "dropped": res.dropped,
                            REPLAY: kept.logprobs, "replay dropped": kept.dropped,
                            UNNORMALISED: plain})  # fmt: skip
                continue
            logits = F.linear(hidden, weight)  # (T, width): ColumnParallelLinear's output
            out.append(
                {
                    "logits": logits,
                    EXACT: linear_selected_logprobs(
                        hidden, weight, target, tp_group=group, vocab_size=vocab
                    ).logprobs,
                    TORCH: selected_logprobs(
                        logits, target, tp_group=group, vocab_size=vocab
                    ).logprobs,
                    # padding masked to -inf: Megatron's best case (zero rows give logit 0)
                    BASELINE: megatron_ce(logits.masked_fill(is_padding, -math.inf), target),
                }
            )
        return out
    finally:
        megatron.teardown()


def trainer(
    cfg: DemoConfig, jobs: dict, vocab_padded: int, cut_jobs: dict | None = None
) -> tuple[dict[str, Side], dict[str, Side]]:
    """jobs: (body, head) -> (hidden (T, H) in the body dtype, weight (V, H) in the head
    dtype, targets (T,)); cut_jobs alike for the processed run. Runs one TP world for all
    of them; returns (body -> record, body -> the processed run's record)."""
    payload = []
    cut_jobs = cut_jobs or {}
    for kind, group in ((None, jobs), (cfg.cut(), cut_jobs)):
        for (_, head), (hidden, weight, target, *kept) in group.items():
            zeros = weight.new_zeros(vocab_padded - weight.shape[0], weight.shape[1])
            padded = torch.cat([weight, zeros])  # zero rows, as a checkpoint converter pads
            payload.append({"hidden": hidden.to(DTYPES[head]), "weight": padded,
                            "target": target, "cut": kind, "kept": kept[0] if kept else None})  # fmt: skip
    ranks = run_gloo_world(cfg.tp, _trainer_rank, cfg.vocab, payload, timeout=1800)
    trl_logprobs, _ = trl_selective_log_softmax()
    cut_sides = {}
    for k, ((body, head), (hidden, *_)) in enumerate(cut_jobs.items(), start=len(jobs)):
        side = cut_sides.setdefault(body, Side(hidden))
        side.logits[head] = torch.cat([r[k]["logits"] for r in ranks], dim=-1)[:, : cfg.vocab]
        for method in (*CUT_METHODS, *DROPPING.values()):
            side.logprobs[head, method] = ranks[0][k][method]
    sides = {}
    for k, ((body, head), (hidden, weight, target)) in enumerate(jobs.items()):
        side = sides.setdefault(body, Side(hidden))
        side.logits[head] = torch.cat([r[k]["logits"] for r in ranks], dim=-1)[:, : cfg.vocab]
        for method in (EXACT, TORCH, BASELINE):
            side.logprobs[head, method] = ranks[0][k][method]
        if trl_logprobs is not None:  # a TRL trainer: no TP, the full head at batch T
            full = F.linear(hidden.to(DTYPES[head]), weight)
            side.logprobs[head, TRL] = trl_logprobs(full, target).float()  # in the head dtype
    return sides, cut_sides


# --- comparison ---


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) True where the rows of a and b have the same bits (any trailing dims)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.contiguous().view(bits) == b.contiguous().view(bits)
    return same.reshape(a.shape[0], -1).all(-1)


def compare(train: torch.Tensor, rollout: torch.Tensor) -> Stats:
    n = train.shape[0]
    if n == 0:
        return Stats(0, 0, *[math.nan] * 4, math.nan)
    d = train.double() - rollout.double()
    equal = int(bitwise_equal(train, rollout).sum())
    if train.dim() > 1:  # logits rows
        return Stats(n, equal, float(d.abs().max()), math.nan, math.nan, math.nan)
    ratio = d.exp()  # the importance ratio pi_train / pi_rollout of the sampled token
    k3 = ratio - 1 - d
    dev = (ratio - 1).abs()
    return Stats(n, equal, float(d.abs().max()), float(dev.mean()), float(dev.max()),
                 float(k3.mean()), float(d.abs().mean()))  # fmt: skip


def hidden_agreement(body, train: Side, roll: Side, lengths) -> HiddenAgreement:
    same = bitwise_equal(train.hidden, roll.hidden)
    first = offsets_of(lengths)
    d = (train.hidden.double() - roll.hidden.double()).abs()
    return HiddenAgreement(
        body, len(same), int(same.sum()), int(same[first].sum()), len(first), float(d.max())
    )


def compare_sides(body, heads, train: Side, roll: Side) -> list[Row]:
    rows = []
    for head in heads:
        # the LM head's input: the body's final hidden states in the head's dtype
        same = bitwise_equal(train.hidden.to(DTYPES[head]), roll.hidden.to(DTYPES[head]))
        for group, mask in ((EQUAL, same), (DIFFER, ~same)):
            for method in METHODS:
                if (head, method) in train.logprobs:
                    a, b = train.logprobs[head, method], roll.logprobs[head, method]
                    rows.append(Row(body, head, method, group, compare(a[mask], b[mask])))
            a, b = train.logits[head], roll.logits[head]
            rows.append(Row(body, head, LOGITS, group, compare(a[mask], b[mask])))
    return rows


def compare_cut(body, heads, train: Side, roll: Side) -> list[Row]:
    """The processed run: (p), (m) and (u) against the rollout's processed logprobs; the
    trainer's dropped targets (logprob -inf under (p) and (m)) are counted and left out of
    their figures."""
    rows = []
    for head in heads:
        same = bitwise_equal(train.hidden.to(DTYPES[head]), roll.hidden.to(DTYPES[head]))
        for group, mask in ((EQUAL, same), (DIFFER, ~same)):
            rollout_lp = roll.logprobs[head, PROCESSED]
            for method in CUT_METHODS:
                dropped = train.logprobs[head, DROPPING[method]] if method in DROPPING else None
                keep = mask if dropped is None else mask & ~dropped
                s = compare(train.logprobs[head, method][keep], rollout_lp[keep])
                if dropped is not None:
                    s = dataclasses.replace(s, dropped=int((mask & dropped).sum()))
                rows.append(Row(body, head, method, group, s))
            a, b = train.logits[head], roll.logits[head]
            rows.append(Row(body, head, LOGITS.replace("own torch head", "exact"), group,
                            compare(a[mask], b[mask])))  # fmt: skip
    return rows


# --- the run ---


def run(cfg: DemoConfig) -> DemoResult:
    start = time.perf_counter()
    for name in (*cfg.bodies, *cfg.scored, *cfg.heads):
        if name not in DTYPES:
            raise ValueError(f"dtype name {name!r} must be one of {sorted(DTYPES)}")
    lengths = cfg.lengths()
    score, vllm_impl, trl_missing = rollout_scorers(cfg.vocab)
    hidden, jobs, rollouts = {}, {}, {}
    cut_jobs, cut_roll, cut_agreement = {}, None, None
    for body in dict.fromkeys((*cfg.bodies, *cfg.scored)):
        model = build_model(cfg, DTYPES[body])
        w = model.lm_head.weight.detach()
        weights = {h: w.to(DTYPES[h]) for h in cfg.heads} if body in cfg.scored else {}
        gen = torch.Generator().manual_seed(cfg.seed + 2)
        prompts = torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen)
        tokens, roll = rollout(model, prompts, lengths, weights, score, gen)
        train_hidden = prefill(model, prompts, tokens, lengths)
        hidden[body] = hidden_agreement(body, Side(train_hidden), roll, lengths)
        rollouts[body] = roll
        for head, weight in weights.items():
            jobs[body, head] = (train_hidden, weight, tokens)
        if body == cfg.scored[0] and cfg.has_cut() and body in cfg.heads:
            # the processed run on this body and its own head dtype: sampled and scored on it
            gen = torch.Generator().manual_seed(cfg.seed + 3)
            cut_weights = {body: weights[body]}
            cut_roll_tokens, cut_roll = rollout(
                model, prompts, lengths, cut_weights, processed_scorer(cfg.cut()), gen,
                draw=processed_sampler(cfg.cut()), methods=(PROCESSED,),
            )  # fmt: skip
            cut_hidden = prefill(model, prompts, cut_roll_tokens, lengths)
            cut_agreement = hidden_agreement(body, Side(cut_hidden), cut_roll, lengths)
            kept = returned_kept_sets(cut_roll.logits[body], cfg.cut())
            cut_jobs = {(body, body): (cut_hidden, weights[body], cut_roll_tokens, kept)}
        del model
    padded = megatron_padded_vocab_size(cfg.vocab, cfg.tp)
    sides, cut_sides = trainer(cfg, jobs, padded, cut_jobs) if jobs else ({}, {})
    rows = []
    for body in cfg.scored:
        rows += compare_sides(body, cfg.heads, sides[body], rollouts[body])
    cut_rows = []
    for body, side in cut_sides.items():
        cut_rows += compare_cut(body, (body,), side, cut_roll)
    return DemoResult(
        cfg, sum(lengths), padded, hidden, rows, vllm_impl, trl_missing,
        time.perf_counter() - start, cut_rows, cut_agreement if cut_jobs else None,
    )  # fmt: skip


# --- report ---


def format_report(res: DemoResult) -> str:
    cfg, lengths = res.config, res.config.lengths()
    lines = [
        f"Qwen3-Next architecture: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, "
        f"random weights (seed {cfg.seed})",
        _wrap(
            f"rollout (TP=1): {cfg.batch} prompts x {cfg.prompt_len} tokens, cached decoding, "
            f"{min(lengths)}..{max(lengths)} tokens per sequence (decode batch {cfg.batch} -> "
            f"{sum(n == max(lengths) for n in lengths)}), {res.num_tokens} tokens; logprobs "
            "recorded at sampling time from that step's hidden states"
        ),
        _wrap(
            f"trainer (TP={cfg.tp}, gloo): one prefill pass over the {cfg.batch} finished "
            f"sequences; vocabulary-parallel LM head padded to {res.padded_vocab} (Megatron)"
        ),
        _wrap(
            "(c) trainer: megatron-core's vocab_parallel_cross_entropy on the shards, padding "
            f"masked to -inf; rollout: {res.vllm_impl}"
        ),
        "(d) TRL: "
        + (f"not run, {res.trl}" if res.trl else "trl.trainer.utils.selective_log_softmax"),
        "",
        "Final hidden states, rollout decode vs trainer prefill:",
    ]
    for a in res.hidden.values():
        lines.append(
            f"  {a.body} body: {a.equal}/{a.tokens} tokens bitwise equal (first sampled token "
            f"of each sequence: {a.first_equal}/{a.first_tokens}), max |diff| {a.max_abs_diff:.3g}"
        )
    lines += [
        "  The model body is outside exactlogp; the table keeps the tokens apart whose LM-head "
        "input differs.",
        "",
        _wrap(
            "Trainer vs rollout, per token. hidden: whether the LM head's input (the final "
            "hidden state in the head's dtype) is bitwise equal on both sides; r = "
            "exp(lp_train - lp_rollout), the importance ratio; k3 = r - 1 - log r, the KL "
            "estimate."
        ),
        _table(res.rows),
        "",
        _wrap(_verdict(res)),
        *_cut_report(res),
        f"wall time {res.seconds:.0f} s",
    ]
    return "\n".join(lines)


def _cut_report(res: DemoResult) -> list[str]:
    cfg, a = res.config, res.cut_hidden
    if a is None:
        return []
    rows = [r for r in res.cut_rows if r.stats.tokens or r.stats.dropped]
    lines = [
        "",
        _wrap(
            f"Processed logprobs: a second rollout of the {a.body} body samples with "
            f"exactlogp.sample (TP=1, temperature 1, top-k {cfg.top_k}, top-p {cfg.top_p}, "
            f"min-p {cfg.min_p}) from its {a.body} exact head and records "
            "exactlogp.processed_logprobs; the trainer (TP=4) replays (p) processed_logprobs "
            "on its shards, (m) the kept sets the rollout returned (exactlogp.replay_logprobs "
            "of the CSR ids: what vLLM's --return-sampling-mask gives), and (u) the "
            "log-softmax over the full vocabulary (TRL's and verl's replay today). |log r| = "
            "|lp_train - lp_rollout|; dropped: the trainer's target outside its kept set "
            "(left out of the figures of (p) and (m))."
        ),
        f"  hidden states bitwise equal: {a.equal}/{a.tokens} tokens",
        _cut_table(rows),
        "",
        _wrap(_cut_verdict(res)),
    ]
    return lines


def _cut_table(rows: list[Row]) -> str:
    width = max(len(m) for m in (*CUT_METHODS, LOGITS))
    out = [
        f"{'head':<4} {'method':<{width}} {'hidden':<6} {'bitwise equal':>13} "
        f"{'mean |log r|':>12} {'max |log r|':>11} {'max |r-1|':>10} {'dropped':>7}"
    ]
    for r in rows:
        s = r.stats
        nums = [_num(x) for x in (s.mean_abs_diff, s.max_abs_diff, s.max_ratio_dev)]
        if r.method.strip().startswith("logits"):
            nums[0] = "-"
        dropped = str(s.dropped) if r.method in DROPPING else "-"
        out.append(
            f"{r.head:<4} {r.method:<{width}} {r.group:<6} {f'{s.equal}/{s.tokens}':>13} "
            f"{nums[0]:>12} {nums[1]:>11} {nums[2]:>10} {dropped:>7}"
        )
    return "\n".join(out)


def processed_holds(res: DemoResult) -> bool:
    """(p) and (m) are bitwise equal, r exactly 1 and nothing dropped on every token whose
    hidden states are equal (and there are such tokens)."""
    equal = [r for r in res.cut_rows if r.method in DROPPING and r.group == EQUAL]
    return bool(equal) and all(
        r.stats.tokens > 0 and r.stats.equal == r.stats.tokens and r.stats.dropped == 0
        and r.stats.max_ratio_dev == 0.0
        for r in equal
    )  # fmt: skip


def _cut_verdict(res: DemoResult) -> str:
    equal = [r for r in res.cut_rows if r.method == PROCESSED and r.group == EQUAL]
    if not any(r.stats.tokens for r in equal):
        return "No token of the processed run has the same hidden states on both sides."
    if not processed_holds(res):
        return "(p) DIFFERS on tokens whose hidden states are bitwise equal: a bug."
    bias = [r for r in res.cut_rows if r.method == UNNORMALISED and r.group == EQUAL]
    return (
        f"On every token whose hidden states are bitwise equal ({equal[0].stats.tokens}), "
        "(p) trainer TP4 and rollout TP1 give the same processed logprob bits, and so does "
        "(m), the replay of the kept sets the rollout returned: r = 1 exactly. The "
        "unnormalised replay (u) is off by log S there: mean |log r| "
        f"{_num(bias[0].stats.mean_abs_diff)}, max {_num(bias[0].stats.max_abs_diff)}."
    )


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100, subsequent_indent="  ", break_on_hyphens=False)


def _table(rows: list[Row]) -> str:
    width = max(len(m) for m in (*METHODS, LOGITS))
    head = (
        f"{'body':<4} {'head':<4} {'method':<{width}} {'hidden':<6} {'bitwise equal':>13} "
        f"{'max |diff|':>10} {'mean |r-1|':>10} {'max |r-1|':>10} {'mean k3':>9}"
    )
    out = [head]
    for r in rows:
        s = r.stats
        if s.tokens == 0:  # an empty group
            continue
        equal = f"{s.equal}/{s.tokens}"
        nums = [_num(x) for x in (s.max_abs_diff, s.mean_ratio_dev, s.max_ratio_dev, s.mean_k3)]
        out.append(
            f"{r.body:<4} {r.head:<4} {r.method:<{width}} {r.group:<6} {equal:>13} "
            f"{nums[0]:>10} {nums[1]:>10} {nums[2]:>10} {nums[3]:>9}"
        )
    return "\n".join(out)


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def exact_holds(res: DemoResult) -> bool:
    """(a) is bitwise equal on every token whose hidden states are, for every body and head."""
    return all(
        r.stats.equal == r.stats.tokens for r in res.rows if r.method == EXACT and r.group == EQUAL
    )


def _verdict(res: DemoResult) -> str:
    equal = [r for r in res.rows if r.method == EXACT and r.group == EQUAL]
    counts = ", ".join(f"{r.stats.tokens} ({r.body} body, {r.head} head)" for r in equal)
    if not any(r.stats.tokens for r in equal):
        return (
            "No token has the same LM-head input on both sides: no method can be expected to agree."
        )
    if exact_holds(res):
        return (
            f"On every token whose LM-head input is bitwise equal on both sides ({counts}), "
            "(a) gives the same logprob bits."
        )
    return f"(a) DIFFERS on tokens whose LM-head input is bitwise equal ({counts}): a bug."


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def main(argv: list[str] | None = None) -> DemoResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    for f in fields(DemoConfig):
        value, flag = getattr(defaults, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, tuple):
            parser.add_argument(flag, type=_names, default=value, help="comma-separated")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    result = run(DemoConfig(**vars(parser.parse_args(argv))))
    print(format_report(result))
    return result


if __name__ == "__main__":
    main()
