"""verl_fused: verl's fused logprob kernel, where the real `verl` package imports.

verl's fused kernel (verl.utils.kernel.linear_cross_entropy) is a CUDA kernel that fuses
the LM-head matmul: it takes hidden states and the head weight, not logits. The report
therefore lists it as unavailable, with the reason: the import error where verl is
missing, otherwise why it cannot take this workload.
"""

from __future__ import annotations

import torch

from .base import Candidate, ShardContext, Unavailable, import_or_unavailable

KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"


class VerlFused(Candidate):
    name = "verl_fused"
    summary = f"{KERNEL_MODULE} (the real package)"
    implementation = "real"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("verl")
        import_or_unavailable(KERNEL_MODULE)
        if device.type != "cuda":
            raise Unavailable(f"{KERNEL_MODULE} needs CUDA; device is {device}")
        raise Unavailable(
            f"{KERNEL_MODULE} fuses the LM-head matmul and takes hidden states and weights; "
            "this workload gives logits"
        )

    def build(self, ctx: ShardContext):
        raise Unavailable("verl_fused cannot take logits")
