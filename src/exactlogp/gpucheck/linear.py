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
V_local = 37984, bf16, a TP group of one) against what a Megatron trainer runs instead:
its bf16 LM-head GEMM followed by the real megatron-core vocab_parallel_cross_entropy, and
the bf16 GEMM + fp32 log_softmax + gather.
"""

from __future__ import annotations

import torch

import exactlogp

from .. import worlds
from ..backends import get_backend
from ..backends.base import EXACT_GEMM_ROUTES
from ..report import candidates, measure
from ..testing import bit_pattern, compare_bits, lm_head_inputs

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

    def run(backend, dev):
        hh, ww, bb = (x.to(dev).detach().requires_grad_(True) for x in (hid, w, bias))
        z = exactlogp.linear_logits(hh.detach(), ww.detach(), bb.detach(), backend=backend)
        res = exactlogp.linear_selected_logprobs(
            hh, ww, t.to(dev), bias=bb, with_entropy=True, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        named = {"logits": z, "logprobs": res.logprobs, "entropy": res.entropy, "lse": res.lse,
                 "grad hidden": hh.grad, "grad weight": ww.grad, "grad bias": bb.grad}  # fmt: skip
        return {k: x.detach().cpu() for k, x in named.items()}

    want = run("reference", torch.device("cpu"))
    for mode in EXACT_GEMM_ROUTES:
        log(f"  fused head {n} x {h} x {v}: triton ({mode} GEMM) on {device}, reference on CPU")
        got = run(gemm_backend(device, mode), device)
        for name in want:
            row = compare_bits(got[name], want[name])
            out.append({"case": f"fused-head {n}x{h}x{v} gemm={mode}", "entropy": True,
                        "output": name, **row})  # fmt: skip
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


def latency(device: torch.device, tiny: bool, repeats: int, warmup: int, log) -> list[dict]:
    n, h, v = (4, 48, 256) if tiny else (1024, QWEN3_NEXT_HIDDEN, 37984)
    hid, w, t = lm_head_inputs(n, h, v, torch.bfloat16, seed=22)
    hid, w, t = hid.to(device), w.to(device), t.to(device)
    steps = {}

    def with_grad():
        return hid.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def exact(mode):
        backend = gemm_backend(device, mode)

        def step(backward):
            x, wt = with_grad() if backward else (hid, w)
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

    for mode in EXACT_GEMM_ROUTES:
        steps[f"exactlogp linear_selected_logprobs (triton, {mode} GEMM)"] = exact(mode)
    steps["torch bf16 GEMM + fp32 log_softmax"] = torch_pipeline
    clock = measure.CudaEventClock(device) if device.type == "cuda" else None
    log(f"  fused head latency {n} x {h} x {v}")
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
    rows = []
    for name in steps:
        rows.append({
            "shape": "fused-head", "rows": n, "cols": v, "candidate": name,
            **{m: vars(measure.Timing.of(seconds[name, m])) for m in measure.MODES},
        })  # fmt: skip
    return rows
