"""Drop-ins for the hosts RL post-training runs on, with each host's names, arguments and
output dtypes, and a reversible `patch_<host>()` per host.

- `trl`: full-logits helpers and the fused LM head of TRL 1.16's trainers; `patch_trl()`.
- `verl`: verl 0.9's log-prob / entropy functions (FSDP, torchtitan, automodel and Megatron
  engines) and its fused kernels; `patch_verl()`.
- `megatron`: megatron-core's `vocab_parallel_cross_entropy`, Megatron-LM RL's
  `selective_log_softmax`; `patch_megatron()`.
- `slime`: slime's `calculate_log_probs_and_entropy` (its Megatron backend's log-probs,
  entropies and top-p replay); `patch_slime()`.
- `vime`: `provider`, for vime's `--linear-logp-provider` (nothing is patched).
- `nemo_rl`: NeMo-RL's vocab-parallel `from_parallel_logits_to_logprobs` and its autograd
  entries (also with top-k / top-p: the exact cut); `patch_nemo_rl()`.
- `skyrl`: SkyRL 0.3.0's FSDP `logprobs_from_logits` / `chunked_entropy_from_logits` and its
  Megatron `from_parallel_logits_to_logprobs` (NeMo-RL's convention); `patch_skyrl()`.
- `areal`: AReaL's `gather_logprobs` / `gather_logprobs_entropy` (every engine);
  `patch_areal()`.
- `openrlhf`: OpenRLHF's `log_probs_from_logits` and `compute_entropy` (the actor);
  `patch_openrlhf()`.
- `vllm`: the rollout's logprobs (V2 model runner, V1 sampler); `patch_vllm_sampler()` and
  the `vllm.general_plugins` entry point.
- `sglang`: the sampler's sampled-token logprobs, opt-in its exact cut and draw
  (`patch_sglang(cut="exact")`); `patch_sglang()` and its plugin.
- `kept`: the kept sets vLLM and SGLang return, as CSR (`kept_csr`), and `replaying`, which
  makes the trainer-side drop-ins replay them (exactlogp.replay_logprobs).
- `autopatch`: EXACTLOGP_PATCH applies patches in worker processes and Ray actors.
- `handshake`: the contract fingerprint a rollout ships and a trainer checks.

No host is a dependency: each module imports its host only inside the calls that need it,
so `import exactlogp.integrations.megatron` works where megatron-core is absent.
See docs/integrations.md for one recipe per host and the version matrix.
"""

from .kept import kept_csr, replaying  # noqa: E402  (torch and exactlogp only)

__all__ = ["kept_csr", "replaying"]
