"""exactlogp.integrations.vime.provider, run by vime's own `compute_linear_logp` (stand-in).

vime is not on the package index (no distribution of that name), and its
`--linear-logp-provider` boundary exists only in RL-Align/vime: tests/host_stubs/vime
reproduces that module at commit 33254c7 (the request / result dataclasses and their checks,
provider loading, normalisation, strict validation). vime's native path is slime's
function (tests/host_stubs/slime), called as vime's loss code calls it: on the logits
divided by the temperature. Claims: vime accepts our results in strict mode on every route;
the values are exactlogp's bits and within fp32 tolerance of vime's native ones; TP = 2 in
a gloo world gives the TP = 1 bits.
"""

from __future__ import annotations

import types

import pytest
import torch

import exactlogp
import slime_vime_world as world
from exactlogp import linear_selected_logprobs, selected_logprobs
from exactlogp.integrations import handshake
from exactlogp.integrations import vime as ours
from exactlogp.testing import assert_bitwise_equal
from integration_stubs import drop_stub_modules, use_stub_package

VOCAB, ROWS = world.VOCAB, world.ROWS
NATIVE_TOL = dict(atol=1e-5, rtol=1e-5)  # vime's native fp32 pipeline (slime's) against ours
GRAD_TOL = dict(atol=1e-5, rtol=0)  # its entropy gradient: a few ulp of |x| (x up to ~40)


@pytest.fixture
def host(monkeypatch):
    use_stub_package(monkeypatch, "slime")
    use_stub_package(monkeypatch, "vime")
    from slime.utils import ppo_utils
    from vime.backends.megatron_utils import linear_logp_provider as vime

    yield vime, ppo_utils
    drop_stub_modules("vime")
    drop_stub_modules("slime")


def _request(vime, logits, *, target=None, tau=0.8, **fields):
    """A request as vime's loss code builds one (vime's strict check wants a differentiable
    entropy whenever with_entropy_grad is set, so it is set where the logits need grad)."""
    fields.setdefault("metadata", {"real_vocab_size": VOCAB, "padded_vocab_size": VOCAB})
    return vime.LinearLogpRequest(
        logits, world.case()["target"] if target is None else target, None,
        vime.TokenLayout(1, 0, "single"), with_entropy=fields.pop("with_entropy", True),
        with_entropy_grad=fields.pop("with_entropy_grad", logits.requires_grad), chunk_size=64,
        temperature=tau, **fields,
    )  # fmt: skip


def _ours(vime, request):
    """Our provider, as vime's compute_linear_logp runs it in strict mode."""
    return vime.compute_linear_logp(args=world.strict_args(), request=request,
                                    native=world._no_native)  # fmt: skip


def _native(vime, ppo_utils, request):
    """vime's native route: no provider configured; its loss code divides the logits by
    the temperature (a float), then calls slime's function."""

    def native(logits, target, group, **kwargs):
        return ppo_utils.calculate_log_probs_and_entropy(
            logits / request.temperature, target, group, **kwargs
        )

    args = types.SimpleNamespace(linear_logp_provider=None)
    return vime.compute_linear_logp(args=args, request=request, native=native)


def _force_kept(mask, target):
    return mask.index_put((torch.arange(len(target)), target), torch.tensor(True))


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "keep mask"])
def test_logits_route_matches_native_and_exactlogp(host, with_entropy, masked):
    vime, ppo_utils = host
    c = world.case()
    keep = c["mask"] if masked else None
    x, x_native = c["logits"].clone().requires_grad_(), c["logits"].clone().requires_grad_()
    fields = dict(with_entropy=with_entropy, log_prob_keep_mask=keep)
    logp, entropy = _ours(vime, _request(vime, x, **fields))
    n_logp, n_entropy = _native(vime, ppo_utils, _request(vime, x_native, **fields))
    assert logp.shape == (ROWS, 1) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, n_logp, **NATIVE_TOL)
    kept = None if keep is None else _force_kept(keep, c["target"])
    direct = selected_logprobs(c["logits"], c["target"], temperature=0.8, keep_mask=kept)
    assert_bitwise_equal(logp.squeeze(-1), direct.logprobs, "logp")
    loss, n_loss = logp.sum(), n_logp.sum()
    if with_entropy:
        assert entropy.shape == (ROWS,) and entropy.dtype == torch.float32
        torch.testing.assert_close(entropy, n_entropy, **NATIVE_TOL)
        unmasked = selected_logprobs(c["logits"], c["target"], temperature=0.8, with_entropy=True)
        assert_bitwise_equal(entropy, unmasked.entropy, "entropy of the unmasked distribution")
        loss, n_loss = loss + entropy.sum(), n_loss + n_entropy.sum()
    else:
        assert entropy is None and n_entropy is None
    (grad,) = torch.autograd.grad(loss, x)
    (n_grad,) = torch.autograd.grad(n_loss, x_native)
    torch.testing.assert_close(grad, n_grad, **GRAD_TOL)


def test_per_row_and_one_element_temperatures(host):
    vime, ppo_utils = host
    c = world.case()
    tau = c["temperature"]
    logp, entropy = _ours(vime, _request(vime, c["logits"], tau=tau))
    direct = selected_logprobs(c["logits"], c["target"], temperature=tau, with_entropy=True)
    assert_bitwise_equal(logp.squeeze(-1), direct.logprobs, "per-row logp")
    assert_bitwise_equal(entropy, direct.entropy, "per-row entropy")
    slime = ppo_utils.calculate_log_probs_and_entropy(c["logits"] / tau[:, None], c["target"],
                                                      None, True)  # fmt: skip
    torch.testing.assert_close(logp, slime[0], **NATIVE_TOL)
    torch.testing.assert_close(entropy, slime[1], **NATIVE_TOL)
    one = _ours(vime, _request(vime, c["logits"], tau=torch.tensor([0.8], dtype=torch.float64)))
    scalar = _ours(vime, _request(vime, c["logits"], tau=0.8))
    assert_bitwise_equal(one[0], scalar[0], "a one-element temperature is the float")


def test_fused_route_is_the_exact_lm_head(host):
    vime, ppo_utils = host
    c = world.case()
    hidden, weight = c["hidden"].clone().requires_grad_(), c["weight"].clone().requires_grad_()
    logits = (hidden @ weight.T + c["bias"]).detach().requires_grad_()
    part = vime.VocabPartition(0, VOCAB, VOCAB, VOCAB)
    context = vime.LinearLogpContext(hidden, vime.LinearProjection(weight, c["bias"]), part)
    request = _request(vime, logits, context=context)
    result = ours.provider(request)
    assert result.provenance["route"] == "fused" and "fused_declined" not in result.provenance
    assert result.contract_id == handshake.contract_fingerprint()
    assert exactlogp.LOGITS_CONTRACT in result.contract_id
    logp, entropy = _ours(vime, request)
    direct = linear_selected_logprobs(c["hidden"], c["weight"], c["target"], bias=c["bias"],
                                      temperature=0.8, with_entropy=True)  # fmt: skip
    assert_bitwise_equal(logp.squeeze(-1), direct.logprobs, "fused logp")
    assert_bitwise_equal(entropy, direct.entropy, "fused entropy")
    n_logp, n_entropy = _native(vime, ppo_utils, request)
    torch.testing.assert_close(logp, n_logp, **NATIVE_TOL)
    torch.testing.assert_close(entropy, n_entropy, **NATIVE_TOL)
    grads = torch.autograd.grad(logp.sum() + entropy.sum(), (hidden, weight))
    assert all(bool(g.abs().sum() > 0) for g in grads)


def test_a_keep_mask_or_scaled_logits_take_the_logits_route(host):
    vime, _ = host
    c = world.case()
    part = vime.VocabPartition(0, VOCAB, VOCAB, VOCAB)
    context = vime.LinearLogpContext(c["hidden"], vime.LinearProjection(c["weight"]), part)
    masked = ours.provider(_request(vime, c["logits"], context=context,
                                    log_prob_keep_mask=c["mask"]))  # fmt: skip
    assert masked.provenance["route"] == "logits" and masked.contract_id == exactlogp.CONTRACT
    assert "keep mask" in masked.provenance["fused_declined"]
    plain = ours.provider(_request(vime, c["logits"], log_prob_keep_mask=c["mask"]))
    assert_bitwise_equal(masked.logp, plain.logp, "logits route with the context's partition")
    metadata = {"logits_are_temperature_scaled": True}
    scaled = ours.provider(_request(vime, c["logits"], context=context, metadata=metadata))
    assert "carry a temperature" in scaled.provenance["fused_declined"]
    unscaled = ours.provider(_request(vime, c["logits"], tau=1.0))
    assert_bitwise_equal(scaled.logp, unscaled.logp, "pre-scaled logits: not divided again")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_empty_request_and_detached_entropy(host, with_entropy):
    vime, _ = host
    logits = torch.zeros(0, VOCAB, requires_grad=True)
    target = torch.zeros(0, dtype=torch.int64)
    request = _request(vime, logits, target=target, with_entropy=with_entropy)
    logp, entropy = _ours(vime, request)
    assert logp.shape == (0, 1) and logp.dtype == torch.float32 and logp.requires_grad
    assert (entropy is None) if not with_entropy else entropy.shape == (0,)
    c = world.case()
    x = c["logits"].clone().requires_grad_()
    logp, entropy = _ours(vime, _request(vime, x, with_entropy_grad=False))
    assert logp.requires_grad and not entropy.requires_grad


def test_identity_padding_and_bad_metadata(host):
    vime, _ = host
    c = world.case()
    result = ours.provider(_request(vime, c["logits"]))
    assert result.backend_id == "exactlogp.cpu" and result.contract_id == exactlogp.CONTRACT
    assert result.provenance["route"] == "logits" and result.provenance["tp_size"] == 1
    padded = torch.cat([c["logits"], torch.zeros(ROWS, 12)], -1)
    metadata = {"real_vocab_size": VOCAB, "padded_vocab_size": VOCAB + 12}
    got = _ours(vime, _request(vime, padded, metadata=metadata))
    assert_bitwise_equal(got[0], result.logp, "padding columns are left out")
    bad = {"real_vocab_size": VOCAB, "padded_vocab_size": VOCAB + 128}
    for mode in ("strict", "auto"):  # a provider error is not an "unavailable" fallback
        with pytest.raises(ValueError, match=r"metadata\['padded_vocab_size'\] = 628"):
            vime.compute_linear_logp(args=world.strict_args(mode=mode),
                                     request=_request(vime, padded, metadata=bad),
                                     native=world._no_native)  # fmt: skip


def test_tp2_is_tp1_bitwise_through_vime(host):
    results = [v for _, v in world.tp2_results()]
    base = world.vime_scores(world.case(), 0, 1, None)  # TP = 1, in this process
    for kind, (logp, entropy, grads) in base.items():
        for rank in range(2):
            got = results[rank][kind]
            assert_bitwise_equal(got[0], logp, f"{kind} logp, TP=2 rank {rank}")
            assert_bitwise_equal(got[1], entropy, f"{kind} entropy, TP=2 rank {rank}")
        if kind == "fused":  # the hidden gradient is whole on every rank, the weight's sharded
            assert_bitwise_equal(results[0][kind][2][0], grads[0], "fused hidden grad")
            weight = torch.cat([results[r][kind][2][1] for r in range(2)])
            assert_bitwise_equal(weight, grads[1], "fused weight grad")
        else:
            logits = torch.cat([results[r][kind][2][0] for r in range(2)], -1)
            assert_bitwise_equal(logits, grads[0], f"{kind} logits grad")
