"""Stand-in for vLLM 0.34's module layout (see tests/host_stubs/README.md)."""

__version__ = "0.34.0"
