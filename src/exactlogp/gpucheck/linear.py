"""Stage 5 of the GPU check: the exact fused LM head on the device.

Bits: linear_logits and linear_selected_logprobs (outputs and the hidden, weight and bias
gradients) of the Triton backend -- its exact GEMM on each path, cuBLAS DGEMM ("fp64") and
int8 slices ("int8") -- against the reference backend on the CPU, on realistic rows
(testing.lm_head_inputs). Batch invariance on the device: the same rows' logits and
logprobs computed one row per call (a decode step), 7 rows per call and all at once (a
prefill), by the exact head and by the torch LM heads a trainer or rollout runs instead
(cuBLAS bf16 and fp32 GEMMs, then exactlogp on their logits): how many rows differ
between batch sizes. Latency (CUDA events, interleaved): the fused forward and
forward+backward on each GEMM path at the Qwen3-Next TP4 shape (1024 rows, H = 2048,
V_local = 37984, bf16, a TP group of one) -- and, on the two fast routes, a decode step
(8 rows, prepared weight), a training-size block (4096 x 4096) and the whole vocabulary
(151936) -- against what a Megatron trainer runs instead: its bf16 LM-head GEMM followed
by the real megatron-core vocab_parallel_cross_entropy, and the bf16 GEMM + fp32
log_softmax + gather. Then the int8 logits kernel alone on each candidate tile.
"""

from __future__ import annotations

from functools import partial

import torch

import exactlogp

from .. import linear as exact_head
from .. import worlds
from ..backends import get_backend
from ..backends.base import EXACT_GEMM_ROUTES
from ..report import candidates, measure
from ..temperature import Temperature
from ..testing import bit_pattern, compare_bits, grad_keep_bytes, lm_head_inputs

QWEN3_NEXT_HIDDEN = 2048


def gemm_backend(device: torch.device, mode: str):
    """The Triton backend for `device` with its exact GEMM on path `mode`."""
    return get_backend("triton", device).with_options(exact_gemm=mode)


def run_bits(device: torch.device, tiny: bool, log) -> list[dict]:
    n, h, v = (6, 48, 200) if tiny else (64, QWEN3_NEXT_HIDDEN, 4096)
    hid, w, t = lm_head_inputs(n, h, v, torch.bfloat16, seed=21)
    t[1] = -100
    bias = (0.1 * torch.randn(v, generator=torch.Generator().manual_seed(2))).bfloat16()
    out = []

    def run(backend, dev, predicted=False):
        hh, ww, bb = (x.to(dev).detach().requires_grad_(True) for x in (hid, w, bias))
        z = exactlogp.linear_logits(hh.detach(), ww.detach(), bb.detach(), backend=backend)
        with grad_keep_bytes(0 if predicted else exact_head.GRAD_KEEP_BYTES):
            res = exactlogp.linear_selected_logprobs(
                hh, ww, t.to(dev), bias=bb, with_entropy=True, backend=backend
            )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        named = {"logits": z, "logprobs": res.logprobs, "entropy": res.entropy, "lse": res.lse,
                 "grad hidden": hh.grad, "grad weight": ww.grad, "grad bias": bb.grad}  # fmt: skip
        return {k: x.detach().cpu() for k, x in named.items()}

    want = run("reference", torch.device("cpu"))
    # every route; the two fast ones also with the backward on a predicted grid (the path
    # past GRAD_KEEP_BYTES)
    cases = [(mode, False) for mode in EXACT_GEMM_ROUTES]
    cases += [("fp64", True), ("int8_fused", True)]
    for mode, predicted in cases:
        what = f"{mode} GEMM" + (", predicted grid" if predicted else "")
        log(f"  fused head {n} x {h} x {v}: triton ({what}) on {device}, reference on CPU")
        got = run(gemm_backend(device, mode), device, predicted)
        for name in want:
            row = compare_bits(got[name], want[name])
            case = f"fused-head {n}x{h}x{v} gemm={mode}" + (" predicted" if predicted else "")
            out.append({"case": case, "entropy": True, "output": name, **row})
    return out


BATCHES = (1, 7)  # rows per call, against all rows in one call


def _row_differs(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many rows of a and b differ in any bit (NaN nowhere here)."""
    differ = bit_pattern(a) != bit_pattern(b)
    return int(differ.reshape(differ.shape[0], -1).any(dim=-1).sum())


def batch_invariance(device: torch.device, tiny: bool, log) -> list[dict]:
    """Rows' logits and logprobs computed in batches of `BATCHES` rows against all rows in
    one call, for the exact head and for torch heads + exactlogp. The exact head must agree
    (a failure otherwise); the torch heads' counts are what the device's GEMMs do."""
    n, h, v = (8, 48, 200) if tiny else (256, QWEN3_NEXT_HIDDEN, 37984)
    hid, w, t = (x.to(device) for x in lm_head_inputs(n, h, v, torch.bfloat16, seed=23))

    def exact(rows):
        z = exactlogp.linear_logits(hid[rows], w)
        lp = exactlogp.linear_selected_logprobs(hid[rows], w, t[rows], validate=False)
        return z, lp.logprobs

    def torch_head(dtype):
        def run(rows):
            z = hid[rows].to(dtype) @ w.to(dtype).T
            return z, exactlogp.selected_logprobs(z, t[rows], validate=False).logprobs

        return run

    heads = {"exact fused LM head (linear_logits, linear_selected_logprobs)": exact,
             "torch bf16 LM head (x @ w.T) + exactlogp": torch_head(torch.bfloat16),
             "torch fp32 LM head (x @ w.T) + exactlogp": torch_head(torch.float32)}  # fmt: skip
    out = []
    with torch.no_grad():
        for name, head in heads.items():
            whole = head(slice(0, n))
            for batch in BATCHES:
                parts = [head(slice(i, min(i + batch, n))) for i in range(0, n, batch)]
                z = torch.cat([p[0] for p in parts])
                lp = torch.cat([p[1] for p in parts])
                out.append({"head": name, "batch": batch, "against": n, "rows": n,
                            "logits_rows_differing": _row_differs(z, whole[0]),
                            "logprobs_differing": _row_differs(lp, whole[1]),
                            "must_agree": name.startswith("exact")})  # fmt: skip
            log(f"  batch invariance {n} x {h} x {v}: {name}: "
                + ", ".join(f"batch {r['batch']}: {r['logits_rows_differing']} rows' logits, "
                            f"{r['logprobs_differing']} logprobs differ" for r in out[-len(BATCHES):]))  # fmt: skip
    return out


def invariance_passed(row: dict) -> bool:
    return not row["must_agree"] or (row["logits_rows_differing"] == 0
                                     and row["logprobs_differing"] == 0)  # fmt: skip


# (name, rows, hidden, V_local, the exact routes timed, a prepared weight, runs): the TP4
# shard on every route; a decode step on a prepared weight, a training-size block and the
# whole vocabulary on the two fast routes, with fewer runs (each run is a larger GEMM)
FUSED_SHAPES = (
    ("tp4-shard", 1024, QWEN3_NEXT_HIDDEN, 37984, EXACT_GEMM_ROUTES, False, None),
    ("decode-step", 8, QWEN3_NEXT_HIDDEN, 37984, ("fp64", "int8_fused"), True, None),
    ("training", 4096, 4096, 37984, ("fp64", "int8_fused"), False, 5),
    ("full-vocab", 1024, QWEN3_NEXT_HIDDEN, 151936, ("fp64", "int8_fused"), False, 5),
)
TINY_FUSED_SHAPES = (
    ("tp4-shard", 4, 48, 256, EXACT_GEMM_ROUTES, False, None),
    ("decode-step", 2, 48, 256, ("int8_fused",), True, None),
)


def latency(device: torch.device, tiny: bool, repeats: int, warmup: int, log) -> list[dict]:
    """The fused head's forward and forward+backward on each shape of FUSED_SHAPES beside
    the torch pipelines it replaces, then the int8 kernel's tiles (tile_sweep)."""
    rows = []
    for shape in TINY_FUSED_SHAPES if tiny else FUSED_SHAPES:
        name, n, h, v, routes, prepared, runs = shape
        log(f"  fused head latency, {name}: {n} x {h} x {v}")
        few = runs is not None  # the large shapes: fewer runs, one warm-up
        rows += _latency(device, name, n, h, v, routes, prepared, runs if few else repeats,
                         min(warmup, 1) if few else warmup, log)  # fmt: skip
    return rows + tile_sweep(device, tiny, repeats, warmup, log)


def _latency(device, shape, n, h, v, routes, prepared, repeats, warmup, log) -> list[dict]:
    hid, w, t = lm_head_inputs(n, h, v, torch.bfloat16, seed=22)
    hid, w, t = hid.to(device), w.to(device), t.to(device)
    steps = {}

    def with_grad():
        return hid.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def exact(mode, predicted=False):
        backend = gemm_backend(device, mode)
        handle = exactlogp.prepare_lm_head(w, backend=backend) if prepared else None

        def step(backward):
            x, wt = with_grad() if backward else (hid, handle if prepared else w)
            with grad_keep_bytes(0 if predicted else exact_head.GRAD_KEEP_BYTES):
                res = exactlogp.linear_selected_logprobs(x, wt, t, validate=False, backend=backend)
            if backward:
                (-res.logprobs.sum()).backward()
            return res.logprobs

        return step

    def torch_pipeline(backward):
        x, wt = with_grad() if backward else (hid, w)
        lp = torch.log_softmax((x @ wt.T).float(), -1).gather(-1, t.unsqueeze(-1))
        if backward:
            (-lp.sum()).backward()
        return lp

    for mode in routes:
        steps[f"exactlogp linear_selected_logprobs (triton, {mode} GEMM"
              + (", prepared weight)" if prepared else ")")] = exact(mode)  # fmt: skip
    if shape == "tp4-shard" and device.type == "cuda":  # dL/dz fit GRAD_KEEP_BYTES here:
        # the other backward beside it (the bits stage runs it everywhere)
        for mode in ("fp64", "int8_fused"):
            name = f"exactlogp linear_selected_logprobs (triton, {mode} GEMM, predicted grid)"
            steps[name] = exact(mode, predicted=True)
    steps["torch bf16 GEMM + fp32 log_softmax"] = torch_pipeline
    clock = measure.CudaEventClock(device) if device.type == "cuda" else None
    with worlds.single_rank(device) as group:
        megatron, built = candidates.create("megatron_ce"), False
        try:
            megatron.check_available(device)
            ce = megatron.build(candidates.ShardContext(0, 1, group, device, v, v, 0))
            built = True

            def megatron_pipeline(backward):  # logprobs = -CE, the loss as a trainer has it
                x, wt = with_grad() if backward else (hid, w)
                lp = ce(x @ wt.T, t)
                if backward:
                    (-lp.sum()).backward()
                return lp

            steps["bf16 GEMM + megatron-core vocab_parallel_cross_entropy"] = megatron_pipeline
        except candidates.Unavailable as exc:
            log(f"  megatron-core unavailable: {exc}")
        timed = {(name, mode): (lambda f=fn, b=(mode == "forward_backward"): f(b))
                 for name, fn in steps.items() for mode in measure.MODES}  # fmt: skip
        try:
            seconds = measure.interleaved(timed, repeats, warmup=warmup, clock=clock)
        finally:
            if built:
                megatron.teardown()
    return [{"shape": f"fused-head {shape} {n}x{h}", "rows": n, "cols": v, "candidate": name,
             **{m: vars(measure.Timing.of(seconds[name, m])) for m in measure.MODES}}
            for name in steps]  # fmt: skip


def tile_sweep(device: torch.device, tiny: bool, repeats: int, warmup: int, log) -> list[dict]:
    """head_logits_kernel on each of linear_kernels.HEAD_TILES: the logits and row max of
    the TP4 shard (1024 x 2048 x 37984) and of a decode step (8 rows), from prepared
    slices -- the int8 GEMMs and their epilogue alone -- timed interleaved; each tile's
    logits and row max must be the default tile's bits (a failed row fails the check)."""
    if device.type != "cuda" and not tiny:
        return []
    from ..backends.triton import linear_kernels as lk
    from ..linear_contract import row_exponents, unit_scales

    prepared = exactlogp.prepare_lm_head
    shapes = ((3, 48, 200),) if tiny else ((1024, QWEN3_NEXT_HIDDEN, 37984),
                                                         (8, QWEN3_NEXT_HIDDEN, 37984))  # fmt: skip
    backend = gemm_backend(device, "int8_fused")
    rows = []
    for n, h, v in shapes:
        hid, w, _ = (x.to(device) for x in lm_head_inputs(n, h, v, torch.bfloat16, seed=24))
        head = prepared(w, backend=backend)
        c3, col_scale = head.c3(backend), head.col_scale
        e, finite = row_exponents(hid)
        a3 = lk.head_slices(hid, e, finite, reverse=True)
        row_scale = unit_scales(e - 2 * lk.linear_contract.QBITS, finite)
        # as the forward launches it: the row max in the epilogue, temperature 0.7
        max_of = (Temperature.of(0.7), v)
        logits = partial(lk.head_logits, a3, row_scale, c3, col_scale, None, 1.0, max_of=max_of)
        run = {tile: partial(logits, tile=tile) for tile in lk.HEAD_TILES}

        seen: dict = {}  # each tile's bits, from its timed runs (every run must agree)
        clock = measure.CudaEventClock(device) if device.type == "cuda" else None
        seconds = measure.interleaved(run, repeats, warmup=warmup, clock=clock,
                                      on_run=partial(_see, seen))  # fmt: skip
        want = seen[lk.HEAD_TILE]
        same = {tile: want is not None and seen[tile] is not None
                and torch.equal(seen[tile], want) for tile in run}  # fmt: skip
        for tile in lk.HEAD_TILES:
            timing = vars(measure.Timing.of(seconds[tile]))
            rows.append({"shape": f"head-logits tiles {n}x{h}", "rows": n, "cols": v,
                         "candidate": f"head_logits_kernel {tile.name}"
                         + (" (default)" if tile == lk.HEAD_TILE else "")
                         + ("" if same[tile] else ": BITS DIFFER from the default tile's"),
                         "forward": timing, "forward_backward": None,
                         "bits_equal_default": same[tile]})  # fmt: skip
        log(f"  head_logits tiles {n} x {h} x {v}: " + ", ".join(
            f"{r['candidate'].split()[1]} {r['forward']['median'] * 1e6:.0f} us"
            + ("" if r["bits_equal_default"] else " BITS DIFFER") for r in rows[-len(run):]))  # fmt: skip
    return rows


def _see(seen: dict, tile, out) -> None:
    """Keeps the bits of a head_logits launch's (logits, row max) for its tile, as int32 on
    the device (compared there: no copy to the host per run); None once two runs of the
    tile disagreed. A zero max counts as +0: its sign is not pinned (numerics.md, 7)."""
    bits = torch.cat([out[0].reshape(-1), out[1] + 0.0]).view(torch.int32)
    if tile not in seen:
        seen[tile] = bits
    elif seen[tile] is not None and not torch.equal(seen[tile], bits):
        seen[tile] = None


def tiles_passed(row: dict) -> bool:
    return row.get("bits_equal_default", True)
