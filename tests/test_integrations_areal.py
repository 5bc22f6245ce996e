"""exactlogp.integrations.areal: against AReaL 1.0.4's own `vocab_parallel` module (in a
subprocess, tests/real_hosts/areal_run.py, which names the stub modules it needs), and
the drop-ins' own rules here, with a gloo world of 2 for AReaL's tensor-parallel split."""

from __future__ import annotations

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import areal as ours
from exactlogp.testing import error_bound, fp64_reference, llm_like_logits, run_gloo_world, ulp32
from real_host_runs import finish, start

VERSION = "1.0.4"  # the Makefile's AREAL
NAMES = ("gather_logprobs", "gather_logprobs_entropy")
CONSUMERS = (
    "areal.engine.fsdp_engine",
    "areal.engine.megatron_engine",
    "areal.experimental.engine.archon_engine",
    "areal.models.tree_attn.functional",
)


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    ours.unpatch_areal()


@pytest.fixture(scope="module", autouse=True)
def _started(tmp_path_factory):
    """AReaL's subprocess starts with this module's first test, and runs while the tests
    that need no AReaL (first in this file) run here."""
    started = start("areal_run", f"areal-{VERSION}", tmp_path_factory.mktemp("areal"))
    yield started
    if started[0] is not None and started[0].poll() is None:
        started[0].kill()
        started[0].wait()


@pytest.fixture(scope="module")
def real(_started):
    return finish(_started)


# --- the drop-ins without AReaL ---


def test_fp64_logits_are_rounded_to_fp32_first_as_areal_does():
    logits, labels = llm_like_logits(6, 300, torch.float32, seed=3)
    wide = logits.double() + 1e-9  # not an fp32 value: AReaL's .float() rounds it
    got = ours.gather_logprobs_entropy(wide, labels, 0.8)
    want = selected_logprobs(wide.float(), labels, temperature=0.8, with_entropy=True)
    assert torch.equal(got[0], want.logprobs) and torch.equal(got[1], want.entropy)


def test_logits_are_not_modified_and_minus_100_gives_0():
    logits, labels = llm_like_logits(5, 300, torch.float32, seed=4)
    before = logits.clone()
    labels[2] = -100
    got = ours.gather_logprobs(logits, labels, 0.5)
    assert torch.equal(logits, before) and got[2] == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1, got 0"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size must be an int, got float"),
        ({"temperature": 0.0}, ValueError, "temperature must be finite and > 0"),
        ({"vocab_size": 0}, ValueError, "vocab_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    logits, labels = llm_like_logits(3, 100, torch.float32, seed=5)
    with pytest.raises(error, match=match):
        ours.gather_logprobs(logits, labels, **kwargs)


def test_logits_must_be_a_tensor():
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        ours.gather_logprobs([[0.0]], torch.zeros(1, dtype=torch.int64))


def test_without_areal_the_patch_is_an_import_error_and_changes_nothing():
    with pytest.raises(ImportError, match="patch_areal: cannot import areal"):
        ours.patch_areal()
    assert ours.unpatch_areal() is False


# --- AReaL's tensor-parallel split: a gloo world of 2 ---

TP_VOCAB = 508  # AReaL splits the vocabulary evenly


def _tp_world(rank, world_size, group, logits, labels):
    import torch.distributed as dist

    width = TP_VOCAB // world_size
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    logprobs, entropy = ours.gather_logprobs_entropy(shard, labels, 0.7, group)
    (logprobs.sum() + 2 * entropy.sum()).backward()
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # a TP group of one
    whole = ours.gather_logprobs_entropy(logits, labels, 0.7, alone)
    return logprobs.detach(), entropy.detach(), shard.grad, whole


def test_tp2_gives_the_bits_of_tp1():
    logits, labels = llm_like_logits(10, TP_VOCAB, torch.bfloat16, seed=6)
    x = logits.clone().requires_grad_()
    logprobs, entropy = ours.gather_logprobs_entropy(x, labels, 0.7)
    (logprobs.sum() + 2 * entropy.sum()).backward()
    ranks = run_gloo_world(2, _tp_world, logits, labels)
    for got_logprobs, got_entropy, _, whole in ranks:
        assert torch.equal(got_logprobs, logprobs.detach())
        assert torch.equal(got_entropy, entropy.detach())
        assert torch.equal(whole[0], logprobs.detach()) and torch.equal(whole[1], entropy.detach())
    assert torch.equal(torch.cat([r[2] for r in ranks], -1), x.grad)


# --- side by side with AReaL's own functions ---


def _cases(real):
    return real["side_by_side"].items()


def test_the_real_areal_module_runs(real):
    assert real["version"] == VERSION
    assert real["vocab_parallel_file"].endswith(
        f"areal-{VERSION}/areal/utils/functional/vocab_parallel.py"
    )


def test_outputs_are_fp32_shaped_like_labels_as_areals(real):
    for _, case in _cases(real):
        for name in NAMES:
            (theirs, _), (mine, _) = case[f"theirs/{name}"], case[f"ours/{name}"]
            assert len(theirs) == len(mine) == (2 if name.endswith("_entropy") else 1)
            for a, b in zip(theirs, mine, strict=True):
                assert a.dtype == b.dtype == torch.float32
                assert a.shape == b.shape == case["labels"].shape


def test_ours_is_exactlogp_called_directly_bitwise(real):
    """Values and the gradient in the logits, for every chunk_size."""
    for key, case in _cases(real):
        for name in NAMES:
            (want, want_grad) = case[f"direct/{name}"]
            for variant in ("ours", "ours_chunked"):
                got, grad = case[f"{variant}/{name}"]
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b), (key, variant, name)
                assert torch.equal(grad, want_grad), (key, variant, name)


def test_both_agree_with_the_fp64_truth(real):
    """AReaL's values within fp32 rounding error; ours correctly rounded (half an ulp
    plus the reference's own bound)."""
    for key, case in _cases(real):
        logits, labels, t = case["logits"], case["labels"], case["temperature"]
        truth = fp64_reference(logits, labels, temperature=t)
        theirs = case["theirs/gather_logprobs_entropy"][0]
        mine = case["ours/gather_logprobs_entropy"][0]
        for k, name in enumerate(("logprobs", "entropy")):
            exact = getattr(truth, name)
            torch.testing.assert_close(theirs[k].double(), exact, atol=2e-5, rtol=2e-6, msg=key)
            bound = 0.5 * ulp32(exact) + error_bound(truth.scale[name], logits.shape[-1])
            assert bool(((mine[k].double() - exact).abs() <= bound).all()), (key, name)


def test_gradients_agree_with_areals(real):
    for key, case in _cases(real):
        for name in NAMES:
            (_, theirs), (_, mine) = case[f"theirs/{name}"], case[f"ours/{name}"]
            assert theirs.dtype == mine.dtype == case["logits"].dtype
            torch.testing.assert_close(
                mine.float(), theirs.float(), atol=1e-2 if mine.dtype == torch.bfloat16 else 2e-6,
                rtol=1e-2 if mine.dtype == torch.bfloat16 else 1e-5, msg=f"{key} {name}",
            )  # fmt: skip


def test_areals_own_values_differ_from_exactlogps_in_some_bits(real):
    """So the bitwise comparisons above tell the drop-in from AReaL's function."""
    differ = sum(
        int((case["theirs/gather_logprobs_entropy"][0][k] != case[
            "ours/gather_logprobs_entropy"][0][k]).sum())
        for _, case in _cases(real)
        for k in (0, 1)
    )  # fmt: skip
    assert differ > 0


# --- patch_areal on AReaL's real modules ---


def test_patch_reaches_the_definition_and_the_reexport(real):
    got = real["patch"]
    assert got["sites"] == [
        f"areal.utils.functional{module}.{name}"
        for name in NAMES
        for module in (".vocab_parallel", "")
    ]
    assert got["patched_defined"] and got["patched_reexport"] and got["idempotent"]
    assert got["unpatch"] is True and got["unpatch_again"] is False and got["restored"]
    assert got["env_patched"]  # EXACTLOGP_PATCH=areal
    assert real["hook_patched"]  # EXACTLOGP_PATCH=areal's start-up hook
    logits, labels = got["logits"], got["labels"]
    res = selected_logprobs(logits, labels, temperature=0.7, with_entropy=True)
    assert all(map(torch.equal, got["patched_call"], (res.logprobs, res.entropy)))
    torch.testing.assert_close(got["unpatched_call"], got["patched_call"])


def test_engines_that_do_not_import_are_named_in_skipped(real):
    """Under the subprocess's stubs AReaL's engines do not import; an engine imported
    later binds the patched functions from `areal.utils.functional`."""
    skipped = real["patch"]["skipped"]
    assert sorted(skipped) == sorted(f"{m}.{n}" for m in CONSUMERS for n in NAMES)
    for site, reason in skipped.items():
        assert reason.startswith(f"patch_areal: cannot import {site.rsplit('.', 1)[0]}")


def test_patch_with_vocab_size_binds_it(real):
    got = real["patch"]
    assert got["vocab_size_options"] == {"vocab_size": 507}
    expected = selected_logprobs(got["logits"], got["labels"]).logprobs
    assert torch.equal(got["vocab_size_call"], expected)  # the padding columns left out
    assert "already applied with {'vocab_size': 507}" in got["other_options"]


def test_an_areal_with_other_arguments_is_refused(real):
    got = real["patch"]
    assert got["refused"].startswith(
        "patch_areal: areal 1.0.4's areal.utils.functional.vocab_parallel.gather_logprobs "
        "takes (logits, labels, temperature=1.0, tp_group=None); exactlogp knows (logits, "
        "labels, temperature=1.0, tp_group=None, chunk_size=1024) of AReaL 1.0.4"
    )
    assert got["nothing_patched"]
