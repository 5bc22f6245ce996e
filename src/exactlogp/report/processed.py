"""The processed-logprobs table: temperature, then a min-p / top-k / top-p cut, then the
log-softmax over the kept set (what a rollout sampling with that cut reports), by three
rows on the same seeded logits:

  exactlogp          `exactlogp.processed_logprobs`, the exact cut of docs/numerics.md
                     section 13 (radix select over the shards; TP ranks each hold a shard)
  vllm_topk_topp     vLLM's float cut: vLLM's own `apply_top_k_top_p` when vLLM imports,
                     else a torch re-implementation of vLLM 0.34's (named so): min-p as
                     `y >= max + log(min_p)` in fp32, top-k by the k-th largest value, top-p
                     by an fp32 cumulative sum of the ascending-sorted softmax; then an fp32
                     log_softmax of the cut row. At TP > 1 each rank all-gathers the row, as
                     vLLM's sampler gets full logits
  trl_unnormalised   TRL's replay: `trl.trainer.utils.selective_log_softmax` at the
                     temperature, over the full vocabulary (no cut, no renormalisation);
                     TRL does not split the vocabulary, so it has no TP column

Measured: the kept set and the logprobs at TP n (the largest requested) against TP 1, bit
for bit; each check row alone against the whole batch; the distinct results over the
repeats; the rows whose kept set differs from the fp64 truth's; the targets outside a
row's own kept set (logprob -inf); the error of the other targets' logprobs against the
fp64 truth (the processed logprob of an independent fp64 cut: softmax in fp64, min-p
against min_p times the largest probability, the k-th largest value, the smallest set of
largest values whose renormalised fp64 mass reaches p; ties at a threshold kept).
Targets are drawn from the truth's processed distribution (seeded).
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..testing import llm_like_logits, ulp32
from ..worlds import run_gloo_world

CUT = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}
ROWS = ("exactlogp", "vllm_topk_topp", "trl_unnormalised")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- the fp64 truth ---


def truth_keep(x: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """(N, V) bool: the fp64 cut of y = fp32(x) / T (module docstring)."""
    y = (x.float() / torch.tensor(temperature, dtype=torch.float32)).double()
    p = torch.softmax(y, -1)
    keep = p >= min_p * p.max(-1, keepdim=True).values
    if top_k and top_k < y.shape[-1]:
        kth = torch.where(keep, y, -math.inf).topk(top_k, -1).values[:, -1:]
        keep &= y >= kth
    if top_p < 1.0:
        ys = torch.where(keep, y, -math.inf)
        order = ys.argsort(-1, descending=True)
        sorted_y = ys.gather(-1, order)
        mass = torch.where(keep, p, 0.0).gather(-1, order)
        cum = mass.cumsum(-1) / mass.sum(-1, keepdim=True)
        first = (cum >= top_p).int().argmax(-1, keepdim=True)  # the first index reaching p
        keep &= y >= sorted_y.gather(-1, first)
    return keep


def truth_logprobs(x, target, keep, temperature) -> torch.Tensor:
    y = (x.float() / torch.tensor(temperature, dtype=torch.float32)).double()
    lp = torch.log_softmax(y.masked_fill(~keep, -math.inf), -1)
    return lp.gather(-1, target[:, None])[:, 0]


# --- the rows ---


def _exactlogp(x, t, group=None, start=None, vocab=None):
    from .. import processed_logprobs

    shard = {} if group is None else {"tp_group": group, "vocab_start": start, "vocab_size": vocab}
    res = processed_logprobs(x, t, **shard, **CUT)
    return res.logprobs, res.mask.keep_mask


def _vllm_function():
    """(vLLM's apply_top_k_top_p, its description) or (None, why not)."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except Exception as exc:  # vLLM absent, or it fails to import on this machine
        return None, f"{type(exc).__name__}: {exc}"
    return apply_top_k_top_p, "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p"


def _float_top_k_top_p(y: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """A torch re-implementation of vLLM 0.34's float top-k / top-p on (N, V) fp32 values:
    ascending sort; values below the k-th largest to -inf; an fp32 softmax of the sorted
    row, its cumulative sum, and the values whose cumulative sum is <= 1 - p to -inf (the
    largest always kept); scattered back."""
    vals, idx = y.sort(-1)
    if k and k < y.shape[-1]:
        kth = vals[:, -k : -k + 1]
        vals = vals.masked_fill(vals < kth, -math.inf)
    if p < 1.0:
        cum = vals.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        vals = vals.masked_fill(drop, -math.inf)
    return torch.empty_like(y).scatter_(-1, idx, vals)


def _vllm(x, t, group=None, start=None, vocab=None):
    if group is not None:  # the sampler gets full rows: gather the shards
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        x = torch.cat(parts, -1)[:, :vocab]
    y = x.float() / torch.tensor(CUT["temperature"], dtype=torch.float32)
    if CUT["min_p"]:  # V2's min-p on the logits: y >= max + log(min_p), in fp32
        bound = y.max(-1, keepdim=True).values + math.log(CUT["min_p"])
        y = y.masked_fill(y < bound, -math.inf)
    fn, _ = _vllm_function()
    k = torch.full((y.shape[0],), CUT["top_k"], dtype=torch.int64)
    p = torch.full((y.shape[0],), CUT["top_p"], dtype=torch.float32)
    y = fn(y, k, p) if fn is not None else _float_top_k_top_p(y, CUT["top_k"], CUT["top_p"])
    keep = y > -math.inf
    lp = torch.log_softmax(y, -1).gather(-1, t[:, None])[:, 0]
    if group is not None:  # this rank's columns, like the other rows
        keep = keep[:, start : start + x.shape[-1] // dist.get_world_size(group)]
    return lp, keep


def _trl(x, t, group=None, start=None, vocab=None):
    from .candidates.base import real_attribute

    fn = real_attribute("trl.trainer.utils", "selective_log_softmax")
    lp = fn(x, t, temperature=CUT["temperature"]).float()
    return lp, torch.ones_like(x, dtype=torch.bool)


FUNCTIONS = {"exactlogp": _exactlogp, "vllm_topk_topp": _vllm, "trl_unnormalised": _trl}


def _available(name: str) -> str | None:
    """None if the row runs here, else why not."""
    if name == "trl_unnormalised":
        from .candidates.base import Unavailable, real_attribute

        try:
            real_attribute("trl.trainer.utils", "selective_log_softmax")
        except Unavailable as exc:
            return str(exc)
    return None


def _implementation(name: str) -> str:
    if name == "exactlogp":
        return "exactlogp.processed_logprobs (exact cut, radix select over the shards)"
    if name == "vllm_topk_topp":
        fn, what = _vllm_function()
        if fn is not None:
            return f"vLLM's own {what}; min-p as y >= max + log(min_p) in fp32"
        return (
            "re-implementation of vLLM 0.34's float min-p / top-k / top-p (vLLM does not "
            "import here); fp32 log_softmax of the cut row"
        )
    return "trl.trainer.utils.selective_log_softmax at the temperature, full vocabulary"


# --- measurement ---


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tp_rank(rank, world, group, x, t, names):
    """Each row's (logprobs, this rank's keep columns) on this rank's vocabulary shard."""
    width = x.shape[-1] // world
    start = rank * width
    shard = x[:, start : start + width]
    out = {}
    for name in names:
        lp, keep = FUNCTIONS[name](shard, t, group, start, x.shape[-1])
        out[name] = (lp, keep)
    return out


def measure(tokens: int, vocab: int, dtype: str, tp: int, repeats: int, check_rows: int,
            seed: int = 0) -> dict:  # fmt: skip
    """The table's data (see the module docstring); `tp` the TP degree compared with 1."""
    x, _ = llm_like_logits(tokens, vocab, DTYPES[dtype], seed=seed)
    keep = truth_keep(x, **CUT)
    y = (x.float() / torch.tensor(CUT["temperature"])).double()
    probs = torch.softmax(y.masked_fill(~keep, -math.inf), -1)
    t = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed + 1))[:, 0]
    truth = truth_logprobs(x, t, keep, CUT["temperature"])
    rows = {}
    runnable = []
    for name in ROWS:
        why = _available(name)
        if why is not None:
            rows[name] = {"unavailable": why}
        else:
            runnable.append(name)
    tp_results = {}
    if tp > 1 and vocab % tp == 0:
        shardable = [n for n in runnable if n != "trl_unnormalised"]
        ranks = run_gloo_world(tp, _tp_rank, x, t, shardable, timeout=600.0)
        for name in shardable:
            tp_results[name] = (ranks[0][name][0], torch.cat([r[name][1] for r in ranks], -1))
    for name in runnable:
        fn = FUNCTIONS[name]
        lp, own_keep = fn(x, t)
        digests = {_digest(lp, own_keep)}
        for _ in range(repeats - 1):
            digests.add(_digest(*fn(x, t)))
        n = min(check_rows, tokens)
        alone = torch.cat([fn(x[i : i + 1], t[i : i + 1])[0] for i in range(n)])
        dropped = lp == -math.inf
        ok = ~dropped
        err = (lp[ok].double() - truth[ok]).abs()
        entry = {
            "implementation": _implementation(name),
            "cut_tp_equals_tp1": None,
            "logprobs_tp_equals_tp1": None,
            "batch_bitwise": bool(torch.equal(alone, lp[:n])),
            "distinct_results_in_repeats": len(digests),
            "rows_cut_differs_from_truth": int((own_keep != keep).any(-1).sum()),
            "dropped_targets": int(dropped.sum()),
            "max_abs_vs_fp64": float(err.max()) if err.numel() else None,
            "max_ulp_vs_fp64": float((err / ulp32(truth[ok])).max()) if err.numel() else None,
            "mean_abs_log_ratio_vs_fp64": float(err.mean()) if err.numel() else None,
        }
        if name in tp_results:
            tp_lp, tp_keep = tp_results[name]
            entry["cut_tp_equals_tp1"] = bool(torch.equal(tp_keep, own_keep))
            entry["logprobs_tp_equals_tp1"] = bool(torch.equal(tp_lp, lp))
        rows[name] = entry
    return {
        "tokens": tokens,
        "vocab": vocab,
        "dtype": dtype,
        **CUT,
        "tp": tp,
        "check_rows": min(check_rows, tokens),
        "repeats": repeats,
        "truth": "fp64 softmax of y = fp32(logits) / T; min-p: p >= min_p max p; top-k: y >= "
        "the k-th largest; top-p: the smallest set of largest y whose renormalised fp64 mass "
        "reaches p (ties at a threshold kept); logprob = y_t - logsumexp over the kept set",
        "rows_in_workload_cut_by_truth": int((~keep).any(-1).sum()),
        "rows": rows,
    }


def failures(processed: dict) -> list[str]:
    """exactlogp's row failing a bitwise check it promises (empty when it holds)."""
    e = processed["rows"].get("exactlogp", {})
    if "unavailable" in e:
        return [f"processed: exactlogp unavailable: {e['unavailable']}"]
    bad = [
        key
        for key in ("cut_tp_equals_tp1", "logprobs_tp_equals_tp1", "batch_bitwise")
        if e.get(key) is False
    ]
    if e.get("distinct_results_in_repeats", 1) != 1:
        bad.append("repeats")
    return [f"processed: exactlogp fails {key}" for key in bad]
