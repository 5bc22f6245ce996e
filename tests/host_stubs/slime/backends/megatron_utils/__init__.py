"""Stand-in: slime/backends/megatron_utils/__init__.py of THUDM/slime@624b824, without its
start-up work (accelerator initialisation, an optional DeepEP / torch_memory_saver patch),
which concerns GPUs only."""
