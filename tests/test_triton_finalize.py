"""The Triton finalize kernel gives contract.finalize's bits in every field (bitwise claims).

Records are drawn directly (testing.finalize_inputs): limb sums over their whole range and
at every boundary, each bad flag, ignored rows, and rows no local pass can produce. Without
a GPU the kernel runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1);
benchmarks/triton_ptx_check.py checks that the compiled kernel does the same arithmetic.
The last test logs the torch ops of a forward with the kernels stubbed out: three launches,
no other device work in finalize, nothing that reads a device value on the host.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

import exactlogp  # noqa: E402
from exactlogp import autograd, contract, testing  # noqa: E402
from exactlogp.backends import get_backend  # noqa: E402
from exactlogp.backends.triton import kernels, launch, prepare  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs
NAN32 = 0x7FC00000  # the fp32 NaN contract.finalize writes on the CPU


@pytest.fixture(scope="module")
def triton_backend():
    if DEVICE.type == "cpu" and not launch.interpreted():
        raise RuntimeError("exactlogp's Triton kernels were imported before TRITON_INTERPRET=1")
    return get_backend("triton", DEVICE)


def _assert_finalized_equal(got: contract.Finalized, want: contract.Finalized):
    for name, a, b in zip(contract.Finalized._fields, got, want, strict=True):
        testing.assert_bitwise_equal(a, b, name)
    # Bad rows: exactly the NaN bits of the CPU reference (stricter than NaN positions).
    bad = want.bad != 0
    for name in ("logprobs", "entropy", "lse"):
        bits = getattr(got, name).cpu().view(torch.int32)[bad]
        assert torch.equal(bits, torch.full_like(bits, NAN32)), name


def _on_device(inp: testing.FinalizeInputs) -> testing.FinalizeInputs:
    return inp._replace(**{
        name: getattr(inp, name).to(DEVICE)
        for name in ("row_max", "record", "target", "bad_temperature")
        if getattr(inp, name) is not None
    })  # fmt: skip


@pytest.mark.parametrize(
    "vocab_size, ignore_index, bad_tau",
    [(1000, -100, True), (None, -100, False), (None, 7, True), (50257, 0, False)],
    ids=["vocab-badtau", "novocab", "novocab-ignore7-badtau", "vocab-ignore0"],
)
def test_random_and_adversarial_records(triton_backend, vocab_size, ignore_index, bad_tau):
    inp = testing.finalize_inputs(1500, seed=vocab_size or 3, vocab_size=vocab_size,
                                  ignore_index=ignore_index, with_bad_temperature=bad_tau)  # fmt: skip
    want = contract.finalize(*inp)
    assert (want.bad != 0).any() and want.ignored.any() and (want.bad == 0).any()
    _assert_finalized_equal(triton_backend.finalize(*_on_device(inp)), want)


def test_every_block_size_and_a_strided_record(triton_backend):
    """Rows are independent: blocks of 16 (a ragged last one) and a record that is a
    column slice of a wider tensor (row stride 11) give the same bits."""
    inp = testing.finalize_inputs(203, seed=11)
    want = contract.finalize(*inp)
    dev = _on_device(inp)
    wide = torch.zeros(203, 11, dtype=torch.int64, device=dev.record.device)  # made there:
    wide[:, 2:10] = dev.record  # moving a slice to a GPU would copy it contiguous
    dev = dev._replace(record=wide[:, 2:10])
    assert dev.record.stride(0) == 11
    for block_n in (16, 128, 256):
        _assert_finalized_equal(launch.finalize(*dev, block_n=block_n), want)


def _record(e_hi, e_lo, w_hi=0, w_lo=0, bits=0, owners=1, masked=0, nonfinite=0):
    return [e_hi, e_lo, w_hi, w_lo, bits, owners, masked, nonfinite]


def test_named_boundary_rows(triton_backend):
    one = 1 << 42
    f32_bits = lambda v: int(torch.tensor(v).view(torch.int32))  # noqa: E731
    rows = [  # (row_max, record, target)
        (0.0, _record(one, 0), 3),  # S exactly 1: log S = +0
        (-0.0, _record(one, 0, bits=f32_bits(-0.0)), 3),  # -0 max and target
        (1.5, _record(one, 1), 3),  # S = 1 + 2^-84
        (1.5, _record(one - 1, 1 << 42), 3),  # S = 1 through a carry
        (2.0, _record((1 << 62) - 1, (1 << 62) - 1, (1 << 62) - 1, (1 << 62) - 1), 3),
        (3.4e38, _record(1 << 61, 5, bits=f32_bits(3.4e38)), 3),  # lse overflows fp32
        (1e-45, _record(one * 3, 7, bits=f32_bits(-1e-45)), 3),  # subnormal fp32 max
        (1.0, _record((1 << 54) + 2, 0), 3),  # int64 -> fp64 tie
        (1.0, _record(one, 0, bits=f32_bits(float("-inf"))), 3),  # target y = -inf is legal
        (1.0, _record(0, 0), 3),  # S = 0 (no local pass gives it): NaN from log_c
        (1.0, _record(one, 0, owners=0), 3),  # owner missing
        (1.0, _record(one, 0, owners=2), 3),  # two owners
        (1.0, _record(one, 0, masked=1), 3),
        (1.0, _record(0, 0, nonfinite=2), 3),  # S = 0 on a bad row is replaced by 1
        (float("-inf"), _record(0, 0, owners=0), 3),  # no valid column
        (1.0, _record(one, 0, owners=0), -1),  # out of range, not also an owner problem
        (1.0, _record(one, 0, owners=0), 1000),  # >= vocab_size
        (float("-inf"), _record(0, 0, owners=3, nonfinite=1), -100),  # ignored: all +0
    ]
    row_max = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    record = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    target = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    for vocab_size in (None, 1000):
        for bad_tau in (None, torch.arange(len(rows)) % 5 == 1):
            inp = testing.FinalizeInputs(row_max, record, target, vocab_size, -100, bad_tau)
            want = contract.finalize(*inp)
            _assert_finalized_equal(triton_backend.finalize(*_on_device(inp)), want)
    assert want.s_hi[0] == 1.0 and want.log_s[0] == 0.0 and want.ignored[-1]


def test_empty_batch(triton_backend):
    inp = testing.finalize_inputs(0)
    _assert_finalized_equal(triton_backend.finalize(*_on_device(inp)), contract.finalize(*inp))


# --- through the public API ---


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_api_bad_and_ignored_rows_equal_reference(triton_backend, dtype):
    logits, target = testing.llm_like_logits(8, 400, dtype, seed=21)
    logits[0, 9] = float("nan")
    logits[1] = float("-inf")
    target[2] = -100
    target[3] = 395  # padding column: outside vocab_size
    keep = torch.ones(8, 400, dtype=torch.bool)
    keep[4, target[4]] = False
    tau = torch.tensor([0.7, 1.0, 0.0, 1.3, 2.0, float("nan"), 0.9, 1.1])
    backends = (("reference", torch.device("cpu")), ("triton", DEVICE))

    def run(name, dev, **kwargs):
        return exactlogp.selected_logprobs(
            logits.to(dev), target.to(dev), vocab_size=390, temperature=tau.to(dev),
            backend=name, **kwargs,
        )  # fmt: skip

    ref, tri = (run(n, d, keep_mask=keep.to(d), with_entropy=True, validate=False)
                for n, d in backends)  # fmt: skip
    for name in ("logprobs", "entropy", "lse"):
        testing.assert_bitwise_equal(getattr(tri, name), getattr(ref, name), name)
    assert torch.isnan(ref.logprobs).sum() == 5  # rows 0, 1, 3, 4, 5
    messages = []
    for name, dev in backends:  # validate=True: the same error from the Triton flags
        with pytest.raises(ValueError) as err:
            run(name, dev)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


# --- the forward issues three launches, no other device work and no host sync ---


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class _KernelStub:
    """Stands for a kernel: records the launch, runs nothing (the op log stays host-side)."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(self.name)


ALLOCATIONS = {"aten.empty", "aten.new_empty"}
SYNCS = {"aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal", "aten.item"}


@pytest.mark.parametrize("temperature", ["1", "0.7", "per_row"])
def test_forward_is_three_launches_without_sync(triton_backend, monkeypatch, temperature):
    """validate=False: the pipeline's device work is the three kernels (plus a scalar
    temperature's fill per local pass, or autograd's flags of a per-row temperature);
    finalize itself only allocates, and nothing reads a device value on the host."""
    launches: list[str] = []
    contract.exp2_table(DEVICE)  # made once per device, not per forward: made before the log
    interpreted = launch.interpreted()
    monkeypatch.setattr(launch, "interpreted", lambda: interpreted)
    monkeypatch.setattr(prepare, "target_programs", lambda device: 1)  # no split rows
    for name in ("row_max_kernel", "partials_kernel", "finalize_kernel"):
        monkeypatch.setattr(kernels, name, _KernelStub(name, launches))
    pipeline_ops, finalize_ops = _OpLog(), _OpLog()
    pipeline, finalize = autograd.forward_pipeline, launch.TritonBackend.finalize

    def logged_pipeline(*args, **kwargs):
        with pipeline_ops:
            return pipeline(*args, **kwargs)

    def logged_finalize(*args, **kwargs):
        with finalize_ops:
            return finalize(*args, **kwargs)

    monkeypatch.setattr(autograd, "forward_pipeline", logged_pipeline)
    monkeypatch.setattr(launch.TritonBackend, "finalize", logged_finalize)
    logits, target = testing.llm_like_logits(6, 300, torch.bfloat16, seed=22)
    tau = {"1": 1.0, "0.7": 0.7, "per_row": torch.rand(6) + 0.5}[temperature]
    if isinstance(tau, torch.Tensor):
        tau = tau.to(DEVICE)
    exactlogp.selected_logprobs(logits.to(DEVICE), target.to(DEVICE), temperature=tau,
                                with_entropy=True, validate=False, backend="triton")  # fmt: skip

    assert launches == ["row_max_kernel", "partials_kernel", "finalize_kernel"]
    assert set(finalize_ops.ops) <= ALLOCATIONS, finalize_ops.ops
    assert not set(pipeline_ops.ops) & SYNCS, pipeline_ops.ops
    device_work = [op for op in pipeline_ops.ops if op not in ALLOCATIONS]
    if temperature == "1":
        assert device_work == [], device_work
    elif temperature == "0.7":  # the temperature as a device scalar, once per local pass
        assert device_work == ["aten.full", "aten.full"], device_work
