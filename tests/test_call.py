"""The call object and how options reach the kernels: Temperature, Call, backend objects.

Bitwise claims against the reference backend; the backend objects' options are shown to
be the ones that ran (spies), and never changed by a call or another thread.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import exactlogp
from exactlogp import agreement, contract, distributed
from exactlogp.backends import CpuBackend, ReferenceBackend, get_backend
from exactlogp.call import LinearOptions, make_call
from exactlogp.temperature import ONE, Temperature
from exactlogp.testing import assert_bitwise_equal, lm_head_inputs

CPU = torch.device("cpu")


def _cpu_backend_or_skip():
    try:
        return get_backend("cpu", CPU)
    except ValueError as exc:
        pytest.skip(str(exc))


def _inputs(seed=0, rows=(3, 4), vocab=300):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, vocab, generator=gen).bfloat16()
    t = torch.randint(0, vocab, rows, generator=gen)
    return x, t


def _same(a, b):
    for u, v in zip(a, b, strict=True):
        if u is None or v is None:
            assert u is None and v is None
        else:
            assert_bitwise_equal(u, v)


# --- Temperature ---


def test_temperature_scalar_and_per_row_forms():
    tau = Temperature.of(0.7)
    assert not tau.per_row and tau.scalar == contract.fp32_temperature(0.7)
    assert tau.field() == contract.fp32_bits(tau.scalar) and tau.bad() is None
    assert Temperature.of(tau) is tau and ONE.is_one and not tau.is_one
    assert torch.equal(tau.row_bits(3, CPU), torch.full((3,), tau.field(), dtype=torch.int32))
    rows = Temperature.of(torch.tensor([[0.5, -1.0], [float("nan"), 2.0]], dtype=torch.float64))
    assert rows.per_row and rows.rows.dtype == torch.float32 and rows.rows.shape == (4,)
    assert rows.field() == -1 and rows.value is rows.rows
    assert rows.bad().tolist() == [False, True, True, False]
    assert rows.take(slice(1, 3)).rows.tolist()[0] == -1.0 and tau.take(slice(0, 1)) is tau
    assert rows.column().shape == (4, 1) and tau.column() == tau.scalar
    assert rows.at(3) == 2.0 and tau.at(5) == tau.scalar


def test_the_gradient_divisor_is_one_on_rows_without_a_gradient():
    rows = Temperature.of(torch.tensor([0.0, 2.0, float("nan")]))
    stats = contract.GradStats(*[None] * 10, silent=torch.tensor([True, False, True]))
    assert rows.gradient_divisor(stats).rows.tolist() == [1.0, 2.0, 1.0]
    assert ONE.gradient_divisor(stats) is ONE


# --- the call object ---


def _call(**overrides):
    x, t = _inputs()
    arguments = dict(
        source=x, num_cols=x.shape[-1], target=t, group=distributed.resolve(None),
        vocab_start=None, vocab_size=None, temperature=0.5, has_keep_mask=False,
        ignore_index=-100, with_entropy=True, validate=True, backend="reference",
    )  # fmt: skip
    return make_call(**{**arguments, **overrides})


def test_the_call_is_built_once_frozen_and_extended_not_changed():
    call = _call()
    assert call.target_shape == (3, 4) and call.num_rows == 12 and call.num_cols == 300
    assert call.temperature.scalar == 0.5 and call.with_entropy and call.linear is None
    assert call.fields.temperature == contract.fp32_bits(0.5) and call.call_key == 0
    assert isinstance(call.backend, ReferenceBackend)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.validate = False
    extended = dataclasses.replace(call, linear=LinearOptions(0.5, True))
    assert extended.linear.logit_scale == 0.5 and call.linear is None
    with pytest.raises(TypeError):
        make_call(**{"source": None})  # keyword-only, every argument named
    with pytest.raises(TypeError):
        make_call(None, 3)  # no positional parameters


def test_the_call_checks_arguments_in_the_order_a_user_fixes_them():
    with pytest.raises(TypeError, match="with_entropy must be a bool, got int"):
        _call(with_entropy=1, ignore_index="x")
    with pytest.raises(TypeError, match="backend must be a str or an exactlogp Backend"):
        _call(backend=3)
    assert agreement.KIND_NAMES[_call().fields.kind] == "selected_logprobs"


# --- backend objects: reachable options, immutable, one per thread if wanted ---


class _Spy(CpuBackend):
    """A CpuBackend that records which object and which thread ran each forward."""

    def __init__(self, log: list, **options):
        super().__init__(**options)
        object.__setattr__(self, "log", log)

    def with_options(self, **changes):
        return type(self)(self.log, **{**self.options, **changes})

    def forward_unsharded(self, *args):
        self.log.append((threading.get_ident(), id(self), self.value_tables))
        return super().forward_unsharded(*args)


def test_backend_objects_with_options_give_the_reference_bits():
    _cpu_backend_or_skip()
    x, t = _inputs(1)
    want = exactlogp.selected_logprobs(x, t, with_entropy=True, backend="reference")
    for impl in (
        CpuBackend(num_threads=1, value_tables="never"),
        CpuBackend(num_threads=2, value_tables="always"),
        ReferenceBackend(),
    ):
        got = exactlogp.selected_logprobs(x, t, with_entropy=True, backend=impl)
        _same(got, want)
    h, w, target = lm_head_inputs(5, 16, 40, torch.float32, seed=2)
    want = exactlogp.linear_selected_logprobs(h, w, target, backend="reference")
    got = exactlogp.linear_selected_logprobs(h, w, target, backend=CpuBackend(num_threads=1))
    _same(got, want)
    assert torch.equal(
        exactlogp.linear_logits(h, w, backend=ReferenceBackend()),
        exactlogp.linear_logits(h, w, backend="reference"),
    )


def test_backends_are_immutable_and_with_options_makes_another():
    impl = _cpu_backend_or_skip()
    with pytest.raises(AttributeError, match="immutable"):
        impl.value_tables = "never"
    other = impl.with_options(value_tables="never", num_threads=1)
    assert impl.value_tables == "auto" and impl.num_threads is None
    assert other.value_tables == "never" and other.num_threads == 1 and other is not impl
    assert other.options == {"num_threads": 1, "isa": None, "value_tables": "never"}
    with pytest.raises(ValueError, match=r"value_tables must be one of .*, got 'sometimes'"):
        impl.with_options(value_tables="sometimes")
    with pytest.raises(ValueError, match=r"num_threads must be None or an int >= 1, got 0"):
        CpuBackend(num_threads=0)
    assert get_backend("cpu", CPU) is impl  # the registered one is never replaced


def test_a_backend_object_that_does_not_support_the_device_is_refused():
    class NoDevice(ReferenceBackend):
        def supports(self, device):
            return False

    x, t = _inputs(2)
    with pytest.raises(ValueError, match=r"backend='reference' does not support device cpu"):
        exactlogp.selected_logprobs(x, t, backend=NoDevice())
    with pytest.raises(TypeError, match="backend must be a str or an exactlogp Backend object"):
        exactlogp.selected_logprobs(x, t, backend=object())


def test_two_threads_with_different_options_each_run_their_own():
    """Two threads call at once, each with its own backend object (other value-table mode
    and thread count): every call runs its thread's object in its mode, the bits are the
    reference's, and neither object changes."""
    _cpu_backend_or_skip()
    log: list = []
    objects = [_Spy(log, value_tables="never", num_threads=1), _Spy(log, value_tables="always")]
    x, t = _inputs(3, rows=(8, 2), vocab=2000)
    want = exactlogp.selected_logprobs(x, t, with_entropy=True, backend="reference")
    start, errors, threads = threading.Barrier(2), [], {}

    def work(impl):
        threads[id(impl)] = threading.get_ident()
        try:
            start.wait(timeout=10)
            for _ in range(20):
                got = exactlogp.selected_logprobs(x, t, with_entropy=True, backend=impl)
                _same(got, want)
        except Exception as exc:  # reported below, from the main thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(impl,)) for impl in objects]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers) and not errors, errors
    assert len(log) == 40
    for impl in objects:
        mine = [entry for entry in log if entry[1] == id(impl)]
        assert len(mine) == 20
        assert all(thread == threads[id(impl)] and mode == impl.value_tables
                   for thread, _, mode in mine)  # fmt: skip
    assert [o.value_tables for o in objects] == ["never", "always"]


def test_calls_with_the_same_static_arguments_are_checked_once(monkeypatch):
    """A loop's repeated call reuses its checked Call; any change of what the checks read
    (shape, dtype, requires_grad, grad mode, an option, its type, the backend object)
    builds and checks a new one; failed checks are never kept; per-row temperatures are
    not kept."""
    from exactlogp import call as call_module

    built = []
    real = call_module.make_call
    monkeypatch.setattr(
        exactlogp.api, "make_call", lambda **kw: built.append(kw) or real(**kw)
    )  # the name api's builder calls
    monkeypatch.setattr(call_module, "_calls", {})
    x, t = _inputs(4)
    run = exactlogp.selected_logprobs
    first = run(x, t, temperature=0.5)
    _same(run(x, t, temperature=0.5), first)
    assert len(built) == 1
    variants = [
        lambda: run(x.float(), t, temperature=0.5),
        lambda: run(x[:2], t[:2], temperature=0.5),
        lambda: run(x.clone().requires_grad_(True), t, temperature=0.5),
        lambda: run(x, t, temperature=0.25),
        lambda: run(x, t, temperature=1),  # an int: checked as such
        lambda: run(x, t, temperature=0.5, with_entropy=True),
        lambda: run(x, t, temperature=0.5, backend=ReferenceBackend()),
        lambda: run(x, t, temperature=0.5, validate=False),
    ]
    for i, variant in enumerate(variants):
        variant()
        assert len(built) == i + 2, i
    with torch.no_grad():  # grad mode is read too (which inputs require a gradient)
        run(x.clone().requires_grad_(True), t, temperature=0.5)
    assert len(built) == len(variants) + 2
    for _ in range(2):  # a failed check raises every time
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            run(x, t, temperature=-1.0)
    per_row = torch.full(t.shape, 0.5)
    run(x, t, temperature=per_row)
    run(x, t, temperature=per_row)
    assert len(built) == len(variants) + 6
