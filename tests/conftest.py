"""Without a GPU, Triton kernels run in Triton's interpreter on the CPU. The variable must be
set before exactlogp's kernels are defined, so it is set here, before any test module loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
