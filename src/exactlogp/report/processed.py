"""The processed-logprobs table: temperature, then a min-p / top-k / top-p cut, then the
log-softmax over the kept set (what a rollout sampling with that cut reports), by three
rows on the same seeded logits:

  exactlogp          `exactlogp.processed_logprobs`, the exact cut of docs/numerics.md
                     section 13 (radix select over the shards; TP ranks each hold a shard)
  vllm_topk_topp     vLLM's float cut: min-p as vLLM 0.34 V2's kernel has it, `y >= max +
                     log(min_p)` in fp32, then vLLM's own PyTorch top-k / top-p
                     (`apply_top_k_top_p_pytorch`, what it runs on CPU) when vLLM imports --
                     in this process, or else in its own process from the vLLM 0.34 that
                     `make setup` installs under <venv>/hosts -- and otherwise a torch
                     re-implementation of it (named so): top-k by the k-th largest value,
                     top-p by an fp32 cumulative sum of the ascending-sorted softmax; then an
                     fp32 log_softmax of the cut row. vLLM's sampler gets full rows (TP > 1
                     all-gathers them): the re-implementation runs in the TP world, gathering;
                     vLLM's own function runs at TP 1 only
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
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..testing import llm_like_logits, ulp32
from ..worlds import run_gloo_world

CUT = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}
ROWS = ("exactlogp", "vllm_topk_topp", "trl_unnormalised")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VLLM_HOST = "vllm-0.34.0"  # the Makefile's $(HOSTS)/vllm-$(VLLM_V2)
_VLLM_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"


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
    """(vLLM's apply_top_k_top_p_pytorch, its description) or (None, why not)."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    except Exception as exc:  # vLLM absent, or it fails to import on this machine
        return None, f"{type(exc).__name__}: {exc}"
    import vllm

    def cut(y, k, p):
        return apply_top_k_top_p_pytorch(y, k, p, allow_cpu_sync=True)

    return cut, f"{_VLLM_MODULE}.apply_top_k_top_p_pytorch (vLLM {vllm.__version__})"


def vllm_host() -> Path | None:
    """The vLLM 0.34 that `make setup` installs in its own directory, if it is there."""
    host = Path(sys.prefix) / "hosts" / VLLM_HOST
    return host if (host / _VLLM_MODULE.replace(".", "/")).with_suffix(".py").is_file() else None


def _vllm_in_host(host: Path, x, t, check_rows: int, repeats: int) -> dict:
    """The vllm_topk_topp row at TP 1 in a process that imports vLLM from `host`."""
    src = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="exactlogp-vllm-cut-") as tmp:
        inp, out = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save({"x": x, "t": t, "check_rows": check_rows, "repeats": repeats}, inp)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(host), str(src)])}
        done = subprocess.run(
            [sys.executable, "-m", "exactlogp.report.processed", str(inp), str(out)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's cut in {host} failed: {done.stderr[-2000:]}")
        return torch.load(out, weights_only=True)


def _host_job(inp: str, out: str) -> None:
    """Inside the vLLM process: the row's results on the saved workload."""
    job = torch.load(inp, weights_only=True)
    x, t, n = job["x"], job["t"], job["check_rows"]
    fn, what = _vllm_function()
    if fn is None:
        raise RuntimeError(what)
    lp, keep = _vllm(x, t)
    digests = {_digest(lp, keep)}
    for _ in range(job["repeats"] - 1):
        digests.add(_digest(*_vllm(x, t)))
    alone = torch.cat([_vllm(x[i : i + 1], t[i : i + 1])[0] for i in range(n)])
    torch.save({"lp": lp, "keep": keep, "alone": alone, "distinct": len(digests),
                "what": what}, out)  # fmt: skip


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


def _implementation(name: str, host_what: str | None = None) -> str:
    if name == "exactlogp":
        return "exactlogp.processed_logprobs (exact cut, radix select over the shards)"
    if name == "vllm_topk_topp":
        fn, what = _vllm_function()
        if fn is not None or host_what:
            return (
                f"vLLM's own {host_what or what}, TP 1 (vLLM samples from gathered rows); "
                "min-p as V2's y >= max + log(min_p) in fp32"
            )
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
    in_host = None
    if "vllm_topk_topp" in runnable and _vllm_function()[0] is None:
        host = vllm_host()
        if host is not None:
            in_host = _vllm_in_host(host, x, t, min(check_rows, tokens), repeats)
    tp_results = {}
    if tp > 1 and vocab % tp == 0:
        own = in_host is not None or _vllm_function()[0] is not None
        shardable = [n for n in runnable if n != "trl_unnormalised"]
        if own:  # vLLM's own function: TP 1 (its sampler gets gathered rows)
            shardable.remove("vllm_topk_topp")
        ranks = run_gloo_world(tp, _tp_rank, x, t, shardable, timeout=600.0)
        for name in shardable:
            tp_results[name] = (ranks[0][name][0], torch.cat([r[name][1] for r in ranks], -1))
    n = min(check_rows, tokens)
    for name in runnable:
        fn = FUNCTIONS[name]
        if name == "vllm_topk_topp" and in_host is not None:
            lp, own_keep, alone = in_host["lp"], in_host["keep"], in_host["alone"]
            digests = set(range(in_host["distinct"]))
        else:
            lp, own_keep = fn(x, t)
            digests = {_digest(lp, own_keep)}
            for _ in range(repeats - 1):
                digests.add(_digest(*fn(x, t)))
            alone = torch.cat([fn(x[i : i + 1], t[i : i + 1])[0] for i in range(n)])
        dropped = lp == -math.inf
        ok = ~dropped
        err = (lp[ok].double() - truth[ok]).abs()
        entry = {
            "implementation": _implementation(
                name, in_host["what"] if name == "vllm_topk_topp" and in_host else None
            ),
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


if __name__ == "__main__":  # the vLLM process of _vllm_in_host
    _host_job(sys.argv[1], sys.argv[2])
