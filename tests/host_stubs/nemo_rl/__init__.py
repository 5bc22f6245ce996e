"""Stand-in for NeMo-RL's package root (NVIDIA-NeMo/RL@7ea279abfbeb, `nemo_rl/__init__.py`
and `nemo_rl/package_info.py`), see tests/host_stubs/README.md.

Only the version is kept (package_info's 0.6.0 at that commit, without the `+<git hash>`
suffix it appends from a checkout). NeMo-RL's import side effects are left out on purpose:
`logging.basicConfig`, the Ray environment variables, the Megatron-LM and HF-modules
entries it adds to `sys.path`, the container fingerprint check and the `git rev-parse`
subprocess of package_info.
"""

__version__ = "0.6.0"
