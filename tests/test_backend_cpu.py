"""backend="cpu" gives exactly the bits of backend="reference" (bitwise claims only).

Every comparison is torch.equal on the bit patterns (testing.assert_bitwise_equal):
forward outputs, the int64 row record, the row max and the gradients, over dtypes,
temperatures, keep masks, padding, shard offsets, empty and width-1 shards, ignored,
non-finite and bad rows, non-contiguous inputs and thread counts. Every test that takes
the `cpu` fixture runs twice: with the direct per-column loops (value_tables="never") and
with the per-value tables of 16-bit rows (value_tables="always").
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactlogp
from exactlogp import contract
from exactlogp.backends import ShardPlan, cpu_build, get_backend
from exactlogp.contract import GradStats
from exactlogp.temperature import ONE, Temperature
from exactlogp.testing import assert_bitwise_equal, bit_pattern, llm_like_logits, simulate_shards

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CPU = torch.device("cpu")


@pytest.fixture
def registered_cpu():
    """The registered CPU backend (what backend="cpu" runs), as it is configured."""
    try:
        return get_backend("cpu", CPU)
    except ValueError as exc:
        if "no C compiler found" not in str(exc):
            raise  # a compiler that fails to build the kernels is a failure, not a skip
        pytest.skip(str(exc))  # no C compiler on this machine: only the reference runs


@pytest.fixture(params=["never", "always"], ids=["direct", "tables"])
def cpu(request, registered_cpu):
    """The registered CPU backend in one value-table mode."""
    return registered_cpu.with_options(value_tables=request.param)


def test_the_kernels_build_wherever_there_is_a_compiler():
    try:
        cpu_build.find_compiler()
    except cpu_build.CpuBuildError as exc:
        pytest.skip(str(exc))
    assert get_backend("cpu", CPU).name == "cpu"


@pytest.fixture(scope="module")
def ref():
    return get_backend("reference", CPU)


# --- the compiled library ---


def test_compiled_constants_are_contract_constants(cpu):
    compiled = cpu_build.compiled_constants(cpu._lib)
    expected = cpu_build.expected_constants()
    assert [v.hex() for v in compiled] == [v.hex() for v in expected]
    assert expected[:2] == [contract.CUTOFF, contract.MAGIC]
    tables = len(contract.EXP2_TABLE) + len(contract.EXP_POLY) + len(contract.LOG_POLY)
    assert len(expected) == 11 + tables + 17


def test_header_is_generated_from_contract():
    header = cpu_build.constants_header()
    assert f"#define ELP_MAGIC ({contract.MAGIC.hex()})" in header
    assert f"#define ELP_LN2_32_LO ({contract.LN2_32_LO.hex()})" in header
    assert contract.EXP2_TABLE[31].hex() in header


def _disassembly(path: Path) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed")
    return subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True).stdout


# The products the kernels may fuse into an FMA, each exact: kd (-LN2_32_HI) with |kd| < 2^12
# and 39 significant bits in LN2_32_HI; (s - hi) 2^42, a power of two. Adding a use of
# exact_product_add means proving its product exact and naming it here.
_EXACT_PRODUCTS = {"splatd(-ELP_LN2_32_HI)", "splatd(ELP_LIMB_SCALE)"}
_FMA_INTRINSIC = r"_mm\d*_f\w*(add|sub)_p[sd]|__builtin_fma|\bfmaf?\("
_FMA_INSTRUCTION = r"\bvf\w*(add|sub)\w*"


def _kernel_source() -> str:
    return (Path(cpu_build.__file__).parent / "csrc" / cpu_build.SOURCE_NAME).read_text()


def test_fma_is_written_only_where_the_product_is_exact():
    """The source writes FMA only in exact_product_add, and its callers multiply by the
    constants of _EXACT_PRODUCTS."""
    source = _kernel_source()
    start = source.index("ELP_INLINE vd exact_product_add(")
    end = source.index("\n}\n", start)
    assert re.search(_FMA_INTRINSIC, source[start:end])
    outside = source[:start] + source[end:]
    assert not re.search(_FMA_INTRINSIC, outside)
    calls = re.findall(r"exact_product_add\([^,]+, ([^,]+), ", outside)
    assert len(calls) == 3 and set(calls) == _EXACT_PRODUCTS, calls


def test_the_compiler_fuses_nothing_itself(tmp_path):
    """Built for AVX2 (-mfma) with exact_product_add's FMA branches taken out, the library
    has no FMA instruction: every other + - * stays the single IEEE operation."""
    source = _kernel_source().replace("defined(__FMA__)", "0")
    assert _kernel_source().count("defined(__FMA__)") == 2  # both FMA branches go
    out = tmp_path / "no_fma.so"
    try:
        cpu_build._compile(
            cpu_build.find_compiler(), source, cpu_build.constants_header(), "avx2", out
        )
    except cpu_build.CpuBuildError as exc:  # not x86-64, or no compiler
        pytest.skip(f"no AVX2 build here: {str(exc)[:200]}")
    assert "-mfma" in cpu_build.ISA_FLAGS["avx2"] and "-ffp-contract=off" in cpu_build.CFLAGS
    assert not re.search(_FMA_INSTRUCTION, _disassembly(out))


def test_compiled_code_fma_only_in_simd_builds_and_uses_256_bit_vectors(registered_cpu):
    cpu = registered_cpu  # the listing is the library's, whatever the value-table mode
    code = _disassembly(cpu_build.build())
    if cpu.uses_avx2:  # exact_product_add's FMA, packed doubles, a*b + c only
        fused = {m.group(0) for m in re.finditer(_FMA_INSTRUCTION, code)}
        assert fused and all(re.fullmatch(r"vfmadd\d{3}pd", op) for op in fused), fused
    assert not re.search(_FMA_INSTRUCTION, _disassembly(cpu_build.build("baseline")))
    if cpu.uses_avx2:  # the AVX2 copies do the fp64 work four lanes at a time
        assert "ymm" in code and "vdivpd" in code


def test_auto_picks_cpu_on_cpu(cpu):
    assert get_backend("auto", CPU) is get_backend("cpu", CPU)
    assert cpu.supports(torch.device("cpu")) and not cpu.supports(torch.device("meta"))


def test_without_a_compiler_cpu_says_why_and_auto_falls_back(tmp_path):
    script = (
        "import torch, exactlogp\n"
        "from exactlogp.backends import get_backend\n"
        "assert get_backend('auto', torch.device('cpu')).name == 'reference'\n"
        "try:\n"
        "    exactlogp.selected_logprobs(torch.zeros(1, 4), torch.tensor([0]), backend='cpu')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), EXACTLOGP_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "backend='cpu' is not available" in run.stdout
    assert "no C compiler found" in run.stdout


def test_isa_override_is_checked(monkeypatch):
    monkeypatch.setenv("EXACTLOGP_CPU_ISA", "avx9000")
    with pytest.raises(cpu_build.CpuBuildError, match="EXACTLOGP_CPU_ISA"):
        cpu_build.default_isa()
    monkeypatch.setenv("EXACTLOGP_CPU_ISA", "baseline")
    assert cpu_build.default_isa() == "baseline"
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_build.build("avx9000")


def test_num_threads_is_checked():
    from exactlogp.backends.cpu import CpuBackend

    with pytest.raises(ValueError, match="num_threads"):
        CpuBackend(num_threads=0)
    with pytest.raises(ValueError, match="value_tables.*'sometimes'"):
        CpuBackend(value_tables="sometimes")


# --- end to end through the public API: outputs and gradients ---


def _case(name: str, dtype: torch.dtype, num_rows: int = 7, vocab: int = 507, seed: int = 0):
    """(logits, target, keyword arguments) of a named case."""
    x, target = llm_like_logits(num_rows, vocab, dtype, seed=seed)
    kw: dict = {}
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "scalar_temperature":
        kw["temperature"] = 0.7
    elif name == "row_temperature":
        kw["temperature"] = 0.25 + 2.0 * torch.rand(num_rows, generator=gen)
        kw["temperature"][0] = 1.0
    elif name == "keep_mask":
        keep = torch.rand(num_rows, vocab, generator=gen) < 0.3
        keep[torch.arange(num_rows), target] = True
        kw["keep_mask"] = keep
    elif name == "padding":
        kw["vocab_size"] = vocab - 11
        target = target.clamp(max=vocab - 12)
    elif name == "ignored_rows":
        target[::3] = -100
    elif name == "nonfinite":  # NaN, +inf, -inf, all -inf, a bad target; validate=False
        x[0, 5] = float("nan")
        x[1, 9] = float("inf")
        x[2, :] = float("-inf")
        x[3, ::2] = float("-inf")
        target[3] = 4
        target[4] = vocab + 3
        x[5, target[5]] = float("nan")
        kw["validate"] = False
    elif name == "row_temperature_bad":  # bad temperatures, in kept and in ignored rows
        tau = torch.ones(num_rows)
        tau[0], tau[1], tau[2], tau[3] = 0.0, -2.0, float("nan"), float("inf")
        target[2] = target[3] = -100
        kw.update(temperature=tau, validate=False)
    return x, target, kw


CASES = (
    "plain", "scalar_temperature", "row_temperature", "keep_mask", "padding",
    "ignored_rows", "nonfinite", "row_temperature_bad",
)  # fmt: skip


def _forward_backward(x, target, kw, backend, with_entropy, seed=3):
    x = x.detach().clone().requires_grad_(True)
    res = exactlogp.selected_logprobs(x, target, backend=backend, with_entropy=with_entropy, **kw)
    outs = [res.logprobs, res.lse] + ([res.entropy] if with_entropy else [])
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen) for o in outs]
    (grad,) = torch.autograd.grad(outs, x, ups)
    return [o.detach() for o in outs], grad


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprob", "entropy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_api_forward_and_backward_match_reference(cpu, name, dtype, with_entropy):
    x, target, kw = _case(name, dtype)
    outs_c, grad_c = _forward_backward(x, target, kw, cpu, with_entropy)
    outs_r, grad_r = _forward_backward(x, target, kw, "reference", with_entropy)
    for what, a, b in zip(("logprobs", "lse", "entropy"), outs_c, outs_r, strict=False):
        assert_bitwise_equal(a, b, f"{name} {what}")
    assert_bitwise_equal(grad_c, grad_r, f"{name} grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (5, 9), (2, 8), (4, 17), (0, 5)])
def test_small_shapes_match_reference(cpu, dtype, shape):
    x, target = llm_like_logits(max(shape[0], 1), shape[1], dtype, seed=shape[1])
    x, target = x[: shape[0]], target[: shape[0]]
    outs_c, grad_c = _forward_backward(x, target, {}, cpu, True)
    outs_r, grad_r = _forward_backward(x, target, {}, "reference", True)
    for a, b in zip(outs_c, outs_r, strict=True):
        assert_bitwise_equal(a, b, f"{shape}")
    assert_bitwise_equal(grad_c, grad_r, f"{shape} grad")


def test_non_contiguous_inputs_are_read_not_changed(cpu):
    base, target = llm_like_logits(6, 520, torch.bfloat16, seed=4)
    keep_base = torch.rand(6, 520, generator=torch.Generator().manual_seed(2)) < 0.5
    keep_base[torch.arange(6), target] = True
    inputs = {
        "column slice": (base[:, :507], keep_base[:, :507]),
        "transposed storage": (base.t().contiguous().t(), keep_base.t().contiguous().t()),
    }
    target = target.clamp(max=506)
    keep_base[torch.arange(6), target] = True
    for what, (x, keep) in inputs.items():
        before = x.clone()
        outs_c, grad_c = _forward_backward(x, target, {"keep_mask": keep}, cpu, True)
        outs_r, grad_r = _forward_backward(x, target, {"keep_mask": keep}, "reference", True)
        for a, b in zip(outs_c, outs_r, strict=True):
            assert_bitwise_equal(a, b, what)
        assert_bitwise_equal(grad_c, grad_r, f"{what} grad")
        assert_bitwise_equal(x, before, f"{what} input unchanged")


def test_strided_rows_are_read_in_place(cpu):
    """logits[:, :-1, :] of (B, T + 1, V) logits, whose rows are not evenly spaced: the
    kernels read them where they are (no copy of the logits) with the reference's bits,
    forward and backward, and a keep mask sliced alike."""
    from exactlogp.backends.base import row_view

    full, _ = llm_like_logits(3 * 6, 20000, torch.bfloat16, seed=23)
    full = full.view(3, 6, 20000)
    gen = torch.Generator().manual_seed(24)
    target = torch.randint(0, 20000, (3, 5), generator=gen)
    keep = torch.rand(3, 6, 20000, generator=gen) < 0.8
    keep[:, :-1][torch.arange(3)[:, None], torch.arange(5)[None, :], target] = True
    rows = row_view(full[:, :-1, :])
    assert rows.dim() == 3 and rows.data_ptr() == full.data_ptr()
    shard, alive = cpu._shard(rows, ONE, None, ShardPlan(0, None, -100, False), "forward")
    assert alive[0].data_ptr() == full.data_ptr()  # read in place
    results = []
    for backend in (cpu, "reference"):
        leaf = full.clone().requires_grad_(True)
        res = exactlogp.selected_logprobs(
            leaf[:, :-1, :], target, keep_mask=keep[:, :-1, :], temperature=0.7,
            with_entropy=True, backend=backend,
        )  # fmt: skip
        (res.logprobs.sum() + 0.5 * res.entropy.sum() - 0.25 * res.lse.sum()).backward()
        results.append([o.detach() for o in res] + [leaf.grad])
    for name, a, b in zip(("logprobs", "entropy", "lse", "grad"), *results, strict=True):
        assert_bitwise_equal(a, b, name)
    assert (results[0][3][:, -1] == 0).all()


# --- the three passes directly, on shards with offsets, padding and nothing at all ---


def _stats_for(fin: contract.Finalized, seed: int) -> GradStats:
    gen = torch.Generator().manual_seed(seed)
    n = fin.s_hi.shape[0]
    g_lp, g_ent, g_lse = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3))
    return contract.grad_stats(None, fin, g_lp, g_ent, g_lse)


def _compare_shards(cpu, ref, x, target, boundaries, **kw):
    """Record, max and finalize through simulate_shards, then every shard's gradient."""
    fin_c = simulate_shards(x, target, boundaries, backend=cpu, **kw)
    fin_r = simulate_shards(x, target, boundaries, backend="reference", **kw)
    for field in contract.Finalized._fields:
        assert_bitwise_equal(getattr(fin_c, field), getattr(fin_r, field), field)
    tau = Temperature.of(kw.get("temperature", 1.0))
    keep = kw.get("keep_mask")
    plan_kw = dict(vocab_size=kw.get("vocab_size"), ignore_index=-100)
    for with_entropy in (False, True):
        row_max = ref.row_max(x, tau, keep, ShardPlan(0, with_entropy=with_entropy, **plan_kw))
        stats = _stats_for(fin_r, seed=len(boundaries))._replace(row_max=row_max)
        for lo, hi in zip(boundaries[:-1], boundaries[1:], strict=False):
            plan = ShardPlan(lo, with_entropy=with_entropy, **plan_kw)
            mask = None if keep is None else keep[:, lo:hi]
            args = (x[:, lo:hi], target, tau, mask, stats, plan)
            assert_bitwise_equal(cpu.grad(*args), ref.grad(*args), f"grad of [{lo}, {hi})")
            local_max = (x[:, lo:hi], tau, mask, plan)
            assert_bitwise_equal(cpu.row_max(*local_max), ref.row_max(*local_max), "max")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uneven_width_one_and_empty_shards(cpu, ref, dtype):
    x, target = llm_like_logits(9, 507, dtype, seed=7)
    target[2] = -100
    for boundaries in ([0, 200, 200, 201, 507], [0, 0, 1, 506, 507], [0, 507, 507]):
        _compare_shards(cpu, ref, x, target, boundaries)


def test_shards_with_padding_mask_and_row_temperature(cpu, ref):
    x, target = llm_like_logits(8, 512, torch.bfloat16, seed=8)
    target = target.clamp(max=506)
    keep = torch.rand(8, 512, generator=torch.Generator().manual_seed(3)) < 0.6
    keep[torch.arange(8), target] = True
    tau = 0.5 + torch.rand(8, generator=torch.Generator().manual_seed(4))
    kw = dict(vocab_size=507, keep_mask=keep, temperature=tau, with_entropy=True)
    # the last shard is all padding: [507, 512) holds no vocabulary
    _compare_shards(cpu, ref, x, target, [0, 130, 131, 507, 512], **kw)
    _compare_shards(cpu, ref, x, target, [0, 256, 512], **kw)


def test_row_length_past_the_exact_float_flush(cpu, ref):
    """Rows longer than one flush of the integer-valued double sums (8192 columns), with
    every term as large as it can be, keep the int64 sums exact."""
    x = torch.zeros(2, 20000, dtype=torch.float32)
    x[1, ::2] = -0.5
    target = torch.tensor([0, 1])
    plan = ShardPlan(0, None, -100, True)
    m = ref.row_max(x, ONE, None, plan)
    assert_bitwise_equal(cpu.partials(x, target, ONE, None, m, plan),
                         ref.partials(x, target, ONE, None, m, plan), "record")  # fmt: skip


def _assert_fused_equal(cpu, ref, x, target, tau, keep, plan):
    """The fused forward's row max and record through `cpu` equal the reference's;
    returns (cpu's, reference's) results."""
    tau = Temperature.of(tau)
    fused = cpu.forward_unsharded(x, target, tau, keep, plan)
    expected = ref.forward_unsharded(x, target, tau, keep, plan)
    assert_bitwise_equal(fused[0], expected[0], "fused row max")
    assert_bitwise_equal(fused[1], expected[1], "fused record")
    return fused, expected


def _build(isa: str, value_tables: str, **kw):
    """A CpuBackend of one build: "native" (this CPU's best), "avx2" (skipped on a CPU
    without it) or "baseline"."""
    from exactlogp.backends.cpu import CpuBackend

    if isa == "avx2" and cpu_build.default_isa() == "baseline":
        pytest.skip("this CPU has no AVX2")
    return CpuBackend(isa=None if isa == "native" else isa, value_tables=value_tables, **kw)


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprob", "entropy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_record_of_every_pass_with_and_without_entropy(cpu, ref, dtype, with_entropy, isa):
    """The whole int64 record -- W_HI and W_LO are zero without entropy -- of partials and
    of the fused forward, on rows long enough for several flushes of the sums, with and
    without a keep mask (whole steps and masked steps), a temperature and a short last
    step (20003 columns), on every build (AVX-512, AVX2, portable)."""
    cpu = _build(isa, cpu.value_tables)
    x, target = llm_like_logits(3, 20003, dtype, seed=11)
    keep = torch.rand(3, 20003, generator=torch.Generator().manual_seed(12)) < 0.7
    keep[torch.arange(3), target] = True
    plan = ShardPlan(0, None, -100, with_entropy)
    for tau, mask in ((ONE, None), (Temperature.of(0.8), keep)):
        m = ref.row_max(x, tau, mask, plan)
        expected = ref.partials(x, target, tau, mask, m, plan)
        assert_bitwise_equal(cpu.partials(x, target, tau, mask, m, plan), expected, "record")
        _, fused, _ = cpu.forward_unsharded(x, target, tau, mask, plan)
        assert_bitwise_equal(fused, expected, "fused record")
        if not with_entropy:
            assert not expected[:, contract.COL_W_HI : contract.COL_W_LO + 1].any()


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_forward_counts_every_non_finite_column(cpu, ref, dtype, isa):
    """The fused forward skips counting NaN / +inf columns in the whole steps of a row
    whose max pass saw none: rows with one NaN or one +inf in a whole step or in the last
    (short) step, several of them, a masked-out NaN, -inf only (not counted), and none;
    the record's count column and the rest match the reference on every build. So does
    the row max of a TP shard's pass (a NaN or +inf takes the max pass back to max_step)."""
    cpu = _build(isa, cpu.value_tables)
    width = 5003  # the last step is short on every build
    x, target = llm_like_logits(8, width, dtype, seed=21)
    nan, inf = float("nan"), float("inf")
    x[0, 1000] = nan  # a whole step
    x[1, 2001] = inf
    x[2, width - 2] = nan  # the last step
    x[3, width - 1] = inf
    x[4, 7::500] = nan
    x[4, 9::700] = inf
    x[5, 300] = nan  # masked out below
    x[6, 40::3] = -inf
    keep = torch.ones(8, width, dtype=torch.bool)
    keep[5, 300] = False
    target = target.clamp(max=width - 3)
    plan = ShardPlan(0, None, -100, False)
    for mask, bad_rows in ((None, 6), (keep, 5)):
        _, expected = _assert_fused_equal(cpu, ref, x, target, 1.0, mask, plan)
        shard_max = cpu.row_max(x, ONE, mask, plan)
        assert_bitwise_equal(shard_max, ref.row_max(x, ONE, mask, plan), "row max")
        assert_bitwise_equal(shard_max, expected[0], "row max and fused row max")
        counted = (expected[1][:, contract.COL_NONFINITE] != 0).tolist()
        assert counted == [True] * bad_rows + [False] * (8 - bad_rows)


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_forward_at_the_cutoff(cpu, ref, dtype, isa):
    """The fused forward compares no lane against CUTOFF in the whole steps of a row whose
    smallest y is at most -CUTOFF below its max: rows whose smallest d is exactly CUTOFF
    (a term), the next value below it (not a term; it would quantize to 0 either way), a
    -inf column and one 30000 below the max (neither may reach exp_c: its result there
    is not a small number), positive values 30000 below the max (the value tables list
    them first, so they are in a whole step there, where the most negative values of the
    other rows are in the last), and a temperature that moves a row across; each matches
    the reference on every build."""
    cpu = _build(isa, cpu.value_tables)
    width = 4099
    x, target = llm_like_logits(6, width, torch.float32, seed=23)
    x = x.clamp(-40.0, 20.0)
    x[:, 0] = 20.0  # the max: d of a column is y - 20
    x[0, 2000] = 20.0 + contract.CUTOFF  # d = CUTOFF exactly: a term
    x[2, 2000] = -float("inf")
    x[3, 2000] = -60.0  # d = -80 at tau 1, -40 at tau 2
    x[4, 2000] = -30000.0
    x[5] = x[5].abs() + 1.0
    x[5, 0] = 30000.0
    x = x.to(dtype)
    edge = torch.tensor(20.0 + contract.CUTOFF, dtype=dtype)
    x[1, 2000] = torch.nextafter(edge, torch.tensor(-1e9, dtype=dtype))  # the next one down
    plan = ShardPlan(0, None, -100, False)
    for tau in (1.0, 2.0, torch.tensor([1.0, 1.0, 1.0, 2.0, 0.5, 1.0])):
        _assert_fused_equal(cpu, ref, x, target, tau, None, plan)


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
def test_fp32_rows_of_bf16_values_and_nearly(cpu, ref, isa):
    """fp32 rows are checked for bf16 values on their first 64 columns, and the rest as
    they are counted by their high halves: rows all bf16, one with a single value that is
    not bf16 late in the row (it is counted, then goes to the direct loops), the same
    value in a masked-out column, one in the first 64 columns, and one in the last
    column. Each matches the reference, in partials and the fused forward, on every
    build."""
    cpu = _build(isa, cpu.value_tables)
    width = 20000
    x, target = llm_like_logits(5, width, torch.bfloat16, seed=31)
    x = x.float()
    off = 1.0 + 2.0**-20  # not a bf16 value
    x[1, 15000] = off
    x[2, 15000] = off
    x[3, 10] = off
    x[4, width - 1] = off
    keep = torch.ones(5, width, dtype=torch.bool)
    keep[2, 15000] = False
    keep[torch.arange(5), target] = True
    plan = ShardPlan(0, None, -100, True)
    for mask in (None, keep):
        m = ref.row_max(x, ONE, mask, plan)
        expected = ref.partials(x, target, ONE, mask, m, plan)
        assert_bitwise_equal(cpu.partials(x, target, ONE, mask, m, plan), expected, "record")
        fused = cpu.forward_unsharded(x, target, ONE, mask, plan)
        assert_bitwise_equal(fused[0], m, "fused row max")
        assert_bitwise_equal(fused[1], expected, "fused record")


# --- value tables: counts, many distinct values, the automatic choice ---


def _passes(backend, x, target, tau, keep, plan, seed=0, nan_rows=True):
    """(row max, record, gradient) of one shard through `backend`'s three passes;
    nan_rows=False computes the gradient of rows that finalize flagged bad too."""
    tau = Temperature.of(tau)
    m = backend.row_max(x, tau, keep, plan)
    record = backend.partials(x, target, tau, keep, m, plan)
    fin = contract.finalize(m, record, target, plan.vocab_size, -100, None)
    stats = _stats_for(fin, seed=seed)._replace(row_max=m)
    if not nan_rows:
        stats = stats._replace(row_nan=torch.zeros_like(stats.row_nan))
    return m, record, backend.grad(x, target, tau, keep, stats, plan)


def _assert_passes_equal(a, b, what):
    for name, u, v in zip(("row max", "record", "grad"), a, b, strict=True):
        assert_bitwise_equal(u, v, f"{what}: {name}")


def test_value_counts_multiply_exactly(cpu, ref):
    """One value in every column (count 20000, each term e = 1, the largest limb), a row
    of two values, and rows whose maximum is repeated: the count-weighted integer sums
    are the per-column sums."""
    x = torch.zeros(4, 20000, dtype=torch.bfloat16)
    x[1, ::2] = -0.5
    x[2] = torch.randn(20000, generator=torch.Generator().manual_seed(1)).round()
    x[3, :] = -30.0
    x[3, 7::1000] = 2.0
    target = torch.tensor([0, 1, 5, 7])
    plan = ShardPlan(0, None, -100, True)
    _assert_passes_equal(_passes(cpu, x, target, 1.0, None, plan),
                         _passes(ref, x, target, 1.0, None, plan), "repeated values")  # fmt: skip


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_counts_at_and_past_the_uint16_wrap(cpu, ref, dtype, isa):
    """The tables count in uint16 first; a value in 65536 columns (its count wraps to 0),
    in every column, in 65535 columns, and 65536 kept columns of a value that fills more:
    every row is counted again in uint32 where it must be, and matches the reference (fp32
    rows here hold bf16 values, so they take the tables too). Each build's listing of the
    counts (AVX-512, AVX2, portable) runs."""
    cpu = _build(isa, cpu.value_tables)
    width = 70000
    gen = torch.Generator().manual_seed(8)
    noise = torch.randn(4, width, generator=gen).round() - 3.0
    x = noise.clone()
    x[0, :65536] = 1.5
    x[1, :] = -0.25
    x[2, :65535] = 0.75
    x[3, :] = 2.0
    x = x.to(dtype)
    keep = torch.ones(4, width, dtype=torch.bool)
    keep[3, 65536:] = False  # row 3: its value kept in exactly 65536 columns
    target = torch.tensor([1, 2, 3, 4])
    plan = ShardPlan(0, None, -100, True)
    for mask in (None, keep):
        _assert_passes_equal(_passes(cpu, x, target, 1.0, mask, plan),
                             _passes(ref, x, target, 1.0, mask, plan), f"{dtype} wrap")  # fmt: skip
        fused, expected = _assert_fused_equal(cpu, ref, x, target, 1.0, mask, plan)
        for field in contract.Finalized._fields:
            assert_bitwise_equal(getattr(fused[2], field), getattr(expected[2], field), field)


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
def test_fp16_value_counts_at_and_past_the_uint8_wrap(ref, isa):
    """fp16 rows are counted in uint8 first: a value in 255, 256, 257 and 512 columns (a
    count of 256 wraps to 0), and one kept in exactly 256 of its 300 columns; the row is
    counted again in uint16, and so are the thread's next 64 rows at once (rows 1-64
    here), then uint8 again (rows 65-69, row 67 wraps again). Every row matches the
    reference, with and without the keep mask, in the passes and the fused forward, on
    each build's listing of the counts (one thread: the rows run in order)."""
    cpu = _build(isa, "always", num_threads=1)
    n_rows, width = 70, 3000
    x, target = llm_like_logits(n_rows, width, torch.float16, seed=13)
    repeats = {0: (256, 1.5), 3: (255, 2.0), 30: (257, -1.25), 64: (512, 0.5), 67: (256, 3.0)}
    for row, (count, value) in repeats.items():
        x[row, 100 : 100 + count] = value
    keep = torch.ones(n_rows, width, dtype=torch.bool)
    x[5, 200:500] = 0.375
    keep[5, 200:244] = False  # row 5: 0.375 kept in exactly 256 columns
    keep[torch.arange(n_rows), target] = True
    plan = ShardPlan(0, None, -100, True)
    for mask in (None, keep):
        _assert_passes_equal(_passes(cpu, x, target, 1.0, mask, plan),
                             _passes(ref, x, target, 1.0, mask, plan), f"uint8 wrap {isa}")  # fmt: skip
        _assert_fused_equal(cpu, ref, x, target, 1.0, mask, plan)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_tables_on_rows_of_one_sign_one_value_and_extreme_magnitudes(cpu, ref, dtype):
    """Rows whose values fill few, far-apart slots of the value table: one sign only, one
    value, +-0 only, a narrow band, both ends of the magnitudes (subnormal and +-inf, NaN),
    small values of both signs. The fused forward (its max from the listed values) and the
    three passes both match the reference."""
    width = 3000
    gen = torch.Generator().manual_seed(5)
    band = 1.0 + torch.rand(width, generator=gen)  # [1, 2): one binade
    rows = [
        -band,  # negative only
        band * 8.0,  # positive only
        torch.full((width,), -3.25),  # one value
        torch.where(torch.arange(width) % 2 == 0, 0.0, -0.0),  # +0 and -0 only
        torch.cat([band[:-4] * 1e-3, torch.tensor([1e-40, -float("inf"), float("inf"), -2.0])]),
        torch.cat([-band[:-1] * 1e-30, torch.tensor([float("nan")])]),
        torch.randn(width, generator=gen) * 1e-3,  # both signs, small magnitudes
    ]
    x = torch.stack(rows).to(dtype)
    target = torch.arange(len(rows)) * 7
    kw = {"validate": False}
    outs_c, grad_c = _forward_backward(x, target, kw, cpu, True)
    outs_r, grad_r = _forward_backward(x, target, kw, "reference", True)
    for what, a, b in zip(("logprobs", "lse", "entropy"), outs_c, outs_r, strict=True):
        assert_bitwise_equal(a, b, f"{dtype} {what}")
    assert_bitwise_equal(grad_c, grad_r, f"{dtype} grad")
    plan = ShardPlan(0, None, -100, True)
    _assert_passes_equal(_passes(cpu, x, target, 1.0, None, plan),
                         _passes(ref, x, target, 1.0, None, plan), f"{dtype} ranges")  # fmt: skip


def test_every_fp16_value_in_one_row(cpu, ref):
    """A row holding all 65536 fp16 bit patterns (NaNs, infinities, subnormals, -0) plus
    more columns, with temperatures that overflow large values to inf. Such rows are bad
    (their gradient is NaN), so backward is also run as if they were not, to compare a
    table of all 65536 values element by element."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(2))
    row = torch.cat([every[perm], every[:4464]])
    x = torch.stack([row, row.flip(0), row.roll(17)])
    finite = torch.isfinite(x.float())
    target = torch.stack([torch.nonzero(f)[7 + i, 0] for i, f in enumerate(finite)])
    tau = torch.tensor([1.0, 0.001, 3.5])
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) < 0.8
    keep[torch.arange(3), target] = True
    for kw in ({"tau": tau, "keep": None}, {"tau": 0.25, "keep": keep}):
        plan = ShardPlan(0, 70000 - 3, -100, True)
        for nan_rows in (True, False):
            a = _passes(cpu, x, target, kw["tau"], kw["keep"], plan, nan_rows=nan_rows)
            b = _passes(ref, x, target, kw["tau"], kw["keep"], plan, nan_rows=nan_rows)
            _assert_passes_equal(a, b, f"every fp16 value, nan_rows={nan_rows}")
            finite = torch.isfinite(a[2].float()).sum(-1)
            assert (finite > 60000).all() if not nan_rows else (finite == 0).all()
        _assert_unsharded_equal(cpu, ref, x, target, kw["tau"], kw["keep"], plan, "every fp16")


def _assert_unsharded_equal(cpu, ref, x, target, tau, keep, plan, what):
    """The fused whole-vocabulary forward: row max, record and every Finalized field."""
    tau = Temperature.of(tau)
    a = cpu.forward_unsharded(x, target, tau, keep, plan)
    b = ref.forward_unsharded(x, target, tau, keep, plan)
    assert_bitwise_equal(a[0], b[0], f"{what}: row max")
    assert_bitwise_equal(a[1], b[1], f"{what}: record")
    for field in contract.Finalized._fields:
        assert_bitwise_equal(getattr(a[2], field), getattr(b[2], field), f"{what}: {field}")


def test_auto_value_tables_match_reference_on_long_rows(ref):
    """The default mode on rows past every TABLE_MIN_COLS_BY_PASS threshold, for each dtype and
    for fp32 rows whose values are all exactly bf16 (read through the bf16 tables)."""
    from exactlogp.backends.cpu import TABLE_MIN_COLS_BY_PASS, CpuBackend

    auto = CpuBackend(value_tables="auto")
    cols = max(v for per_dtype in TABLE_MIN_COLS_BY_PASS.values() for v in per_dtype.values())
    for dtype in (*DTYPES, "bf16 as fp32"):
        bf16_as_fp32 = dtype == "bf16 as fp32"
        x, target = llm_like_logits(3, cols + 5, torch.bfloat16 if bf16_as_fp32 else dtype, 12)
        x = x.float() if bf16_as_fp32 else x
        plan = ShardPlan(0, cols + 1, -100, True)
        target = target.clamp(max=cols)
        _assert_passes_equal(_passes(auto, x, target, 0.8, None, plan),
                             _passes(ref, x, target, 0.8, None, plan), str(dtype))  # fmt: skip
        _assert_unsharded_equal(auto, ref, x, target, 0.8, None, plan, str(dtype))


def test_fp32_rows_of_bf16_values_take_the_bf16_tables(cpu, ref):
    """fp32 rows whose values are all exactly bf16 (as after bf16_logits.float()) are
    counted by their high halves; NaN, +-inf, -0, subnormals, keep masks, padding and
    per-row temperatures included. One row holds a single value that is not bf16 (it
    takes the direct loops), and its neighbours do not."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    bf16 = every.view(torch.bfloat16)
    perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(4))
    rows = torch.stack([bf16[perm], bf16.flip(0), bf16.roll(7)]).float()
    x, target = llm_like_logits(4, 65536, torch.bfloat16, seed=5)
    x = torch.cat([rows, x.float()])
    x[4, 1000] = 1.0 + 2**-20  # not a bf16 value: this row goes column by column
    finite = torch.isfinite(x)
    target = torch.stack([torch.nonzero(f)[11 + i, 0] for i, f in enumerate(finite)])
    tau = 0.5 + torch.rand(7, generator=torch.Generator().manual_seed(6))
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(7)) < 0.9
    keep[torch.arange(7), target] = True
    target = target.clamp(max=65000)
    for t, k in ((tau, None), (0.75, keep), (1.0, None)):
        plan = ShardPlan(0, 65001, -100, True)
        for nan_rows in (True, False):
            _assert_passes_equal(_passes(cpu, x, target, t, k, plan, nan_rows=nan_rows),
                                 _passes(ref, x, target, t, k, plan, nan_rows=nan_rows),
                                 f"bf16 values in fp32, nan_rows={nan_rows}")  # fmt: skip
        _assert_unsharded_equal(cpu, ref, x, target, t, k, plan, "bf16 values in fp32")


# --- threads ---


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value_tables", ["never", "always"])
def test_one_thread_and_many_threads_give_the_same_bits(ref, value_tables, dtype):
    """Every pass, and the fused forward, whose threads claim their next rows early and
    prefetch them (64 rows: enough for the look-ahead at every thread count here)."""
    from exactlogp.backends.cpu import CpuBackend

    x, target = llm_like_logits(64, 4099, dtype, seed=9)
    keep = torch.rand(64, 4099, generator=torch.Generator().manual_seed(1)) < 0.9
    keep[torch.arange(64), target] = True
    plan = ShardPlan(0, None, -100, True)
    tau = Temperature.of(0.9)
    results = []
    for threads in (1, 2, 3, 8):
        b = CpuBackend(num_threads=threads, value_tables=value_tables)
        m = b.row_max(x, tau, keep, plan)
        record = b.partials(x, target, tau, keep, m, plan)
        fin = contract.finalize(m, record, target, None, -100, None)
        stats = _stats_for(fin, seed=0)._replace(row_max=m)
        m_fused, record_fused, fin_fused = b.forward_unsharded(x, target, tau, keep, plan)
        results.append(
            (m, record, b.grad(x, target, tau, keep, stats, plan), m_fused, record_fused,
             *fin_fused)
        )  # fmt: skip
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_bitwise_equal(a, b, "threads")
    m_ref = ref.row_max(x, tau, keep, plan)
    record_ref = ref.partials(x, target, tau, keep, m_ref, plan)
    assert_bitwise_equal(results[0][1], record_ref, "ref")
    assert_bitwise_equal(results[0][3], m_ref, "fused row max")
    assert_bitwise_equal(results[0][4], record_ref, "fused record")
    fin_ref = contract.finalize(m_ref, record_ref, target, None, -100, None)
    for field, got in zip(contract.Finalized._fields, results[0][5:], strict=True):
        assert_bitwise_equal(got, getattr(fin_ref, field), field)


_FORK_SCRIPT = """
import os, sys, torch, exactlogp
from exactlogp.testing import llm_like_logits
torch.set_num_threads(2)
x, t = llm_like_logits(64, 32000, torch.float32, seed=3)
if sys.argv[1] == "after-a-call":  # the kernels loaded and a parallel region run
    before = exactlogp.selected_logprobs(x, t, backend="cpu").logprobs
else:  # only torch's parallel ops so far: the kernels load in the child
    torch.log_softmax(x, -1)
    before = exactlogp.selected_logprobs(x, t, backend="reference").logprobs
pid = os.fork()
if pid == 0:
    after = exactlogp.selected_logprobs(x, t, backend="cpu").logprobs
    os._exit(0 if torch.equal(before, after) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("when", ["after-a-call", "before-the-kernels-load"])
def test_a_forked_child_computes_the_same_bits_without_hanging(registered_cpu, when):
    """OpenMP's state in a forked child names the parent's threads (torch's own parallel
    ops hang there); the kernels run on the child's one thread instead, whether they were
    loaded in the parent or load in the child. (The script runs backend="cpu" as
    registered, so this runs once, not once per value-table mode.)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORK_SCRIPT, when], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and its forked child
        proc.communicate()
        pytest.fail("the forked child hung in its first call")
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_the_kernels_share_torchs_openmp_runtime(cpu):
    """One OpenMP runtime in the process: the kernels' libgomp is the one torch loaded (a
    second runtime would keep a second set of threads spinning on the same cores)."""
    if "-serial-" in Path(cpu._lib._name).name:
        pytest.skip("this compiler built the kernels without OpenMP")
    maps = Path("/proc/self/maps").read_text().splitlines()
    names = ("libgomp", "libomp", "libiomp")  # GNU, LLVM, Intel
    runtimes = {line.split()[-1] for line in maps if any(n in line.split()[-1] for n in names)}
    assert len(runtimes) == 1, runtimes


# --- random partitions ---


# the fixture only picks a mode, which no example changes
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cuts=st.lists(st.integers(0, 300), min_size=0, max_size=5),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_random_partitions_match_reference(cpu, cuts, dtype, seed):
    x, target = llm_like_logits(4, 300, dtype, seed=seed)
    boundaries = [0, *sorted(cuts), 300]
    fin_c = simulate_shards(x, target, boundaries, backend=cpu)
    fin_r = simulate_shards(x, target, boundaries, backend="reference")
    for field in ("logprobs", "entropy", "lse", "bad"):
        assert_bitwise_equal(getattr(fin_c, field), getattr(fin_r, field), field)


# --- the portable build (no AVX2) gives the same bits ---


def test_baseline_isa_build_matches_reference(cpu, ref):
    from exactlogp.backends.cpu import CpuBackend

    baseline = CpuBackend(isa="baseline", value_tables=cpu.value_tables)
    assert not baseline.uses_avx2
    x, target = llm_like_logits(6, 507, torch.float16, seed=11)
    keep = torch.rand(6, 507, generator=torch.Generator().manual_seed(5)) < 0.7
    keep[torch.arange(6), target] = True
    tau = Temperature.of(0.5 + torch.rand(6, generator=torch.Generator().manual_seed(6)))
    plan = ShardPlan(0, 500, -100, True)
    target = target.clamp(max=499)
    m = ref.row_max(x, tau, keep, plan)
    record = ref.partials(x, target, tau, keep, m, plan)
    fin = contract.finalize(m, record, target, 500, -100, None)
    stats = _stats_for(fin, seed=1)._replace(row_max=m)
    for impl in (baseline, cpu):
        assert_bitwise_equal(impl.row_max(x, tau, keep, plan), m, "row max")
        assert_bitwise_equal(impl.partials(x, target, tau, keep, m, plan), record, "record")
        expected = ref.grad(x, target, tau, keep, stats, plan)
        assert_bitwise_equal(impl.grad(x, target, tau, keep, stats, plan), expected, "grad")


# --- the chunk maxima of the exact cut: the C kernel gives the torch default's bits ---


def _chunk_rows(dtype: torch.dtype) -> torch.Tensor:
    """9 rows of 1000 columns whose chunks of 128 (and 64) hold NaN, +inf, -inf and zeros
    of both signs, in whole steps and in the row's short last step."""
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(9, 1000, generator=gen) * 3
    x[1, 5], x[1, 6], x[1, 300], x[1, 990] = float("nan"), float("inf"), float("inf"), float("nan")
    x[2] = float("-inf")
    x[2, 700] = 1.5  # one finite column, every other chunk all -inf
    x[3] = 0.0
    x[3, ::3] = -0.0
    x[3, 128:256] = -0.0  # a chunk of -0 alone
    x[4, 900:] = float("-inf")
    x[4, 999] = float("nan")  # the last column
    x[6] = torch.randint(-2, 3, (1000,), generator=gen).float()  # ties everywhere
    x[7, 400], x[7, 401] = float("inf"), float("-inf")
    x[8, 228] = float("nan")  # the second step of a chunk
    return x.to(dtype)


_CHUNK_TAUS = (
    ONE,
    Temperature.of(0.7),
    Temperature.of(torch.tensor([0.7, 1.0, 2.5, 0.3, 1.0, 0.9, 1.7, 1e-3, 3.0])),
    # bad per-row values (flagged by finalize): the kernel still gives the default's bits
    Temperature.of(torch.tensor([0.7, 0.0, -1.0, float("inf"), float("nan"), -0.0, 1.7, 1, 3])),
)
# no padding; padding past vocab_size at an offset; fewer real columns than one step of a
# chunk; no real column at all
_CHUNK_PLANS = (
    ShardPlan(0, None, -100, False),
    ShardPlan(3000, 3900, -100, False),
    ShardPlan(3000, 3100, -100, False),
    ShardPlan(3000, 2000, -100, False),
)


def _assert_chunk_max_equal(backend, x, tau, plan, chunk, what=""):
    from exactlogp.backends.base import Backend
    from exactlogp.backends.cpu import CHUNK_MAX_STEP

    got = backend.chunk_max(x, tau, plan, chunk)
    want = Backend.chunk_max(backend, x, tau, plan, chunk)  # the torch default
    chunks = -(-plan.real_columns(x.shape[-1]) // chunk)
    runs = [got]
    if chunk % CHUNK_MAX_STEP == 0:  # the kernel itself, also where chunk_max takes torch's
        runs.append(backend.kernel_chunk_max(x, tau, plan, chunk))
    for got in runs:
        assert got.shape == want.shape == (math.prod(x.shape[:-1]), chunks), what
        assert torch.equal(torch.isnan(got), torch.isnan(want)), what
        got_bits, want_bits = (bit_pattern(t.masked_fill(torch.isnan(t), 0.0)) for t in (got, want))
        assert torch.equal(got_bits, want_bits), what  # +0 where the max is a zero
    return got


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_max_matches_the_torch_default(isa, dtype):
    cpu = _build(isa, "never")
    x = _chunk_rows(dtype)
    for tau in _CHUNK_TAUS:
        for plan in _CHUNK_PLANS:
            for chunk in (128, 64, 1024):
                _assert_chunk_max_equal(cpu, x, tau, plan, chunk, f"{isa} {tau} {plan} {chunk}")
    got = cpu.chunk_max(x, ONE, _CHUNK_PLANS[0], 128)
    assert torch.isnan(got[1, [0, 7]]).all() and got[1, 2] == float("inf")  # NaN before +inf
    assert (got[2, :5] == float("-inf")).all() and got[2, 5] == 1.5
    assert got[3].eq(0).all() and not torch.signbit(got[3]).any()  # -0 as +0
    assert torch.isnan(got[4, 7]) and torch.isnan(got[8, 1]) and not torch.isnan(got[8, 0])


@pytest.mark.parametrize("isa", ["native", "avx2", "baseline"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunk_max_on_one_and_two_threads(isa, dtype):
    """Rows enough for two threads (cpu.MIN_ELEMENTS_PER_THREAD each), a NaN, a +inf and
    per-row temperatures: both thread counts give the default's bits."""
    x, _ = llm_like_logits(64, 4099, dtype, seed=32)
    x[5, 4000], x[9, 17], x[9, 200] = float("nan"), float("inf"), float("-inf")
    tau = Temperature.of(0.5 + torch.rand(64, generator=torch.Generator().manual_seed(33)))
    plan = ShardPlan(0, 4090, -100, False)
    results = [
        _assert_chunk_max_equal(_build(isa, "never", num_threads=t), x, tau, plan, 128, f"{t}")
        for t in (1, 2)
    ]
    assert_bitwise_equal(results[0], results[1], "threads")


def test_chunk_max_reads_strided_rows():
    """logits[:, :-1, :] of (B, T + 1, V) logits (rows not evenly spaced) and logits whose
    columns are not adjacent, with a per-row temperature and padding."""
    from exactlogp.backends.base import row_view

    cpu = _build("native", "never")
    full = _chunk_rows(torch.bfloat16)[:8].view(2, 4, 1000)
    rows = row_view(full[:, :-1, :])
    assert rows.dim() == 3
    tau = Temperature.of(torch.tensor([0.7, 1.0, 2.5, 0.3, 1.0, 0.9]))
    for plan in _CHUNK_PLANS[:2]:
        _assert_chunk_max_equal(cpu, rows, tau, plan, 128, "(B, T, V) rows")
    _assert_chunk_max_equal(cpu, full.view(8, 1000)[:, ::2], ONE, _CHUNK_PLANS[0], 64, "stride 2")


def test_chunk_max_checks_its_chunk():
    from exactlogp.backends.base import Backend

    cpu = _build("native", "never")
    x, plan = _chunk_rows(torch.float32), _CHUNK_PLANS[0]
    for bad in (0, -128, 128.0, True, None):
        for fn in (cpu.chunk_max, lambda *a: Backend.chunk_max(cpu, *a)):
            with pytest.raises(ValueError, match=rf"chunk must be an int >= 1, got {bad!r}"):
                fn(x, ONE, plan, bad)
    for chunk in (100, 32, 1):  # not a multiple of the kernel's step: the torch default
        _assert_chunk_max_equal(cpu, x, ONE, plan, chunk, f"chunk {chunk}")
    whole_rows = _assert_chunk_max_equal(cpu, x, ONE, plan, 1 << 16, "one chunk per row")
    assert_bitwise_equal(cpu.chunk_max(x, ONE, plan, 1 << 70), whole_rows, "a chunk past int64")
    # the kernel itself refuses what it cannot take
    out = torch.empty(9 * 8, dtype=torch.float32)
    shard, _alive = cpu._shard(x, ONE, None, plan)
    for chunk in (0, -64, 100, 64 + 1):
        assert cpu._lib.elp_chunk_max(ctypes.byref(shard), chunk, out.data_ptr()) == -1
    assert cpu._lib.elp_chunk_max(ctypes.byref(shard), (1 << 63) - 64, out.data_ptr()) == 0
    assert_bitwise_equal(out[:9], whole_rows[:, 0], "the largest chunk the kernel takes")
    keep = torch.ones(9, 1000, dtype=torch.bool)
    masked, _alive_masked = cpu._shard(x, ONE, keep, plan)
    assert cpu._lib.elp_chunk_max(ctypes.byref(masked), 128, out.data_ptr()) == -1
    assert cpu._lib.elp_chunk_max(ctypes.byref(shard), 128, out.data_ptr()) == 0
