"""The trainer <-> rollout contract fingerprint, and patches applied in a spawned process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import exactlogp
from exactlogp.integrations import autopatch, handshake


def test_fingerprint_names_both_contracts():
    fp = handshake.contract_fingerprint()
    assert fp.startswith(exactlogp.CONTRACT + "+logits:")
    assert fp.endswith(exactlogp.LOGITS_CONTRACT)


def test_stamped_batch_is_accepted_and_others_are_refused(monkeypatch):
    meta = handshake.stamp({"logprobs": [-0.5]})
    handshake.check_fingerprint(meta)
    handshake.check_fingerprint(meta[handshake.FINGERPRINT_KEY])
    with pytest.raises(ValueError, match="carry no exactlogp contract fingerprint"):
        handshake.check_fingerprint({"logprobs": [-0.5]})
    monkeypatch.setattr(exactlogp, "CONTRACT", "exactlogp-v3")
    with pytest.raises(
        ValueError,
        match=r"computed under 'exactlogp-v2\+logits:.*', this trainer runs 'exactlogp-v3",
    ):
        handshake.check_fingerprint(meta)


def test_a_rollout_stamped_with_linear_v1_is_refused_with_what_changed():
    assert exactlogp.LOGITS_CONTRACT == "exactlogp-linear-v2"
    v1 = {handshake.FINGERPRINT_KEY: f"{exactlogp.CONTRACT}+logits:exactlogp-linear-v1"}
    with pytest.raises(ValueError) as err:
        handshake.check_fingerprint(v1)
    text = str(err.value)
    assert "'exactlogp-v2+logits:exactlogp-linear-v1'" in text
    assert "exactlogp-linear-v2" in text and "20-bit grid" in text and "outlier" in text
    assert "recompute the rollout" in text


def test_unknown_host_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(autopatch.ENV, "megatron, torchtune")
    with pytest.raises(ValueError, match=r"unknown hosts \['torchtune'\]"):
        autopatch.requested()
    monkeypatch.delenv(autopatch.ENV)
    assert autopatch.apply_from_env() == {}


def test_sitecustomize_applies_the_patch_in_a_spawned_process(tmp_path):
    """What a worker process (a Ray actor, a torchrun rank) does at start-up."""
    (tmp_path / "sitecustomize.py").write_text(
        "from exactlogp.integrations import autopatch\nautopatch.apply_from_env()\n"
    )
    code = (
        "import megatron.core.tensor_parallel as tp\n"
        "from exactlogp.integrations import _patching\n"
        "print(tp.vocab_parallel_cross_entropy.__module__, _patching.active('patch_megatron').options)\n"
    )
    env = dict(os.environ, EXACTLOGP_PATCH="megatron", EXACTLOGP_VOCAB_SIZE="151936")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["exactlogp.integrations.megatron", "{'vocab_size':", "151936}"]
