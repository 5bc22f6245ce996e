"""Stand-in for `nemo_rl/models/megatron/train.py` (NVIDIA-NeMo/RL@7ea279abfbeb): only the
by-name import of line 50 that matters to a patch, i.e. the module-level copy of
`from_parallel_logits_to_logprobs` its logprob post-processor calls (line 657, with
`inference_only=True` and the trainer's `sampling_params`). The Megatron training code
itself (megatron-core, Megatron-Bridge) is not reproduced."""

from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs

__all__ = ["from_parallel_logits_to_logprobs"]
