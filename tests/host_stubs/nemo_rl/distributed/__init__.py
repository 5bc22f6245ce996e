"""Stand-in for `nemo_rl/distributed/__init__.py` (NVIDIA-NeMo/RL@7ea279abfbeb): empty."""
