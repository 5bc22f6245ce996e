"""A real TRL 1.16 GRPO training loop, patched with patch_trl(), on the CPU.

A tiny Qwen3 and a word-level tokenizer are built here and saved to the test's own
temporary directory (no hub, no network); `GRPOTrainer` loads both from there, as it would
a hub id, generates with transformers, and trains two steps with `beta > 0` (the
reference model's logprobs) and `num_iterations = 2` (the old policy's logprobs, and a
second step that reuses them after the policy moved). Hooks record what the trainer's
fused LM head saw -- the backbone's last hidden states, the LM-head weight at that moment,
the labels -- and every logprob tensor `_get_per_token_logps_and_entropies` handed the
trainer must be bitwise exactlogp's `linear_selected_logprobs` of those inputs -- in fp32,
and under the trainer's bf16 autocast (`bf16=True`), where the head computes in bf16.
Unpatched, TRL's own head fails these checks (its chunked fp32 sums round differently).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import exactlogp
from exactlogp.integrations import trl
from tiny_models import save_tiny_qwen3, words

VOCAB = 300
WORDS = words(VOCAB)
TEMPERATURE = 0.7


@pytest.fixture
def patched():
    handle = trl.patch_trl()
    yield handle
    with warnings.catch_warnings():  # the trainer's models keep exactlogp's head, as it says
        warnings.filterwarnings("ignore", "unpatch_trl: TRL's functions", RuntimeWarning)
        trl.unpatch_trl()


class _Recorder:
    """What the fused head saw and returned, per forward, while the trainer scored tokens."""

    def __init__(self):
        self.scoring = None  # the list of this call's forwards, while a call is running
        self.calls = []  # (model kind, grad enabled, logps returned, its forwards)

    def watch(self, model, kind):
        def pre(module, args, kwargs):
            if self.scoring is not None and kwargs.get("fused_lm_head"):
                autocast = torch.is_autocast_enabled("cpu")
                self.scoring.append(
                    {"kind": kind, "labels": kwargs["labels"].clone(), "autocast": autocast}
                )

        def backbone_out(module, args, output):
            if self.scoring is not None and self.scoring and "hidden" not in self.scoring[-1]:
                self.scoring[-1]["hidden"] = output.last_hidden_state.detach().clone()
                self.scoring[-1]["weight"] = model.lm_head.weight.detach().clone()

        def out(module, args, kwargs, output):
            if self.scoring is not None and kwargs.get("fused_lm_head"):
                entropy = None if output.entropy is None else output.entropy.detach().clone()
                self.scoring[-1].update(
                    log_probs=output.log_probs.detach().clone(), entropy=entropy
                )

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.model.register_forward_hook(backbone_out)
        model.register_forward_hook(out, with_kwargs=True)

    def wrap(self, trainer):
        original = trainer._get_per_token_logps_and_entropies

        def scored(model, *args, **kwargs):
            self.scoring = []
            try:
                logps, entropies, aux = original(model, *args, **kwargs)
            finally:
                forwards, self.scoring = self.scoring, None
            kind = "ref" if model is trainer.ref_model else "policy"
            self.calls.append((kind, torch.is_grad_enabled(), logps.detach().clone(), forwards))
            return logps, entropies, aux

        trainer._get_per_token_logps_and_entropies = scored


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_grpo_trains_two_steps_and_every_logprob_is_exactlogps(tmp_path, patched, bf16):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    save_tiny_qwen3(tmp_path / "model", VOCAB)
    dataset = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5"]})

    def reward_alternating(completions, **kwargs):
        # the two completions of each prompt always differ in reward: nonzero advantages
        return [float(i % 2) for i in range(len(completions))]

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, beta=0.1, num_iterations=2,
        temperature=TEMPERATURE, learning_rate=0.05, use_cpu=True, bf16=bf16,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(tmp_path / "model"), reward_funcs=reward_alternating, args=args,
        train_dataset=dataset,
    )  # fmt: skip
    assert trainer.ref_model is not None
    recorder = _Recorder()
    recorder.watch(trainer.model, "policy")
    recorder.watch(trainer.ref_model, "ref")
    recorder.wrap(trainer)
    weight_before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(trainer.model.lm_head.weight, weight_before), "the policy did not move"

    # old policy and reference at step 1 (no grad), then the policy with grad at both steps
    kinds = [(kind, grad) for kind, grad, _, _ in recorder.calls]
    assert kinds == [("policy", False), ("ref", False), ("policy", True), ("policy", True)]
    dtype = torch.bfloat16 if bf16 else torch.float32  # the head computes in autocast's dtype
    entropies = 0
    for kind, _, logps, forwards in recorder.calls:
        assert forwards and all(f["kind"] == kind for f in forwards)
        assert all(f["autocast"] == bf16 for f in forwards)
        keep = logps.shape[1]
        expected = []
        for f in forwards:
            hidden, labels = f["hidden"][:, :-1], f["labels"][:, 1:]
            exact = exactlogp.linear_selected_logprobs(
                hidden.reshape(-1, hidden.shape[-1]).to(dtype), f["weight"].to(dtype),
                labels.reshape(-1),
                temperature=TEMPERATURE, with_entropy=f["entropy"] is not None,
            )  # fmt: skip
            assert f["log_probs"].dtype == torch.float32
            assert torch.equal(f["log_probs"], exact.logprobs.view(labels.shape)), kind
            if f["entropy"] is not None:
                entropies += 1
                assert torch.equal(f["entropy"], exact.entropy.view(labels.shape)), kind
            expected.append(exact.logprobs.view(labels.shape)[:, -keep:])
        assert torch.equal(logps, torch.cat(expected)), kind  # what the trainer used
        assert bool((logps != 0).any())
    assert entropies >= 2  # the loss passes ask for the entropy too
    # the second step scored the same completions with the moved policy
    assert not torch.equal(recorder.calls[3][2], recorder.calls[0][2])
