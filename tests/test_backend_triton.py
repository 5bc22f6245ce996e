"""The Triton backend gives the reference backend's bits (bitwise claims, no tolerance).

Without a GPU the kernels run on the CPU in the Triton interpreter (TRITON_INTERPRET=1, set
by conftest.py before the kernels are defined), so every case is small; with one they run on it and
are compared with the reference on the CPU. benchmarks/gpu_check.py does the same on large
shapes.
"""

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")
tl = triton.language

import exactlogp  # noqa: E402
from exactlogp import contract, testing  # noqa: E402
from exactlogp.backends import ShardPlan, get_backend  # noqa: E402
from exactlogp.backends.triton import kernels, launch, prepare  # noqa: E402
from exactlogp.temperature import ONE, Temperature  # noqa: E402

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL = launch.LaunchConfig(block_v=128, num_warps=4)  # many loop steps and a ragged tail


@pytest.fixture(scope="module")
def backends():
    tri = get_backend("triton", DEVICE)
    if DEVICE.type == "cpu" and not launch.interpreted():
        raise RuntimeError("exactlogp's Triton kernels were imported before TRITON_INTERPRET=1")
    return get_backend("reference", CPU), tri


@pytest.fixture(params=["never", "always"], ids=["direct", "tables"])
def mode(request, monkeypatch):
    """A Triton backend in one value-table mode (16-bit rows; fp32 rows stay direct), with
    groups of two rows so that the tables' row groups are exercised too."""
    from exactlogp.backends.triton import value_tables

    monkeypatch.setattr(value_tables, "GROUP_ROWS", 2)
    return launch.TritonBackend(value_tables=request.param)


def _on(device, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def _outputs_and_grad(logits, target, backend, device, seed=7, **kwargs):
    """Forward outputs and d(sum of random weights * outputs)/dlogits, on the CPU."""
    x, target = _on(device, logits, target)
    x = x.clone().requires_grad_(True)
    kwargs = {k: _on(device, v)[0] for k, v in kwargs.items()}
    res = exactlogp.selected_logprobs(x, target, backend=backend, **kwargs)
    outs = [res.logprobs, res.lse] + ([res.entropy] if res.entropy is not None else [])
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen).to(device) for o in outs]
    torch.autograd.backward(outs, weights)
    return [o.detach().cpu() for o in outs], x.grad.cpu()


def _assert_same_run(logits, target, tri="triton", **kwargs):
    """The Triton backend `tri` (a name or an object) against the reference."""
    ref_out, ref_grad = _outputs_and_grad(logits, target, "reference", CPU, **kwargs)
    tri_out, tri_grad = _outputs_and_grad(logits, target, tri, DEVICE, **kwargs)
    for name, a, b in zip(("logprobs", "lse", "entropy"), tri_out, ref_out, strict=False):
        testing.assert_bitwise_equal(a, b, name)
    testing.assert_bitwise_equal(tri_grad, ref_grad, "grad")


# --- through the public API ---


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", [False, True], ids=["lp", "entropy"])
@pytest.mark.parametrize("temperature", ["1", "0.7", "per_row"])
def test_api_bits_equal_reference(backends, mode, dtype, with_entropy, temperature):
    logits, target = testing.llm_like_logits(6, 700, dtype, seed=11)
    tau = {"1": 1.0, "0.7": 0.7, "per_row": torch.tensor([0.3, 0.7, 1.0, 1.3, 2.0, 0.9])}
    _assert_same_run(
        logits, target, tri=mode, with_entropy=with_entropy, temperature=tau[temperature]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_api_keep_mask_padding_ignore_index(backends, mode, dtype):
    logits, target = testing.llm_like_logits(5, 640, dtype, seed=12)
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(5, 640, generator=gen) > 0.3
    keep[torch.arange(5), target] = True
    target[2] = -100
    target[3] = min(int(target[3]), 599)
    keep[3, target[3]] = True
    kwargs = dict(vocab_size=600, keep_mask=keep, with_entropy=True, temperature=0.9)
    _assert_same_run(logits, target, tri=mode, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_api_nan_inf_rows_without_validation(backends, mode, dtype):
    logits, target = testing.llm_like_logits(6, 300, dtype, seed=13)
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")  # no valid column
    logits[3, ::3] = float("-inf")
    target[3] = 1
    logits[4, target[4]] = float("nan")  # the target itself
    _assert_same_run(logits, target, tri=mode, with_entropy=True, validate=False)


def test_api_huge_and_tiny_logits(backends):
    logits, target = testing.llm_like_logits(4, 200, torch.float32, seed=14)
    logits[0] *= 1e30  # y overflows to +-inf with a small temperature
    logits[1] *= 1e-39  # subnormal logits
    logits[2, :100] = -3e38
    _assert_same_run(logits, target, with_entropy=True, validate=False, temperature=0.25)
    # A large temperature drives the gradient into fp32 and bf16 subnormals.
    _assert_same_run(logits[1:], target[1:], with_entropy=True, temperature=1e36)
    _assert_same_run(logits[1:].bfloat16(), target[1:], temperature=1e36)


def test_api_invalid_per_row_temperature_gives_nan_rows(backends, mode):
    logits, target = testing.llm_like_logits(4, 150, torch.bfloat16, seed=15)
    tau = torch.tensor([0.0, -1.0, float("nan"), 0.5])
    _assert_same_run(logits, target, tri=mode, with_entropy=True, validate=False, temperature=tau)


def test_strided_rows_are_read_in_place(backends, mode):
    """logits[:, :-1, :] of (B, T + 1, V) logits (rows not evenly spaced) with a keep mask
    sliced alike: the kernels read them through two row strides, with the reference's
    bits, and the gradient reaches the unsliced leaf."""
    full, _ = testing.llm_like_logits(3 * 5, 300, torch.bfloat16, seed=21)
    full = full.view(3, 5, 300)
    gen = torch.Generator().manual_seed(22)
    target = torch.randint(0, 300, (3, 4), generator=gen)
    keep = torch.rand(3, 5, 300, generator=gen) < 0.7
    keep[:, :-1][torch.arange(3)[:, None], torch.arange(4)[None, :], target] = True
    results = []
    for backend, device in (("reference", CPU), (mode, DEVICE)):
        leaf = full.to(device).detach().requires_grad_(True)
        x, mask, t = leaf[:, :-1, :], keep.to(device)[:, :-1, :], target.to(device)
        res = exactlogp.selected_logprobs(
            x, t, keep_mask=mask, temperature=0.7, with_entropy=True, backend=backend
        )
        (res.logprobs.sum() + 0.5 * res.entropy.sum() - 0.25 * res.lse.sum()).backward()
        results.append([o.detach().cpu() for o in res] + [leaf.grad.cpu()])
    for name, a, b in zip(("logprobs", "entropy", "lse", "grad"), *results, strict=True):
        testing.assert_bitwise_equal(b, a, name)
    assert (results[1][3][:, -1] == 0).all()


def test_value_tables_hold_every_16_bit_value(backends, mode):
    """Rows holding every bf16 / fp16 bit pattern (NaN, +-inf, -0, subnormals) with
    temperatures that overflow large values to inf, a keep mask and padding: the max,
    the record and every Finalized field of the whole forward, and the gradient of the
    rows as if a gradient flowed into them (element by element over all 65536 values)."""
    ref, tri = backends[0], mode
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(2))
    for dtype in (torch.bfloat16, torch.float16):
        row = torch.cat([every[perm], every[:300]]).view(dtype)
        x = torch.stack([row, row.flip(0), row.roll(17)])
        finite = torch.isfinite(x.float())
        target = torch.stack([torch.nonzero(f)[7 + i, 0] for i, f in enumerate(finite)])
        keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) < 0.8
        keep[torch.arange(3), target] = True
        plan = ShardPlan(0, x.shape[1] - 3, -100, True)
        for tau, mask in ((torch.tensor([1.0, 0.001, 3.5]), None), (0.25, keep)):
            tau = Temperature.of(tau)
            a = tri.forward_unsharded(*_on(DEVICE, x, target, tau, mask), plan)
            b = ref.forward_unsharded(x, target, tau, mask, plan)
            for name, u, v in zip(("max", "record", "fin"), a, b, strict=True):
                for field in contract.Finalized._fields if name == "fin" else (None,):
                    got = getattr(u, field) if field else u
                    want = getattr(v, field) if field else v
                    testing.assert_bitwise_equal(got.cpu(), want, f"{dtype} {name} {field}")
            stats = contract.grad_stats(b[0], b[2], *(torch.randn(3, dtype=torch.float64)
                                                      for _ in "abc"))  # fmt: skip
            stats = stats._replace(row_nan=torch.zeros(3, dtype=torch.bool))
            got = tri.grad(*_on(DEVICE, x, target, tau, mask), contract.GradStats(
                *_on(DEVICE, *stats)), plan)  # fmt: skip
            testing.assert_bitwise_equal(got.cpu(), ref.grad(x, target, tau, mask, stats, plan))


# --- the local passes on shards: offsets, padding, masks, empty shards, split rows ---


def _row_stats(logits, target, tau, keep, vocab_size, with_entropy, seed=0, ignore_index=-100):
    """Whole-row max and GradStats (random upstream gradients), from the reference."""
    fin = testing.simulate_shards(
        logits, target, [0, logits.shape[1]], vocab_size=vocab_size, temperature=tau,
        keep_mask=keep, with_entropy=with_entropy, ignore_index=ignore_index,
    )  # fmt: skip
    plan = ShardPlan(0, vocab_size, ignore_index, with_entropy)
    row_max = get_backend("reference", CPU).row_max(logits, Temperature.of(tau), keep, plan)
    gen = torch.Generator().manual_seed(seed)
    g_lp, g_ent, g_lse = (
        torch.randn(len(target), generator=gen, dtype=torch.float64) for _ in "abc"
    )
    return contract.grad_stats(row_max, fin, g_lp, g_ent, g_lse)


def _compare_shard(
    logits, target, tau, keep, stats, lo, hi, vocab_size, with_entropy, cfg, ignore_index=-100
):
    """Every local pass of shard [lo, hi) of the padded rows, both backends, bitwise."""
    ref = get_backend("reference", CPU)
    plan = ShardPlan(lo, vocab_size, ignore_index, with_entropy)
    tau = Temperature.of(tau)
    x = logits[:, lo:hi]
    mask = None if keep is None else keep[:, lo:hi]
    dx, dtarget, dtau, dmask = _on(DEVICE, x, target, tau, mask)
    dstats = contract.GradStats(*_on(DEVICE, *stats))
    testing.assert_bitwise_equal(
        launch.row_max(dx, dtau, dmask, plan, cfg), ref.row_max(x, tau, mask, plan), "row_max"
    )
    testing.assert_bitwise_equal(
        launch.partials(dx, dtarget, dtau, dmask, dstats.row_max, plan, cfg),
        ref.partials(x, target, tau, mask, stats.row_max, plan),
        "partials",
    )
    testing.assert_bitwise_equal(
        launch.grad(dx, dtarget, dtau, dmask, dstats, plan, cfg),
        ref.grad(x, target, tau, mask, stats, plan),
        "grad",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_local_passes_on_uneven_padded_shards(backends, dtype):
    n, width, vocab_size = 7, 507, 470
    logits, _ = testing.llm_like_logits(n, width, dtype, seed=16)
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(n, width, generator=gen) > 0.2
    target = torch.tensor([3, 150, 300, 469, -100, 0, 260])
    keep[torch.arange(n), target.clamp(min=0)] = True
    keep[6, 260] = False  # a masked-out target
    logits[5, 40] = float("nan")
    tau = torch.tensor([0.5, 1.0, 1.7, 0.8, 1.0, 2.5, 0.3])
    stats = _row_stats(logits, target, tau, keep, vocab_size, True)
    # width 1, empty, across the padding, all padding; default and small blocks
    shards = [(0, 150, None), (150, 151, None), (151, 151, None), (151, 460, SMALL),
              (460, 500, None), (500, 507, SMALL)]  # fmt: skip
    for lo, hi, cfg in shards:
        _compare_shard(logits, target, tau, keep, stats, lo, hi, vocab_size, True, cfg)
    stats = _row_stats(logits, target, 0.6, None, None, False)
    _compare_shard(logits, target, 0.6, None, stats, 100, 400, None, False, SMALL)
    # ignore_index that is also a real column id: rows with that target are ignored
    stats = _row_stats(logits, target, 1.0, None, None, True, ignore_index=150)
    _compare_shard(logits, target, 1.0, None, stats, 0, 507, None, True, SMALL, ignore_index=150)


def test_rows_split_across_programs(backends, monkeypatch):
    """Several programs per row (as for few rows on a GPU) combine to the same bits."""
    monkeypatch.setattr(prepare, "target_programs", lambda device: 64)
    logits, target = testing.llm_like_logits(3, 700, torch.bfloat16, seed=17)
    keep = torch.ones(3, 700, dtype=torch.bool)
    keep[:, 1::5] = False
    keep[torch.arange(3), target] = True
    stats = _row_stats(logits, target, 0.8, keep, 650, True)
    for cfg in (None, SMALL):
        _compare_shard(logits, target, 0.8, keep, stats, 0, 700, 650, True, cfg)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="simulate_shards combines on the CPU")
def test_simulated_tp_shards_match_whole_vocab(backends, mode):
    logits, target = testing.llm_like_logits(5, 509, torch.bfloat16, seed=18)
    whole = testing.simulate_shards(logits, target, [0, 509], vocab_size=500, temperature=0.8)
    sharded = testing.simulate_shards(
        logits, target, [0, 128, 128, 300, 509], vocab_size=500, temperature=0.8, backend=mode
    )
    for name in ("logprobs", "entropy", "lse", "s_hi", "log_s", "bad"):
        testing.assert_bitwise_equal(getattr(sharded, name), getattr(whole, name), name)


def test_empty_batch_and_empty_shard(backends):
    for shape in ((0, 50), (3, 0)):
        logits = torch.randn(shape, dtype=torch.bfloat16)
        target = torch.full((shape[0],), -100)
        plan = ShardPlan(10, None, -100, True)
        ref, tri = backends
        row_max = torch.full((shape[0],), float("-inf"))
        dx, dtarget, drow_max = _on(DEVICE, logits, target, row_max)
        testing.assert_bitwise_equal(
            tri.row_max(dx, ONE, None, plan), ref.row_max(logits, ONE, None, plan), "max"
        )
        testing.assert_bitwise_equal(
            tri.partials(dx, dtarget, ONE, None, drow_max, plan),
            ref.partials(logits, target, ONE, None, row_max, plan),
            "partials",
        )


# --- the helpers, on their own: exp_c and quantize on chosen binary64 values ---


# launched as the backend launches its kernels: with FMA contraction on (Triton's default),
# a GPU build of exp_c fuses its multiply-adds and differs from the contract in the last bit
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _exp_c_kernel(d_ptr, table_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(d_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, kernels._exp_c(d, table_ptr), mask=offs < n)


@triton.jit
def _quantize_kernel(v_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    hi, lo = kernels._quantize(tl.load(v_ptr + offs, mask=offs < n, other=0.0))
    tl.store(hi_ptr + offs, hi, mask=offs < n)
    tl.store(lo_ptr + offs, lo, mask=offs < n)


@triton.jit
def _store_grad_kernel(g_ptr, out_ptr, n, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, mask=offs < n, other=0.0)
    kernels._store_grad(out_ptr, offs, offs < n, g, offs < 0, OUT_KIND)


def _rounding_cases() -> torch.Tensor:
    """fp64 values on every rounding boundary of fp64 -> fp32 -> fp16 / bf16."""
    gen = torch.Generator().manual_seed(4)
    mant = torch.randint(0, 1 << 23, (3000,), generator=gen, dtype=torch.int32)
    expo = torch.randint(0, 255, (3000,), generator=gen, dtype=torch.int32) << 23
    sign = torch.randint(0, 2, (3000,), generator=gen, dtype=torch.int32) << 31
    f32 = mant | expo | sign  # random fp32 bit patterns (subnormals included)
    ties = torch.cat([(f32 & ~0xFFFF) | 0x8000, (f32 & ~0x1FFF) | 0x1000])  # bf16, fp16 ties
    near = torch.cat([f32, ties, ties + 1, ties - 1]).view(torch.float32)
    near = near[torch.isfinite(near)].double()
    half_ulp = torch.ldexp(torch.ones(8, dtype=torch.float64), torch.tensor([-24] * 8))
    f64_ties = (1.0 + torch.arange(8) * 2.0**-23).double() + half_ulp  # fp64 -> fp32 ties
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0,
                            65520.0, -65520.0, 3.4e38, 3.5e38, 2.0**-149, 2.0**-150,
                            3 * 2.0**-151, 2.0**-24, 2.0**-25, 3 * 2.0**-26], dtype=torch.float64)  # fmt: skip
    return torch.cat([near, f64_ties, -f64_ties, special, torch.randn(500, generator=gen) * 1e-3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_rounding_to_each_dtype(backends, dtype):
    g = _rounding_cases()
    kind, bits = launch._GRAD_KIND[dtype]
    out = torch.empty(g.numel(), dtype=dtype, device=DEVICE)
    grid = (triton.cdiv(g.numel(), 1024),)
    _store_grad_kernel[grid](g.to(DEVICE), out.view(bits), g.numel(), kind, 1024, **NO_FMA)
    testing.assert_bitwise_equal(out, g.to(torch.float32).to(dtype), str(dtype))


def test_exp_c_and_quantize_on_boundary_values(backends):
    gen = torch.Generator().manual_seed(3)
    ln2_32 = torch.log(torch.tensor(2.0, dtype=torch.float64)) / 32
    ties = -(torch.arange(0, 2956, dtype=torch.float64) + 0.5) * ln2_32  # t near k + 1/2
    d = torch.cat([
        torch.tensor([0.0, -0.0, contract.CUTOFF, -1e-300, -2.0**-60]),
        ties, torch.nextafter(ties, torch.zeros_like(ties)),
        -64.0 * torch.rand(4000, generator=gen, dtype=torch.float64),
    ]).clamp(min=contract.CUTOFF)  # fmt: skip
    out = torch.empty_like(d, device=DEVICE)
    table = torch.tensor(contract.EXP2_TABLE, dtype=torch.float64, device=DEVICE)
    grid = (triton.cdiv(d.numel(), 1024),)
    _exp_c_kernel[grid](d.to(DEVICE), table, out, d.numel(), BLOCK=1024, **NO_FMA)
    testing.assert_bitwise_equal(out, contract.exp_c(d), "exp_c")
    out = out.cpu()

    k = torch.randint(0, 1 << 42, (2000,), generator=gen, dtype=torch.int64).double()
    v = torch.cat([
        torch.tensor([0.0, -0.0, 1.0, 2.0**-84, 2.0**-85, 3 * 2.0**-85, 2.0**-42]),
        k * 2.0**-42, (k + 0.5) * 2.0**-42, k * 2.0**-42 + 2.0**-85,
        torch.rand(4000, generator=gen, dtype=torch.float64), out,
    ]).clamp(max=1.0)  # fmt: skip
    hi = torch.empty_like(v, dtype=torch.int64, device=DEVICE)
    lo = torch.empty_like(hi)
    _quantize_kernel[(triton.cdiv(v.numel(), 1024),)](
        v.to(DEVICE), hi, lo, v.numel(), BLOCK=1024, **NO_FMA
    )
    ref_hi, ref_lo = contract.quantize(v)
    testing.assert_bitwise_equal(hi, ref_hi, "hi")
    testing.assert_bitwise_equal(lo, ref_lo, "lo")


# --- registry and errors ---


def test_auto_never_picks_triton_for_cpu_tensors(backends):
    assert get_backend("auto", CPU).name in ("cpu", "reference")  # even under the interpreter
    if DEVICE.type == "cuda":
        assert get_backend("auto", DEVICE).name == "triton"


def test_cpu_without_interpreter_is_a_clear_error():
    code = (
        "import torch, exactlogp\n"
        "try:\n"
        "    exactlogp.selected_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),"
        " backend='triton')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "does not support device cpu" in done.stdout
    assert "TRITON_INTERPRET=1" in done.stdout
