"""exactlogp.integrations.trl against the real TRL 1.16 (installed by `make setup`).

Side by side on the same inputs: the drop-in's values are within TRL's own test tolerance
of TRL's, its bits are exactlogp's, its shapes and dtypes are TRL's. TRL runs its torch
code here (no GPU: its Triton kernels are not taken).
"""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
import trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import ChunkedLogProbFunction as TrlChunked

import exactlogp
from exactlogp import selected_logprobs
from exactlogp.integrations import _patching, trl
from exactlogp.testing import assert_bitwise_equal, llm_like_logits

VOCAB = 509
HALF = (torch.bfloat16, torch.float16)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1.3e-1}


def _logits(dtype, rows=12, seed=5):
    logits, index = llm_like_logits(rows, VOCAB, torch.float32, seed=seed)
    return logits.to(dtype).view(3, rows // 3, VOCAB), index.view(3, rows // 3)


def _close(got, host, dtype):
    torch.testing.assert_close(got.double(), host.double(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_side_by_side(dtype, temperature):
    logits, index = _logits(dtype)
    mask = torch.ones_like(index, dtype=torch.bool)
    mask[1, 2] = False
    got = trl.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
    host = trl_utils.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
    assert got.shape == host.shape and got.dtype == host.dtype == dtype
    _close(got, host, dtype)
    assert got[1, 2].item() == 0.0
    if dtype != torch.float64:
        exact = selected_logprobs(logits, index, temperature=temperature).logprobs
        assert_bitwise_equal(
            got.masked_fill(~mask, 0), exact.to(dtype).masked_fill(~mask, 0), "bits"
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_k_ids_per_row_side_by_side(dtype):
    logits, index = _logits(dtype)
    ids = torch.stack([index, (index + 7) % VOCAB, torch.zeros_like(index)], -1)  # (3, 4, 3)
    got = trl.selective_log_softmax(logits, ids)
    host = trl_utils.selective_log_softmax(logits, ids)
    assert got.shape == host.shape == ids.shape and got.dtype == host.dtype
    _close(got, host, dtype)
    for k in range(3):
        assert_bitwise_equal(got[..., k], trl.selective_log_softmax(logits, ids[..., k]), f"k={k}")


def test_half_precision_is_correctly_rounded():
    """bf16 / fp16 results are exactlogp's fp32 rounded once: the correctly rounded value,
    where torch's half-precision log_softmax (TRL's CPU path) is off by an ulp in ~20%."""
    for dtype in HALF:
        logits, index = _logits(dtype, rows=96)
        got = trl.selective_log_softmax(logits, index)
        truth = torch.log_softmax(logits.double(), -1).gather(-1, index[..., None])[..., 0]
        assert torch.equal(got, truth.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_selective_log_softmax_and_entropy_side_by_side(dtype):
    logits, index = _logits(dtype)
    mask = torch.rand(index.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    x = logits.clone().requires_grad_()
    got = trl.selective_log_softmax_and_entropy(x, index, False, 0.8, mask)
    host = trl_utils.selective_log_softmax_and_entropy(logits, index, False, 0.8, mask)
    for g, h in zip(got, host, strict=True):
        assert g.dtype == h.dtype and g.shape == h.shape
        _close(g, h, dtype)
        assert bool((g[~mask] == 0).all())
    assert got[0].requires_grad and not got[1].requires_grad
    if dtype == torch.float32:
        exact = selected_logprobs(
            logits, index.masked_fill(~mask, -100), temperature=0.8, with_entropy=True
        )
        assert_bitwise_equal(got[1], exact.entropy, "entropy bits")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(VOCAB,), (6, VOCAB), (2, 3, 4, VOCAB)])
def test_entropy_from_logits_side_by_side(dtype, shape):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = trl.entropy_from_logits(logits, chunk_size=2)
    host = trl_utils.entropy_from_logits(logits, chunk_size=2)
    assert got.shape == host.shape == shape[:-1] and got.dtype == host.dtype
    _close(got, host, dtype)
    assert_bitwise_equal(got, trl.entropy_from_logits(logits, 1000), "chunk size")


def test_out_dtype_opt_in_keeps_fp32():
    logits, index = _logits(torch.bfloat16)
    got = trl.selective_log_softmax(logits, index, out_dtype=torch.float32)
    assert_bitwise_equal(got, selected_logprobs(logits, index).logprobs, "fp32")
    assert trl.entropy_from_logits(logits, out_dtype=torch.float32).dtype == torch.float32


def test_gradient_matches_the_host():
    logits, index = _logits(torch.float32)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    lp, h = trl.selective_log_softmax_and_entropy(a, index, temperature=0.7)
    (lp.sum() + 0.3 * h.sum()).backward()
    lp, h = trl_utils.selective_log_softmax_and_entropy(b, index, temperature=0.7)
    (lp.sum() + 0.3 * h.sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    logits, index = _logits(torch.float32)
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        trl.selective_log_softmax(logits, index, temperature=0)
    with pytest.raises(ValueError, match=r"index shape \(2,\) must be logits shape"):
        trl.selective_log_softmax(logits, index[0, :2])
    with pytest.raises(ValueError, match=r"row_mask shape \(3,\) must equal the index shape"):
        trl.selective_log_softmax(logits, index, row_mask=torch.ones(3))
    with pytest.raises(ValueError, match="one id per row"):
        trl.selective_log_softmax_and_entropy(logits, index[..., None])
    with pytest.raises(TypeError, match="logits must be a torch.Tensor, got list"):
        trl.selective_log_softmax([1.0], index)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        trl.entropy_from_logits(logits, 0)


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.uint8, torch.bool, "float32", float])
def test_out_dtype_must_be_a_floating_dtype(out_dtype):
    """An integer or bool out_dtype truncates or wraps the log-probabilities around."""
    logits, index = _logits(torch.float32)
    match = r"out_dtype must be a floating torch\.dtype .*, got " + re.escape(repr(out_dtype))
    calls = [
        lambda: trl.selective_log_softmax(logits, index, out_dtype=out_dtype),
        lambda: trl.selective_log_softmax_and_entropy(logits, index, out_dtype=out_dtype),
        lambda: trl.entropy_from_logits(logits, out_dtype=out_dtype),
        lambda: trl.patch_trl(out_dtype=out_dtype),
    ]
    try:
        for i, call in enumerate(calls):
            with pytest.raises(TypeError, match=match):
                call()
                pytest.fail(f"call {i} accepted out_dtype={out_dtype!r}")
        assert _patching.active(trl.PATCH_KEY) is None
    finally:
        trl.unpatch_trl()


# --- patch_trl ---

TRAINERS = [f"trl.trainer.{n}_trainer" for n in ("grpo", "rloo", "kto", "sft", "dpo")]


@pytest.fixture
def patched():
    import importlib

    for name in TRAINERS:
        importlib.import_module(name)
    handle = trl.patch_trl()
    yield handle
    trl.unpatch_trl()


def test_patch_reaches_every_binding_and_undo_restores_them(patched):
    originals = {
        "selective_log_softmax": trl_utils.selective_log_softmax,
        "add_fused_lm_head": trl_utils.add_fused_lm_head,
    }
    assert originals["selective_log_softmax"] is trl.selective_log_softmax
    assert trl_utils._ChunkedLogProbFunction is trl.ChunkedLogProbFunction
    for name in TRAINERS:
        assert sys.modules[name].add_fused_lm_head is trl.add_fused_lm_head, name
    import trl.trainer as trainer_pkg

    assert trainer_pkg.add_fused_lm_head is trl.add_fused_lm_head
    assert trl.patch_trl() is patched  # idempotent
    patched.undo()
    assert trl_utils.selective_log_softmax is not trl.selective_log_softmax
    assert trl_utils._ChunkedLogProbFunction is TrlChunked
    for name in TRAINERS:
        assert sys.modules[name].add_fused_lm_head is trl_utils.add_fused_lm_head, name


def test_patch_reaches_trls_triton_kernel_and_its_copy():
    """trl.kernels.selective_log_softmax_and_entropy (TRL's Triton kernel: temperature
    third, fp32 outputs) and its copy trl.trainer.utils._fused_logprob_entropy, which TRL's
    own selective_log_softmax_and_entropy calls on CUDA, are exactlogp's while patched."""
    import trl.kernels as trl_kernels

    theirs = trl_kernels.selective_log_softmax_and_entropy
    assert trl_utils._fused_logprob_entropy is theirs
    x, t = llm_like_logits(6, 40, torch.bfloat16, seed=2)
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    trl.patch_trl()
    try:
        assert trl_kernels.selective_log_softmax_and_entropy is (
            trl.kernel_selective_log_softmax_and_entropy
        )
        assert trl_utils._fused_logprob_entropy is trl.kernel_selective_log_softmax_and_entropy
        lp, ent = trl_kernels.selective_log_softmax_and_entropy(x, t, 0.7, mask)
    finally:
        trl.unpatch_trl()
    assert trl_kernels.selective_log_softmax_and_entropy is theirs
    assert trl_utils._fused_logprob_entropy is theirs
    want = selected_logprobs(x, torch.where(mask == 0, -100, t), temperature=0.7,
                             with_entropy=True)  # fmt: skip
    assert lp.dtype == ent.dtype == torch.float32  # the kernel's dtype
    assert torch.equal(lp, want.logprobs) and torch.equal(ent, want.entropy)


def test_patch_reaches_a_module_imported_afterwards(patched):
    for name in [n for n in sys.modules if n.startswith("trl.experimental.cpo")]:
        del sys.modules[name]
    try:
        from trl.experimental.cpo import cpo_trainer
    except ImportError as exc:  # its own optional dependencies
        pytest.skip(f"trl.experimental.cpo does not import here: {exc}")
    assert cpo_trainer.selective_log_softmax is trl.selective_log_softmax
    patched.undo()
    assert cpo_trainer.selective_log_softmax is trl_utils.selective_log_softmax


def test_patch_with_out_dtype():
    handle = trl.patch_trl(out_dtype=torch.float32)
    try:
        logits, index = _logits(torch.bfloat16)
        assert trl_utils.selective_log_softmax(logits, index).dtype == torch.float32
        with pytest.raises(ValueError, match="already applied"):
            trl.patch_trl()
    finally:
        handle.undo()


# --- the fused LM head ---


def _head_case(dtype=torch.float32, n=40, h=32, v=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    bias = (0.1 * torch.randn(v, generator=g)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_function_side_by_side(temperature):
    hidden, weight, bias, targets = _head_case()
    args = (targets, temperature, 64, None, 0.5, trl.OPTIONAL_OUTPUTS)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ours = trl.ChunkedLogProbFunction.apply(*leaves, *args)
    host_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    host = TrlChunked.apply(*host_leaves, *args)
    for name, a, b in zip(("log_probs", *trl.OPTIONAL_OUTPUTS), ours, host, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "is_top1":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    (ours[0].sum() + 0.5 * ours[1].sum()).backward()
    (host[0].sum() + 0.5 * host[1].sum()).backward()
    for a, b in zip(leaves, host_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    exact = exactlogp.linear_selected_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, logit_scale=0.5
    )
    assert_bitwise_equal(ours[0].detach(), exact.logprobs, "log_probs bits")


def test_chunked_function_refuses_softcapping():
    hidden, weight, bias, targets = _head_case()
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
        trl.ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 1.0, 64, 30.0)


def tiny_model(seed=0, **config):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **config,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def _fused_pair(outputs, temperature=0.7, **config):
    import copy

    host = tiny_model(**config)
    ours = copy.deepcopy(host)
    trl_utils.add_fused_lm_head(host, temperature=temperature, outputs=outputs)
    trl.add_fused_lm_head(ours, temperature=temperature, outputs=outputs)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :3] = -100
    return host, ours, ids, labels


@pytest.mark.parametrize("shift", [False, True])
def test_add_fused_lm_head_side_by_side(shift):
    outputs = ("log_probs", *trl.OPTIONAL_OUTPUTS)
    host, ours, ids, labels = _fused_pair(outputs)
    kwargs = {"shift_labels": labels} if shift else {"labels": labels}
    a = ours(input_ids=ids, fused_lm_head=True, **kwargs)
    b = host(input_ids=ids, fused_lm_head=True, **kwargs)
    assert type(a) is type(b)
    assert a.log_probs.shape == ((2, 9) if shift else (2, 8))
    assert torch.equal(a.label_mask, b.label_mask)
    for name in ("log_probs", *trl.OPTIONAL_OUTPUTS):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        if name == "is_top1":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
    assert bool((a.log_probs[~a.label_mask] == 0).all())
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), host.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_add_fused_lm_head_reads_the_logit_scale_and_keeps_generate():
    host, ours, ids, labels = _fused_pair(("log_probs",), logits_scaling=4.0)
    a = ours(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=5)
    b = host(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=5)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=1e-5)
    assert a.entropy is None and b.entropy is None
    torch.testing.assert_close(a.loss, b.loss)
    plain = ours(input_ids=ids, labels=ids)
    assert plain.logits.shape == (2, 9, VOCAB)
    assert "fused_lm_head" not in str(__import__("inspect").signature(ours.forward))


def test_add_fused_lm_head_refuses_softcapping_and_unknown_outputs():
    model = tiny_model()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 in the model config"):
        trl.add_fused_lm_head(model)
    with pytest.raises(ValueError, match=r"outputs \['logits'\] are unknown"):
        trl.add_fused_lm_head(tiny_model(), outputs=("log_probs", "logits"))


@pytest.mark.parametrize("cast", [False, True])
def test_add_fused_lm_head_on_a_bf16_model(cast):
    import copy

    host = tiny_model().to(torch.bfloat16)
    ours = copy.deepcopy(host)
    outputs = ("log_probs", "entropy")
    trl_utils.add_fused_lm_head(host, temperature=0.9, cast_lm_head_to_fp32=cast, outputs=outputs)
    trl.add_fused_lm_head(ours, temperature=0.9, cast_lm_head_to_fp32=cast, outputs=outputs)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    a = ours(input_ids=ids, labels=ids, fused_lm_head=True)
    b = host(input_ids=ids, labels=ids, fused_lm_head=True)
    assert a.log_probs.dtype == b.log_probs.dtype == torch.float32
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-4, rtol=1e-4)
    a.loss.backward()
    b.loss.backward()
    for p, q in zip(ours.parameters(), host.parameters(), strict=True):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=1e-2, rtol=1e-2)


# --- fp64 models: the fused head computes them in fp64 with plain torch ---


def test_chunked_function_in_fp64_side_by_side():
    hidden, weight, bias, targets = _head_case(torch.float64)
    targets[3] = -100
    args = (targets, 0.7, 64, None, 0.5, trl.OPTIONAL_OUTPUTS)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ours = trl.ChunkedLogProbFunction.apply(*leaves, *args)
    host_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    host = TrlChunked.apply(*host_leaves, *(targets.clamp(min=0), *args[1:]))
    for name, a, b in zip(("log_probs", *trl.OPTIONAL_OUTPUTS), ours, host, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        keep = torch.ones_like(targets, dtype=torch.bool)
        keep[3] = False
        if name == "is_top1":
            assert torch.equal(a[keep], b[keep])
        else:
            torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5, msg=name)
    assert ours[0][3].item() == 0.0 and ours[1][3].item() == 0.0
    (ours[0].sum() + 0.5 * ours[1].sum()).backward()
    keep_rows = torch.ones_like(targets, dtype=torch.float64)
    keep_rows[3] = 0
    (host[0] * keep_rows).sum().add(0.5 * (host[1] * keep_rows).sum()).backward()
    for a, b in zip(leaves, host_leaves, strict=True):
        assert a.grad.dtype == torch.float64
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_sft_trainer_trains_an_fp64_model_patched(tmp_path, monkeypatch):
    """TRL's SFTTrainer installs the fused head at construction (add_fused_lm_head) and
    trains an fp64 model; patched, the same step runs (it raised a TypeError mid-training)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, VOCAB, (8,), generator=g).tolist() for _ in range(4)]
    dataset = Dataset.from_dict({"input_ids": rows})

    def train_one_step():
        model = tiny_model().double()
        args = SFTConfig(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
            use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False,  # no autocast
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        return trainer.train().training_loss, model

    host_loss, _ = train_one_step()
    calls = []
    fp64 = getattr(trl, "_fp64_chunked", None)
    spy = lambda *a: calls.append(1) or fp64(*a)  # noqa: E731
    monkeypatch.setattr(trl, "_fp64_chunked", spy, raising=False)
    trl.patch_trl()
    try:
        loss, model = train_one_step()
    finally:
        with warnings.catch_warnings():  # `model` keeps exactlogp's head, as it says
            warnings.simplefilter("ignore", RuntimeWarning)
            trl.unpatch_trl()
    assert model.lm_head.weight.dtype == torch.float64
    assert calls, "the trainer did not run exactlogp's fp64 head"
    assert loss == pytest.approx(host_loss, rel=1e-6)  # TRL returns fp32 values


# --- what unpatch_trl restores, and what it leaves behind ---


def _head_owner(model) -> str:
    """'exactlogp' or 'trl': whose add_fused_lm_head gave `model` its forward."""
    filename = model.forward.__func__.__code__.co_filename
    return "exactlogp" if filename == trl.__file__ else "trl"


def test_unpatch_warns_about_models_that_keep_exactlogps_head():
    import gc

    before = tiny_model()
    trl_utils.add_fused_lm_head(before)  # TRL's head, built before the patch
    handle = trl.patch_trl()
    try:
        kept = tiny_model()
        trl_utils.add_fused_lm_head(kept)  # what a trainer built while patched does
        dropped = tiny_model()
        trl_utils.add_fused_lm_head(dropped)
        del dropped
        gc.collect()
        assert _head_owner(kept) == "exactlogp"
        assert trl_utils._ChunkedLogProbFunction is trl.ChunkedLogProbFunction
        with pytest.warns(RuntimeWarning, match=r"1 object\(s\) .*\(Qwen3ForCausalLM at 0x") as w:
            assert trl.unpatch_trl() is True
        assert w[0].filename == __file__  # points at the call
    finally:
        handle.undo()
    assert _head_owner(kept) == "exactlogp"  # left behind, as the warning says
    # restored: the names, so TRL's head of a model built before the patch computes with
    # TRL's kernel again, and models built now get TRL's head
    assert trl_utils._ChunkedLogProbFunction is TrlChunked
    after = tiny_model()
    trl_utils.add_fused_lm_head(after)
    assert _head_owner(before) == _head_owner(after) == "trl"
    # warned once: a second cycle with no model built while patched says nothing
    trl.patch_trl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trl.unpatch_trl() is True


def test_handle_undo_warns_too():
    handle = trl.patch_trl()
    try:
        model = tiny_model()
        trl_utils.add_fused_lm_head(model)
        with pytest.warns(RuntimeWarning, match="unpatch_trl: the host's functions are restored"):
            handle.undo()
    finally:
        handle.undo()
    assert _head_owner(model) == "exactlogp"
