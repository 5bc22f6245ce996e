"""The Triton backend: the contract's three local passes and its finalize as GPU kernels.

kernels.py holds the @triton.jit kernels (max pass, partials pass, finalize, gradient),
launch.py the fixed launch configurations and the `TritonBackend` registered as
backend="triton".
"""

from .launch import CONFIGS, LaunchConfig, TritonBackend, interpreted

__all__ = ["CONFIGS", "LaunchConfig", "TritonBackend", "interpreted"]
