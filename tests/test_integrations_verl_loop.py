"""verl 0.9.1's FSDP engine computing old log-probs, patched with patch_verl(), on the CPU.

In verl 0.9.1 `ActorRolloutRefWorker.compute_log_prob` (the successor of
`DataParallelPPOActor.compute_log_prob`) is `TrainingWorker.infer_batch`, which sets the
batch's defaults and calls the engine's `infer_batch`. The worker module does not import
here (its rollout-server imports need uvicorn, which verl's dependencies do not bring), so
this test drives the engine the worker wraps: a real `FSDPEngineWithLMHead` (FSDP2,
`fully_shard`) over a 1-rank gloo group of this process, built from a tiny Qwen3 saved to
the test's own temporary directory, fed by verl's own `left_right_2_no_padding` with the
keys the worker and the PPO trainer's `_compute_old_log_prob` set, its output read back
with verl's own `no_padding_2_padding` (the trainer's `old_log_probs`). Not verl's here:
- `_CpuPlatformStandIn`: verl 0.9.1 has no CPU platform (it falls back to CUDA), so a
  platform whose device is the CPU is installed through verl's `set_platform`;
- verl's model patch is told TRL is absent: with TRL 1.16 installed it imports
  `trl.AutoModelForCausalLMWithValueHead`, which TRL 1.16 no longer has, and fails to
  build any engine (it only touches a value-head class's `state_dict`);
- `use_remove_padding=False` and SDPA attention: verl's default packed path needs
  flash-attn's variable-length kernels (CUDA).
The model ties its embeddings (as Qwen3 0.6B - 4B do): with untied ones verl's FSDP2
wraps `lm_head` on its own, and its fused forward, which reads `lm_head.weight` without
calling the head, gets the sharded DTensor and fails in verl's own kernel too.

Two engines run: verl's default path (the LM head's bf16 logits, divided by the
temperature as verl does, into the patched `logprobs_from_logits` / `entropy_from_logits`)
and `use_fused_kernels=True` (hidden states and the LM-head weight into the patched
`FusedLinearForPPO`). Every log-prob and entropy the engine returns must be bitwise
exactlogp's, computed here from what hooks recorded at the LM head.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import exactlogp
from exactlogp.integrations.verl import patch_verl, unpatch_verl
from exactlogp.worlds import single_rank
from tiny_models import save_tiny_qwen3

VOCAB = 300
TEMPERATURE = 0.7
B, PROMPT, RESPONSE = 4, 5, 4


def _batch():
    """A left-padded prompt + right-padded response batch, as the rollout hands it over."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(B, PROMPT, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :1] = 0
    response_mask = torch.ones(B, RESPONSE, dtype=torch.long)
    response_mask[1, 2:] = 0
    response_mask[3, 3:] = 0
    prompts = torch.randint(3, VOCAB, (B, PROMPT), generator=g) * prompt_mask
    responses = torch.randint(3, VOCAB, (B, RESPONSE), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        },
        batch_size=[B],
    )


def _cpu_platform():
    from verl.plugin.platform.platform_base import PlatformBase

    class _CpuPlatformStandIn(PlatformBase):
        """The CPU as verl's accelerator: verl 0.9.1 ships CUDA, NPU and ROCm only."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # verl moves tensors and modules `.to(current_device())`

        def device_count(self):
            return 1

        def set_device(self, index):
            pass

        def synchronize(self, index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return _CpuPlatformStandIn()


@pytest.fixture
def verl_on_cpu(monkeypatch):
    """verl's FSDP engine on this process: a 1-rank gloo group, the CPU platform stand-in,
    patch_verl(); everything put back afterwards."""
    import verl.models.transformers.monkey_patch as verl_model_patch
    from transformers import Qwen3ForCausalLM
    from verl.plugin.platform import platform_manager

    monkeypatch.setattr(platform_manager, "_current_platform", _cpu_platform())
    monkeypatch.setattr(verl_model_patch, "is_trl_available", lambda: False)  # see above
    # use_fused_kernels=True makes verl replace the model class's forward
    monkeypatch.setattr(Qwen3ForCausalLM, "forward", Qwen3ForCausalLM.forward)
    patch_verl()  # before the engine is built, as the docs say
    try:
        with single_rank(torch.device("cpu"), timeout=120):
            yield
    finally:
        unpatch_verl()


def _old_log_probs(model_dir, fused):
    """Build verl's FSDP engine, compute the old log-probs; what the LM head saw."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    model_config = HFModelConfig(
        path=model_dir, use_remove_padding=False, use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": "torch"} if fused else None,
        override_config={"attn_implementation": "sdpa"}, enable_gradient_checkpointing=False,
    )  # fmt: skip
    model_config.model_type = "language_model"
    engine = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()

    seen = {}
    module = engine.module

    def inputs(mod, args, kwargs):
        seen["input_ids"] = kwargs["input_ids"].clone()

    def backbone(mod, args, output):
        weight = module.lm_head.weight
        weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        seen["hidden"] = output.last_hidden_state.detach().clone()
        seen["weight"] = weight.detach().clone()

    def head(mod, args, output):
        seen["logits"] = output.detach().clone()

    module.register_forward_pre_hook(inputs, with_kwargs=True)
    module.model.register_forward_hook(backbone)
    module.lm_head.register_forward_hook(head)

    data = left_right_2_no_padding(_batch())
    # what TrainingWorker.infer_batch and RayPPOTrainer._compute_old_log_prob set
    tu.assign_non_tensor(
        data, calculate_entropy=True, compute_loss=False, temperature=TEMPERATURE,
        use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=B,
        max_token_len_per_gpu=4096, use_fused_kernels=fused,
    )  # fmt: skip
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    log_probs, entropy = output["model_output"]["log_probs"], output["model_output"]["entropy"]
    return {
        "seen": seen,
        "offsets": log_probs.offsets(),
        "log_probs": log_probs.values(),
        "entropy": entropy.values(),
        "old_log_probs": no_padding_2_padding(log_probs, data),
        "autocast_dtype": engine._autocast_dtype,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl-model")
    save_tiny_qwen3(path, VOCAB, tie_word_embeddings=True)
    return str(path)


def _valid(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The packed (tokens, ...) rows of a (B, L, ...) tensor, each sequence's first tokens."""
    return torch.cat([padded[i, :n] for i, n in enumerate(offsets.diff().tolist())])


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "use_fused_kernels"])
def test_fsdp_engine_old_log_probs_are_exactlogps(model_dir, verl_on_cpu, fused):
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    got = _old_log_probs(model_dir, fused)
    seen, offsets = got["seen"], got["offsets"]
    assert got["autocast_dtype"] == torch.bfloat16  # verl's default mixed precision
    ids = seen["input_ids"]  # (B, L) as the engine padded them
    if fused:
        assert "logits" not in seen, "the fused path computed the logits"
        hidden, weight = seen["hidden"], seen["weight"]
        # FSDP2's mixed precision hands the forward bf16 parameters
        assert hidden.dtype == weight.dtype == torch.bfloat16
        exact = exactlogp.linear_selected_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), weight, torch.roll(ids, -1, -1).reshape(-1),
            temperature=TEMPERATURE, with_entropy=True,
        )  # fmt: skip
        expected_logp = _valid(exact.logprobs.view(ids.shape), offsets)  # verl's fp32
        expected_entropy = _valid(exact.entropy.view(ids.shape), offsets).to(hidden.dtype)
    else:
        logits = seen["logits"]
        assert logits.dtype == torch.bfloat16
        # verl divides the logits by the temperature in their dtype before scoring them
        scaled = _valid(logits / torch.tensor(TEMPERATURE).to(logits.dtype), offsets)
        labels = torch.roll(_valid(ids, offsets), -1, 0)
        exact = exactlogp.selected_logprobs(scaled, labels, with_entropy=True)
        expected_logp = exact.logprobs.to(logits.dtype)  # the logits' dtype, as verl's
        expected_entropy = exact.entropy.to(logits.dtype)
    assert torch.equal(got["log_probs"], expected_logp)
    assert torch.equal(got["entropy"], expected_entropy)
    # what the PPO trainer keeps as old_log_probs: the response tokens of the same values
    data = left_right_2_no_padding(_batch())
    nested = torch.nested.nested_tensor_from_jagged(expected_logp, offsets)
    assert torch.equal(got["old_log_probs"], no_padding_2_padding(nested, data))
    assert got["old_log_probs"].shape == (B, RESPONSE)
