"""Stage 1 of the GPU check: the Triton backend's bits against the reference backend.

Forward outputs and gradients, entropy on and off, on the cases of `bit_cases`: the
Triton backend on the device (through the public API, or the TP pipeline over several
shards of one device, collectives done exactly) against a CPU backend on every row
(`ref_rows` None; a number checks only the first rows -- rows are independent). The CPU
side is the fused "cpu" backend by default: the test suite holds it bitwise to the torch
reference, and it checks 10^8 logits in seconds where the reference takes minutes.
Both Triton paths are checked whatever the GPU's "auto" picks: cases named -direct and
-tables force the direct kernels or the value tables (backends/triton/value_tables.py).
The finalize kernel alone on drawn records (testing.finalize_inputs) against
contract.finalize on the CPU, every field. And the forward with validate=False under
torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

import exactlogp

from .. import contract, testing
from ..backends import ShardPlan, get_backend
from ..temperature import Temperature

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
    value_tables: str = "auto"  # the Triton path: "auto" (as the GPU picks), "always", "never"


def forced(case: BitCase, value_tables: str) -> BitCase:
    """`case` on one Triton path whatever "auto" picks on this GPU, named -tables or -direct
    (its inputs, and so the CPU runs, are shared with `case`)."""
    suffix = "-tables" if value_tables == "always" else "-direct"
    return dataclasses.replace(case, name=case.name + suffix, value_tables=value_tables)


def bit_cases(tiny: bool) -> list[BitCase]:
    if tiny:
        # two rows: each Triton call with value tables fills a table of all 65536 16-bit
        # values per row, which the interpreter does element by element
        tp4 = BitCase("tiny-tp4", 2, 512, torch.bfloat16, shards=TP)
        fp16 = BitCase("tiny-fp16-mask", 5, 300, torch.float16, 290, "per_row", 0.7, True)
        fp32 = BitCase("tiny-fp32-edge", 6, 200, torch.float32, None, "0.7", None, True)
        return [tp4, forced(tp4, "always"), fp16, forced(fp16, "never"), fp32]
    full = BitCase("qwen3next-full", 1024, QWEN3_NEXT_VOCAB, torch.bfloat16)
    tp4 = dataclasses.replace(full, name="qwen3next-tp4", shards=TP)
    fp16 = BitCase("fp16-temp-mask-pad", 257, 50304, torch.float16, 50257, "per_row", 0.6, True)
    fp32 = BitCase("fp32-edge", 64, 4096, torch.float32, None, "0.7", None, True)
    # a decode step: one row (Triton compiles a size of 1 as a constant)
    decode = BitCase("decode-1row", 1, QWEN3_NEXT_VOCAB, torch.bfloat16, None, "0.7")
    return [
        full, tp4, forced(full, "never"), forced(full, "always"), forced(tp4, "always"),
        fp16, forced(fp16, "always"), forced(fp16, "never"), fp32,
        decode, forced(decode, "always"),
    ]  # fmt: skip


# --- inputs, made on the device (the CPU copy feeds the reference) ---


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
    x, target = testing.llm_like_logits(case.rows, case.vocab, case.dtype, seed, device)
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


def run_api(inp: Inputs, case: BitCase, backend, with_entropy: bool) -> dict:
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


def run_sharded(inp: Inputs, case: BitCase, impl, with_entropy: bool) -> dict:
    """The TP pipeline over `case.shards` shards on one device, collectives done exactly."""
    tau = Temperature.of(inp.temperature)
    n, width = inp.logits.shape[0], case.vocab // case.shards
    spans = [(k * width, (k + 1) * width) for k in range(case.shards)]

    def shard(lo, hi):
        plan = ShardPlan(lo, case.vocab_size, -100, with_entropy)
        keep = None if inp.keep_mask is None else inp.keep_mask[:, lo:hi]
        return inp.logits[:, lo:hi], keep, plan

    row_max = torch.full((n,), float("-inf"), device=inp.logits.device)
    for lo, hi in spans:  # all_reduce(MAX)
        x, keep, plan = shard(lo, hi)
        row_max = torch.maximum(row_max, impl.row_max(x, tau, keep, plan))
    record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64, device=row_max.device)
    for lo, hi in spans:  # all_reduce(SUM)
        x, keep, plan = shard(lo, hi)
        record += impl.partials(x, inp.target, tau, keep, row_max, plan)
    fin = impl.finalize(row_max, record, inp.target, case.vocab_size, -100, None)
    g_lp, g_lse, g_ent = inp.weights
    stats = contract.grad_stats(row_max, fin, g_lp, g_ent if with_entropy else None, g_lse)
    tau = tau.gradient_divisor(stats)
    grads = []
    for lo, hi in spans:
        x, keep, plan = shard(lo, hi)
        grads.append(impl.grad(x, inp.target, tau, keep, stats, plan))
    outs = {"logprobs": fin.logprobs, "lse": fin.lse}
    if with_entropy:
        outs["entropy"] = fin.entropy
    return outs | {"grad": torch.cat(grads, dim=1)}


def run_local_passes(inp: Inputs, case: BitCase, backend, lo: int, hi: int) -> dict:
    """One shard's local passes (what a TP rank computes), with the whole-row max."""
    impl = get_backend(backend, inp.logits.device)
    tau = Temperature.of(inp.temperature)
    full_plan = ShardPlan(0, case.vocab_size, -100, True)
    row_max = impl.row_max(inp.logits, tau, inp.keep_mask, full_plan)
    plan = ShardPlan(lo, case.vocab_size, -100, True)
    x = inp.logits[:, lo:hi]
    return {
        "shard_row_max": impl.row_max(x, tau, None, plan),
        "shard_record": impl.partials(x, inp.target, tau, None, row_max, plan),
    }


def triton_backend(device, value_tables: str):
    """The Triton backend for `device` on the path `value_tables` names ("auto": as it is)."""
    impl = get_backend("triton", device)
    return impl if value_tables == "auto" else impl.with_options(value_tables=value_tables)


# --- comparing bits ---


def cpu_reference() -> str:
    """The CPU backend the device's bits are compared with: "cpu" where it builds."""
    try:
        get_backend("cpu", torch.device("cpu"))
        return "cpu"
    except ValueError:
        return "reference"


def check_bits(
    case: BitCase, device, ref_rows: int | None, ref_cache: dict, log, ref_backend: str
) -> list[dict]:
    """Both entropy settings of one case; `ref_cache` shares CPU reference runs between
    cases with the same inputs (the TP4 case reuses the whole-vocabulary one)."""
    inp = make_inputs(case, device)
    count = case.rows if ref_rows is None else min(ref_rows, case.rows)
    cpu_inp = inp.rows(count, "cpu")
    inputs_key = dataclasses.replace(case, name="", shards=1, value_tables="auto")
    results = []
    triton = triton_backend(device, case.value_tables)
    for with_entropy in (False, True):
        t0 = time.perf_counter()
        if case.shards > 1:
            got = run_sharded(inp, case, triton, with_entropy)
        else:
            got = run_api(inp, case, triton, with_entropy)
        t1 = time.perf_counter()
        key = (inputs_key, count, with_entropy)
        if key not in ref_cache:
            ref_cache[key] = run_api(cpu_inp, case, ref_backend, with_entropy)
        want = ref_cache[key]
        t2 = time.perf_counter()
        for name, ref in want.items():
            res = testing.compare_bits(got[name][:count], ref)
            results.append({"case": case.name, "entropy": with_entropy, "output": name,
                            "rows": count, "against": ref_backend} | res)  # fmt: skip
        log(f"  {case.name} entropy={with_entropy}: triton {t1 - t0:.1f} s, "
            f"{ref_backend} backend ({count} of {case.rows} rows, CPU) {t2 - t1:.1f} s")  # fmt: skip
    if case.shards > 1:  # one TP rank's local passes on its own
        lo, hi = (case.shards - 1) * (case.vocab // case.shards), case.vocab
        got = run_local_passes(inp.rows(count, device), case, triton, lo, hi)
        want = run_local_passes(cpu_inp, case, ref_backend, lo, hi)
        for name in want:
            res = testing.compare_bits(got[name], want[name])
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
            res = testing.compare_bits(getattr(got, field), getattr(want, field))
            results.append({"case": name, "entropy": None, "output": field} | res)
    log(f"  finalize on {len(FINALIZE_CASES)} x {rows} drawn records")
    return results


def check_no_sync(device) -> list[dict]:
    """The forward with validate=False must not wait on the device (CUDA only)."""
    x, target = testing.llm_like_logits(64, 4096, torch.bfloat16, 3, device)
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


def run(device, tiny: bool, ref_rows: int | None, log, ref_backend: str | None = None):
    """(bit results, host-sync results) of the whole stage."""
    bits, ref_cache = [], {}
    ref_backend = ref_backend or cpu_reference()
    for case in bit_cases(tiny):
        bits += check_bits(case, device, ref_rows, ref_cache, log, ref_backend)
    bits += check_finalize_bits(device, 300 if tiny else 20000, log)
    sync = check_no_sync(device) if device.type == "cuda" else []
    return bits, sync
