"""Stand-in for SGLang 0.5.23's module layout (see tests/host_stubs/README.md)."""

__version__ = "0.5.23"
