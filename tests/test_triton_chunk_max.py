"""The Triton chunk_max kernel gives base.Backend.chunk_max's bits (bitwise claims).

Backend.chunk_max is the exact cut's one full read of the logits: (N, ceil(R / chunk))
maxima of y = fp32(x) / tau, NaN where a chunk holds a NaN, else +inf where it holds +inf,
a zero max as +0. Its torch default is the definition; the kernel is compared with it bit
for bit (testing.assert_bitwise_equal: equal bit patterns, so -0 and +0 differ, and NaN
in the same places). Without a GPU the kernel runs in the Triton interpreter (conftest.py
sets TRITON_INTERPRET=1), so the shapes are small.
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

from exactlogp import testing  # noqa: E402
from exactlogp.backends import ShardPlan, get_backend  # noqa: E402
from exactlogp.backends.base import Backend, row_view  # noqa: E402
from exactlogp.backends.triton import launch, prepare  # noqa: E402
from exactlogp.temperature import ONE, Temperature  # noqa: E402

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL = launch.LaunchConfig(block_v=128, num_warps=4)  # one chunk of 128 per loop step
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def triton_backend():
    if DEVICE.type == "cpu" and not launch.interpreted():
        raise RuntimeError("exactlogp's Triton kernels were imported before TRITON_INTERPRET=1")
    return get_backend("triton", DEVICE)


def _tau_on(tau: Temperature) -> Temperature:
    return tau if tau.rows is None else Temperature(1.0, tau.rows.to(DEVICE))


def _compare(tri, x, tau, plan, chunk, cfg=None, what=""):
    """The kernel (through the backend, or launch.chunk_max with `cfg`) on DEVICE against
    the torch default on the CPU; returns the kernel's output."""
    want = Backend.chunk_max(tri, x, tau, plan, chunk)
    dx, dtau = x.to(DEVICE), _tau_on(tau)
    if cfg is None:
        got = tri.chunk_max(dx, dtau, plan, chunk)
    else:
        got = launch.chunk_max(dx, dtau, plan, chunk, cfg)
    assert got.dtype == torch.float32 and got.device.type == DEVICE.type, what
    testing.assert_bitwise_equal(got.cpu(), want, what)
    return got.cpu()


def _special_rows(dtype: torch.dtype) -> torch.Tensor:
    """6 rows x 600 columns (4 chunks of 128 and a tail of 88) with NaN, +inf, -inf, +-0
    and all -inf chunks, one or more per chunk, some in the tail."""
    x, _ = testing.llm_like_logits(6, 600, dtype, seed=41)
    x[0, 5] = NAN  # NaN in chunk 0
    x[0, 130] = INF  # +inf in chunk 1
    x[0, 300], x[0, 301] = NAN, INF  # both in chunk 2: NaN wins
    x[0, 590] = NAN  # in the tail
    x[1, :256] = -INF  # two chunks of -inf only
    x[1, 256:384] = -0.0  # a chunk of -0 only: +0
    x[1, 384:512] = -1.0
    x[1, 400] = 0.0  # +0 among negatives
    x[1, 420] = -0.0
    x[1, 512:] = -INF  # the tail -inf only
    x[1, 599] = INF  # ... but for its last column
    x[2, 7::11] = -INF  # scattered -inf
    x[2, 250] = 60000.0  # overflows to +inf at a small temperature
    x[3] = x[3].abs().neg()  # all <= 0, with -0 where the largest is -0
    x[3, ::128] = -0.0
    x[3, 1::128] = 0.0
    x[4, 127], x[4, 128] = INF, -INF  # on either side of a chunk boundary
    x[5] = -x[5].abs()  # negatives only (the max nearest zero)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_max_matches_the_torch_default(triton_backend, dtype):
    """Every dtype, scalar temperatures (the division skipped at 1) and per-row ones
    (those that overflow, and the bad ones: 0, negative, NaN, inf), unpadded and padded
    shards with a tail chunk, at chunk 128 and a chunk that is not a power of two."""
    x = _special_rows(dtype)
    taus = [
        ONE, Temperature.of(0.7), Temperature.of(1e-3),
        Temperature.of(torch.tensor([0.5, 1.0, 1e-3, 1.7, 0.0, -1.0])),
        Temperature.of(torch.tensor([NAN, INF, 0.3, -0.5, 2.5, 1e-30])),
    ]  # fmt: skip
    plans = [ShardPlan(0, None, -100, False), ShardPlan(0, 555, -100, True)]
    for tau in taus:
        for plan in plans:
            _compare(triton_backend, x, tau, plan, 128, what=f"{dtype} {tau.value} {plan}")
    out = _compare(triton_backend, x, ONE, plans[0], 128, what="values")
    # the special values landed where the definition puts them
    assert torch.isnan(out[0, [0, 2, 4]]).all() and out[0, 1] == INF
    assert out[1, :2].eq(-INF).all() and out[1, 4] == INF
    assert out[1, 2].view(torch.int32) == 0 and out[1, 3].view(torch.int32) == 0  # +0
    _compare(triton_backend, x, Temperature.of(0.8), plans[1], 50, what=f"{dtype} chunk 50")


def test_chunk_max_on_shards_small_steps_and_split_rows(triton_backend, monkeypatch):
    """Shards at an offset into a padded vocabulary (a shard with one real column, one of
    padding only), launch steps narrower than a chunk (a loop over each chunk's columns)
    and rows split over several programs give the same bits."""
    x = _special_rows(torch.bfloat16)
    tau = Temperature.of(torch.tensor([0.5, 1.0, 1.3, 1.7, 0.9, 2.5]))
    for lo, hi, vocab_size in ((128, 507, 470), (0, 469, 470), (469, 600, 470), (470, 600, 470)):
        plan = ShardPlan(lo, vocab_size, -100, False)
        _compare(triton_backend, x[:, lo:hi], tau, plan, 128, what=f"shard {lo}:{hi}")
    plan = ShardPlan(0, 555, -100, False)
    _compare(triton_backend, x, tau, plan, 300, SMALL, what="chunk 300 in steps of 128")
    _compare(triton_backend, x, tau, plan, 64, SMALL, what="two chunks per step")
    monkeypatch.setattr(prepare, "target_programs", lambda device: 16)
    _compare(triton_backend, x, tau, plan, 32, SMALL, what="rows split over programs")


def test_chunk_max_reads_strided_rows_in_place(triton_backend):
    """logits[:, :-1, :] of (B, T + 1, V) logits (rows not evenly spaced: a (B, T, V)
    row_view) and a column slice (column stride 2, copied by the launch)."""
    full = _special_rows(torch.float16)[:, :510].reshape(2, 3, 510)
    x = row_view(full[:, :-1, :])
    assert x.dim() == 3 and not x.is_contiguous()
    tau = Temperature.of(torch.tensor([0.6, 1.0, 2.0, 0.25]))
    out = _compare(triton_backend, x, tau, ShardPlan(0, 500, -100, False), 128, what="(B,T,V)")
    assert out.shape == (4, 4)
    _compare(triton_backend, full[:, :, ::2], Temperature.of(0.9),
             ShardPlan(0, None, -100, False), 100, what="column stride 2")  # fmt: skip


def test_chunk_max_empty_shapes_and_bad_chunk(triton_backend):
    plan = ShardPlan(0, None, -100, False)
    for shape, want in (((0, 300), (0, 3)), ((3, 0), (3, 0))):
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert _compare(triton_backend, x, ONE, plan, 128, what=str(shape)).shape == want
    x = torch.randn(2, 300, dtype=torch.bfloat16)
    padding_only = ShardPlan(400, 300, -100, False)
    assert _compare(triton_backend, x, ONE, padding_only, 128, what="padding").shape == (2, 0)
    for chunk in (0, -128, 1.5, True):
        with pytest.raises(ValueError, match="chunk must be a positive int"):
            triton_backend.chunk_max(x.to(DEVICE), ONE, plan, chunk)
