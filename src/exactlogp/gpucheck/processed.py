"""Stage 6 of the GPU check: the exact top-k / top-p / min-p cut on the device.

`processed_logprobs` (logprobs, entropy, lse, the dropped targets, the keep mask and the
per-row thresholds), `sampling_mask` and `sample` with the same uniforms, on the device
(the plain op on the Triton backend, the cut in torch ops there) against the CPU, every
output compared bit for bit; and their latency beside the plain forward and an eager
sort-based top-p sampler (CUDA events, interleaved). The cut's definition is
docs/numerics.md section 13.

The cut's one full read of the logits, Backend.chunk_max (the maxima of y over chunks of
cut.candidates.CHUNK columns), has a Triton kernel: its bits against the torch default
(base.Backend.chunk_max) on the same device at 1024 x 151936 bf16, with NaN, +inf, -inf
and -0 columns, a scalar and a per-row temperature and a padded shard; and its time beside
the max pass, which reads the same bytes.
"""

from __future__ import annotations

import torch

import exactlogp

from ..backends import ShardPlan, get_backend
from ..backends.base import Backend
from ..cut.candidates import CHUNK
from ..report import measure
from ..temperature import Temperature
from ..testing import compare_bits, llm_like_logits
from .speed import clock

# (top_k, top_p, min_p) of the compared cases: each cut alone, all three, per-row values
CUTS = {
    "top-k 50": (50, None, None),
    "top-p 0.9": (None, 0.9, None),
    "min-p 0.05": (None, None, 0.05),
    "top-k 50 / top-p 0.9 / min-p 0.05": (50, 0.9, 0.05),
}


def _outputs(x, target, u, cut, per_row_k=None) -> dict:
    top_k, top_p, min_p = cut
    top_k = per_row_k if per_row_k is not None else top_k
    kw = dict(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    res = exactlogp.processed_logprobs(x, target, with_entropy=True, **kw)
    out = {"logprobs": res.logprobs, "entropy": res.entropy, "lse": res.lse,
           "dropped": res.dropped, "keep_mask": res.mask.keep_mask,
           "threshold": res.mask.threshold, "row_max": res.mask.row_max}  # fmt: skip
    out["sample"] = exactlogp.sample(x, uniforms=u, **kw)
    return {k: v.detach().cpu() for k, v in out.items()}


def run_bits(device: torch.device, tiny: bool, log) -> list[dict]:
    n, v = (4, 300) if tiny else (256, 151936)
    x, target = llm_like_logits(n, v, torch.bfloat16, 31)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    per_row_k = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(4))
    rows = []
    cases = {} if tiny else dict(CUTS)  # --tiny: the code runs; a GPU: every case
    cases["top-k 50 / top-p 0.9 / min-p 0.05"] = CUTS["top-k 50 / top-p 0.9 / min-p 0.05"]
    cases["per-row top-k, top-p 0.9"] = (None, 0.9, None)
    for name, cut in cases.items():
        k = per_row_k if name.startswith("per-row") else None
        log(f"  processed {n} x {v} bf16, {name}: {device} vs cpu")
        want = _outputs(x, target, u, cut, k)
        got = _outputs(x.to(device), target.to(device), u.to(device), cut,
                       None if k is None else k.to(device))  # fmt: skip
        for output in want:
            rows.append({"case": f"processed {n}x{v} {name}", "entropy": True,
                         "output": output, **compare_bits(got[output], want[output])})  # fmt: skip
    return rows + chunk_max_bits(device, tiny, log)


def chunk_max_bits(device: torch.device, tiny: bool, log) -> list[dict]:
    """The Triton chunk_max kernel against the torch default, both on `device`."""
    n, v = (4, 300) if tiny else (1024, 151936)
    x, _ = llm_like_logits(n, v, torch.bfloat16, 33, device)
    x[0, 5], x[1, 200] = float("nan"), float("inf")  # a NaN chunk, a +inf chunk
    x[2, : 2 * CHUNK] = float("-inf")  # two chunks of -inf only
    x[3, CHUNK : 2 * CHUNK] = -x[3, CHUNK : 2 * CHUNK].abs()  # a chunk whose max is -0
    x[3, CHUNK + 7] = -0.0
    tri = get_backend("triton", device)
    per_row = Temperature.of(torch.linspace(0.25, 2.0, n, device=device))
    cases = {
        "tau 0.8": (Temperature.of(0.8), ShardPlan(0, None, -100, False)),
        "per-row tau, padded (tail chunk)": (per_row, ShardPlan(0, v - 100, -100, False)),
    }
    rows = []
    for name, (tau, plan) in cases.items():
        log(f"  chunk_max {n} x {v} bf16, {name}: Triton kernel vs torch default on {device}")
        got = tri.chunk_max(x, tau, plan, CHUNK)
        want = Backend.chunk_max(tri, x, tau, plan, CHUNK)
        rows.append({"case": f"chunk_max {n}x{v} {name}", "entropy": False,
                     "output": "chunk maxima", **compare_bits(got, want)})  # fmt: skip
    return rows


def latency(device: torch.device, tiny: bool, repeats: int, warmup: int, log) -> list[dict]:
    """The processed forward and sample beside the plain forward and a sort-based sampler."""
    n, v = (4, 300) if tiny else (1024, 151936)
    x, target = llm_like_logits(n, v, torch.bfloat16, 32, device)
    xf = x[:64].float()
    tri, tau = get_backend("triton", device), Temperature.of(0.8)
    plan = ShardPlan(0, None, -100, False)

    def sorted_top_p():  # what a sampler without the exact cut runs: sort, softmax, cumsum
        s, idx = torch.sort(xf / 0.8, dim=-1, descending=True)
        p = torch.softmax(s, -1)
        keep = (p.cumsum(-1) - p) < 0.9
        p = torch.where(keep, p, 0.0)
        return idx.gather(-1, torch.multinomial(p, 1))

    steps = {
        "selected_logprobs (plain forward)": lambda: exactlogp.selected_logprobs(
            x, target, temperature=0.8, validate=False
        ),
        "processed_logprobs top-k 50 / top-p 0.9": lambda: exactlogp.processed_logprobs(
            x, target, temperature=0.8, top_k=50, top_p=0.9, validate=False
        ),
        "sample top-p 0.9, 64 rows": lambda: exactlogp.sample(
            x[:64], temperature=0.8, top_p=0.9, validate=False
        ),
        "sort-based top-p sampling, 64 rows (eager torch)": sorted_top_p,
        # the cut's read of the logits beside the max pass, which reads the same bytes
        "max pass alone (Triton row_max)": lambda: tri.row_max(x, tau, None, plan),
        f"chunk_max alone (Triton kernel, chunks of {CHUNK})": lambda: tri.chunk_max(
            x, tau, plan, CHUNK
        ),
        f"chunk_max alone (torch default, chunks of {CHUNK})": lambda: Backend.chunk_max(
            tri, x, tau, plan, CHUNK
        ),
    }
    seconds = measure.interleaved(steps, repeats, warmup=warmup, clock=clock(device))
    rows = []
    for name in steps:
        t = measure.Timing.of(seconds[name])
        rows.append({"shape": "processed", "rows": n, "cols": v, "candidate": name,
                     "forward": vars(t), "forward_backward": None, "host_forward": None})  # fmt: skip
        gbs = x.numel() * x.element_size() / t.median / 1e9
        log(f"  {name}: {t.median * 1e6:.1f} us"
            + (f" ({gbs:.0f} GB/s of logits read)" if "alone" in name else ""))  # fmt: skip
    return rows
