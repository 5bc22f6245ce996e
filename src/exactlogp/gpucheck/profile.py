"""Stage 7 of the GPU check: where the time goes.

1. GEMM ceilings at the real shapes (CUDA events, interleaved): the bf16 LM-head GEMM a
   user runs instead, one K-chunk of the DGEMM route (fp64), and torch._int_mm over each
   K' of the five diagonals (the int8 routes' GEMMs), with the rate each achieves.
2. torch.profiler over one call each -- the core op's forward and forward+backward on the
   TP4 shard, the fused head's forward and forward+backward on every exact_gemm route --
   giving the device time per kernel and the number of kernel launches.
3. cProfile of one core-op forward and one backward through the API: the host functions
   with the most cumulative time.
4. The core op's forward+backward replayed from a CUDA graph (launch costs removed).
5. An exactness probe of bf16 tl.dot with fp32 accumulation on integer slices (|s| <= 64,
   products <= 2^12, so a K-block of up to 4096 sums below 2^24 and is exact in fp32 IF
   the hardware accumulates in full fp32): the count of wrong elements against int64 truth
   at K-blocks 256, 512 and 1024. Evidence for a route on GPUs with neither fast fp64 nor
   int8, not a proof.
On the CPU (--tiny, the Triton interpreter) every part but the CUDA graph runs on tiny
shapes, to prove the code runs; its figures are not GPU figures.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import triton
import triton.language as tl

import exactlogp

from ..backends.base import EXACT_GEMM_ROUTES
from ..linear_contract import DIAGONAL_MAX_K, K_CHUNK
from ..report import measure
from ..testing import llm_like_logits, lm_head_inputs
from .linear import QWEN3_NEXT_HIDDEN, gemm_backend
from .speed import clock, graph_replay

TOP = 12  # rows kept per table
TINY_ROUTES = ("fp64", "int8_fused")  # --tiny proves the code runs; every route on a GPU


def shapes(tiny: bool) -> dict:
    """(core op rows, TP4 shard columns), (head rows, hidden, shard rows)."""
    if tiny:
        return {"core": (4, 96), "head": (4, 32, 96)}
    return {"core": (1024, 37984), "head": (1024, QWEN3_NEXT_HIDDEN, 37984)}


# --- 1. GEMM ceilings ---


def ceilings(device, tiny: bool, repeats: int, warmup: int, notes: list) -> list[dict]:
    n, h, v = shapes(tiny)["head"]
    gen = torch.Generator().manual_seed(1)
    steps, work = {}, {}
    a16, w16 = (torch.randn(r, h, generator=gen).bfloat16().to(device) for r in (n, v))
    steps["bf16 matmul (the LM head)"] = lambda: a16 @ w16.T
    work["bf16 matmul (the LM head)"] = 2 * n * h * v
    k = min(h, K_CHUNK)
    a64, w64 = (torch.randn(r, k, generator=gen, dtype=torch.float64).to(device) for r in (n, v))
    steps[f"fp64 matmul, K = {k} (a DGEMM-route chunk)"] = lambda: a64 @ w64.T
    work[f"fp64 matmul, K = {k} (a DGEMM-route chunk)"] = 2 * n * k * v
    if h <= DIAGONAL_MAX_K:
        for width in (1, 2, 3):  # K' = K, 2K, 3K: the five diagonals' three sizes
            a8 = torch.randint(-64, 65, (max(n, 17), width * h), dtype=torch.int8, generator=gen)
            w8 = torch.randint(-64, 65, (width * h, v), dtype=torch.int8, generator=gen)
            a8, w8 = a8.to(device), w8.to(device)
            name = f"torch._int_mm, K' = {width} K"
            steps[name] = lambda a8=a8, w8=w8: torch._int_mm(a8, w8)
            work[name] = 2 * a8.shape[0] * width * h * v
    for name, fn in list(steps.items()):  # a GEMM this device or torch refuses: noted
        try:
            fn()
        except Exception as exc:
            notes.append(f"GEMM ceiling '{name}' skipped: {type(exc).__name__}: {exc}")
            del steps[name]
    seconds = measure.interleaved(steps, repeats, warmup=warmup, clock=clock(device))
    out = []
    for name in steps:
        t = measure.Timing.of(seconds[name])
        out.append({"gemm": name, "shape": f"{n} x {h} x {v}", **vars(t),
                    "T_per_s": work[name] / t.median / 1e12})  # fmt: skip
    return out


# --- 2. per-kernel device times and launch counts ---


def _calls(device, tiny: bool) -> dict:
    """{name: fn} of the calls whose kernels are profiled."""
    n, v = shapes(tiny)["core"]
    x, target = llm_like_logits(n, v, torch.bfloat16, 3, device)
    xg = x.detach().requires_grad_(True)

    def core_forward():
        exactlogp.selected_logprobs(x, target, validate=False, backend="triton")

    def core_forward_backward():
        res = exactlogp.selected_logprobs(xg, target, validate=False, backend="triton")
        torch.autograd.grad(res.logprobs.sum(), xg)

    calls = {"core op forward": core_forward, "core op forward+backward": core_forward_backward}
    n, h, v = shapes(tiny)["head"]
    hid, w, t = (z.to(device) for z in lm_head_inputs(n, h, v, torch.bfloat16, seed=5))
    hg, wg = hid.detach().requires_grad_(True), w.detach().requires_grad_(True)
    for mode in TINY_ROUTES if tiny else EXACT_GEMM_ROUTES:
        backend = gemm_backend(device, mode)

        def head_forward(backend=backend):
            exactlogp.linear_selected_logprobs(hid, w, t, validate=False, backend=backend)

        def head_forward_backward(backend=backend):
            res = exactlogp.linear_selected_logprobs(hg, wg, t, validate=False, backend=backend)
            torch.autograd.grad(res.logprobs.sum(), (hg, wg))

        calls[f"fused head forward ({mode})"] = head_forward
        calls[f"fused head forward+backward ({mode})"] = head_forward_backward
    return calls


def kernel_profile(device, tiny: bool, calls: dict) -> list[dict]:
    """Per call: launches, device microseconds per kernel (CUDA), or the CPU ops (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = []
    for name, fn in calls.items():
        fn()  # compiled and warm
        measure.sync(device)
        with profile(activities=activities) as prof:
            fn()
            measure.sync(device)
        per = {}
        for ev in prof.events():
            on_device = ev.device_type == torch.autograd.DeviceType.CUDA
            if on_device != cuda or (not cuda and ev.cpu_parent is not None):
                continue  # kernels on a GPU; the top-level ops on the CPU
            count, us = per.get(ev.name, (0, 0.0))
            per[ev.name] = (count + 1, us + ev.time_range.elapsed_us())
        ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
        out.append({
            "call": name,
            "launches" if cuda else "top-level ops": sum(c for c, _ in per.values()),
            "total_us": sum(us for _, us in per.values()),
            "kernels": [{"name": k[:80], "count": c, "us": us} for k, (c, us) in ranked[:TOP]],
        })  # fmt: skip
    return out


# --- 3. the host's functions ---


def host_profile(device, calls: dict) -> list[dict]:
    out = []
    for name in ("core op forward", "core op forward+backward"):
        fn = calls[name]
        fn()
        measure.sync(device)
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        measure.sync(device)
        stats = pstats.Stats(prof).stats  # {(file, line, function): (cc, nc, tt, ct, callers)}
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][3])[:TOP]
        out.append({"call": name, "functions": [
            {"function": f"{file.rsplit('/', 1)[-1]}:{line}({func})", "calls": nc,
             "own_us": tt * 1e6, "cumulative_us": ct * 1e6}
            for (file, line, func), (_, nc, tt, ct, _) in ranked]})  # fmt: skip
    return out


# --- 4. a CUDA graph of forward+backward ---


def graph_forward_backward(device, tiny: bool, repeats: int, warmup: int, notes: list):
    if device.type != "cuda":
        notes.append("CUDA-graph replay of forward+backward skipped: no CUDA device")
        return []
    calls = _calls(device, tiny)
    step = calls["core op forward+backward"]
    try:
        replay = graph_replay(step, device)
    except Exception as exc:  # capture is not possible everywhere; say why
        notes.append(f"CUDA graph capture of forward+backward failed: {type(exc).__name__}: {exc}")
        return []
    steps = {"core op forward+backward (API)": step, "the same, CUDA graph replay": replay}
    seconds = measure.interleaved(steps, repeats, warmup=warmup, clock=clock(device))
    return [{"what": k, **vars(measure.Timing.of(seconds[k]))} for k in steps]


# --- 5. bf16 tl.dot on integer slices ---


@triton.jit
def bf16_dot_probe_kernel(
    a_ptr,  # [BLOCK, K] bf16 integers in [-64, 64]
    b_ptr,  # [K, BLOCK] bf16 integers in [-64, 64]
    out_ptr,  # [BLOCK, BLOCK] fp32: one tl.dot over the whole K
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter: its bf16 tl.dot multiplies the bit patterns
):
    r = tl.arange(0, BLOCK)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + r[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * BLOCK + r[None, :])
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    acc = tl.dot(a, b, out_dtype=tl.float32)
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)


def bf16_probe(device, tiny: bool) -> list[dict]:
    """Wrong elements of one bf16 tl.dot per K-block, against int64, on random slices and
    on the worst case (every product +2^12, the sum at its largest). In the interpreter
    the operands are widened to fp32 first (its bf16 tl.dot is wrong, Triton 3.9): the
    CPU run checks the harness, not bf16 arithmetic."""
    block = 16 if tiny else 32
    out = []
    gen = torch.Generator().manual_seed(7)
    for kb in (256, 512, 1024):
        for case in ("random", "largest"):
            if case == "random":
                a = torch.randint(-64, 65, (block, kb), generator=gen)
                b = torch.randint(-64, 65, (kb, block), generator=gen)
            else:
                a, b = torch.full((block, kb), 64), torch.full((kb, block), 64)
            got = torch.empty(block, block, dtype=torch.float32, device=device)
            bf = [x.to(torch.bfloat16).to(device) for x in (a, b)]
            bf16_dot_probe_kernel[(1,)](bf[0], bf[1], got, K=kb, BLOCK=block,
                                        UPCAST=device.type != "cuda", num_stages=1)  # fmt: skip
            truth = a @ b  # int64
            wrong = int((got.cpu().to(torch.int64) != truth).sum())
            out.append({"k_block": kb, "case": case, "elements": block * block, "wrong": wrong,
                        "largest_sum": int(truth.abs().max())})  # fmt: skip
    return out


def run(device, tiny: bool, repeats: int, warmup: int, log) -> tuple[dict, list[str]]:
    notes: list[str] = []
    log("  GEMM ceilings")
    result = {"ceilings": ceilings(device, tiny, repeats, warmup, notes)}
    calls = _calls(device, tiny)
    log("  kernels per call (torch.profiler)")
    result["kernels"] = kernel_profile(device, tiny, calls)
    log("  host functions (cProfile)")
    result["host"] = host_profile(device, calls)
    result["graph"] = graph_forward_backward(device, tiny, repeats, warmup, notes)
    log("  bf16 tl.dot exactness probe")
    result["bf16_probe"] = bf16_probe(device, tiny)
    if device.type != "cuda":
        notes.append("bf16 probe: operands widened to fp32 in the interpreter (not bf16 data)")
    return result, notes


def markdown(p: dict) -> list[str]:
    lines = ["", "## 7. Where the time goes", "", "| GEMM | shape | median us | T/s |",
             "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['gemm']} | {r['shape']} | {r['median'] * 1e6:.1f} | {r['T_per_s']:.1f} |"
              for r in p["ceilings"]]  # fmt: skip
    for r in p["kernels"]:
        count = r.get("launches", r.get("top-level ops"))
        what = "launches" if "launches" in r else "top-level ops"
        lines += ["", f"**{r['call']}**: {count} {what}, {r['total_us']:.1f} us", "",
                  "| kernel | count | us |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {k['name']} | {k['count']} | {k['us']:.1f} |" for k in r["kernels"]]
    for r in p["host"]:
        lines += ["", f"**host, {r['call']}** (cProfile)", "",
                  "| function | calls | own us | cumulative us |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {f['function']} | {f['calls']} | {f['own_us']:.0f} | "
                  f"{f['cumulative_us']:.0f} |" for f in r["functions"]]  # fmt: skip
    if p["graph"]:
        lines += ["", "| forward+backward | median us |", "|---|---|"]
        lines += [f"| {r['what']} | {r['median'] * 1e6:.1f} |" for r in p["graph"]]
    lines += ["", "| bf16 tl.dot probe: K-block | case | wrong / elements | largest sum |",
              "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['k_block']} | {r['case']} | {r['wrong']} / {r['elements']} | "
              f"{r['largest_sum']} |" for r in p["bf16_probe"]]  # fmt: skip
    return lines
