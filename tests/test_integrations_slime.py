"""exactlogp.integrations.slime, against a stand-in of slime's `calculate_log_probs_and_entropy`.

The package named `slime` on the package index (0.0.0) is an unrelated linear mixed-effects
model library; THUDM/slime is installed from its repository only. So
tests/host_stubs/slime reproduces THUDM/slime@624b824's `slime.utils.ppo_utils` log-prob /
entropy (the same arithmetic) and a loss module that binds the name, as slime's does.
Claims: ours has slime's shapes and dtypes; ours is within the stated accuracy of the fp64
truth and within fp32 tolerance of slime's values; bitwise the same at TP = 1 and 2 (gloo).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import slime_vime_world
from exactlogp import selected_logprobs
from exactlogp.integrations import autopatch
from exactlogp.integrations import slime as ours
from exactlogp.testing import (
    assert_bitwise_equal,
    error_bound,
    fp64_reference,
    llm_like_logits,
    ulp32,
)
from integration_stubs import STUB_ROOT, drop_stub_modules, use_stub_package

VOCAB, ROWS = 500, 6
# slime's fp32 pipeline (row max, exp, fp32 sum, log, fp32 entropy sum) against ours; its
# entropy gradient p * (sum(p x) - x) carries a few ulp of |x| (logits up to ~40 here)
SLIME_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture
def host(monkeypatch):
    use_stub_package(monkeypatch, "slime")
    import slime.backends.megatron_utils.loss as loss
    import slime.utils.ppo_utils as ppo_utils

    yield ppo_utils, loss
    ours.unpatch_slime()
    drop_stub_modules("slime")


def _case(dtype=torch.float32, seed=0, rows=ROWS, vocab=VOCAB):
    logits, target = llm_like_logits(rows, vocab, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, vocab, generator=gen) < 0.3
    mask[0, target[0]] = False  # a target the mask drops: slime keeps it anyway
    return logits, target, mask


def _kept(mask, target):
    return mask.clone().index_put_((torch.arange(len(target)), target), torch.tensor(True))


def _assert_accurate(got, ref, name, vocab=VOCAB):
    want = getattr(ref, name)
    bound = 0.5 * ulp32(want) + error_bound(ref.scale[name], vocab)
    assert bool(((got.double() - want).abs() <= bound).all()), name


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "keep mask"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("chunk_size", [-1, 2])
def test_matches_slime_and_the_fp64_truth(host, masked, with_entropy, chunk_size):
    ppo_utils, _ = host
    logits, target, mask = _case()
    keep = mask if masked else None
    x_ours, x_theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    kwargs = dict(with_entropy=with_entropy, chunk_size=chunk_size, log_prob_keep_mask=keep)
    logp, entropy = ours.calculate_log_probs_and_entropy(x_ours, target, None, **kwargs)
    s_logp, s_entropy = ppo_utils.calculate_log_probs_and_entropy(x_theirs, target, None, **kwargs)
    assert logp.shape == s_logp.shape == (ROWS, 1) and logp.dtype == s_logp.dtype == torch.float32
    torch.testing.assert_close(logp, s_logp, **SLIME_TOL)
    ref = fp64_reference(logits, target, keep_mask=_kept(mask, target) if masked else None)
    _assert_accurate(logp.squeeze(-1), ref, "logprobs")
    direct = selected_logprobs(logits, target, keep_mask=_kept(mask, target) if masked else None)
    assert_bitwise_equal(logp.squeeze(-1), direct.logprobs, "logp vs exactlogp")
    if with_entropy:
        assert entropy.shape == s_entropy.shape == (ROWS,) and entropy.dtype == torch.float32
        torch.testing.assert_close(entropy, s_entropy, **SLIME_TOL)
        _assert_accurate(entropy, fp64_reference(logits, target), "entropy")
        loss, s_loss = logp.sum() + entropy.sum(), s_logp.sum() + s_entropy.sum()
    else:
        assert entropy is None and s_entropy is None
        loss, s_loss = logp.sum(), s_logp.sum()
    loss.backward()
    s_loss.backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **GRAD_TOL)


def test_bf16_logits_give_slimes_fp32_outputs(host):
    ppo_utils, _ = host
    logits, target, _ = _case(torch.bfloat16)
    logp, entropy = ours.calculate_log_probs_and_entropy(logits, target, None, True)
    s_logp, s_entropy = ppo_utils.calculate_log_probs_and_entropy(logits, target, None, True)
    assert (logp.dtype, entropy.dtype) == (s_logp.dtype, s_entropy.dtype) == (torch.float32,) * 2
    torch.testing.assert_close(logp, s_logp, **SLIME_TOL)
    torch.testing.assert_close(entropy, s_entropy, **SLIME_TOL)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_empty_input_gives_slimes_shapes(host, with_entropy):
    ppo_utils, _ = host
    logits = torch.zeros(0, VOCAB, dtype=torch.bfloat16)
    target = torch.zeros(0, dtype=torch.int64)
    got = ours.calculate_log_probs_and_entropy(logits, target, None, with_entropy)
    want = ppo_utils.calculate_log_probs_and_entropy(logits, target, None, with_entropy)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or (a.shape, a.dtype) == (b.shape, b.dtype) == (
            (0,),
            torch.bfloat16,
        )


def test_keep_mask_narrows_logp_only_and_chunks_change_no_bit(host):
    logits, target, mask = _case()
    plain = ours.calculate_log_probs_and_entropy(logits, target, None, True)
    masked = ours.calculate_log_probs_and_entropy(logits, target, None, True, 2, mask)
    assert_bitwise_equal(masked[1], plain[1], "entropy ignores the mask")
    assert bool((masked[0] >= plain[0]).all())  # a smaller normaliser
    chunked = ours.calculate_log_probs_and_entropy(logits, target, None, True, 4, mask)
    assert_bitwise_equal(chunked[0], masked[0], "chunked logp")


@pytest.mark.parametrize("with_entropy_grad", [False, True])
def test_entropy_grad_follows_with_entropy_grad(host, with_entropy_grad):
    ppo_utils, _ = host
    logits, target, mask = _case()
    x = logits.clone().requires_grad_()
    for keep in (None, mask):
        for fn in (ours.calculate_log_probs_and_entropy, ppo_utils.calculate_log_probs_and_entropy):
            logp, entropy = fn(x, target, None, True, log_prob_keep_mask=keep,
                               with_entropy_grad=with_entropy_grad)  # fmt: skip
            assert logp.requires_grad and entropy.requires_grad == with_entropy_grad


def test_inputs_are_not_modified_and_padding_can_be_left_out(host):
    logits, target, mask = _case()
    before = (logits.clone(), mask.clone())
    ours.calculate_log_probs_and_entropy(logits, target, None, True, -1, mask)
    assert_bitwise_equal(logits, before[0], "logits")
    assert torch.equal(mask, before[1])
    padded = torch.cat([logits, torch.zeros(ROWS, 12)], -1)
    got = ours.calculate_log_probs_and_entropy(padded, target, None, True, vocab_size=VOCAB)
    want = ours.calculate_log_probs_and_entropy(logits, target, None, True)
    assert_bitwise_equal(got[0], want[0], "logp without padding")
    assert_bitwise_equal(got[1], want[1], "entropy without padding")


def test_bad_arguments_are_named(host):
    logits, target, mask = _case()
    with pytest.raises(ValueError, match="target"):
        ours.calculate_log_probs_and_entropy(logits, target + VOCAB, None)
    with pytest.raises(TypeError, match="log_prob_keep_mask must be a torch.bool"):
        ours.calculate_log_probs_and_entropy(logits, target, None, False, -1, mask.int())
    with pytest.raises(ValueError, match="log_prob_keep_mask must be"):
        ours.calculate_log_probs_and_entropy(logits, target, None, False, -1, mask[:2])
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        ours.calculate_log_probs_and_entropy(logits, target, None, False, 2.0)
    with pytest.raises(ValueError, match=r"logits must be \[T, V_local\]"):
        ours.calculate_log_probs_and_entropy(logits[None], target[None], None)


# --- the patch ---


def test_signature_is_slimes(host):
    ppo_utils, _ = host
    theirs = inspect.signature(ppo_utils.calculate_log_probs_and_entropy).parameters
    mine = list(inspect.signature(ours.calculate_log_probs_and_entropy).parameters.values())
    assert [(p.name, p.default, p.kind) for p in theirs.values()] == [
        (p.name, p.default, p.kind) for p in mine[: len(theirs)]
    ]


def test_patch_reaches_both_bindings_and_unpatch_restores(host):
    ppo_utils, loss = host
    original = ppo_utils.calculate_log_probs_and_entropy
    logits, target, mask = _case()
    handle = ours.patch_slime()
    assert ours.patch_slime() is handle and not handle.skipped
    assert ppo_utils.calculate_log_probs_and_entropy is ours.calculate_log_probs_and_entropy
    assert loss.calculate_log_probs_and_entropy is ours.calculate_log_probs_and_entropy
    logp, entropy = loss.score_rows(logits, target, None, rollout_temperature=0.7,
                                    with_entropy=True, log_prob_keep_mask=mask)  # fmt: skip
    direct = selected_logprobs(logits / 0.7, target, keep_mask=_kept(mask, target))
    assert_bitwise_equal(logp.squeeze(-1), direct.logprobs, "loss module's call, patched")
    with pytest.raises(ValueError, match="already applied"):
        ours.patch_slime(vocab_size=VOCAB)
    assert ours.unpatch_slime() is True and ours.unpatch_slime() is False
    assert ppo_utils.calculate_log_probs_and_entropy is original
    assert loss.calculate_log_probs_and_entropy is original


def test_patch_binds_vocab_size_and_env(host, monkeypatch):
    ppo_utils, loss = host
    logits, target, _ = _case()
    monkeypatch.setenv("EXACTLOGP_PATCH", "slime")
    monkeypatch.setenv("EXACTLOGP_VOCAB_SIZE", str(VOCAB))
    handles = autopatch.apply_from_env()
    assert handles["slime"].options == {"vocab_size": VOCAB}
    padded = torch.cat([logits, torch.zeros(ROWS, 12)], -1)
    got, _ = loss.calculate_log_probs_and_entropy(padded, target, None)
    assert_bitwise_equal(got, ours.calculate_log_probs_and_entropy(logits, target, None)[0], "")


def test_an_unknown_slime_is_refused_with_its_version(host, monkeypatch):
    ppo_utils, _ = host

    def older(logits, tokens, tp_group, with_entropy=False, chunk_size=-1, need_entropy_grad=False):
        raise AssertionError

    original = ppo_utils.calculate_log_probs_and_entropy
    monkeypatch.setattr(ppo_utils, "calculate_log_probs_and_entropy", older)
    with pytest.raises(RuntimeError, match=r"slime of unknown version has calculate_log_probs"):
        ours.patch_slime()
    assert ppo_utils.calculate_log_probs_and_entropy is older
    monkeypatch.setattr(ppo_utils, "calculate_log_probs_and_entropy", original)


def test_a_loss_module_that_does_not_import_is_skipped(host, monkeypatch):
    ppo_utils, _ = host
    monkeypatch.setitem(sys.modules, ours.LOSS, None)  # the real one needs megatron-core
    handle = ours.patch_slime()
    assert ours.LOSS + "." + ours.NAME in handle.skipped
    assert ppo_utils.calculate_log_probs_and_entropy is ours.calculate_log_probs_and_entropy


def test_without_slime_nothing_is_patched(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)
    with pytest.raises(ImportError, match="patch_slime: cannot import slime"):
        ours.patch_slime()


def test_the_start_up_hook_patches_slime_when_it_is_imported():
    root = STUB_ROOT.parent.parent
    code = (
        f"{(root / 'src' / 'exactlogp-autopatch.pth').read_text().strip()}\n"
        "import slime.backends.megatron_utils.loss as loss, exactlogp.integrations.slime as x\n"
        "print(loss.calculate_log_probs_and_entropy is x.calculate_log_probs_and_entropy)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTLOGP_")}
    env.update(
        EXACTLOGP_PATCH="slime", PYTHONPATH=os.pathsep.join([str(root / "src"), str(STUB_ROOT)])
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


# --- a 2-rank gloo world: TP = 2 against TP = 1 ---


def test_tp2_is_tp1_bitwise_and_slimes_values(host):
    results = [slime for slime, _ in slime_vime_world.tp2_results()]
    base = slime_vime_world.slime_scores(slime_vime_world.case(), 0, 1, None)  # TP = 1
    for kind in ("plain", "masked"):
        grad = torch.cat([results[r][(kind, "ours")][2] for r in range(2)], -1)
        assert_bitwise_equal(grad, base[(kind, "ours")][2], f"{kind} grad, TP=2")
        for rank in range(2):
            got, theirs = results[rank][(kind, "ours")], results[rank][(kind, "slime")]
            assert_bitwise_equal(got[0], base[(kind, "ours")][0], f"{kind} logp, rank {rank}")
            assert_bitwise_equal(got[1], base[(kind, "ours")][1], f"{kind} entropy, rank {rank}")
            torch.testing.assert_close(theirs[0], got[0], **SLIME_TOL)
            torch.testing.assert_close(theirs[1], got[1], **SLIME_TOL)
            torch.testing.assert_close(theirs[2], got[2], **GRAD_TOL)
