"""verl_fused: verl's fused logprob kernel, where the real `verl` package imports.

verl's fused kernel (verl.utils.kernel.linear_cross_entropy) is a CUDA kernel that fuses
the LM-head matmul: it takes hidden states and the head weight, not logits (candidate
kind "hidden_states"). The report therefore lists it as unavailable, with the reason:
the import error where verl is missing, otherwise why it cannot take this workload.
"""

from __future__ import annotations

import torch

from .base import Candidate, Unavailable, import_or_unavailable

KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"


class VerlFused(Candidate):
    name = "verl_fused"
    summary = f"{KERNEL_MODULE} (the real package)"
    implementation = "real"
    kind = "hidden_states"

    def check_available(self, device: torch.device) -> None:
        import_or_unavailable("verl")
        import_or_unavailable(KERNEL_MODULE)
        if device.type != "cuda":
            raise Unavailable(f"{KERNEL_MODULE} needs CUDA; device is {device}")
        super().check_available(device)  # the workload kind
