"""exactlogp.integrations.openrlhf: against OpenRLHF 0.11.2's own `openrlhf.models.utils`
and `Actor.forward` (in a subprocess, tests/real_hosts/openrlhf_run.py, which names the
stub modules it needs), and the drop-ins' own rules here."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from exactlogp import selected_logprobs
from exactlogp.integrations import openrlhf as ours
from exactlogp.testing import error_bound, fp64_reference, ulp32
from real_host_runs import finish, start

VERSION = "0.11.2"  # the Makefile's OPENRLHF
NAMES = ("log_probs_from_logits", "compute_entropy")
# OpenRLHF's own error against the fp64 truth (its bf16 / fp16 branch takes the
# log-softmax in that dtype; its entropy sums softmax * logits in it)
THEIR_ATOL = {
    "bf16": (2e-2, 0.25),
    "fp16": (2e-3, 5e-2),
    "fp32": (1e-5, 2e-5),
    "fp64": (1e-12, 1e-12),
}  # (log-probs, entropy)


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    ours.unpatch_openrlhf()


@pytest.fixture(scope="module", autouse=True)
def _started(tmp_path_factory):
    """OpenRLHF's subprocess starts with this module's first test, and runs while the
    tests that need no OpenRLHF (first in this file) run here."""
    started = start("openrlhf_run", f"openrlhf-{VERSION}", tmp_path_factory.mktemp("openrlhf"))
    yield started
    if started[0] is not None and started[0].poll() is None:
        started[0].kill()
        started[0].wait()


@pytest.fixture(scope="module")
def real(_started):
    return finish(_started)


# --- the drop-ins without OpenRLHF ---


def _logits(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(2, 3, 50, dtype=dtype) * 3, torch.randint(0, 50, (2, 3))


def test_fp64_output_is_fp32_where_flash_attn_imports(monkeypatch):
    """OpenRLHF's fused branch (flash-attn's cross-entropy, fp32 losses) for fp64 logits;
    a stand-in module makes the import succeed (only our dtype rule runs here)."""
    for name in ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton",
                 "flash_attn.ops.triton.cross_entropy"):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    logits, labels = _logits(torch.float64)
    got = ours.log_probs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(got, want.float())
    assert ours.compute_entropy(logits).dtype == torch.float64  # no such branch there


@pytest.mark.parametrize(
    ("temperature", "error", "match"),
    [(0.0, ValueError, "temperature must be positive, got 0.0"),
     ("1", TypeError, "temperature must be a float, got str")],
)  # fmt: skip
def test_bad_temperature_is_named(temperature, error, match):
    logits, labels = _logits()
    with pytest.raises(error, match=match):
        ours.log_probs_from_logits(logits, labels, temperature)


def test_logits_must_be_a_tensor():
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        ours.log_probs_from_logits([[0.0]], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        ours.compute_entropy([[0.0]])


def test_without_openrlhf_the_patch_is_an_import_error_and_changes_nothing():
    with pytest.raises(ImportError, match="patch_openrlhf: cannot import openrlhf"):
        ours.patch_openrlhf()
    assert ours.unpatch_openrlhf() is False


# --- side by side with OpenRLHF's own functions ---


def _half_ulp_bound(exact: torch.Tensor, dtype: torch.dtype, scale, vocab: int):
    """Half an ulp of `dtype` at `exact`, plus the fp32 step and the reference's bound:
    exactlogp's fp32 value rounded once to `dtype`."""
    if dtype == torch.float32:
        return 0.5 * ulp32(exact) + error_bound(scale, vocab)
    info = torch.finfo(dtype)
    binade = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(info.tiny))))
    return 0.5 * info.eps * binade + ulp32(exact) + error_bound(scale, vocab)


def test_the_real_openrlhf_module_runs(real):
    assert real["version"] == VERSION
    assert real["utils_file"].endswith(f"openrlhf-{VERSION}/openrlhf/models/utils.py")


def test_output_dtypes_and_shapes_are_openrlhfs(real):
    """fp32 -> fp32, bf16 / fp16 -> their own dtype, fp64 -> fp64 (OpenRLHF's torch path:
    no flash-attn here); the entropy in the logits' dtype."""
    for key, case in real["side_by_side"].items():
        for name in ("log_probs/1.0", "log_probs/0.7", "entropy"):
            (theirs, theirs_grad), (mine, grad) = case[f"theirs/{name}"], case[f"ours/{name}"]
            assert mine.dtype == theirs.dtype == case["logits"].dtype, (key, name)
            assert mine.shape == theirs.shape == case["labels"].shape, (key, name)
            assert grad.dtype == theirs_grad.dtype and grad.shape == theirs_grad.shape


def test_ours_is_exactlogp_called_directly_bitwise(real):
    """Values and gradients in the logits (bf16, fp16, fp32; fp64 is outside the
    contract)."""
    for key, case in real["side_by_side"].items():
        if key == "fp64":
            continue
        for name in ("log_probs/1.0", "log_probs/0.7", "entropy"):
            (mine, grad), (want, want_grad) = case[f"ours/{name}"], case[f"direct/{name}"]
            assert torch.equal(mine, want) and torch.equal(grad, want_grad), (key, name)


def test_both_agree_with_the_fp64_truth(real):
    """OpenRLHF's values within its own error (THEIR_ATOL); ours correctly rounded to the
    output dtype (bf16, fp16, fp32)."""
    checks = (("log_probs/1.0", 1.0, "logprobs"), ("log_probs/0.7", 0.7, "logprobs"),
              ("entropy", 1.0, "entropy"))  # fmt: skip
    for key, case in real["side_by_side"].items():
        if key == "fp64":
            continue  # the next test
        logits, labels = case["logits"], case["labels"]
        rows, vocab = logits.reshape(-1, logits.shape[-1]), logits.shape[-1]
        for name, t, field in checks:
            truth = fp64_reference(rows, labels.reshape(-1), temperature=t)
            exact = getattr(truth, field).view(labels.shape)
            theirs, mine = case[f"theirs/{name}"][0], case[f"ours/{name}"][0]
            atol = THEIR_ATOL[key][field == "entropy"]
            torch.testing.assert_close(theirs.double(), exact, atol=atol, rtol=0, msg=key)
            scale = truth.scale[field].view(labels.shape)
            bound = _half_ulp_bound(exact, logits.dtype, scale, vocab)
            assert bool(((mine.double() - exact).abs() <= bound).all()), (key, name)


def test_fp64_logits_are_computed_in_fp64_as_openrlhfs(real):
    """Outside the contract: plain torch in fp64, as OpenRLHF's torch path."""
    case = real["side_by_side"]["fp64"]
    for name in ("log_probs/1.0", "log_probs/0.7", "entropy"):
        theirs, mine = case[f"theirs/{name}"][0], case[f"ours/{name}"][0]
        torch.testing.assert_close(mine, theirs, atol=THEIR_ATOL["fp64"][0], rtol=0)


def test_gradients_agree_with_openrlhfs(real):
    for key, case in real["side_by_side"].items():
        atol = {"bf16": 0.2, "fp16": 2e-2, "fp32": 1e-5, "fp64": 1e-12}[key]
        for name in ("log_probs/1.0", "log_probs/0.7", "entropy"):
            (_, theirs), (_, mine) = case[f"theirs/{name}"], case[f"ours/{name}"]
            torch.testing.assert_close(mine.double(), theirs.double(), atol=atol, rtol=0)


def test_openrlhf_divides_the_callers_logits_in_place_and_ours_does_not(real):
    for key, case in real["side_by_side"].items():
        logits = case["logits"]
        assert torch.equal(case["theirs/logits_after"], logits / 0.7), key
        assert torch.equal(case["ours/logits_after"], logits), key


def test_minus_100_raises_in_openrlhfs_torch_path_and_gives_0_in_ours(real):
    for key, case in real["side_by_side"].items():
        assert "index -100 is out of bounds" in case["theirs/ignored"], key
        got, plain = case["ours/ignored"], case["ours/log_probs/1.0"][0]
        assert got[0, 1] == 0 and got[1, 4] == 0
        keep = torch.ones_like(got, dtype=torch.bool)
        keep[0, 1] = keep[1, 4] = False
        assert torch.equal(got[keep], plain[keep]), key


# --- patch_openrlhf on OpenRLHF's real modules ---


def test_patch_reaches_utils_and_the_actor(real):
    got = real["patch"]
    assert got["own_actor"]  # the actor binds OpenRLHF's own functions by name
    assert got["sites"] == [
        f"openrlhf.models.{module}.{name}" for name in NAMES for module in ("utils", "actor")
    ]
    assert got["skipped"] == {} and got["patched"] and got["idempotent"]
    assert got["unpatch"] is True and got["unpatch_again"] is False and got["restored"]
    assert got["env_patched"]  # EXACTLOGP_PATCH=openrlhf
    assert real["hook_patched"]  # EXACTLOGP_PATCH=openrlhf's start-up hook


def test_patched_actor_forward_gives_exactlogps_bits(real):
    """OpenRLHF's own Actor.forward (temperature 0.7, a tiny random Qwen3 in fp32): it
    divides the fp32 logits by the temperature in place, then calls the patched functions;
    its action log-probs and entropy are exactlogp's of the LM head's logits at that
    temperature, bit for bit."""
    got = real["patch"]["actor_forward"]
    logits, sequences, mask = got["logits"], got["sequences"], got["action_mask"]
    rolled = torch.roll(sequences, -1, dims=1)
    res = selected_logprobs(logits.float(), rolled, temperature=0.7, with_entropy=True)
    actions = mask.shape[1]
    assert torch.equal(got["action_log_probs"], res.logprobs[:, :-1][:, -actions:] * mask.float())
    assert torch.equal(got["entropy"], res.entropy[:, :-1])
    theirs = real["patch"]["actor_forward_unpatched"]
    assert torch.equal(theirs["logits"], logits)
    torch.testing.assert_close(theirs["action_log_probs"], got["action_log_probs"])
    torch.testing.assert_close(theirs["entropy"], got["entropy"])


def test_an_openrlhf_with_other_arguments_is_refused(real):
    got = real["patch"]
    assert got["refused"].startswith(
        "patch_openrlhf: openrlhf 0.11.2's openrlhf.models.utils.compute_entropy takes "
        "(logits, dim=-1); exactlogp knows (logits) of OpenRLHF 0.11.2"
    )
    assert got["nothing_patched"]
