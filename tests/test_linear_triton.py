"""The Triton backend of the exact fused LM head: the reference's bits.

The exact integer GEMM runs as nine int8 dot products with int32 accumulation
(backends/triton/linear_kernels.py; without a GPU in Triton's interpreter, so every case
is small), as five diagonal int8 GEMMs (torch._int_mm, or the fused route whose kernel
also rounds) or as fp64 GEMMs over K-chunks (cuBLAS DGEMM on a GPU), the backend's
exact_gemm option. Compared bit for bit with the reference backend's int64 arithmetic.
"""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

import exactlogp  # noqa: E402
from exactlogp import linear_contract as lc  # noqa: E402
from exactlogp.backends import get_backend  # noqa: E402
from exactlogp.backends.triton import launch, linear_kernels  # noqa: E402
from exactlogp.backends.triton.launch import TritonBackend, fp64_rich  # noqa: E402
from exactlogp.testing import assert_bitwise_equal, lm_head_inputs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_int8_slices_rebuild_every_operand():
    x = torch.tensor([[0, 1, -1, 63, 64, -64, -65, 127, 128, 2**20, -(2**20), 2**20 - 1, 12345]])
    s = linear_kernels.int8_slices(x.double()).to(torch.int64)
    assert s[:2].abs().max() <= 64 and s[2].abs().max() <= 64
    assert torch.equal(s[0] + 128 * s[1] + 16384 * s[2], x)


def test_exact_dot_is_the_integer_product_on_ragged_tiles():
    gen = torch.Generator().manual_seed(0)
    for m, p, k in ((1, 1, 1), (5, 70, 3), (65, 63, 129)):
        a = torch.randint(-(2**20), 2**20 + 1, (m, k), generator=gen).double()
        c = torch.randint(-(2**20), 2**20 + 1, (p, k), generator=gen).double()
        a[0, : min(k, 2)] = 2.0**20  # the extremes, where the top slice is +-64
        c[0, : min(k, 2)] = -(2.0**20)
        got = linear_kernels.exact_dot(a.to(DEVICE), c.to(DEVICE)).cpu()
        assert torch.equal(got, lc.exact_dot(a, c)), (m, p, k)


def test_exact_gemm_option_picks_a_path_and_refuses_unknown_modes():
    rich = fp64_rich(DEVICE)
    assert TritonBackend().gemm_path(DEVICE) == ("fp64" if rich else "int8")
    assert TritonBackend().gemm_path(torch.device("cpu")) == "int8"
    assert TritonBackend(exact_gemm="fp64").gemm_path(torch.device("cpu")) == "fp64"
    with pytest.raises(ValueError, match=r"exact_gemm must be one of .*, got 'bf16'"):
        TritonBackend(exact_gemm="bf16")
    impl = get_backend("triton", DEVICE)
    with pytest.raises(ValueError, match=r"exact_gemm must be one of .*, got 'fp32'"):
        impl.with_options(exact_gemm="fp32")
    with pytest.raises(AttributeError, match="immutable"):
        impl.exact_gemm = "fp64"
    assert impl.exact_gemm == "auto" and impl.with_options(exact_gemm="fp64").exact_gemm == "fp64"


@pytest.mark.parametrize(
    ("name", "capability", "rich"),
    [("NVIDIA H200", (9, 0), True), ("NVIDIA H100 80GB HBM3", (9, 0), True),
     ("NVIDIA H20", (9, 0), False), ("NVIDIA H20-3e", (9, 0), False),
     ("NVIDIA A100-SXM4-80GB", (8, 0), True), ("NVIDIA L40S", (8, 9), False),
     ("NVIDIA GeForce RTX 4090", (8, 9), False)],
)  # fmt: skip
def test_auto_routes_follow_the_device_name_not_the_capability_alone(
    monkeypatch, name, capability, rich
):
    """An H20 is sm_90 like an H200 but has ~1 TFLOP/s of fp64: no DGEMM route, and the
    value tables; a name in MEASURED_GEMM_ROUTES takes its measured route."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    assert fp64_rich(gpu) is rich
    assert TritonBackend().gemm_path(gpu) == ("fp64" if rich else "int8")
    part = name.split()[1].split("-")[0]  # "H20-3e": the part H20
    monkeypatch.setattr(launch, "MEASURED_GEMM_ROUTES", {part: "int8_fused"})
    assert TritonBackend().gemm_path(gpu) == "int8_fused"
    assert TritonBackend(exact_gemm="fp64").gemm_path(gpu) == "fp64"  # an explicit route wins


def test_exact_dot_takes_the_path_its_option_names(monkeypatch):
    calls = []

    def spy(name):
        # the integers on the CPU (torch has no int64 GEMM on CUDA), back on a's device
        return lambda a, c: calls.append(name) or lc.exact_dot(a.cpu(), c.cpu()).to(a.device)

    monkeypatch.setattr(linear_kernels, "exact_dot", spy("int8"))
    monkeypatch.setattr(linear_kernels, "diagonal_dot", spy("int8_mm"))
    monkeypatch.setattr(lc, "float_exact_dot", spy("fp64"))
    a = torch.ones(2, 3, dtype=torch.float64, device=DEVICE)
    for mode in ("int8", "fp64", "int8_mm"):
        assert torch.equal(TritonBackend(exact_gemm=mode).exact_dot(a, a).cpu(),
                           torch.full((2, 2), 3, dtype=torch.int64))  # fmt: skip
    assert calls == ["int8", "fp64", "int8_mm"]


@pytest.mark.parametrize(
    "gemm,keep_bytes",
    [("int8", None), ("fp64", None), ("int8_mm", None), ("int8_fused", None),
     ("int8_fused", 0), ("fp64", 0)],  # 0: the backward on a predicted grid (one pass)
)  # fmt: skip
def test_fused_head_gives_the_reference_bits_forward_and_backward(gemm, keep_bytes, monkeypatch):
    from exactlogp import linear

    if keep_bytes is not None:
        monkeypatch.setattr(linear, "GRAD_KEEP_BYTES", keep_bytes)
    h, w, t = lm_head_inputs(9, 40, 90, torch.bfloat16, seed=3)
    t[2] = -100
    bias = (0.1 * torch.randn(90, generator=torch.Generator().manual_seed(1))).bfloat16()
    results = []
    triton = TritonBackend(exact_gemm=gemm)
    for backend, device in (("reference", "cpu"), (triton, DEVICE)):
        hh, ww, bb = (x.to(device).detach().requires_grad_(True) for x in (h, w, bias))
        res = exactlogp.linear_selected_logprobs(
            hh, ww, t.to(device), bias=bb, with_entropy=True, logit_scale=0.5, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum()).backward()
        results.append([x.detach().cpu() for x in (*res, hh.grad, ww.grad, bb.grad)])
    for a, b in zip(*results, strict=True):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("gemm", ["int8", "fp64", "int8_mm", "int8_fused"])
@pytest.mark.parametrize("dtype,outlier", [(torch.bfloat16, 1000.0), (torch.float32, 8.0)])
def test_every_route_gives_contract_v2s_logits(gemm, dtype, outlier):
    """Contract exactlogp-linear-v2 on each exact-GEMM route at H = 4096: bf16 rows with two
    channels 1000x the rest, and fp32 inputs -- where v1's 20-bit grid was not exact --
    against the Python-integer definition."""
    from exactlogp.testing import exact_logits

    h, w, _ = lm_head_inputs(3, 4096, 7, dtype, seed=8, outlier=outlier, outlier_channels=2)
    z = exactlogp.linear_logits(h.to(DEVICE), w.to(DEVICE), backend=TritonBackend(exact_gemm=gemm))
    assert_bitwise_equal(z.cpu(), exact_logits(h, w))


# --- the fused route: quantise-and-slice in one pass, L3-L5 in one kernel ---


def _hard_rows(dtype, gen):
    """Rows over a wide exponent range: zeros, subnormals, the dtype's extremes, a NaN row
    and an inf row, H not a multiple of any block."""
    x = torch.randn(21, 301, generator=gen) * torch.logspace(-30, 30, 301).unsqueeze(0)
    x[0] = 0.0
    x[1, ::3] = 1e-40  # subnormal in fp32, 0 in fp16
    x[2, 5] = float("nan")
    x[3, 7] = -float("inf")
    x = x.to(dtype)
    x[4, 0] = torch.finfo(dtype).max
    x[5, 1:] = 0.0
    x[5, 0] = -torch.finfo(dtype).tiny  # a row whose maximum is its smallest normal
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_head_slices_are_the_quantised_diagonal_layout(dtype):
    x = _hard_rows(dtype, torch.Generator().manual_seed(4))
    e, finite = lc.row_exponents(x)
    strided = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # a row stride that is not H
    for rows in (x, strided):
        for reverse in (False, True):
            got = linear_kernels.head_slices(rows.to(DEVICE), e.to(DEVICE), finite.to(DEVICE),
                                             reverse).cpu()  # fmt: skip
            want = lc.diagonal_layout(lc.quantize(x, e, finite), reverse=reverse)
            assert torch.equal(got, want), (dtype, reverse)


def _head_logits(h, w, bias=None, scale=1.0):
    """(fused kernel's logits, linear_contract.logits_block's) of h and w."""
    e, fin_h = lc.row_exponents(h)
    f, fin_w = lc.row_exponents(w)
    row_scale, col_scale = lc.unit_scales(e - 2 * lc.QBITS, fin_h), lc.unit_scales(f, fin_w)
    want = lc.logits_block(lc.quantize(h, e, fin_h), row_scale, lc.quantize(w, f, fin_w),
                           col_scale, bias, scale)  # fmt: skip
    dev = [t.to(DEVICE) for t in (h, e, fin_h, w, f, fin_w, row_scale, col_scale)]
    a3 = linear_kernels.head_slices(dev[0], dev[1], dev[2], reverse=True)
    c3 = linear_kernels.head_slices(dev[3], dev[4], dev[5], reverse=False)
    bias = None if bias is None else bias.to(DEVICE)
    got = linear_kernels.head_logits(a3, dev[6], c3, dev[7], bias, scale).cpu()
    return got, want


def test_head_logits_round_like_the_contract_on_hard_values():
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        h = _hard_rows(dtype, gen)
        w = _hard_rows(dtype, gen)[:, torch.randperm(301, generator=gen)]
        bias = torch.randn(21, generator=gen).to(dtype)
        for b, s in ((None, 1.0), (bias, 0.625), (None, 3.0)):
            got, want = _head_logits(h, w, b, s)
            assert_bitwise_equal(got, want, f"{dtype} bias={b is not None} scale={s}")


def test_head_logits_round_integers_past_2_to_the_53_and_fold_the_accumulators(monkeypatch):
    """H = 8194, built so that Z = 2^53 + 2^29 + 1: fp64 rounds it to 2^53 + 2^29, which is
    halfway between two fp32 values, so rounding twice to nearest gives 2^13 where the
    correctly rounded z = Z 2^-40 is 2^13 + 2^-10; the epilogue's rounding to odd must get
    it (and its negative, and Z = 2^53 + 2^29 - 1). Then, with the fold every 64 columns
    instead of every 2^18, each diagonal's int32 accumulator is folded many times."""
    one = 1.0 - 2.0**-24  # quantises to 2^20 in a row whose largest value it is
    h = torch.full((3, 8194), one)
    h[:, 0] = torch.tensor([1.0, -1.0, 1.0]) * 2.0**-20  # A[n, 0] = 1, -1, 1
    h[2] = -h[2]
    w = torch.full((1, 8194), one)
    w[0, 0], w[0, -1] = 2.0**-20, 2.0**-11  # C = [1, 2^20 x 8192, 512]
    got, want = _head_logits(h, w)
    assert_bitwise_equal(got, want)
    assert got[:, 0].tolist() == [2.0**13 + 2.0**-10, 2.0**13, -(2.0**13 + 2.0**-10)]
    gen = torch.Generator().manual_seed(6)
    monkeypatch.setattr(linear_kernels, "FOLD_K", linear_kernels.HEAD_TILE.block_k)
    got, want = _head_logits(torch.randn(3, 200, generator=gen), torch.randn(5, 200, generator=gen))
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("tau", [1.0, 0.01, "rows"])
def test_head_logits_epilogue_gives_the_max_pass_row_max(tau):
    """The row max the fused kernel's epilogue writes is launch.row_max of its logits: y =
    logits / tau over the real columns, NaN and +inf left out, -inf for none -- on hard rows
    (NaN and inf rows, a NaN column, logits that overflow to +-inf, or do once divided by
    tau = 0.01, per-row tau
    including 0, -1 and NaN), with padding columns, across several column tiles."""
    from exactlogp.backends.base import ShardPlan
    from exactlogp.temperature import Temperature

    gen = torch.Generator().manual_seed(8)
    # rows of logits from ~1 to ~1e38 (past fp32's range once divided by 0.01, or before)
    h = torch.randn(21, 200, generator=gen) * torch.logspace(0, 20, 21).unsqueeze(1)
    h[0], h[1, 3], h[2, 5] = 0.0, float("nan"), float("inf")
    w = torch.randn(161, 200, generator=gen) * 1e17  # 161 columns: three tiles
    w[7, 9] = float("nan")  # a NaN column
    if tau == "rows":
        rows = torch.linspace(0.25, 4.0, 21)
        rows[3], rows[4], rows[6] = 0.0, -1.0, float("nan")
        temperature = Temperature.of(rows)
    else:
        temperature = Temperature.of(tau)
    e, fin_h = lc.row_exponents(h)
    f, fin_w = lc.row_exponents(w)
    dev = [t.to(DEVICE) for t in (h, e, fin_h, w, f, fin_w)]
    a3 = linear_kernels.head_slices(dev[0], dev[1], dev[2], reverse=True)
    c3 = linear_kernels.head_slices(dev[3], dev[4], dev[5], reverse=False)
    row_scale = lc.unit_scales(dev[1] - 2 * lc.QBITS, dev[2])
    col_scale = lc.unit_scales(dev[4], dev[5])
    for n_real in (161, 150, 0):
        z, got = linear_kernels.head_logits(a3, row_scale, c3, col_scale, None, 1.0,
                                            max_of=(temperature.to(DEVICE), n_real))  # fmt: skip
        plan = ShardPlan(0, n_real, -100, False)
        want = launch.row_max(z, temperature.to(DEVICE), None, plan)
        got, want = got.cpu(), want.cpu()
        zero = (got == 0) & (want == 0)  # a zero max's sign is not pinned (numerics.md, 7)
        assert_bitwise_equal(torch.where(zero, 0.0, got), torch.where(zero, 0.0, want))
        if tau == 0.01 and n_real:  # the case is real: some y overflow, some maxima do not
            y = z.cpu()[:, :n_real] / 0.01
            assert torch.isposinf(y).any() and torch.isfinite(got).any(), got


@pytest.mark.parametrize("on_grid", [True, False])
def test_the_fused_route_reads_its_row_max_from_the_epilogue(monkeypatch, on_grid):
    """On the fused route the forward launches no max pass where every element is on L2's
    grid (the epilogue's row max feeds the partials pass); where a residual takes part,
    the route runs contract v2's correction and the max pass. Its outputs are the
    reference's bits either way."""
    launched = []
    real = launch.row_max
    monkeypatch.setattr(launch, "row_max", lambda *a, **k: launched.append(1) or real(*a, **k))
    h, w, t = lm_head_inputs(9, 40, 90, torch.bfloat16, seed=5)
    if on_grid:  # multiples of 2^-6 (2^-8) below 4 (2): every element on its row's grid
        h, w = ((x.float() * s).round().clamp(-250, 250) / s for x, s in ((h, 64), (w, 256)))
        h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
    else:  # an outlier channel: row 1's small elements fall off its grid
        h[1, 3] = 600.0
    q, scaled = lc.split(h, *lc.row_exponents(h))
    assert bool((q == scaled).all()) == on_grid  # every element on its row's 20-bit grid
    t.clamp_(max=84)
    triton = TritonBackend(exact_gemm="int8_fused")
    got = exactlogp.linear_selected_logprobs(h.to(DEVICE), w.to(DEVICE), t.to(DEVICE),
                                             temperature=0.8, with_entropy=True,
                                             vocab_size=85, backend=triton)  # fmt: skip
    assert launched == ([] if on_grid else [1])
    want = exactlogp.linear_selected_logprobs(h, w, t, temperature=0.8, with_entropy=True,
                                              vocab_size=85, backend="reference")  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a.cpu(), b)
    launched.clear()
    exactlogp.linear_selected_logprobs(h, w, t, temperature=0.8, vocab_size=85,
                                       backend=TritonBackend(exact_gemm="fp64"))  # fmt: skip
    assert launched == [1]  # the other routes keep their max pass


def test_class_max_kernel_gives_the_default_maxima():
    """launch.class_max (one program per row, no atomics) against Backend.class_max's
    scatter_reduce: ties, -inf and +inf logits, columns of no class, skipped columns (and
    none), a row whose every column is skipped or classless, several column steps; a zero
    max's sign aside. The default leaves z as it was."""
    from exactlogp.backends.base import Backend

    gen = torch.Generator().manual_seed(11)
    r, p, classes = 7, 300, 32
    z = torch.randn(r, p, generator=gen).round(decimals=1)  # ties
    z[1, 5], z[2, 7], z[3] = float("inf"), float("-inf"), 0.0
    z[3, 2] = -0.0
    cls = torch.randint(0, classes + 3, (p,), generator=gen, dtype=torch.int32)
    cls[:40] = 2  # a crowded class
    cls[cls == 31] = 30  # and an empty one
    skip = torch.tensor([-1, 0, 5, 299, 40, -1, 17])
    z[6] = float("nan")  # a NaN row: anything goes there
    before = z.clone()
    want = Backend().class_max(z, cls, skip, classes)
    assert torch.equal(z.view(torch.int32), before.view(torch.int32))
    got = launch.class_max(z.to(DEVICE), cls.to(DEVICE), skip.to(DEVICE), classes).cpu()
    assert_bitwise_equal(got[:6] + 0.0, want[:6] + 0.0)
    assert (want[:6] == float("-inf")).any() and (want[:6] == float("inf")).any()
    none = launch.class_max(z[:, :0].to(DEVICE), cls[:0].to(DEVICE), skip.to(DEVICE), classes)
    assert torch.equal(none.cpu(), torch.full((r, classes), float("-inf")))
