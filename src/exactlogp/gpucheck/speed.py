"""Stages 2 and 3 of the GPU check: latency and bandwidth.

Latency, on the TP4 shard and the whole vocabulary, bf16: the registry's candidates at
TP1 (report/tp1.py: a process group of one rank, so every candidate pays for its
collectives) — exactlogp's whole forward through the public API (as "auto" picks, and
with the value tables forced off and on), the real megatron-core
`vocab_parallel_cross_entropy`, eager torch and torch.compile, forward and
forward+backward — beside exactlogp's parts: the two local passes, the finalize kernel
alone (and the unfused contract.finalize in torch ops), and on CUDA the forward replayed
from a CUDA graph. Every step is timed by measure.interleaved (seeded order shuffled per
round, after the warm-up runs), with CUDA events and L2 flushed on a GPU. Beside each
forward, its host time: the CPU's seconds inside one call, the device idle before it and
nothing synchronised inside (the median of HOST_CALLS); where it exceeds the GPU time the
figure measures Python and launches, not kernels.

Bandwidth: the max pass's bytes read over its time, beside a device copy's.
"""

from __future__ import annotations

import time

import torch

import exactlogp

from .. import contract
from ..backends import ShardPlan, get_backend
from ..report import measure
from ..report.measure import MODES
from ..report.tp1 import tp1_steps
from ..temperature import ONE
from ..testing import llm_like_logits

HEADLINE = "exactlogp[triton,validate=false]"  # the whole forward through the public API
# both Triton paths whatever "auto" picks on this GPU: the direct kernels (fp64 per logit)
# and the value tables (fp64 per distinct value; backends/triton/value_tables.py)
TRITON_PATHS = tuple(
    f"exactlogp[triton,value_tables={mode},validate=false]" for mode in ("never", "always")
)
CANDIDATES = (HEADLINE, *TRITON_PATHS, "megatron_ce", "torch_full[row_block=all]", "torch_compile")
GRAPH = "exactlogp triton (CUDA graph replay, no collectives)"
HOST_CALLS = 20


def host_seconds(fn, device: torch.device, calls: int = HOST_CALLS) -> float:
    """Median CPU seconds inside one call of fn, the device's queue drained before each."""
    seconds = []
    for _ in range(calls):
        measure.sync(device)
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    measure.sync(device)
    return measure.percentile(seconds, 50)


def clock(device: torch.device):
    return measure.CudaEventClock(device) if device.type == "cuda" else measure.WallClock(device)


def _parts(x: torch.Tensor, target: torch.Tensor) -> dict:
    """exactlogp's stages on their own, forward only."""
    impl = get_backend("triton", x.device)
    plan = ShardPlan(0, None, -100, False)
    row_max = impl.row_max(x, ONE, None, plan)
    record = impl.partials(x, target, ONE, None, row_max, plan)
    return {
        "exactlogp local passes (max + terms)": lambda: impl.partials(
            x, target, ONE, None, impl.row_max(x, ONE, None, plan), plan
        ),
        "exactlogp finalize kernel alone": lambda: impl.finalize(
            row_max, record, target, None, -100, None
        ),
        "contract.finalize alone (torch ops, unfused)": lambda: contract.finalize(
            row_max, record, target, None, -100, None
        ),
    }


def graph_replay(fn, device):
    """fn captured in a CUDA graph: replaying it times the GPU work without launch costs."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _graph_step(x, target, notes: list) -> dict:
    def forward():
        exactlogp.selected_logprobs(x, target, validate=False, backend="triton")

    try:
        return {GRAPH: graph_replay(forward, x.device)}
    except Exception as exc:  # capture is not possible everywhere; say why
        notes.append(f"CUDA graph capture failed: {type(exc).__name__}: {exc}")
        return {}


def latency(shapes: dict, device, repeats: int, warmup: int, log) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    for label, (n, v) in shapes.items():
        x, target = llm_like_logits(n, v, torch.bfloat16, 1, device)
        with tp1_steps(CANDIDATES, x, target, skip_unavailable=True) as (cands, skipped):
            notes += [f"{name} skipped: {why}" for name, why in skipped.items()]
            cols = {name: s.cols for name, s in cands.items()}
            steps = {
                (name, mode): getattr(s, mode)
                for name, s in cands.items()
                for mode in MODES
                if getattr(s, mode) is not None
            }
            extra = _parts(x, target)
            if device.type == "cuda":
                extra |= _graph_step(x, target, notes)
            steps |= {(name, "forward"): fn for name, fn in extra.items()}
            seconds = measure.interleaved(steps, repeats, warmup=warmup, clock=clock(device))
            calls = HOST_CALLS if device.type == "cuda" else 2  # the interpreter: a token
            host = {name: host_seconds(fn, device, calls) for (name, mode), fn in steps.items()
                    if mode == "forward"}  # fmt: skip
        for name in [*cands, *extra]:
            timing = {
                mode: vars(measure.Timing.of(seconds[name, mode]))
                if (name, mode) in seconds
                else None
                for mode in MODES
            }
            rows.append({"shape": label, "rows": n, "cols": cols.get(name, v), "candidate": name,
                         **timing, "host_forward": host.get(name)})  # fmt: skip
            log(f"  {label} {name}: fwd {timing['forward']['median'] * 1e6:.1f} us")
    return rows, list(dict.fromkeys(notes))


def bandwidth(shapes: dict, device, repeats: int, warmup: int) -> list[dict]:
    impl = get_backend("triton", device)
    plan = ShardPlan(0, None, -100, False)
    steps, sizes = {}, {}
    for label, (n, v) in shapes.items():
        x, _ = llm_like_logits(n, v, torch.bfloat16, 2, device)
        what = f"max pass, {label} bf16"
        steps[what] = lambda x=x: impl.row_max(x, ONE, None, plan)
        sizes[what] = x.numel() * x.element_size()
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    steps["device copy 1 GiB (read + write)"] = lambda: dst.copy_(src)
    sizes["device copy 1 GiB (read + write)"] = 2 * src.numel()
    seconds = measure.interleaved(steps, repeats, warmup=warmup, clock=clock(device))
    out = []
    for what, nbytes in sizes.items():
        t = measure.Timing.of(seconds[what])
        out.append({"what": what, "bytes": nbytes, **vars(t), "GB_per_s": nbytes / t.median / 1e9})
    return out


def headline(latency_rows: list[dict], device: str) -> str:
    """The one figure the target is stated on: the whole forward on the TP4 shard."""
    rows = [r for r in latency_rows if r["shape"] == "tp4-shard" and r["candidate"] == HEADLINE]
    if not rows:
        return "Headline: not measured in this run."
    r, t = rows[0], rows[0]["forward"]
    where = ("the Triton interpreter on the CPU: not a GPU figure" if device == "cpu"
             else "target <= 100 us on an H200")  # fmt: skip
    return (
        f"**Headline: exactlogp forward, all kernels incl. the fused finalize, TP4 shard "
        f"{r['rows']}x{r['cols']} bf16: {t['median'] * 1e6:.1f} us** "
        f"(p10-p90 {t['p10'] * 1e6:.1f}-{t['p90'] * 1e6:.1f}; {where})"
    )
