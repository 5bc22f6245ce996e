"""The harness shared by the report, the bench and the GPU check: worlds (failures,
timeouts, the group of one rank), interleaved timing, registry parameters, one display."""

import io

import pytest
import torch

from exactlogp import worlds
from exactlogp.report import candidates, display, measure
from exactlogp.testing import run_gloo_world


def _rank_sum(rank, world_size, group):
    import torch.distributed as dist

    x = torch.tensor([rank + 1])
    dist.all_reduce(x, group=group)
    return int(x), torch.get_num_threads()


def _fail_on_rank1(rank, world_size, group):
    if rank == 1:
        raise ValueError("rank 1 says no")
    import torch.distributed as dist

    dist.barrier(group=group)


def _publish_then_hang(rank, world_size, group):
    import time

    if rank == 0:
        worlds.progress("first", 1, "working")
        worlds.publish("first", {"done": True})
        worlds.progress("second", 0, "hanging")
    time.sleep(60)


def test_run_gloo_world_returns_every_rank_value_with_one_thread_each():
    assert run_gloo_world(2, _rank_sum, timeout=60) == [(3, 1), (3, 1)]


def _environment(rank, world_size, group):
    import os
    import sys

    names = ("EXACTLOGP_TEST_SET_LATE", "EXACTLOGP_TEST_REMOVED", "EXACTLOGP_TEST_GIVEN")
    return tuple(os.environ.get(n) for n in names), "torch" in sys.modules


def test_a_rank_sees_the_environment_of_the_moment_its_world_starts(monkeypatch):
    """The fork server started before these variables changed; its ranks see them anyway,
    with the world's own `env` on top (None: removed)."""
    run_gloo_world(1, _rank_sum, timeout=60)  # the fork server is running by now
    monkeypatch.setenv("EXACTLOGP_TEST_SET_LATE", "late")
    monkeypatch.setenv("EXACTLOGP_TEST_REMOVED", "there")
    env = {"EXACTLOGP_TEST_REMOVED": None, "EXACTLOGP_TEST_GIVEN": "given"}
    with worlds.World(2, _environment, env=env, timeout=60) as world:
        assert world.wait() is None
        assert world.values() == [(("late", None, "given"), True)] * 2


def test_a_failing_rank_is_the_error_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1: ValueError: rank 1 says no") as exc:
        run_gloo_world(2, _fail_on_rank1, timeout=60)
    assert "Traceback" in str(exc.value)


def test_a_phase_past_its_timeout_kills_the_world_and_keeps_what_was_published():
    seen = []
    with worlds.World(1, _publish_then_hang, timeout=3.0) as world:
        failure = world.wait(lambda *line: seen.append(line))
        published = world.published()
    assert failure.timed_out and failure.error.startswith("TimeoutError: no result after 3 s")
    assert world.phase == "second" and published == {"first": {"done": True}}
    assert seen[-1] == ("second", 0, "hanging")  # the poll may miss lines in between


def test_single_rank_is_a_group_of_one_that_goes_away():
    import torch.distributed as dist

    with worlds.single_rank(torch.device("cpu")) as group:
        assert dist.get_world_size(group) == 1
        x = torch.ones(3)
        dist.all_reduce(x, group=group)
        assert torch.equal(x, torch.ones(3))
    assert not dist.is_initialized()


def test_interleaved_rounds_are_shuffled_seeded_and_capped():
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in "abcd"}
    seconds = measure.interleaved(steps, {"a": 5, "b": 5, "c": 5, "d": 2}, seed=3, warmup=1)
    assert order[:4] == list("abcd")  # the warm-up, in order
    rounds = [order[4 + 4 * r : 8 + 4 * r] for r in range(2)] + [
        order[12 + 3 * r : 15 + 3 * r] for r in range(3)
    ]
    assert all(sorted(r) == list("abcd") for r in rounds[:2])
    assert all(sorted(r) == list("abc") for r in rounds[2:])
    assert len({tuple(r) for r in rounds[:2]}) > 1 or len({tuple(r) for r in rounds[2:]}) > 1
    assert [len(seconds[k]) for k in "abcd"] == [5, 5, 5, 2]
    again = []
    steps = {name: (lambda name=name: again.append(name)) for name in "abcd"}
    measure.interleaved(steps, {"a": 5, "b": 5, "c": 5, "d": 2}, seed=3, warmup=1)
    assert again == order


def test_timing_keeps_median_min_max():
    t = measure.Timing.of([3.0, 1.0, 2.0, 10.0])
    assert (t.median, t.low, t.high, t.runs) == (2.5, 1.0, 10.0, 4)


@pytest.mark.parametrize(
    "name, error",
    [
        ("torch_compile[x]", "takes no parameters"),
        ("exactlogp[cpu,fast=1]", "exactlogp takes"),
        ("torch_full[row_block=0]", "row_block must be a positive int or 'all', got '0'"),
    ],
)
def test_bad_parameters_name_the_candidate_and_the_value(name, error):
    with pytest.raises(ValueError, match=error):
        candidates.create(name)


def test_parameters_make_the_variants_of_one_candidate():
    entropy = candidates.create("exactlogp[cpu,entropy]")
    assert (entropy.backend, entropy.with_entropy) == ("cpu", True)
    assert entropy.name == "exactlogp[cpu,entropy]" and entropy.max_timed_runs == 3
    assert candidates.create("torch_full[row_block=all]").row_block is None
    names = "exactlogp[cpu,value_tables=never], megatron_ce,torch_full[row_block=all]"
    assert candidates.split_names(names) == (
        "exactlogp[cpu,value_tables=never]", "megatron_ce", "torch_full[row_block=all]"
    )  # fmt: skip


def test_tp1_steps_give_logits_only_so_a_fused_lm_head_is_unavailable_there():
    from exactlogp.report.tp1 import tp1_steps

    logits, target = torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64)
    with tp1_steps(["exactlogp_linear"], logits, target, skip_unavailable=True) as (steps, why):
        assert steps == {}
    assert why == {
        "exactlogp_linear": "exactlogp_linear takes hidden states and the LM-head weight "
        "(fused LM-head candidates); TP1 steps give logits"
    }


def test_exactlogp_linear_takes_one_backend_parameter():
    pinned = candidates.create("exactlogp_linear[reference]")
    assert (pinned.name, pinned.backend, pinned.kind) == (
        "exactlogp_linear[reference]", "reference", "hidden_states"
    )  # fmt: skip
    assert (
        pinned.max_timed_runs == 3 and candidates.create("exactlogp_linear").max_timed_runs is None
    )
    with pytest.raises(ValueError, match="exactlogp_linear takes \\[BACKEND\\]"):
        candidates.create("exactlogp_linear[cpu,entropy]")


def test_a_log_gets_each_progress_line_once():
    from rich.console import Console

    out = io.StringIO()
    with display.RichDisplay(Console(file=out, width=200)) as shown:
        task = shown.start("exactlogp[cpu] TP1", 3)
        shown.advance(task, 1, "built")
        shown.finish(task, "done in 1 s")
    assert out.getvalue() == "exactlogp[cpu] TP1: done in 1 s\n"
