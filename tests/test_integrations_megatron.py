"""exactlogp.integrations.megatron: against stub modules (the adapter and patch logic) and
against the real megatron-core in a gloo world of 4 CPU processes (the numbers)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import megatron as ours
from exactlogp.testing import (
    assert_bitwise_equal,
    error_bound,
    fp64_reference,
    llm_like_logits,
    run_gloo_world,
    ulp32,
)
from integration_stubs import install_megatron

SITES = (
    "megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy",
    "megatron.core.tensor_parallel.vocab_parallel_cross_entropy",
    "megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy",
    "megatron.core.models.common.language_module.language_module.fused_vocab_parallel_cross_entropy",
)


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    ours.unpatch_megatron()


def _sb_case(seed=0, s=5, b=3, vocab=507, dtype=torch.bfloat16):
    logits, target = llm_like_logits(s * b, vocab, dtype, seed=seed)
    return logits.view(s, b, vocab), target.view(s, b)


# --- the drop-in, on stub parallel state ---


def test_loss_is_minus_selected_logprob_with_megatron_shapes(monkeypatch):
    install_megatron(monkeypatch)
    logits, target = _sb_case()
    loss = ours.vocab_parallel_cross_entropy(logits, target)
    assert loss.shape == target.shape and loss.dtype == torch.float32
    assert_bitwise_equal(loss, -selected_logprobs(logits, target).logprobs, "loss")


def test_gradient_is_softmax_minus_one_hot(monkeypatch):
    install_megatron(monkeypatch)
    logits, target = _sb_case(dtype=torch.float32)
    x = logits.clone().requires_grad_()
    ours.vocab_parallel_cross_entropy(x, target).sum().backward()
    p = torch.softmax(logits.double(), -1)
    expected = p - torch.nn.functional.one_hot(target, logits.shape[-1]).double()
    torch.testing.assert_close(x.grad.double(), expected, atol=1e-7, rtol=0)


def test_input_is_not_modified(monkeypatch):
    install_megatron(monkeypatch)
    logits, target = _sb_case(dtype=torch.float32)
    before = logits.clone()
    ours.vocab_parallel_cross_entropy(logits, target)
    assert_bitwise_equal(logits, before, "logits after the call")


def test_vocab_size_leaves_padding_out(monkeypatch):
    install_megatron(monkeypatch)
    logits, target = _sb_case(vocab=500)
    padded = torch.cat([logits, torch.zeros(5, 3, 12, dtype=logits.dtype)], -1)
    loss = ours.vocab_parallel_cross_entropy(padded, target, vocab_size=500)
    assert_bitwise_equal(loss, ours.vocab_parallel_cross_entropy(logits, target), "padded")


@pytest.mark.parametrize("value", [0.1, -0.5, 1.0])
def test_label_smoothing_is_refused(monkeypatch, value):
    install_megatron(monkeypatch)
    logits, target = _sb_case()
    with pytest.raises(ValueError, match=rf"label_smoothing={value!r} is not supported"):
        ours.vocab_parallel_cross_entropy(logits, target, value)


def test_label_smoothing_must_be_a_number(monkeypatch):
    install_megatron(monkeypatch)
    logits, target = _sb_case()
    with pytest.raises(TypeError, match="label_smoothing must be a float, got str"):
        ours.vocab_parallel_cross_entropy(logits, target, "0")


def test_uninitialized_parallel_state_is_a_clear_error(monkeypatch):
    install_megatron(monkeypatch, initialized=False)
    logits, target = _sb_case()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ours.vocab_parallel_cross_entropy(logits, target)


def test_missing_megatron_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)
    logits, target = _sb_case()
    with pytest.raises(ImportError, match="install megatron-core or pass tp_group"):
        ours.vocab_parallel_cross_entropy(logits, target)


def test_group_and_vocab_range_come_from_megatron_state(monkeypatch):
    mods = install_megatron(monkeypatch, rank=2, world_size=4)
    group, start = ours.resolve_tp_group(None, torch.empty(3, 128))
    assert group is mods.group and start == 2 * 128
    explicit = object()
    assert ours.resolve_tp_group(explicit, torch.empty(3, 128)) == (explicit, None)


def test_megatron_padded_vocab_size():
    assert ours.megatron_padded_vocab_size(151936, 1) == 151936  # 1187 * 128
    assert ours.megatron_padded_vocab_size(151936, 2) == 152064
    assert ours.megatron_padded_vocab_size(151936, 4) == 152064
    assert ours.megatron_padded_vocab_size(151936, 8) == 152576
    assert ours.megatron_padded_vocab_size(1024, 8) == 1024


# --- patch_megatron, on stub modules ---


def _site_values(mods):
    return (
        mods.cross_entropy.vocab_parallel_cross_entropy,
        mods.tensor_parallel.vocab_parallel_cross_entropy,
        mods.fused.fused_vocab_parallel_cross_entropy,
        mods.language_module.fused_vocab_parallel_cross_entropy,
    )


def test_patch_replaces_every_site_and_undo_restores(monkeypatch):
    mods = install_megatron(monkeypatch)
    before = _site_values(mods)
    handle = ours.patch_megatron()
    assert handle.active and handle.sites == SITES
    plain, fused = ours.vocab_parallel_cross_entropy, ours.fused_vocab_parallel_cross_entropy
    assert _site_values(mods) == (plain, plain, fused, fused)
    logits, target = _sb_case()
    expected = ours.vocab_parallel_cross_entropy(logits, target).transpose(0, 1)
    for fusion in (False, True):
        loss = mods.language_module.compute_language_model_loss(
            target.transpose(0, 1), logits, fusion=fusion
        )
        assert_bitwise_equal(loss, expected, f"model loss, fusion={fusion}")
    assert ours.unpatch_megatron() is True
    assert _site_values(mods) == before and not handle.active
    assert ours.unpatch_megatron() is False


def test_patch_is_idempotent(monkeypatch):
    mods = install_megatron(monkeypatch)
    first = ours.patch_megatron()
    assert ours.patch_megatron() is first
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is ours.vocab_parallel_cross_entropy
    first.undo()
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is mods.originals["plain"]
    first.undo()  # a second undo is a no-op
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is mods.originals["plain"]


def test_patch_with_vocab_size_binds_it(monkeypatch):
    mods = install_megatron(monkeypatch)
    ours.patch_megatron(vocab_size=500)
    logits, target = _sb_case(vocab=500)
    padded = torch.cat([logits, torch.full((5, 3, 12), 30.0, dtype=logits.dtype)], -1)
    loss = mods.tensor_parallel.vocab_parallel_cross_entropy(padded, target)
    assert_bitwise_equal(loss, ours.vocab_parallel_cross_entropy(logits, target), "bound")
    with pytest.raises(ValueError, match="already applied with {'vocab_size': 500}"):
        ours.patch_megatron()
    with pytest.raises(TypeError, match="vocab_size must be an int or None, got float"):
        ours.unpatch_megatron()
        ours.patch_megatron(vocab_size=500.0)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (9.9, TypeError, "vocab_size must be an int or None, got float 9.9"),
        (True, TypeError, "vocab_size must be an int or None, got bool True"),
        ("151936", TypeError, "vocab_size must be an int or None, got str '151936'"),
        (0, ValueError, "vocab_size must be >= 1, got 0"),
    ],
)
def test_patch_checks_vocab_size(monkeypatch, value, error, match):
    mods = install_megatron(monkeypatch)
    with pytest.raises(error, match=match):
        ours.patch_megatron(vocab_size=value)
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is mods.originals["plain"]


def test_moved_symbol_is_named_and_nothing_changes(monkeypatch):
    mods = install_megatron(monkeypatch)
    del mods.fused.fused_vocab_parallel_cross_entropy
    before = mods.tensor_parallel.vocab_parallel_cross_entropy
    with pytest.raises(AttributeError, match=SITES[2].replace(".", r"\.") + " does not exist"):
        ours.patch_megatron()
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is before
    assert mods.cross_entropy.vocab_parallel_cross_entropy is before


def test_missing_module_is_named(monkeypatch):
    install_megatron(monkeypatch)
    monkeypatch.setitem(sys.modules, "megatron.core.fusions.fused_cross_entropy", None)
    with pytest.raises(
        ImportError, match=r"cannot import megatron\.core\.fusions\.fused_cross_entropy"
    ):
        ours.patch_megatron()


def test_undo_leaves_a_later_replacement_alone(monkeypatch, caplog):
    mods = install_megatron(monkeypatch)
    ours.patch_megatron()
    theirs = types.SimpleNamespace()  # someone else's patch, applied after ours
    mods.tensor_parallel.vocab_parallel_cross_entropy = theirs
    with caplog.at_level(logging.WARNING):
        ours.unpatch_megatron()
    assert mods.tensor_parallel.vocab_parallel_cross_entropy is theirs
    assert mods.cross_entropy.vocab_parallel_cross_entropy is mods.originals["plain"]
    assert "was replaced after patch_megatron" in caplog.text


# --- the real megatron-core, gloo world of 4 ---

VOCAB = 1024  # megatron needs equal shards; 1000 real columns + 24 padding in one case
TP_SIZES = (1, 2, 4)


def _cases():
    cases = {}
    for name, dtype, seed in (("bf16", torch.bfloat16, 1), ("fp32", torch.float32, 2)):
        logits, target = llm_like_logits(48, VOCAB, dtype, seed=seed)
        cases[name] = (logits.view(8, 6, VOCAB), target.view(8, 6))
    return cases


def _megatron_world(rank, world_size, group, cases):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.language_module import language_module

    from exactlogp.integrations import verl
    from exactlogp.report.candidates.megatron import setup_megatron, teardown_megatron

    out = {}
    for tp in TP_SIZES:
        setup_megatron(tp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, (logits, target) in cases.items():
            width = VOCAB // tp
            shard = logits[..., tp_rank * width : (tp_rank + 1) * width]
            theirs, theirs_grad = _loss_and_grad(
                tensor_parallel.vocab_parallel_cross_entropy, shard, target
            )
            mine, mine_grad = _loss_and_grad(ours.vocab_parallel_cross_entropy, shard, target)
            explicit = ours.vocab_parallel_cross_entropy(shard, target, 0.0, tp_group)
            padded = torch.where(torch.arange(VOCAB) >= 1000, 0.0, logits.float()).to(logits.dtype)
            pad_shard = padded[..., tp_rank * width : (tp_rank + 1) * width]
            mine_padded = ours.vocab_parallel_cross_entropy(
                pad_shard, target.clamp(max=999), vocab_size=1000
            )
            logp, entropy = verl.vocab_parallel_log_probs_and_entropy(shard, target)
            out[(tp, name)] = dict(
                theirs=theirs, theirs_grad=theirs_grad, mine=mine, mine_grad=mine_grad,
                explicit=explicit, mine_padded=mine_padded, verl_logp=logp, verl_entropy=entropy,
                verl_entropy_alone=verl.vocab_parallel_entropy(shard),
                verl_logp_alone=verl.vocab_parallel_log_probs_from_logits(shard, target),
            )  # fmt: skip
        if tp == TP_SIZES[-1]:
            out["patch"] = _check_patch_in_megatron(
                tensor_parallel, language_module, tp_group, cases["bf16"], tp_rank, tp
            )
        teardown_megatron()
    return out


def _loss_and_grad(fn, shard, target):
    x = shard.clone().requires_grad_()  # megatron edits fp32 logits in place: give it a copy
    loss = fn(x, target)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def _check_patch_in_megatron(tensor_parallel, language_module, tp_group, case, tp_rank, tp):
    from megatron.core.tensor_parallel import cross_entropy

    logits, target = case
    width = VOCAB // tp
    shard = logits[..., tp_rank * width : (tp_rank + 1) * width]
    originals = (
        cross_entropy.vocab_parallel_cross_entropy,
        tensor_parallel.vocab_parallel_cross_entropy,
        language_module.fused_vocab_parallel_cross_entropy,
    )
    handle = ours.patch_megatron()
    model_losses = {}
    for fusion in (False, True):
        module = types.SimpleNamespace(
            config=types.SimpleNamespace(
                cross_entropy_loss_fusion=fusion, cross_entropy_fusion_impl="native"
            ),
            pg_collection=types.SimpleNamespace(tp=tp_group),
        )
        model_losses[fusion] = language_module.LanguageModule.compute_language_model_loss(
            module, target.transpose(0, 1), shard
        )
    via_package = tensor_parallel.vocab_parallel_cross_entropy(shard, target)
    rows = shard.reshape(-1, shard.shape[-1]).to(torch.float32, copy=True)  # miles' fp32 copy
    before = rows.clone()
    miles = miles_compute_log_probs(rows, target.reshape(-1), tp_group)
    handle.undo()
    restored = (
        cross_entropy.vocab_parallel_cross_entropy,
        tensor_parallel.vocab_parallel_cross_entropy,
        language_module.fused_vocab_parallel_cross_entropy,
    )
    return dict(
        model_losses=model_losses,
        via_package=via_package,
        restored=all(a is b for a, b in zip(originals, restored, strict=True)),
        sites=handle.sites,
        miles=miles,
        miles_input_kept=torch.equal(rows, before),
    )


def miles_compute_log_probs(logits, tokens, process_group):
    """miles' default log-prob path (radixark/miles@31f1ca9,
    miles/backends/training_utils/loss_hub/math_utils.py, `compute_log_probs` without
    true-on-policy mode): megatron-core's fused CE imported when called, on [T, 1, V_local]
    logits and [T, 1] tokens, three positional arguments, negated: [T, 1]."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    return -fused_vocab_parallel_cross_entropy(logits.unsqueeze(1), tokens.unsqueeze(1),
                                               process_group)  # fmt: skip


@pytest.fixture(scope="module")
def megatron_world():
    pytest.importorskip("megatron.core")
    cases = _cases()
    return cases, run_gloo_world(4, _megatron_world, cases, timeout=240)


def _full_grad(results, tp, name):
    return torch.cat([results[r][(tp, name)]["mine_grad"] for r in range(tp)], -1)


def test_real_megatron_ours_is_tp_invariant_bitwise(megatron_world):
    cases, results = megatron_world
    for name in cases:
        base = results[0][(1, name)]
        for tp in TP_SIZES:
            for rank in range(4):
                got = results[rank][(tp, name)]
                for key in ("mine", "explicit", "mine_padded", "verl_logp", "verl_entropy"):
                    assert_bitwise_equal(got[key], base[key], f"{name} TP={tp} rank {rank} {key}")
            assert_bitwise_equal(
                _full_grad(results, tp, name), base["mine_grad"], f"{name} grad TP={tp}"
            )


def test_real_megatron_is_not_tp_invariant(megatron_world):
    # Measured on these seeded inputs: Megatron's fp32 partial sums, added across ranks,
    # round differently for TP=1, 2 and 4.
    cases, results = megatron_world
    differing = {
        name: int((results[0][(4, name)]["theirs"] != results[0][(1, name)]["theirs"]).sum())
        for name in cases
    }
    assert all(count > 0 for count in differing.values()), differing


def _megatron_band(ref) -> torch.Tensor:
    """What megatron's fp32 pipeline may be off by: S = fp32 sum of fp32 exps carries a
    relative error of a few 2^-24 (an absolute error of as much in log S), then log and
    the final subtraction round once each. Stated generously: 16 * 2^-24 + 2 ulp(loss)."""
    return 16 * 2.0**-24 + 2 * ulp32(ref.logprobs)


def test_real_megatron_values_agree_within_megatron_error(megatron_world):
    cases, results = megatron_world
    for name, (logits, target) in cases.items():
        ref = fp64_reference(logits.view(-1, VOCAB), target.view(-1))
        mine = results[0][(1, name)]["mine"].view(-1).double()
        ulp = ulp32(ref.logprobs)
        # ours: correctly rounded up to the documented tiny bound
        assert bool(
            (
                (mine + ref.logprobs).abs() <= 0.5 * ulp + error_bound(ref.scale["logprobs"], VOCAB)
            ).all()
        )
        for tp in TP_SIZES:
            theirs = results[0][(tp, name)]["theirs"].view(-1).double()
            assert bool(((theirs - mine).abs() <= _megatron_band(ref)).all()), (name, tp)


def test_real_megatron_gradients_agree(megatron_world):
    # Megatron forms softmax - one_hot in fp32: an absolute error of a few 2^-24 (at the
    # target it rounds p near 1). Ours is rounded once to the logits' dtype: half an ulp.
    cases, results = megatron_world
    for name in cases:
        rtol = 2.0**-8 if name == "bf16" else 2.0**-24
        for tp in TP_SIZES:
            theirs = torch.cat([results[r][(tp, name)]["theirs_grad"] for r in range(tp)], -1)
            mine = _full_grad(results, tp, name)
            torch.testing.assert_close(mine.double(), theirs.double(), atol=8 * 2.0**-24, rtol=rtol)


def test_real_megatron_padding_is_left_out(megatron_world):
    cases, results = megatron_world
    logits, target = cases["bf16"]
    expected = -selected_logprobs(logits[..., :1000], target.clamp(max=999)).logprobs
    assert_bitwise_equal(results[3][(4, "bf16")]["mine_padded"], expected, "vocab_size=1000")


def test_real_megatron_verl_functions(megatron_world):
    cases, results = megatron_world
    for name, (logits, target) in cases.items():
        got = results[0][(4, name)]
        assert_bitwise_equal(got["verl_logp"], -got["mine"], f"{name} verl logp")
        assert_bitwise_equal(got["verl_logp_alone"], got["verl_logp"], f"{name} logp alone")
        assert_bitwise_equal(
            got["verl_entropy_alone"], got["verl_entropy"], f"{name} entropy alone"
        )
        ref = fp64_reference(logits.view(-1, VOCAB), target.view(-1))
        err = (got["verl_entropy"].view(-1).double() - ref.entropy).abs()
        assert bool(
            (err <= 0.5 * ulp32(ref.entropy) + error_bound(ref.scale["entropy"], VOCAB)).all()
        )


def test_real_megatron_patch_reaches_the_model_loss(megatron_world):
    cases, results = megatron_world
    for rank in range(4):
        patch = results[rank]["patch"]
        mine = results[rank][(4, "bf16")]["mine"]
        assert patch["sites"] == SITES
        assert patch["restored"]
        assert_bitwise_equal(
            patch["via_package"], mine, "tensor_parallel.vocab_parallel_cross_entropy"
        )
        for fusion, loss in patch["model_losses"].items():
            assert_bitwise_equal(
                loss, mine.transpose(0, 1), f"LanguageModule loss, fusion={fusion}"
            )


def test_real_megatron_patch_covers_miles_log_probs(megatron_world):
    """miles calls megatron-core's fused CE by name (math_utils.compute_log_probs): under
    patch_megatron() that call form gives exactlogp's log-probs at TP = 4, the TP = 1 bits,
    [T, 1] fp32, and leaves miles' fp32 copy as it was (megatron's own CE edits it)."""
    cases, results = megatron_world
    for rank in range(4):
        patch = results[rank]["patch"]
        assert patch["miles"].shape == (48, 1) and patch["miles"].dtype == torch.float32
        tp1 = results[rank][(1, "bf16")]["mine"].reshape(-1, 1)
        assert_bitwise_equal(patch["miles"], -tp1, f"miles log-probs, rank {rank}")
        assert patch["miles_input_kept"]


# --- Megatron-LM HEAD: explicit groups and the RL log-probs ---


class MethodGroup:
    """What megatron-core HEAD passes as tp_group: asked with .rank() / .size()."""

    def rank(self):
        return 0

    def size(self):
        return 1


def test_explicit_group_is_asked_for_rank_and_size(monkeypatch):
    install_megatron(monkeypatch, initialized=False)  # parallel state is not read
    logits, target = _sb_case()
    got = ours.vocab_parallel_cross_entropy(logits, target, 0.0, MethodGroup())
    assert_bitwise_equal(got, -selected_logprobs(logits, target).logprobs, "explicit group")


def _install_rl_utils(monkeypatch):
    """megatron.rl.rl_utils as Megatron-LM HEAD has it: get_logprobs calls the module's
    own selective_log_softmax (a copy of TRL's) on the gathered, padded-vocab logits."""
    import torch.nn.functional as F

    def selective_log_softmax(logits, index):
        return torch.stack(
            [
                F.log_softmax(row, -1).gather(-1, i[:, None])[:, 0]
                for row, i in zip(logits, index, strict=True)
            ]
        )

    rl = types.ModuleType("megatron.rl")
    rl_utils = types.ModuleType("megatron.rl.rl_utils")
    rl_utils.selective_log_softmax = selective_log_softmax
    rl_utils.is_batch_invariant_mode_enabled = lambda: False
    exec(
        "def get_logprobs(logits, tokens):\n"
        "    return selective_log_softmax(logits[:, :-1, :], tokens[:, 1:])\n",
        rl_utils.__dict__,
    )
    monkeypatch.setitem(sys.modules, "megatron.rl", rl)
    monkeypatch.setitem(sys.modules, "megatron.rl.rl_utils", rl_utils)
    return rl_utils


def test_patch_reaches_megatron_rl_get_logprobs(monkeypatch):
    rl_utils = _install_rl_utils(monkeypatch)
    logits = llm_like_logits(2 * 6, 256, torch.bfloat16, seed=3)[0].view(2, 6, 256)
    tokens = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(0))
    theirs = rl_utils.get_logprobs(logits, tokens)
    handle = ours.patch_megatron(vocab_size=250)
    assert "megatron.rl.rl_utils.selective_log_softmax" in handle.sites
    got = rl_utils.get_logprobs(logits, tokens)
    assert got.dtype == theirs.dtype == torch.bfloat16 and got.shape == theirs.shape
    exact = selected_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size=250).logprobs
    assert_bitwise_equal(got, exact.to(torch.bfloat16), "RL log-probs without the padding")
    handle.undo()
    ours.patch_megatron()
    torch.testing.assert_close(
        rl_utils.get_logprobs(logits, tokens).float(), theirs.float(), atol=0.07, rtol=0
    )


def test_without_megatron_rl_the_site_is_skipped_and_named():
    handle = ours.patch_megatron()
    assert "megatron.rl.rl_utils.selective_log_softmax" in handle.skipped
    assert handle.sites == SITES
