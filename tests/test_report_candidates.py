"""The re-implemented candidates' math against fp64, their TP claims, the emulated
collective orders (one gloo world of 4 ranks), and the unavailable path."""

import sys
import types

import pytest
import torch

from exactlogp.report import candidates, emulation, workload
from exactlogp.report.candidates.base import ShardContext, Unavailable, import_or_unavailable
from exactlogp.testing import fp64_reference, llm_like_logits, run_gloo_world, ulp32

REIMPLEMENTED = ("vime_default", "vllm_gather", "rl_kernel_ws2")
TPS = (1, 2, 4)
N, VOCAB = 24, 1000  # 1000 is no multiple of 64 or 128: every layout pads


def _world(rank, world_size, group, logits, target, pattern):
    import torch.distributed as dist

    groups = {}
    for tp in TPS:  # every rank creates every group, in the same order
        for start in range(0, world_size, tp):
            g = dist.new_group(list(range(start, start + tp)))
            if start <= rank < start + tp:
                groups[tp] = g
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
    return outs, emulated, dist.all_reduce is original


@pytest.fixture(scope="module")
def world():
    logits, target = llm_like_logits(N, VOCAB, dtype=torch.bfloat16, seed=3)
    e = 2.0**-24
    pattern = torch.tensor(  # per rank, 3 columns whose fp32 sum depends on the order
        [[1.0, 1e8, 3.0], [e, 1.0, e], [e, -1e8, e], [-1.0, 1.0, -3.0]], dtype=torch.float32
    )
    outs, emulated, restored = run_gloo_world(4, _world, logits, target, pattern, timeout=180)[0]
    assert restored  # the patched all_reduce is gone after each setting
    return logits, target, pattern, outs, emulated


@pytest.mark.parametrize("name", REIMPLEMENTED)
def test_reimplemented_math_matches_fp64(world, name):
    # accuracy claim for an fp32 pipeline: within 8 fp32 ulps of (|logprob| + log V),
    # the size of the fp32 log-sum-exp it subtracts
    logits, target, _, outs, _ = world
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


# --- the unavailable path ---


@pytest.mark.parametrize(
    "name, text",
    [
        ("miles_fused", "ModuleNotFoundError: No module named 'miles'"),
        ("verl_fused", "ModuleNotFoundError: No module named 'verl'"),
    ],
)
def test_missing_packages_are_unavailable_with_the_exception_text(name, text):
    with pytest.raises(Unavailable) as exc:
        candidates.create(name).check_available(torch.device("cpu"))
    assert str(exc.value) == text


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
    after = candidates.expand(["exactlogp"], cpu)
    assert "exactlogp[twin]" in after and "exactlogp[absent]" not in after


def test_check_rows_are_seeded_and_disjoint():
    rows, extra = workload.check_rows(100, 10, seed=0)
    assert rows == sorted(rows) and len(rows) == 10 and len(extra) == 10
    assert not set(rows) & set(extra)
    assert (rows, extra) == workload.check_rows(100, 10, seed=0)
