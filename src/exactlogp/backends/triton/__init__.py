"""The Triton backend: contract v1's three local passes and its finalize as GPU kernels.

kernels.py holds the @triton.jit kernels (max pass, term pass, finalize, gradient),
launch.py the fixed launch configurations and the `TritonBackend` registered as
backend="triton".
"""

from .launch import CONFIGS, LaunchConfig, TritonBackend, interpreted

__all__ = ["CONFIGS", "LaunchConfig", "TritonBackend", "interpreted"]
