"""Drop-ins for the frameworks RL post-training runs on: each side of the loop swaps one call.

- `megatron`: `vocab_parallel_cross_entropy` with megatron-core's signature; `patch_megatron()`.
- `verl`: `vocab_parallel_log_probs_from_logits`, `vocab_parallel_entropy` and both at once.
- `trl`: `selective_log_softmax`, `entropy_from_logits` on full logits.
- `vllm`: the rollout's logprobs of the sampled tokens; `patch_vllm_sampler()`.

No framework is a dependency: each module imports its framework only inside the calls that
need it, so `import exactlogp.integrations.megatron` works where megatron-core is absent.
See docs/integrations.md for one recipe per framework.
"""
