"""patch_trl(processed=True): a real TRL 1.16 GRPOTrainer replays the processed logprobs.

The trainer's policy, old and reference logprobs must be, bit for bit, exactlogp's
`processed_logprobs` of the logits `linear_logits` gives for the hidden states its fused
head saw (in bf16: the trainer runs under bf16 autocast), under the trainer's temperature /
top-k / top-p / min-p; tokens outside the trainer's kept set must be 0 there, out of the
loss mask, and counted. The rollout here
samples with no cut while the trainer replays top-k 200 / top-p 0.5 / min-p 0.05 (a tiny
model's near-uniform rows), so targets outside the kept set are certain.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import exactlogp
from exactlogp.integrations import trl
from tiny_models import save_tiny_qwen3

VOCAB = 300
TEMPERATURE = 0.7
CUT = {"top_k": 2, "top_p": 0.9, "min_p": 0.05}
# the tiny model's distributions are near uniform: a cut that keeps about half of them
LOOP_CUT = {"top_k": 200, "top_p": 0.5, "min_p": 0.05}


def test_processed_selective_log_softmax_masks_the_cut_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    index = torch.randint(0, 40, (3, 5))
    index[0, 0] = int(logits[0, 0].float().argmax())  # always kept
    row_mask = torch.ones_like(index)
    row_mask[2, 4] = 0
    got = trl.processed_selective_log_softmax(logits, index, 0.7, row_mask=row_mask, **CUT)
    exact = exactlogp.processed_logprobs(logits, index, temperature=0.7, **CUT)
    keep = ~exact.dropped & (row_mask != 0)
    assert torch.equal(got.loss_mask, keep)
    assert torch.equal(got.logprobs[keep], exact.logprobs[keep])
    assert bool((got.logprobs[~keep] == 0).all()) and bool(got.logprobs.isfinite().all())
    assert int(got.num_dropped) == int((exact.dropped & (row_mask != 0)).sum()) > 0
    assert got.loss_mask[0, 0]
    # TRL's defaults (top_k 0, top_p 1.0, min_p None) are no cut: the plain logprobs
    plain = trl.processed_selective_log_softmax(logits, index, 0.7, top_k=0, top_p=1.0)
    assert torch.equal(
        plain.logprobs, trl.selective_log_softmax(logits, index, 0.7, out_dtype=torch.float32)
    )
    assert bool(plain.loss_mask.all()) and int(plain.num_dropped) == 0
    with pytest.raises(ValueError, match="top_p"):
        trl.processed_selective_log_softmax(logits, index, top_p=1.5)


def test_processed_head_gradient_and_no_cut_bits():
    torch.manual_seed(1)
    hidden = torch.randn(10, 16, requires_grad=True)
    weight = torch.randn(60, 16)
    targets = torch.randint(0, 60, (10,))
    targets[3] = -100
    targets[:3] = (hidden.detach() @ weight.T)[:3].argmax(-1)  # kept
    lp, ent, dropped = trl.processed_head_logprobs(
        hidden, weight, None, targets, 0.7, top_k=3, with_entropy=True
    )
    assert bool(dropped.any()) and not bool(dropped[:4].any())
    lp.sum().backward()
    assert bool((hidden.grad[dropped] == 0).all()) and bool((hidden.grad[:3].abs() > 0).all())
    z = exactlogp.linear_logits(hidden.detach(), weight)
    exact = exactlogp.processed_logprobs(z, targets, temperature=0.7, top_k=3, with_entropy=True)
    assert torch.equal(lp.detach(), exact.logprobs.masked_fill(exact.dropped, 0))
    assert torch.equal(ent.detach(), exact.entropy)
    plain, _, none = trl.processed_head_logprobs(hidden.detach(), weight, None, targets, 0.7)
    reference = exactlogp.linear_selected_logprobs(
        hidden.detach(), weight, targets, temperature=0.7
    )
    assert torch.equal(plain, reference.logprobs) and not bool(none.any())


@pytest.fixture
def patched_processed():
    handle = trl.patch_trl(processed=True)
    yield handle
    with warnings.catch_warnings():  # the trainer's models keep exactlogp's head, as it says
        warnings.filterwarnings("ignore", "unpatch_trl: the host's functions", RuntimeWarning)
        trl.unpatch_trl()


def test_grpo_trainer_replays_processed_logprobs(tmp_path, patched_processed):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    assert "processed" in patched_processed.options
    save_tiny_qwen3(tmp_path / "model", VOCAB)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, beta=0.1, num_iterations=2,
        temperature=TEMPERATURE, learning_rate=0.05, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0, bf16=True,
        top_entropy_quantile=0.99,  # TRL then hands its loss mask to get_high_entropy_mask
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(tmp_path / "model"), reward_funcs=lambda completions, **_: [
            float(i % 2) for i in range(len(completions))
        ], args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5"]}),
    )  # fmt: skip
    # the rollout (transformers' generate) was configured with no cut; the trainer replays one
    trainer.top_k, trainer.top_p, trainer.min_p = LOOP_CUT.values()

    seen, calls, masks = [], [], []

    def watch(model, kind):
        def backbone_out(module, args, output):
            if seen and "hidden" not in seen[-1]:
                seen[-1]["hidden"] = output.last_hidden_state.detach().clone()
                seen[-1]["weight"] = model.lm_head.weight.detach().clone()

        def pre(module, args, kwargs):
            if kwargs.get("fused_lm_head"):
                assert torch.is_autocast_enabled("cpu")
                seen.append({"kind": kind, "labels": kwargs["labels"].clone()})

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.model.register_forward_hook(backbone_out)

    watch(trainer.model, "policy")
    watch(trainer.ref_model, "ref")
    score = trainer._get_per_token_logps_and_entropies

    def scored(model, *a, **k):
        start = len(seen)
        out = score(model, *a, **k)
        calls.append((torch.is_grad_enabled(), out[0].detach().clone(), seen[start:]))
        return out

    trainer._get_per_token_logps_and_entropies = scored
    high_entropy = trainer.get_high_entropy_mask

    def entropy_mask(entropies, mask, threshold):
        masks.append(mask.clone())
        return high_entropy(entropies, mask, threshold)

    trainer.get_high_entropy_mask = entropy_mask
    trainer.train()

    assert [grad for grad, _, _ in calls] == [False, False, True]  # old, ref, policy
    dropped_per_call = []
    for _, logps, forwards in calls:
        keep = logps.shape[1]
        expected, dropped = [], []
        for f in forwards:
            hidden, labels = f["hidden"][:, :-1], f["labels"][:, 1:]
            # under the trainer's bf16 autocast the head computes in bf16
            z = exactlogp.linear_logits(hidden.bfloat16(), f["weight"].bfloat16())
            exact = exactlogp.processed_logprobs(z, labels, temperature=TEMPERATURE, **LOOP_CUT)
            expected.append(exact.logprobs.masked_fill(exact.dropped, 0)[:, -keep:])
            dropped.append(exact.dropped[:, -keep:])
        assert torch.equal(logps, torch.cat(expected))
        assert bool(logps.isfinite().all())
        dropped_per_call.append(torch.cat(dropped))
    old_ref, policy = dropped_per_call[0] | dropped_per_call[1], dropped_per_call[2]
    assert bool(policy.any()), "the replayed cut should drop some sampled tokens"
    # the loss mask TRL used: the completion mask without any token cut in old, ref or policy
    (mask,) = masks
    assert not bool(mask.bool()[old_ref | policy].any())
    assert bool(mask.bool().any())
    metrics = {k: v for row in trainer.state.log_history for k, v in row.items()}
    assert metrics["exactlogp/dropped_tokens/policy"] > 0
    assert metrics["exactlogp/dropped_tokens/old_ref"] > 0
    assert math.isfinite(metrics["loss"])


def test_processed_head_under_autocast_computes_in_its_dtype_across_row_blocks():
    torch.manual_seed(2)
    rows = trl._ROW_BLOCK + 37  # two blocks
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight = torch.randn(60, 16, requires_grad=True)
    targets = torch.randint(0, 60, (rows,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _, dropped = trl.processed_head_logprobs(hidden, weight, None, targets, 0.7, **CUT)
    z = exactlogp.linear_logits(hidden.detach().bfloat16(), weight.detach().bfloat16())
    exact = exactlogp.processed_logprobs(z, targets, temperature=0.7, **CUT)
    assert torch.equal(dropped, exact.dropped) and 0 < int(dropped.sum()) < rows
    assert torch.equal(lp.detach(), exact.logprobs.masked_fill(exact.dropped, 0))
    lp.sum().backward()  # the checkpointed blocks recompute in bf16 too
    assert bool(hidden.grad.isfinite().all()) and bool((hidden.grad[dropped] == 0).all())
