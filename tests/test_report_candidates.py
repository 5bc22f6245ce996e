"""The re-implemented candidates' math against fp64, their TP claims, the emulated
collective orders and the fused LM-head candidates on hidden states (one gloo world of 4
ranks), and the unavailable path."""

import sys
import types

import pytest
import torch

from exactlogp.report import candidates, emulation, workload
from exactlogp.report.candidates.base import ShardContext, Unavailable, import_or_unavailable
from exactlogp.testing import (
    fp64_reference,
    llm_like_logits,
    lm_head_inputs,
    run_gloo_world,
    ulp32,
)

REIMPLEMENTED = ("vime_default", "vllm_gather", "rl_kernel_ws2")
# miles_fused runs in the quick report's worlds (test_report_cli.py): each of its ranks
# compiles megatron-core's fused cross-entropy, tens of seconds on two cores
FUSED = ("exactlogp_linear", "verl_fused", "torch_linear")
TPS = (1, 2, 4)
N, VOCAB = 24, 1000  # 1000 is no multiple of 64 or 128: every layout pads
HIDDEN_ROWS, HIDDEN = 20, 128


def _world(rank, world_size, group, logits, target, pattern, lm_head):
    import torch.distributed as dist

    groups = {}
    for tp in TPS:  # every rank creates every group, in the same order
        for start in range(0, world_size, tp):
            g = dist.new_group(list(range(start, start + tp)))
            if start <= rank < start + tp:
                groups[tp] = g
    fused = _fused(rank, groups, *lm_head)
    outs = {}
    for name in REIMPLEMENTED:
        cand = candidates.create(name)
        for tp in TPS:
            padded = cand.padded_vocab(VOCAB, tp)
            width, r = padded // tp, rank % tp
            ctx = ShardContext(r, tp, groups[tp], torch.device("cpu"), VOCAB, padded, r * width)
            shard = workload.cut_shard(logits, r * width, width, VOCAB)
            outs[(name, tp)] = cand.build(ctx)(shard, target)
    emulated, original = {}, dist.all_reduce
    for setting in emulation.emulated_settings(world_size):
        x = pattern[rank].clone()
        ints = torch.full((3,), rank + 1, dtype=torch.int64)
        with emulation.emulate(setting) as counter:
            dist.all_reduce(x)
            dist.all_reduce(ints)
        emulated[setting.name] = (x, ints, counter.count)
    return outs, emulated, dist.all_reduce is original, fused


def _fused(rank, groups, hidden, weight, target):
    """{(name, tp): logprobs}, {(name, tp): float all_reduces} of the FUSED candidates,
    each rank holding the weight rows of its layout."""
    outs, counts = {}, {}
    for name in FUSED:
        cand = candidates.create(name)
        for tp in TPS:
            if cand.tp1_only and tp != 1:
                continue
            padded = cand.padded_vocab(VOCAB, tp)
            width, r = padded // tp, rank % tp
            rows = workload.cut_rows(weight, r * width, width, VOCAB)
            ctx = ShardContext(
                r, tp, groups[tp], torch.device("cpu"), VOCAB, padded, r * width, rows
            )
            with emulation.emulate(None) as counter:
                outs[(name, tp)] = candidates.logprobs_of(cand.build(ctx)(hidden, target))
            counts[(name, tp)] = counter.count
    return outs, counts


@pytest.fixture(scope="module")
def world():
    logits, target = llm_like_logits(N, VOCAB, dtype=torch.bfloat16, seed=3)
    e = 2.0**-24
    pattern = torch.tensor(  # per rank, 3 columns whose fp32 sum depends on the order
        [[1.0, 1e8, 3.0], [e, 1.0, e], [e, -1e8, e], [-1.0, 1.0, -3.0]], dtype=torch.float32
    )
    lm_head = lm_head_inputs(HIDDEN_ROWS, HIDDEN, VOCAB, seed=5)
    outs, emulated, restored, fused = run_gloo_world(
        4, _world, logits, target, pattern, lm_head, timeout=180
    )[0]
    assert restored  # the patched all_reduce is gone after each setting
    return logits, target, pattern, outs, emulated, lm_head, fused


@pytest.mark.parametrize("name", REIMPLEMENTED)
def test_reimplemented_math_matches_fp64(world, name):
    # accuracy claim for an fp32 pipeline: within 8 fp32 ulps of (|logprob| + log V),
    # the size of the fp32 log-sum-exp it subtracts
    logits, target, _, outs, _, _, _ = world
    ref = fp64_reference(logits, target).logprobs
    bound = 8 * ulp32(ref.abs() + torch.log(torch.tensor(float(VOCAB), dtype=torch.float64)))
    for tp in TPS:
        err = (outs[(name, tp)].double() - ref).abs()
        assert bool((err <= bound).all()), (name, tp, float(err.max()))


@pytest.mark.parametrize("name", ["vllm_gather", "rl_kernel_ws2"])
def test_invariant_candidates_give_the_same_bits_at_every_tp(world, name):
    outs = world[3]
    for tp in TPS[1:]:
        assert torch.equal(outs[(name, tp)].view(torch.int32), outs[(name, 1)].view(torch.int32))


def test_vime_default_depends_on_tp(world):
    outs = world[3]
    assert not torch.equal(outs[("vime_default", 4)], outs[("vime_default", 1)])


def _expected(pattern: torch.Tensor, setting) -> torch.Tensor:
    node = emulation.rank_order(setting, pattern.shape[0])

    def combine(n):
        return pattern[n] if isinstance(n, int) else combine(n[0]) + combine(n[1])

    return combine(node)


def test_emulated_orders_are_the_stated_ones(world):
    pattern, emulated = world[2], world[4]
    for setting in emulation.emulated_settings(4):
        x, ints, count = emulated[setting.name]
        assert count == 1  # the float all_reduce only
        assert torch.equal(ints, torch.full((3,), 10, dtype=torch.int64))
        if setting.name != "as_is":
            assert torch.equal(x, _expected(pattern, setting)), setting.name
    results = {tuple(v[0].tolist()) for v in emulated.values()}
    assert len(results) > 1  # the orders really do change float bits


def test_rank_order_shapes():
    s = {x.name: x for x in emulation.emulated_settings(4)}
    assert emulation.rank_order(s["ring_from_2"], 4) == [[[2, 3], 0], 1]
    assert emulation.rank_order(s["tree"], 4) == [[0, 1], [2, 3]]
    assert emulation.rank_order(s["reversed"], 4) == [[[3, 2], 1], 0]
    assert emulation.rank_order(s["tree"], 3) == [[0, 1], 2]
    with pytest.raises(ValueError, match="as_is"):
        emulation.rank_order(s["as_is"], 4)
    assert len(emulation.nccl_settings()) == 13  # defaults + 2 x 3 x 2


# --- the fused LM-head candidates (hidden-state workload) ---


@pytest.fixture(scope="module")
def fused_world(world):
    hidden, weight, target = world[5]
    outs, counts = world[6]
    return workload.reference_hidden_logprobs(hidden, weight, target), outs, counts


def test_exactlogp_linear_gives_the_tp1_bits_on_every_megatron_layout(fused_world):
    _, outs, counts = fused_world
    base = outs[("exactlogp_linear", 1)]
    for tp in TPS[1:]:
        assert torch.equal(outs[("exactlogp_linear", tp)].view(torch.int32), base.view(torch.int32))
        assert counts[("exactlogp_linear", tp)] == 1  # the fp32 MAX; no float SUM


def test_verl_fused_is_fp32_gemm_accurate_and_sums_floats_over_ranks(fused_world):
    # accuracy claim for an fp32-accumulated LM head: the logits' fp32 rounding and
    # accumulation (~1e-6 here) decide it; well inside the 1e-4 bar
    truth, outs, counts = fused_world
    for tp in TPS:
        err = (outs[("verl_fused", tp)].double() - truth).abs().max()
        assert float(err) < 2e-5, (tp, float(err))
    # TP > 1: MAX of the split maxima, SUM of the target logit, SUM of [sum-exp; sum z e]
    assert [counts[("verl_fused", tp)] for tp in TPS] == [0, 3, 3]


def test_torch_linear_is_off_by_its_bf16_logits(fused_world):
    # a relative rounding of up to 2^-9 of every logit puts it far from the fp64 truth of
    # the same inputs, however its softmax adds
    truth, outs, _ = fused_world
    err = float((outs[("torch_linear", 1)].double() - truth).abs().max())
    assert 1e-3 < err < 0.2, err


def test_miles_lm_head_logits_are_the_bf16_gemm_in_fp32_with_padding_at_minus_inf():
    from exactlogp.report.candidates.miles_fused import lm_head_logits

    hidden, weight, _ = lm_head_inputs(6, HIDDEN, 40, seed=1)
    rows = workload.cut_rows(weight, 16, 32, 40)  # the real rows 16..39, then 8 padding
    logits = lm_head_logits(hidden, rows, 24)
    assert logits.dtype == torch.float32 and logits.shape == (6, 32)
    assert torch.equal(logits[:, :24], (hidden @ rows.T)[:, :24].float())
    assert torch.equal(rows[:24], weight[16:]) and not rows[24:].any()
    assert bool((logits[:, 24:] == float("-inf")).all())


def test_verl_split_stats_follow_the_temperature_as_a_reciprocal_multiply():
    from exactlogp.report.candidates import verl_fused

    hidden, weight, target = lm_head_inputs(5, HIDDEN, 3000, seed=2)
    ctx = ShardContext(0, 1, None, torch.device("cpu"), 3000, 3000, 0, weight)
    logprobs, entropy = verl_fused.verl_linear_cross_entropy(hidden, weight, target, 0.7, ctx)
    z = (hidden.double() @ weight.double().T) * float(torch.tensor(1 / 0.7, dtype=torch.float32))
    lp = torch.log_softmax(z, -1)
    assert torch.allclose(logprobs.double(), lp.gather(-1, target[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(entropy.double(), -(lp.exp() * lp).sum(-1), atol=1e-5)
    # three splits of 1024 rows, the last one short: one (m, a, b) per split
    stats = verl_fused.split_stats(hidden, weight, target, 0.7)
    assert [t.shape for t in stats] == [(5, 3)] * 3 + [(5,)]


def test_verl_fused_refuses_the_layouts_verl_cannot_take():
    cand = candidates.create("verl_fused")
    assert cand.padded_vocab(1000, 4) == 1000
    with pytest.raises(ValueError, match="must split evenly over tp=3"):
        cand.padded_vocab(1000, 3)
    weight = torch.zeros(8, 96, dtype=torch.bfloat16)
    ctx = ShardContext(0, 1, None, torch.device("cpu"), 8, 8, 0, weight)
    with pytest.raises(ValueError, match="hidden_size % 128 == 0, got 96"):
        cand.build(ctx)


# --- the unavailable path ---


def test_miles_fused_without_miles_runs_its_lines_around_the_real_megatron_function():
    cand = candidates.create("miles_fused")
    assert cand.implementation == "re-implementation" and cand.kind == "hidden_states"
    assert cand.note == "real package not importable: ModuleNotFoundError: No module named 'miles'"
    assert [p["name"] for p in cand.third_party()] == ["megatron-core"]
    cand.check_available(torch.device("cpu"))  # megatron-core is installed


def test_import_failures_of_any_kind_become_unavailable(monkeypatch, tmp_path):
    (tmp_path / "broken_pkg.py").write_text("raise OSError('libfoo.so: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Unavailable) as exc:
        import_or_unavailable("broken_pkg")
    assert str(exc.value) == "OSError: libfoo.so: cannot open"


def test_real_packages_are_used_when_they_import(monkeypatch):
    calls = []
    fake = types.ModuleType("vime.utils.ppo_utils")
    fake.calculate_log_probs_and_entropy = lambda *a: calls.append(a)
    monkeypatch.setitem(sys.modules, "vime", types.ModuleType("vime"))
    monkeypatch.setitem(sys.modules, "vime.utils", types.ModuleType("vime.utils"))
    monkeypatch.setitem(sys.modules, "vime.utils.ppo_utils", fake)
    vime = candidates.create("vime_default")
    assert vime.implementation == "real" and "real package" in vime.summary
    sampler = types.ModuleType("vllm.v1.sample.sampler")
    sampler.Sampler = type("Sampler", (), {"compute_logprobs": staticmethod(lambda x: x * 0)})
    for mod in ("vllm", "vllm.v1", "vllm.v1.sample"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.sampler", sampler)
    assert candidates.create("vllm_gather").implementation == "real"
    monkeypatch.undo()
    assert candidates.create("vime_default").implementation == "re-implementation"


def test_registry_names_and_errors():
    assert set(candidates.names()) >= {"exactlogp", "megatron_ce", "rl_kernel_ws2", "torch_full"}
    with pytest.raises(ValueError, match="candidate must be one of"):
        candidates.create("no_such_candidate")
    with pytest.raises(TypeError, match="not a Candidate"):
        candidates.create("exactlogp.report.emulation:FloatAllReduceCounter")
    pinned = candidates.create("exactlogp[reference]")
    assert pinned.name == "exactlogp[reference]" and pinned.backend == "reference"


def test_expand_adds_one_row_per_other_loadable_backend(monkeypatch):
    from exactlogp import backends

    cpu = torch.device("cpu")
    auto = backends.get_backend("auto", cpu).name
    before = candidates.expand(["exactlogp", "megatron_ce"], cpu)
    assert before[0] == "exactlogp" and before[-1] == "megatron_ce"
    assert f"exactlogp[{auto}]" not in before
    monkeypatch.setitem(
        backends._REGISTRY, "twin", ("exactlogp.backends.reference", "ReferenceBackend")
    )
    monkeypatch.setitem(backends._REGISTRY, "absent", ("no.such.module", "Nothing"))
    monkeypatch.setattr(backends, "_cache", dict(backends._cache))
    monkeypatch.setattr(backends, "_load_errors", dict(backends._load_errors))
    after = candidates.expand(["exactlogp", "exactlogp_linear"], cpu)
    assert "exactlogp[twin]" in after and "exactlogp[absent]" not in after
    assert after[-1] == "exactlogp_linear"  # its pinned rows are asked for by name


def test_check_rows_are_seeded_and_disjoint():
    rows, extra = workload.check_rows(100, 10, seed=0)
    assert rows == sorted(rows) and len(rows) == 10 and len(extra) == 10
    assert not set(rows) & set(extra)
    assert (rows, extra) == workload.check_rows(100, 10, seed=0)


def test_value_table_mode_runs_a_backend_object_of_the_shards_device(monkeypatch):
    """exactlogp[BACKEND,value_tables=MODE] runs a backend object for the built shard's
    device (a GPU's Triton backend in the GPU check) in that mode, made by with_options:
    the shared backend is never changed."""
    from exactlogp.report.candidates import exactlogp as module

    seen, used = [], []

    class SharedBackend:
        value_tables = "auto"

        def with_options(self, **changes):
            seen.append(changes)
            return derived

    shared, derived = SharedBackend(), object()
    monkeypatch.setattr(module, "get_backend", lambda name, dev: seen.append((name, dev)) or shared)
    monkeypatch.setattr(
        module, "selected_logprobs",
        lambda *a, **kw: used.append(kw["backend"]) or types.SimpleNamespace(logprobs=None),
    )  # fmt: skip
    cand = candidates.create("exactlogp[triton,value_tables=always]")
    device = torch.device("cuda", 1)  # only named, never used: the backend is a stand-in
    run = cand.build(ShardContext(0, 1, None, device, 256, 256, 0))
    run(None, None)
    assert seen == [("triton", device), {"value_tables": "always"}]
    assert used == [derived] and shared.value_tables == "auto"
