"""Stage 5 of the GPU check: the exact fused LM head on the device.

Bits: linear_logits and linear_selected_logprobs (outputs and the hidden, weight and bias
gradients) of the Triton backend -- its exact GEMM on int8 slices -- against the reference
backend on the CPU, on realistic rows (testing.lm_head_inputs). Latency (CUDA events,
interleaved): the fused forward and forward+backward at the Qwen3-Next TP4 shape (1024
rows, H = 2048, V_local = 37984, bf16, a TP group of one) against what a Megatron trainer
runs instead: its bf16 LM-head GEMM followed by the real megatron-core
vocab_parallel_cross_entropy, and the bf16 GEMM + fp32 log_softmax + gather.
"""

from __future__ import annotations

import torch

import exactlogp

from ..report import candidates, measure, worlds
from ..testing import compare_bits, lm_head_inputs

QWEN3_NEXT_HIDDEN = 2048


def run_bits(device: torch.device, tiny: bool, log) -> list[dict]:
    n, h, v = (6, 48, 200) if tiny else (64, QWEN3_NEXT_HIDDEN, 4096)
    hid, w, t = lm_head_inputs(n, h, v, torch.bfloat16, seed=21)
    t[1] = -100
    bias = (0.1 * torch.randn(v, generator=torch.Generator().manual_seed(2))).bfloat16()
    out = []

    def run(backend, dev):
        hh, ww, bb = (x.to(dev).requires_grad_(True) for x in (hid, w, bias))
        z = exactlogp.linear_logits(hh.detach(), ww.detach(), bb.detach(), backend=backend)
        res = exactlogp.linear_selected_logprobs(
            hh, ww, t.to(dev), bias=bb, with_entropy=True, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        named = {"logits": z, "logprobs": res.logprobs, "entropy": res.entropy, "lse": res.lse,
                 "grad hidden": hh.grad, "grad weight": ww.grad, "grad bias": bb.grad}  # fmt: skip
        return {k: x.detach().cpu() for k, x in named.items()}

    log(f"  fused head {n} x {h} x {v}: triton on {device} vs reference on the CPU")
    got, want = run("triton", device), run("reference", torch.device("cpu"))
    for name in want:
        row = compare_bits(got[name], want[name])
        out.append({"case": f"fused-head {n}x{h}x{v}", "entropy": True, "output": name, **row})
    return out


def latency(device: torch.device, tiny: bool, repeats: int, warmup: int, log) -> list[dict]:
    n, h, v = (4, 48, 256) if tiny else (1024, QWEN3_NEXT_HIDDEN, 37984)
    hid, w, t = lm_head_inputs(n, h, v, torch.bfloat16, seed=22)
    hid, w, t = hid.to(device), w.to(device), t.to(device)
    steps = {}

    def with_grad():
        return hid.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def exact(backward):
        x, wt = with_grad() if backward else (hid, w)
        res = exactlogp.linear_selected_logprobs(x, wt, t, validate=False)
        if backward:
            (-res.logprobs.sum()).backward()
        return res.logprobs

    def torch_pipeline(backward):
        x, wt = with_grad() if backward else (hid, w)
        lp = torch.log_softmax((x @ wt.T).float(), -1).gather(-1, t.unsqueeze(-1))
        if backward:
            (-lp.sum()).backward()
        return lp

    steps["exactlogp linear_selected_logprobs (triton)"] = exact
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
