"""Stand-in for `nemo_rl/models/megatron/__init__.py` (NVIDIA-NeMo/RL@7ea279abfbeb): empty."""
