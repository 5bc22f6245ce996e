"""exactlogp.integrations.verl: the Megatron-engine functions on one process (Megatron
state stubbed to TP=1; real tensor-parallel groups of 1, 2 and 4 are in
test_integrations_megatron.py), then the FSDP-engine functions, the fused kernels and
patch_verl side by side with the real verl 0.9 (installed by `make setup`).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import verl.utils.torch_functional as verl_F
from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFused

import exactlogp
from exactlogp import selected_logprobs
from exactlogp.integrations import _patching, verl
from exactlogp.testing import assert_bitwise_equal, llm_like_logits
from integration_stubs import install_megatron


@pytest.fixture
def case(monkeypatch):
    install_megatron(monkeypatch)
    return llm_like_logits(12, 333, torch.bfloat16, seed=3)


def test_log_probs_shape_and_bits(case):
    logits, labels = case
    got = verl.vocab_parallel_log_probs_from_logits(logits, labels)
    assert got.shape == labels.shape and got.dtype == torch.float32
    assert_bitwise_equal(got, selected_logprobs(logits, labels).logprobs, "log probs")


def test_entropy_shape_and_bits(case):
    logits, labels = case
    got = verl.vocab_parallel_entropy(logits.view(3, 4, -1))
    assert got.shape == (3, 4)
    expected = selected_logprobs(logits, labels, with_entropy=True).entropy
    assert_bitwise_equal(got.view(-1), expected, "entropy")


def test_combined_call_equals_the_two_calls(case):
    logits, labels = case
    logp, entropy = verl.vocab_parallel_log_probs_and_entropy(logits, labels)
    assert_bitwise_equal(logp, verl.vocab_parallel_log_probs_from_logits(logits, labels), "logp")
    assert_bitwise_equal(entropy, verl.vocab_parallel_entropy(logits), "entropy")


def test_gradients_flow_through_both(case):
    logits, labels = case
    x = logits.float().requires_grad_()
    logp, entropy = verl.vocab_parallel_log_probs_and_entropy(x, labels)
    (logp.sum() + entropy.sum()).backward()
    y = logits.double().requires_grad_()
    ref_logp = torch.log_softmax(y, -1).gather(-1, labels[:, None]).squeeze(-1)
    p = torch.softmax(y, -1)
    ref_entropy = -(p * torch.log_softmax(y, -1)).sum(-1)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=0)


def test_vocab_size_leaves_padding_out(case):
    logits, labels = case
    padded = torch.cat([logits, torch.full((12, 19), 50.0, dtype=logits.dtype)], -1)
    got = verl.vocab_parallel_entropy(padded, vocab_size=333)
    assert_bitwise_equal(got, verl.vocab_parallel_entropy(logits), "padded entropy")


def test_uninitialized_megatron_state_is_a_clear_error(monkeypatch):
    install_megatron(monkeypatch, initialized=False)
    logits, labels = llm_like_logits(2, 10, torch.float32)
    with pytest.raises(RuntimeError, match="not initialized"):
        verl.vocab_parallel_entropy(logits)


def test_bad_logits_type(case):
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        verl.vocab_parallel_log_probs_from_logits([1.0], torch.tensor(0))


# --- against the real verl 0.9 (installed by `make setup`) ---


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1.3e-1}


def _full(dtype, rows=12, vocab=333, seed=4):
    logits, labels = llm_like_logits(rows, vocab, torch.float32, seed=seed)
    return logits.to(dtype), labels


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_full_logits_side_by_side(dtype):
    logits, labels = _full(dtype)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    pairs = [
        (verl.logprobs_from_logits(logits, labels, False), verl_F.logprobs_from_logits(logits, labels, False)),
        (verl.logprobs_from_logits_v2(logits, labels), verl_F.logprobs_from_logits_v2(logits, labels)),
        (verl.entropy_from_logits(logits), verl_F.entropy_from_logits(logits)),
        (verl.entropy_from_logits_with_chunking(logits, 5), verl_F.entropy_from_logits_with_chunking(logits, 5)),
    ]  # fmt: skip
    for i, (got, host) in enumerate(pairs):
        assert got.dtype == host.dtype and got.shape == host.shape, i
        if i == 3:  # verl's chunked entropy computes in fp32 whatever the input
            tol = dict(atol=TOL[torch.float32], rtol=TOL[torch.float32])
        torch.testing.assert_close(got.double(), host.double(), **tol)
    if dtype != torch.float64:
        exact = selected_logprobs(logits, labels, with_entropy=True)
        assert_bitwise_equal(pairs[0][0], exact.logprobs.to(dtype), "logprobs bits")
        assert_bitwise_equal(pairs[3][0], exact.entropy, "chunked entropy bits")


def test_entropy_under_torch_compile_gives_the_eager_bits():
    """The FSDP / automodel engines torch.compile the entropy function (dynamic=True)."""
    logits, _ = _full(torch.float32)
    for fn in (verl.entropy_from_logits, verl.entropy_from_logits_with_chunking):
        compiled = torch.compile(fn, dynamic=True)
        results = []
        for f in (fn, compiled):
            x = logits.clone().requires_grad_()
            h = f(x)
            h.sum().backward()
            results.append((h.detach(), x.grad))
        assert_bitwise_equal(results[1][0], results[0][0], "compiled entropy")
        assert_bitwise_equal(results[1][1], results[0][1], "compiled gradient")


ENGINE_MODULES = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.megatron.transformer_impl",
    "verl.workers.rollout.naive.naive_rollout",
)


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.uint8, torch.bool, "float32"])
def test_out_dtype_must_be_a_floating_dtype(out_dtype):
    logits, labels = _full(torch.float32)
    match = r"out_dtype must be a floating torch\.dtype .*, got " + re.escape(repr(out_dtype))
    calls = [
        lambda: verl.logprobs_from_logits(logits, labels, out_dtype=out_dtype),
        lambda: verl.logprobs_from_logits_v2(logits, labels, out_dtype=out_dtype),
        lambda: verl.entropy_from_logits(logits, out_dtype=out_dtype),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(TypeError, match=match):
            call()
            pytest.fail(f"call {i} accepted out_dtype={out_dtype!r}")


@pytest.mark.parametrize(
    "value, error, match",
    [
        (9.9, TypeError, "vocab_size must be an int or None, got float 9.9"),
        (True, TypeError, "vocab_size must be an int or None, got bool True"),
        ("151936", TypeError, "vocab_size must be an int or None, got str '151936'"),
        (0, ValueError, "vocab_size must be >= 1, got 0"),
        (-5, ValueError, "vocab_size must be >= 1, got -5"),
    ],
)
def test_patch_verl_checks_vocab_size(value, error, match):
    try:
        with pytest.raises(error, match=match):
            verl.patch_verl(vocab_size=value)
        assert _patching.active(verl.PATCH_KEY) is None
    finally:
        verl.unpatch_verl()


@pytest.fixture
def verl_patched():
    import importlib

    for name in ENGINE_MODULES:
        importlib.import_module(name)
    handle = verl.patch_verl()
    yield handle
    verl.unpatch_verl()


def test_patch_verl_reaches_the_engines(verl_patched):
    import sys

    fsdp = sys.modules["verl.workers.engine.fsdp.transformer_impl"]
    mcore = sys.modules["verl.workers.engine.megatron.transformer_impl"]
    grouper = sys.modules["verl.workers.rollout.naive.naive_rollout"]
    assert fsdp.logprobs_from_logits is verl.logprobs_from_logits
    assert grouper.logprobs_from_logits is verl.logprobs_from_logits
    assert fsdp.verl_F.entropy_from_logits is verl.entropy_from_logits
    assert mcore.vocab_parallel_entropy is verl.vocab_parallel_entropy
    assert mcore.vocab_parallel_log_probs_from_logits is verl.vocab_parallel_log_probs_from_logits
    assert "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy" in verl_patched.sites
    verl_patched.undo()
    assert fsdp.logprobs_from_logits is verl_F.logprobs_from_logits is not verl.logprobs_from_logits
    assert mcore.vocab_parallel_entropy is not verl.vocab_parallel_entropy


def test_an_engine_built_before_the_patch_is_detected_and_fixed():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = object.__new__(FSDPEngineWithLMHead)  # its __init__ binds the entropy like this:
    engine.compute_entropy_from_logits = torch.compile(verl_F.entropy_from_logits, dynamic=True)
    handle = verl.patch_verl()
    try:
        with pytest.warns(RuntimeWarning, match="was built before patch_verl"):
            with pytest.raises(Exception):  # noqa: B017 (the engine itself is a bare shell)
                engine.prepare_model_outputs(None, {}, None, None)
        bound = engine.compute_entropy_from_logits
        assert bound._torchdynamo_orig_callable is verl.entropy_from_logits
        # the engine now keeps exactlogp's entropy: the unpatch names it
        with pytest.warns(RuntimeWarning, match=r"1 object\(s\) .*\(FSDPEngineWithLMHead at"):
            handle.undo()
    finally:
        handle.undo()


def test_unpatch_names_the_engines_that_keep_exactlogps_entropy():
    import gc

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    handle = verl.patch_verl()
    try:
        kept = object.__new__(FSDPEngineWithLMHead)  # built while patched: its __init__
        kept.compute_entropy_from_logits = verl_F.entropy_from_logits  # binds exactlogp's
        dropped = object.__new__(FSDPEngineWithLMHead)
        dropped.compute_entropy_from_logits = verl_F.entropy_from_logits
        for engine in (kept, dropped):
            with pytest.raises(Exception):  # noqa: B017 (the engine itself is a bare shell)
                engine.prepare_model_outputs(None, {}, None, None)
        del dropped, engine
        gc.collect()
        with pytest.warns(RuntimeWarning, match=r"unpatch_verl: .* 1 object\(s\) .*"
                          r"\(FSDPEngineWithLMHead at 0x.*exactlogp's entropy") as w:  # fmt: skip
            assert verl.unpatch_verl() is True
        assert w[0].filename == __file__  # points at the call
        assert kept.compute_entropy_from_logits is verl.entropy_from_logits  # as it says
    finally:
        handle.undo()
    with warnings.catch_warnings():  # named once: the next cycle has nothing to name
        warnings.simplefilter("error")
        verl.patch_verl()
        assert verl.unpatch_verl() is True


def test_patch_verl_vocab_size_leaves_megatron_padding_out(monkeypatch):
    handle = verl.patch_verl(vocab_size=333)
    try:
        import verl.utils.megatron.tensor_parallel as tp

        install_megatron(monkeypatch)
        logits, _ = _full(torch.float32)
        padded = torch.cat([logits, torch.full((12, 19), 40.0)], -1)
        assert_bitwise_equal(
            tp.vocab_parallel_entropy(padded), verl.vocab_parallel_entropy(logits), "pad"
        )
    finally:
        handle.undo()


def test_fused_linear_for_ppo_side_by_side():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 32, generator=g)
    weight = torch.randn(333, 32, generator=g) / 32**0.5
    ids = torch.randint(0, 333, (2, 7), generator=g)
    a = [t.clone().requires_grad_() for t in (hidden, weight)]
    b = [t.clone().requires_grad_() for t in (hidden, weight)]
    ours = verl.FusedLinearForPPO()(*a, ids, 0.7)
    host = VerlFused()(*b, ids, 0.7)
    for x, y in zip(ours, host, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    (ours[0].sum() + ours[1].sum()).backward()
    (host[0].sum() + host[1].sum()).backward()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-4, rtol=1e-4)
    exact = exactlogp.linear_selected_logprobs(hidden, weight, ids, temperature=0.7)
    assert_bitwise_equal(ours[0].detach(), exact.logprobs, "bits")


def test_fused_kernels_under_autocast_compute_in_its_dtype():
    """Under autocast verl's own kernel takes bf16 hidden states with an fp32 LM-head weight
    (a head autocast casts, not FSDP's mixed precision) and does its matmul in bf16;
    exactlogp's computes in bf16 too (it raised a TypeError)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 32, generator=g).bfloat16()
    weight = torch.randn(333, 32, generator=g) / 32**0.5
    ids = torch.randint(0, 333, (2, 7), generator=g)
    a = [t.clone().requires_grad_() for t in (hidden, weight)]
    b = [t.clone().requires_grad_() for t in (hidden, weight)]
    with torch.autocast("cpu", torch.bfloat16):
        ours = verl.FusedLinearForPPO()(*a, ids, 0.7)
        host = VerlFused()(*b, ids, 0.7)
    for x, y in zip(ours, host, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)
    exact = exactlogp.linear_selected_logprobs(
        hidden, weight.bfloat16(), ids, temperature=0.7, with_entropy=True
    )
    assert_bitwise_equal(ours[0].detach(), exact.logprobs, "log_probs bits")
    assert_bitwise_equal(ours[1].detach(), exact.entropy.bfloat16(), "entropy bits")
    ours[0].sum().backward()
    assert a[0].grad.dtype == torch.bfloat16 and a[1].grad.dtype == torch.float32
    with pytest.raises(TypeError, match="weight dtype torch.float32 must equal hidden dtype"):
        verl.FusedLinearForPPO()(hidden, weight, ids, 0.7)  # no autocast: verl's raises too


def test_use_fused_kernels_model_forward_is_routed_to_exactlogp():
    """verl's fused forward imports FusedLinearForPPO at call time: the patch reaches it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = Qwen3ForCausalLM(cfg).eval()
    original_forward = Qwen3ForCausalLM.forward
    handle = verl.patch_verl()
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        ids = torch.randint(0, 333, (2, 9), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids, temperature=0.7, return_dict=True)
        hidden = model.model(input_ids=ids).last_hidden_state
        exact = exactlogp.linear_selected_logprobs(
            hidden, model.lm_head.weight, torch.roll(ids, -1, -1), temperature=0.7
        )
        assert_bitwise_equal(out.log_probs, exact.logprobs, "fused forward log_probs")
    finally:
        handle.undo()
        Qwen3ForCausalLM.forward = original_forward  # verl patches the class
