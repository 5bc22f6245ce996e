"""The GPU check of the Triton backend, in one command: bits, latency, bandwidth.

1. Bits: the Triton backend on the GPU against the reference backend on the CPU, forward
   outputs and gradients, entropy on and off, on the Qwen3-Next shape (1024 x 151936
   bf16), its TP4 shard (1024 x 37984, local passes), the four TP4 shards combined
   exactly on the GPU against the whole vocabulary, and fp16/fp32 cases with
   temperature, keep-mask, padding, ignored and NaN rows. The CPU reference runs on the
   first --ref-rows rows (rows are independent: each row's bits depend on that row only).
   The finalize kernel alone on drawn records (testing.finalize_inputs: boundary limb
   sums, every bad flag, ignored rows) against contract.finalize on the CPU, every field.
   And the forward with validate=False under torch.cuda.set_sync_debug_mode("error").
2. Latency (CUDA events, median of --repeats after warm-up, L2 flushed before each run)
   on the TP4 shard and the full vocabulary, bf16. The headline is exactlogp's whole
   forward (max pass, term pass and the fused finalize, through the public API) on the
   TP4 shard. Against it: the real megatron-core `vocab_parallel_cross_entropy` (a TP
   group of one) and torch fp32 log_softmax + gather, forward and forward+backward; and
   exactlogp's parts: the two local passes, the finalize kernel alone (beside the
   unfused contract.finalize in torch ops), the forward replayed from a CUDA graph.
3. The max pass's achieved HBM bandwidth (bytes read / time), beside a device copy's.

Writes gpu_check.json and gpu_check.md to --out.

    PYTHONPATH=src python benchmarks/gpu_check.py --out reports/gpu
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/gpu_check.py --tiny --out /tmp/gc

--tiny runs every stage on tiny shapes; without a GPU it runs the kernels in the Triton
interpreter on the CPU (TRITON_INTERPRET=1 must be set) and skips the CUDA-only parts
with a note. CPU timings of the interpreter mean nothing; they only prove the code runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import exactlogp
from exactlogp import contract, testing
from exactlogp.backends import ShardPlan, get_backend

QWEN3_NEXT_VOCAB = 151936
TP = 4


@dataclass(frozen=True)
class BitCase:
    name: str
    rows: int
    vocab: int  # whole vocabulary columns (padding included)
    dtype: torch.dtype
    vocab_size: int | None = None  # real vocabulary, None: no padding
    temperature: str = "1"  # "1", "0.7" or "per_row"
    keep_frac: float | None = None  # fraction of columns kept by a random keep-mask
    edge_rows: bool = False  # NaN, +inf, all -inf and ignored rows (validate=False)
    shards: int = 1  # > 1: the vocabulary split in equal shards, combined on the device


def bit_cases(tiny: bool) -> list[BitCase]:
    if tiny:
        return [
            BitCase("tiny-tp4", 4, 512, torch.bfloat16, shards=TP),
            BitCase("tiny-fp16-mask", 5, 300, torch.float16, 290, "per_row", 0.7, True),
            BitCase("tiny-fp32-edge", 6, 200, torch.float32, None, "0.7", None, True),
        ]
    return [
        BitCase("qwen3next-full", 1024, QWEN3_NEXT_VOCAB, torch.bfloat16),
        BitCase("qwen3next-tp4", 1024, QWEN3_NEXT_VOCAB, torch.bfloat16, shards=TP),
        BitCase("fp16-temp-mask-pad", 257, 50304, torch.float16, 50257, "per_row", 0.6, True),
        BitCase("fp32-edge", 64, 4096, torch.float32, None, "0.7", None, True),
    ]


# --- inputs, made on the device (the CPU copy feeds the reference) ---


def llm_like(rows: int, cols: int, dtype: torch.dtype, seed: int, device) -> tuple:
    """testing.llm_like_logits's recipe, drawn on `device` (fast for the large shapes)."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device=device) * 2.5
    peaks = torch.randint(0, cols, (rows, 4), generator=gen, device=device)
    x.scatter_add_(1, peaks, 8.0 + 22.0 * torch.rand(rows, 4, generator=gen, device=device))
    x = x.to(dtype)
    probs = torch.softmax(x.float(), dim=-1)
    target = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return x, target


@dataclass
class Inputs:
    logits: torch.Tensor  # (N, V) on the device
    target: torch.Tensor
    temperature: float | torch.Tensor
    keep_mask: torch.Tensor | None
    weights: list  # upstream gradients of logprobs, lse, entropy (N,) fp32 each

    def rows(self, count: int, device) -> Inputs:
        def take(t):
            return t[:count].to(device) if isinstance(t, torch.Tensor) else t

        return Inputs(*(take(getattr(self, f)) for f in ("logits", "target", "temperature",
                                                         "keep_mask")),
                      [w[:count].to(device) for w in self.weights])  # fmt: skip


def make_inputs(case: BitCase, device, seed: int = 0) -> Inputs:
    x, target = llm_like(case.rows, case.vocab, case.dtype, seed, device)
    gen = torch.Generator(device).manual_seed(seed + 1)
    n, real = case.rows, case.vocab_size or case.vocab
    target = target.clamp(max=real - 1)
    keep = None
    if case.keep_frac is not None:
        keep = torch.rand(n, case.vocab, generator=gen, device=device) < case.keep_frac
        keep[torch.arange(n, device=device), target] = True
    if case.edge_rows:
        x[0, 7] = float("nan")
        x[1, 3] = float("inf")
        x[2] = float("-inf")
        x[3, ::2] = float("-inf")
        target[3] = 1
        target[4] = -100
    tau = {"1": 1.0, "0.7": 0.7}.get(case.temperature)
    if tau is None:
        tau = 0.25 + 1.5 * torch.rand(n, generator=gen, device=device)
    weights = [torch.randn(n, generator=gen, device=device) for _ in range(3)]
    return Inputs(x, target, tau, keep, weights)


# --- running both backends ---


def run_api(inp: Inputs, case: BitCase, backend: str, with_entropy: bool) -> dict:
    """Forward outputs and the gradient of sum(weights * outputs), through the public API."""
    x = inp.logits.clone().requires_grad_(True)
    res = exactlogp.selected_logprobs(
        x, inp.target, vocab_size=case.vocab_size, temperature=inp.temperature,
        keep_mask=inp.keep_mask, with_entropy=with_entropy, validate=False, backend=backend,
    )  # fmt: skip
    outs = {"logprobs": res.logprobs, "lse": res.lse}
    if with_entropy:
        outs["entropy"] = res.entropy
    torch.autograd.backward(list(outs.values()), inp.weights[: len(outs)])
    return {k: v.detach() for k, v in outs.items()} | {"grad": x.grad}


def run_sharded(inp: Inputs, case: BitCase, with_entropy: bool) -> dict:
    """The TP pipeline over `case.shards` shards on one device, collectives done exactly."""
    impl = get_backend("triton", inp.logits.device)
    n, width = inp.logits.shape[0], case.vocab // case.shards
    spans = [(k * width, (k + 1) * width) for k in range(case.shards)]

    def shard(lo, hi):
        plan = ShardPlan(lo, case.vocab_size, -100, with_entropy)
        keep = None if inp.keep_mask is None else inp.keep_mask[:, lo:hi]
        return inp.logits[:, lo:hi], keep, plan

    row_max = torch.full((n,), float("-inf"), device=inp.logits.device)
    for lo, hi in spans:  # all_reduce(MAX)
        x, keep, plan = shard(lo, hi)
        row_max = torch.maximum(row_max, impl.row_max(x, inp.temperature, keep, plan))
    record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=row_max.device)
    for lo, hi in spans:  # all_reduce(SUM)
        x, keep, plan = shard(lo, hi)
        record += impl.partials(x, inp.target, inp.temperature, keep, row_max, plan)
    fin = impl.finalize(row_max, record, inp.target, case.vocab_size, -100, None)
    g_lp, g_lse, g_ent = inp.weights
    stats = contract.grad_stats(row_max, fin, g_lp, g_ent if with_entropy else None, g_lse)
    tau = contract.grad_temperature(stats, inp.temperature)
    grads = []
    for lo, hi in spans:
        x, keep, plan = shard(lo, hi)
        grads.append(impl.grad(x, inp.target, tau, keep, stats, plan))
    outs = {"logprobs": fin.logprobs, "lse": fin.lse}
    if with_entropy:
        outs["entropy"] = fin.entropy
    return outs | {"grad": torch.cat(grads, dim=1)}


def run_local_passes(inp: Inputs, case: BitCase, backend: str, lo: int, hi: int) -> dict:
    """One shard's local passes (what a TP rank computes), with the whole-row max."""
    impl = get_backend(backend, inp.logits.device)
    full_plan = ShardPlan(0, case.vocab_size, -100, True)
    row_max = impl.row_max(inp.logits, inp.temperature, inp.keep_mask, full_plan)
    plan = ShardPlan(lo, case.vocab_size, -100, True)
    x = inp.logits[:, lo:hi]
    return {
        "shard_row_max": impl.row_max(x, inp.temperature, None, plan),
        "shard_record": impl.partials(x, inp.target, inp.temperature, None, row_max, plan),
    }


# --- comparing bits ---


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return {"status": "DIFFERENT", "detail": f"{got.dtype}{tuple(got.shape)} vs "
                f"{want.dtype}{tuple(want.shape)}"}  # fmt: skip
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    a = got.view(as_int[got.element_size()]) if got.is_floating_point() else got
    b = want.view(as_int[want.element_size()]) if want.is_floating_point() else want
    differ = a != b
    if not differ.any():
        return {"status": "bitwise-equal"}
    if got.is_floating_point():
        nan_pairs = torch.isnan(got) & torch.isnan(want)
        if not (differ & ~nan_pairs).any():
            return {"status": "equal-except-NaN-payload", "count": int(differ.sum())}
    first = tuple(int(i) for i in torch.nonzero(differ)[0])
    return {"status": "DIFFERENT", "count": int(differ.sum()), "first": first,
            "got": repr(got[first].item()), "want": repr(want[first].item())}  # fmt: skip


def check_bits(case: BitCase, device, ref_rows: int, ref_cache: dict, log) -> list[dict]:
    """Both entropy settings of one case; `ref_cache` shares CPU reference runs between
    cases with the same inputs (the TP4 case reuses the whole-vocabulary one)."""
    inp = make_inputs(case, device)
    count = min(ref_rows, case.rows)
    cpu_inp = inp.rows(count, "cpu")
    inputs_key = dataclasses.replace(case, name="", shards=1)
    results = []
    for with_entropy in (False, True):
        t0 = time.perf_counter()
        if case.shards > 1:
            got = run_sharded(inp, case, with_entropy)
        else:
            got = run_api(inp, case, "triton", with_entropy)
        t1 = time.perf_counter()
        key = (inputs_key, count, with_entropy)
        if key not in ref_cache:
            ref_cache[key] = run_api(cpu_inp, case, "reference", with_entropy)
        want = ref_cache[key]
        t2 = time.perf_counter()
        for name, ref in want.items():
            res = compare(got[name][:count], ref)
            results.append({"case": case.name, "entropy": with_entropy, "output": name} | res)
        log(f"  {case.name} entropy={with_entropy}: triton {t1 - t0:.1f} s, "
            f"reference ({count} rows, CPU) {t2 - t1:.1f} s")  # fmt: skip
    if case.shards > 1:  # one TP rank's local passes on its own
        lo, hi = (case.shards - 1) * (case.vocab // case.shards), case.vocab
        got = run_local_passes(inp.rows(count, device), case, "triton", lo, hi)
        want = run_local_passes(cpu_inp, case, "reference", lo, hi)
        for name in want:
            res = compare(got[name], want[name])
            results.append({"case": case.name, "entropy": True, "output": name} | res)
    return results


FINALIZE_CASE = "finalize-records"
FINALIZE_CASES = (  # (vocab_size, ignore_index, per-row temperature flags?)
    (None, -100, False),
    (50257, -100, True),
    (151936, 7, True),
)


def passed(result: dict) -> bool:
    """Bitwise equal; for the drawn finalize records, NaN payloads may differ: their rows
    beyond what the local passes produce (S = 0) get NaN from arithmetic, whose payload
    the contract leaves to the device (docs/numerics.md, section 7)."""
    if result["status"] == "bitwise-equal":
        return True
    return (
        result["case"].startswith(FINALIZE_CASE) and result["status"] == "equal-except-NaN-payload"
    )


def check_finalize_bits(device, rows: int, log) -> list[dict]:
    """The finalize kernel on drawn records, every field, against contract.finalize (CPU)."""
    impl = get_backend("triton", device)
    results = []
    for seed, (vocab_size, ignore_index, bad_tau) in enumerate(FINALIZE_CASES):
        inp = testing.finalize_inputs(rows, seed, vocab_size, ignore_index, bad_tau)
        want = contract.finalize(*inp)
        dev = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inp]
        got = impl.finalize(*dev)
        name = f"{FINALIZE_CASE} vocab={vocab_size} ignore={ignore_index} bad_tau={bad_tau}"
        for field in contract.Finalized._fields:
            res = compare(getattr(got, field), getattr(want, field))
            results.append({"case": name, "entropy": None, "output": field} | res)
    log(f"  finalize on {len(FINALIZE_CASES)} x {rows} drawn records")
    return results


def check_no_sync(device) -> list[dict]:
    """The forward with validate=False must not wait on the device (CUDA only)."""
    x, target = llm_like(64, 4096, torch.bfloat16, 3, device)
    out = []
    for label, tau in (("1", 1.0), ("0.7", 0.7),
                       ("per_row", torch.full((64,), 0.7, device=device))):  # fmt: skip
        kwargs = dict(validate=False, with_entropy=True, temperature=tau, backend="triton")
        exactlogp.selected_logprobs(x, target, **kwargs)  # compiles the kernels
        torch.cuda.set_sync_debug_mode("error")
        try:
            exactlogp.selected_logprobs(x, target, **kwargs)
            status, detail = "no-sync", ""
        except RuntimeError as exc:
            status, detail = "SYNC", str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.append({"check": f"forward validate=False, temperature {label}", "status": status,
                    "detail": detail})  # fmt: skip
    return out


# --- timing ---


class Timer:
    """Median of `repeats` timed calls after `warmup`; CUDA events on a GPU."""

    def __init__(self, device, repeats: int, warmup: int):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.cuda = device.type == "cuda"
        # Flushing L2 (60 MB on an H200) makes every run read its inputs from HBM.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                self.flush.zero_()
                start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
        return {"median_us": statistics.median(times), "p10_us": q[0], "p90_us": q[-1],
                "n": len(times)}  # fmt: skip


@contextlib.contextmanager
def megatron_tp_group_of_one(device):
    """megatron-core's parallel_state with a tensor-parallel group of one rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        yield parallel_state.get_tensor_model_parallel_group()
    finally:
        parallel_state.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


HEADLINE = "exactlogp triton"  # the whole forward through the public API
TP_GROUP_OF_ONE = " (TP group of one)"


def candidates(x: torch.Tensor, target: torch.Tensor, megatron_ce, tp_group) -> dict:
    """name -> (forward, forward+backward) callables on the same logits.

    With megatron-core present, exactlogp runs on megatron's tensor-parallel group of one
    too, so both pay for their collectives (two for exactlogp, three for megatron)."""
    weight = torch.ones(x.shape[0], device=x.device)
    leaf = x.detach().clone().requires_grad_(True)
    impl = get_backend("triton", x.device)
    plan = ShardPlan(0, None, -100, False)
    row_max = impl.row_max(x, 1.0, None, plan)
    record = impl.partials(x, target, 1.0, None, row_max, plan)

    def exact(grad: bool):
        res = exactlogp.selected_logprobs(leaf if grad else x, target, tp_group=tp_group,
                                          validate=False, backend="triton")  # fmt: skip
        if grad:
            torch.autograd.grad(res.logprobs, leaf, weight)

    def local_passes():
        impl.partials(x, target, 1.0, None, impl.row_max(x, 1.0, None, plan), plan)

    def torch_ref(grad: bool):
        lp = torch.log_softmax((leaf if grad else x).float(), dim=-1)
        lp = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if grad:
            torch.autograd.grad(lp, leaf, weight)

    label = HEADLINE + (TP_GROUP_OF_ONE if tp_group is not None else "")
    out = {
        label: (lambda: exact(False), lambda: exact(True)),
        "exactlogp local passes (max + terms)": (local_passes, None),
        "exactlogp finalize kernel alone": (
            lambda: impl.finalize(row_max, record, target, None, -100, None),
            None,
        ),
        "contract.finalize alone (torch ops, unfused)": (
            lambda: contract.finalize(row_max, record, target, None, -100, None),
            None,
        ),
        "torch fp32 log_softmax+gather": (lambda: torch_ref(False), lambda: torch_ref(True)),
    }
    if megatron_ce is not None:

        def mega(grad: bool):
            loss = megatron_ce(leaf if grad else x, target)
            if grad:
                torch.autograd.grad(loss, leaf, weight)

        out["megatron-core vocab_parallel_cross_entropy"] = (lambda: mega(False),
                                                             lambda: mega(True))  # fmt: skip
    return out


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


def latency(shapes, device, timer: Timer, log) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    with contextlib.ExitStack() as stack:
        try:
            from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

            tp_group = stack.enter_context(megatron_tp_group_of_one(device))
            megatron_ce = vocab_parallel_cross_entropy
        except Exception as exc:  # not installed, or no process group possible here
            notes.append(f"megatron-core baseline skipped: {type(exc).__name__}: {exc}")
            megatron_ce = tp_group = None
        for label, (n, v) in shapes.items():
            x, target = llm_like(n, v, torch.bfloat16, 1, device)
            for name, (fwd, fwd_bwd) in candidates(x, target, megatron_ce, tp_group).items():
                row = {"shape": label, "rows": n, "cols": v, "candidate": name,
                       "forward": timer(fwd),
                       "forward_backward": timer(fwd_bwd) if fwd_bwd else None}  # fmt: skip
                rows.append(row)
                log(f"  {label} {name}: fwd {row['forward']['median_us']:.1f} us")
            if device.type == "cuda":
                rows += _graph_row(label, x, target, timer, notes)
    return rows, notes


def _graph_row(label, x, target, timer: Timer, notes: list) -> list[dict]:
    def forward():
        exactlogp.selected_logprobs(x, target, validate=False, backend="triton")

    try:
        replay = graph_replay(forward, x.device)
    except Exception as exc:  # capture is not possible everywhere; say why
        notes.append(f"CUDA graph capture failed: {type(exc).__name__}: {exc}")
        return []
    n, v = x.shape
    return [{"shape": label, "rows": n, "cols": v, "forward": timer(replay),
             "candidate": "exactlogp triton (CUDA graph replay, no collectives)",
             "forward_backward": None}]  # fmt: skip


def bandwidth(shapes, device, timer: Timer) -> list[dict]:
    impl = get_backend("triton", device)
    plan = ShardPlan(0, None, -100, False)
    out = []
    for label, (n, v) in shapes.items():
        x, _ = llm_like(n, v, torch.bfloat16, 2, device)
        t = timer(lambda x=x: impl.row_max(x, 1.0, None, plan))
        read = x.numel() * x.element_size()
        out.append({"what": f"max pass, {label} bf16", "bytes": read, **t,
                    "GB_per_s": read / (t["median_us"] * 1e-6) / 1e9})  # fmt: skip
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    out.append({"what": "device copy 1 GiB (read + write)", "bytes": 2 * src.numel(), **t,
                "GB_per_s": 2 * src.numel() / (t["median_us"] * 1e-6) / 1e9})  # fmt: skip
    return out


# --- environment and report ---


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "exactlogp": exactlogp.__version__, "contract": contract.CONTRACT,
           "device": str(device), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}  # fmt: skip
    for module in ("triton", "megatron.core"):
        try:
            env[module] = __import__(module, fromlist=["x"]).__version__
        except Exception as exc:
            env[module] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "sm_count": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}  # fmt: skip
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True,
                                           timeout=30).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            env["driver"] = f"unknown ({type(exc).__name__})"
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# exactlogp Triton backend: GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## 1. Bits: Triton on the device vs the reference on the CPU", "",
              "| case | entropy | output | result |", "|---|---|---|---|"]  # fmt: skip
    for r in report["bits"]:
        extra = {k: v for k, v in r.items() if k not in ("case", "entropy", "output", "status")}
        lines.append(f"| {r['case']} | {r['entropy']} | {r['output']} | {r['status']}"
                     f"{' ' + json.dumps(extra) if extra else ''} |")  # fmt: skip
    if report.get("sync"):
        lines += ["", "| host sync check | result | detail |", "|---|---|---|"]
        lines += [f"| {r['check']} | {r['status']} | {r['detail']} |" for r in report["sync"]]
    lines += ["", "## 2. Latency (median, p10-p90, microseconds)", ""]
    lines += [headline(report["latency"], env["device"]), ""]
    lines += ["| shape | candidate | forward | forward+backward |", "|---|---|---|---|"]

    def cell(t):
        return "-" if t is None else f"{t['median_us']:.1f} ({t['p10_us']:.1f}-{t['p90_us']:.1f})"

    for r in report["latency"]:
        lines.append(f"| {r['shape']} {r['rows']}x{r['cols']} | {r['candidate']} "
                     f"| {cell(r['forward'])} | {cell(r['forward_backward'])} |")  # fmt: skip
    lines += ["", "## 3. Bandwidth", "", "| what | bytes | median us | GB/s |", "|---|---|---|---|"]
    for r in report["bandwidth"]:
        lines.append(f"| {r['what']} | {r['bytes']} | {r['median_us']:.1f} | {r['GB_per_s']:.0f} |")
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def headline(latency: list[dict], device: str) -> str:
    """The one figure the target is stated on: the whole forward on the TP4 shard."""
    names = (HEADLINE, HEADLINE + TP_GROUP_OF_ONE)
    rows = [r for r in latency if r["shape"] == "tp4-shard" and r["candidate"] in names]
    if not rows:
        return "Headline: not measured in this run."
    r, t = rows[0], rows[0]["forward"]
    where = ("the Triton interpreter on the CPU: not a GPU figure" if device == "cpu"
             else "target <= 100 us on an H200")  # fmt: skip
    return (
        f"**Headline: exactlogp forward, all kernels incl. the fused finalize, TP4 shard "
        f"{r['rows']}x{r['cols']} bf16: {t['median_us']:.1f} us** "
        f"(p10-p90 {t['p10_us']:.1f}-{t['p90_us']:.1f}; {where})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter OK)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per figure (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ref-rows", type=int, default=256,
                        help="rows of each case the CPU reference checks")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["bits", "latency", "bandwidth"])
    args = parser.parse_args(argv)
    log = print  # the script's console

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not (args.tiny and os.environ.get("TRITON_INTERPRET") == "1"):
        log("no CUDA device: run with --tiny under TRITON_INTERPRET=1 to test the script on CPU")
        return 2
    if not args.tiny:
        torch.set_num_threads(os.cpu_count() or 1)  # the CPU reference checks 10^7+ logits
    if args.repeats < 20 and not args.tiny:
        parser.error("--repeats must be >= 20 for reported figures")
    timer = Timer(device, args.repeats, args.warmup)
    shapes = ({"tp4-shard": (2, 128), "full-vocab": (2, 512)} if args.tiny else
              {"tp4-shard": (1024, QWEN3_NEXT_VOCAB // TP),
               "full-vocab": (1024, QWEN3_NEXT_VOCAB)})  # fmt: skip
    report = {"environment": environment(device), "bits": [], "sync": [], "latency": [],
              "bandwidth": [], "notes": []}  # fmt: skip
    if device.type == "cpu":
        report["notes"].append("CPU run in the Triton interpreter: timings are not GPU "
                               "figures; CUDA graphs and the bandwidth stage were skipped")  # fmt: skip
    started = time.perf_counter()
    if "bits" not in args.skip:
        log("1. bits")
        ref_cache: dict = {}
        for case in bit_cases(args.tiny):
            report["bits"] += check_bits(case, device, args.ref_rows, ref_cache, log)
        report["bits"] += check_finalize_bits(device, 300 if args.tiny else 20000, log)
        if device.type == "cuda":
            report["sync"] = check_no_sync(device)
    if "latency" not in args.skip:
        log("2. latency")
        report["latency"], notes = latency(shapes, device, timer, log)
        report["notes"] += notes
    if "bandwidth" not in args.skip and device.type == "cuda":
        log("3. bandwidth")
        report["bandwidth"] = bandwidth(shapes, device, timer)
    report["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_check.md").write_text(markdown(report))
    log(markdown(report))
    bits_ok = all(passed(r) for r in report["bits"])
    return 0 if bits_ok and all(r["status"] == "no-sync" for r in report["sync"]) else 1


if __name__ == "__main__":
    sys.exit(main())
