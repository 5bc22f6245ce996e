"""Stand-in for THUDM/slime's package layout at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
(slime 0.3.1; see tests/host_stubs/README.md). slime's own `slime/__init__.py` is empty: the
version lives only in its distribution's metadata, which a stand-in does not have."""
