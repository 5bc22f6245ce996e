"""exactlogp.integrations.vllm against vLLM's own code: the V2 model runner of vLLM 0.34
and the V1 sampler of vLLM 0.33, on CPU tensors.

`make setup` installs each vLLM into its own directory under .venv/hosts (see the
Makefile: vLLM's wheels pin a CUDA torch, and TRL imports vLLM whenever it is importable).
Each version runs in one subprocess (tests/real_hosts/vllm_v2_run.py, vllm_v1_run.py, which
list the host pieces they set for a CPU), unpatched, patched and unpatched again, and saves
what vLLM returned; the tests here never import vLLM and compare those outputs with
exactlogp called directly on the same logits (torch.equal). The two subprocesses run at
the same time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import exactlogp
from exactlogp import selected_logprobs
from exactlogp.integrations import vllm as ours
from real_host_runs import finish, start

V2_VERSION, V1_VERSION = "0.34.0", "0.33.0"  # its VLLM_V2 and VLLM_V1
PLAIN = ("plain/raw_logprobs", "plain/processed_logprobs")
CASES = (*PLAIN, "edited/processed_logprobs")  # edited: logit bias, penalties, bad words
MANY = "many/raw_logprobs"  # more top logprobs than ours.EXACT_COLUMNS


def _start(script: str, version: str, tmp: Path):
    """One vLLM subprocess, under Triton's interpreter (vLLM's triton_utils needs a driver
    or the interpreter) and without a VLLM_PLUGINS of the caller's."""
    return start(script, f"vllm-{version}", tmp, drop=("VLLM_PLUGINS",), TRITON_INTERPRET="1")


@pytest.fixture(scope="module")
def _started(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_real")
    started = {"v2": _start("vllm_v2_run", V2_VERSION, tmp),
               "v1": _start("vllm_v1_run", V1_VERSION, tmp)}  # fmt: skip
    yield started
    for proc, _ in started.values():
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def v2(_started):
    return finish(_started["v2"], timeout=600)


@pytest.fixture(scope="module")
def v1(_started):
    return finish(_started["v1"], timeout=600)


def _exact_columns(logits, ids):
    """exactlogp on `logits` at every column of `ids` (B, K); ids outside the vocabulary
    (padding) give -inf, as vLLM's contract says."""
    ids = ids.to(torch.int64)
    valid = (ids >= 0) & (ids < logits.shape[-1])
    cols = [
        selected_logprobs(logits, torch.where(valid[:, k], ids[:, k], -100)).logprobs
        for k in range(ids.shape[1])
    ]
    return torch.stack(cols, -1).masked_fill(~valid, float("-inf"))


def _assert_same(a, b, where=""):
    """Bitwise equal nested dicts of tensors (and equal lists: vLLM's SamplingMask ids)."""
    if isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in b:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(b, list):
        assert a == b, where
    else:
        assert torch.equal(a, b), where


def _fp64_columns(logits, ids):
    return torch.log_softmax(logits.double(), -1).gather(-1, ids.to(torch.int64))


# --- vLLM 0.34, V2 model runner ---


def test_v2_is_the_real_vllm_and_the_patch_reaches_every_scorer(v2):
    assert v2["version"] == V2_VERSION
    assert v2["sites"] == [
        "vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs",
        "vllm.v1.worker.gpu.sample.prompt_logprob.compute_token_logprobs",
        "vllm.v1.worker.cpu.logprob.compute_token_logprobs",
    ]
    assert v2["skipped"] == [] and v2["unpatch"] is True and v2["idempotent"]
    assert v2["same_scorer_in_spec"]  # the rejection sampler's name is logprob's function
    assert v2["plugin_patched"]  # vLLM's load_general_plugins with EXACTLOGP_PATCH=vllm


def test_v2_a_scorer_that_bypasses_the_patch_is_refused(v2):
    """With vLLM's compute_topk_scores swapped for one that never calls
    compute_token_logprobs, patching raises and changes nothing."""
    assert "does not route its logprobs through compute_token_logprobs" in v2["refused"]
    assert "vLLM 0.34.0" in v2["refused"] and v2["nothing_patched"]


@pytest.mark.parametrize("case", [*CASES, MANY])
def test_v2_unpatched_returns_vllms_own_logprobs(v2, case):
    """What vLLM itself returns: column 0 the sampled token, then the top-k of the logits
    it scored (the input for raw_logprobs; after processing, cut tokens -inf, for
    processed_logprobs), their fp32 log-softmax, and the sampled token's rank."""
    got = v2["unpatched"][case]
    scored, ids = got["scored"], got["ids"]
    logits = v2["logits_edited" if case.startswith("edited") else "logits_plain"][: len(ids)]
    n, k = ids.shape
    assert got["logprobs"].dtype == torch.float32 and got["logprobs"].shape == (n, k)
    assert ids.dtype == torch.int64 and got["ranks"].shape == (n,)
    assert torch.equal(ids[:, 0], got["sampled"][:, 0])
    if case.endswith("/raw_logprobs"):
        assert torch.equal(scored, logits)
    else:
        assert scored.dtype == torch.float32 and bool(torch.isneginf(scored).any())
    if case.startswith("edited"):
        assert bool(torch.isneginf(scored[1, [7, 9]]).all())  # the bad words
    top = torch.topk(scored.float(), k - 1, dim=-1).values
    assert torch.equal(scored.float().gather(-1, ids[:, 1:]), top)
    if scored.dtype == torch.float32:
        # (on bf16 logits Triton 3.9's interpreter miscounts in vLLM's rank kernel, 1321
        # for a top token of 1500; the patch never touches ranks, see the next test)
        chosen = scored.gather(-1, ids[:, :1])
        assert torch.equal(got["ranks"], (scored >= chosen).sum(-1))
    torch.testing.assert_close(
        got["logprobs"].double(), _fp64_columns(scored, ids), atol=2e-6, rtol=1e-6
    )


@pytest.mark.parametrize("case", CASES)
def test_v2_patched_returns_exactlogp_bits_and_nothing_else_changes(v2, case):
    theirs, got = v2["unpatched"][case], v2["patched"][case]
    for name in ("sampled", "ids", "ranks", "scored"):  # sampling and the scored logits
        assert torch.equal(got[name], theirs[name]), name
    assert got["logprobs"].dtype == theirs["logprobs"].dtype
    assert got["logprobs"].shape == theirs["logprobs"].shape
    assert torch.equal(got["logprobs"], _exact_columns(got["scored"], got["ids"]))
    torch.testing.assert_close(got["logprobs"], theirs["logprobs"], atol=2e-6, rtol=1e-6)


def test_v2_past_exact_columns_the_sampled_token_stays_exact(v2):
    theirs, got = v2["unpatched"][MANY], v2["patched"][MANY]
    assert got["ids"].shape[1] == ours.EXACT_COLUMNS + 4
    assert torch.equal(got["ids"], theirs["ids"])
    exact = selected_logprobs(got["scored"], got["ids"][:, 0]).logprobs
    assert torch.equal(got["logprobs"][:, 0], exact)
    assert torch.equal(got["logprobs"][:, 1:], theirs["logprobs"][:, 1:])


def test_v2_vllms_own_values_differ_from_exactlogps_in_some_bits(v2):
    """So the bitwise comparisons above tell the patched values from vLLM's own."""
    differ = [
        int((v2["unpatched"][c]["logprobs"] != v2["patched"][c]["logprobs"]).sum()) for c in CASES
    ]
    assert sum(differ) > 0, differ


def test_v2_processed_logprobs_are_the_trainers(v2):
    """A trainer with the model's logits, the temperature (greedy rows at 1) and the
    tokens vLLM's min-p / top-k / top-p kept gets the rollout's bits; rollout_logprobs
    rebuilds that cut with vLLM's PyTorch algorithm."""
    got = v2["patched"]["plain/processed_logprobs"]
    logits, t = v2["logits_plain"], v2["temperature_plain"]
    sampled = got["ids"][:, 0]
    keep = torch.isfinite(got["scored"])
    tau = torch.where(t == 0, 1.0, t)
    trainer = selected_logprobs(logits, sampled, temperature=tau, keep_mask=keep).logprobs
    assert torch.equal(got["logprobs"][:, 0], trainer)
    rebuilt = ours.rollout_logprobs(
        logits, sampled, temperature=t, top_k=v2["top_k_plain"], top_p=v2["top_p_plain"],
        min_p=v2["min_p_plain"],
    )  # fmt: skip
    assert torch.equal(got["logprobs"][:, 0], rebuilt.logprobs)


def test_v2_prompt_logprobs(v2):
    """PromptLogprobsWorker: each prompt position's next token and the top-2, and the
    prompt_logprob_token_ids table (scored through prompt_logprob's own binding of
    compute_token_logprobs); -1 in the table is padding (-inf)."""
    for state in ("unpatched", "patched"):
        got = v2[state]["prompt"]
        rows = {"p0": slice(0, 4), "p1": slice(5, 11)}  # a prompt's last row predicts nothing
        for name, prompt in (("p0", [5, 17, 1200, 44, 9]), ("p1", [1, 2, 3, 1499, 600, 70, 8])):
            ids, logits = got[name]["ids"], got["logits"][rows[name]]
            assert ids.dtype == torch.int32 and ids.shape == (len(prompt) - 1, 3)
            assert ids[:, 0].tolist() == prompt[1:]
            if state == "unpatched":
                torch.testing.assert_close(
                    got[name]["logprobs"].double(), _fp64_columns(logits, ids), atol=2e-6,
                    rtol=1e-6,
                )  # fmt: skip
            else:
                assert torch.equal(got[name]["logprobs"], _exact_columns(logits, ids))
                assert torch.equal(got[name]["ids"], v2["unpatched"]["prompt"][name]["ids"])
        table, scores = got["ids_table"], got["ids_scores"]
        assert bool(torch.isneginf(scores[table < 0]).all())
        if state == "patched":
            assert torch.equal(scores, _exact_columns(got["ids_logits"], table))


def test_v2_spec_decode_and_cpu_runner_scorers(v2):
    for name in ("spec", "cpu_runner"):
        got = v2["patched"][name]
        assert torch.equal(got["logprobs"], _exact_columns(v2["logits_plain"], got["ids"]))
        torch.testing.assert_close(got["logprobs"], v2["unpatched"][name]["logprobs"])


def test_v2_unpatch_restores_vllms_bits(v2):
    _assert_same(v2["unpatched_again"], v2["unpatched"])


# --- vLLM 0.34, V2 sampler with patch_vllm_sampler(cut="exact") ---

EXACT_ROWS, VLLM_ROWS = [0, 3, 4, 5], [1, 2]  # rows with a cut; no cut and greedy


def _exact_params(got, rows):
    return dict(
        temperature=got["temperature"][rows], top_k=got["top_k"][rows].long(),
        top_p=got["top_p"][rows], min_p=got["min_p"][rows],
    )  # fmt: skip


def _unpack_mask(got):
    """vLLM's returned sampling mask (SamplingMaskTensors) as an (N, V) bool."""
    bits = got["mask_bits"].to(torch.int64)
    shifts = torch.arange(8)
    mask = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : got["scored"].shape[1]]
    return mask.bool()


def test_v2_exact_cut_is_opt_in_and_reaches_the_sampler(v2):
    assert v2["exact_sites"] == [
        "vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs",
        "vllm.v1.worker.gpu.sample.prompt_logprob.compute_token_logprobs",
        "vllm.v1.worker.cpu.logprob.compute_token_logprobs",
        "vllm.v1.worker.gpu.sample.sampler.Sampler.sample",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler._verify",
    ]
    assert "rejection sampler keeps vLLM's own top-k" in v2["exact_spec_refused"]
    assert v2["exact_options"] == "{'cut': 'exact'}" and v2["exact_unpatch"] is True
    assert "already applied with {'cut': 'exact'}" in v2["exact_then_default"]
    assert v2["plugin_cut"]  # the plugin with EXACTLOGP_VLLM_CUT=exact
    # a Sampler.sample that no longer calls _sample_random is refused, nothing patched
    assert "lacks Sampler.sample calling _sample_random" in v2["exact_refused"]
    assert "vLLM 0.34.0" in v2["exact_refused"] and v2["exact_nothing_patched"]
    _assert_same(v2["exact_unpatched_again"], v2["exact_unpatched"])


def test_v2_exact_cut_samples_inside_exactlogps_kept_set(v2):
    """Every row with a cut: the id vLLM returns is exactlogp.sample's draw (its uniform
    from vLLM's per-request hash) and lies in exactlogp.sampling_mask's kept set; the
    logits cut are those after vLLM's logit bias (row 5), before its temperature."""
    got, rows = v2["exact"], EXACT_ROWS
    before, logits = got["before"], v2["logits_exact"]
    assert torch.equal(before[:5], logits[:5].float())  # no processor on these rows
    assert before[5, 7] == logits[5, 7].float() + 5.0  # logit bias, then the cut
    params = _exact_params(got, rows)
    keep = exactlogp.sampling_mask(before[rows], **params).keep_mask
    sampled = got["sampled"][rows, 0]
    assert bool(keep.gather(1, sampled.unsqueeze(-1)).all())
    drawn = exactlogp.sample(before[rows], uniforms=got["uniforms"][rows], **params)
    assert torch.equal(sampled, drawn)
    assert keep.sum(-1).tolist() == [4, 5, 1173, 20]  # tens of ids kept, not one
    _assert_same(v2["exact_repeat"], got)  # seeded: the same draw again


def test_v2_exact_cut_logprobs_and_sampling_mask_are_exactlogps(v2):
    """The processed logprobs of the sampled ids are exactlogp.processed_logprobs on the
    same logits (bitwise), the processed logits are y on the kept set and -inf elsewhere,
    and vLLM's return_sampling_mask is that kept set."""
    got, rows = v2["exact"], EXACT_ROWS
    params = _exact_params(got, rows)
    x = got["before"][rows]
    res = exactlogp.processed_logprobs(x, got["sampled"][rows, 0], **params)
    assert int(res.num_dropped) == 0
    assert torch.equal(got["logprobs"][rows, 0], res.logprobs)
    y = x / params["temperature"].unsqueeze(-1)
    expected = torch.where(res.mask.keep_mask, y, float("-inf"))
    assert torch.equal(got["scored"][rows], expected)
    # top-k columns: the largest processed values, exactlogp's logprobs of them
    assert torch.equal(got["ids"][:, 0], got["sampled"][:, 0])
    top = torch.topk(got["scored"], got["ids"].shape[1] - 1, dim=-1).values
    assert torch.equal(got["scored"].gather(-1, got["ids"][:, 1:]), top)
    assert torch.equal(got["logprobs"], _exact_columns(got["scored"], got["ids"]))
    mask = _unpack_mask(got)
    assert torch.equal(mask[rows], res.mask.keep_mask)
    assert torch.equal(got["mask_counts"][rows], res.mask.keep_mask.sum(-1).to(torch.int32))
    for i, row in enumerate(rows):
        n = int(got["mask_counts"][row])
        ids = torch.nonzero(res.mask.keep_mask[i]).flatten().to(torch.int32)
        assert torch.equal(got["mask_ids"][row, :n], ids)


def test_v2_exact_cut_refuses_watermarked_requests_with_a_cut(v2):
    """vLLM's GPUWatermarkSampler draws in its own _sample_random: the exact cut would
    replace the watermarked draw silently, so a watermarked request with top_k is refused;
    a watermarked greedy request (no cut) samples as vLLM does."""
    got = v2["exact_watermark"]
    assert "a watermarked request (vLLM's watermark sampler) with top-k" in got["cut"]
    assert got["no cut"] == "sampled"


def test_v2_sampling_masks_replay_to_r_equals_1(v2):
    """vLLM's own SamplingMask objects (its scheduler's CSR sliced per request, as its
    output processor builds them) for the rows it sampled with the exact cut: the trainer
    replays them (kept_csr, replay_logprobs) on the same logits and gets the rollout's
    processed logprobs bit for bit -- r = exp(lp_train - lp_rollout) = 1 exactly -- and
    the same through patch_trl's drop-in inside `replaying`."""
    from exactlogp.integrations import kept_csr, replaying
    from exactlogp.integrations import trl as trl_dropin

    got, rows = v2["exact"], EXACT_ROWS
    masks = [type("SamplingMask", (), {"token_ids": got["sampling_masks"][r]})() for r in rows]
    assert all(len(m.token_ids) == 1 for m in masks)  # one generated token each
    ids, offsets = kept_csr(masks)
    params = _exact_params(got, rows)
    x, sampled = got["before"][rows], got["sampled"][rows, 0]
    train = exactlogp.replay_logprobs(x, sampled, ids, offsets, temperature=params["temperature"])
    rollout = got["logprobs"][rows, 0]
    assert int(train.num_dropped) == 0
    assert torch.equal(train.logprobs, rollout)
    assert torch.equal(torch.exp(train.logprobs - rollout), torch.ones(len(rows)))
    with replaying(masks) as replay:
        lp = trl_dropin.selective_log_softmax(x / params["temperature"].unsqueeze(-1), sampled)
    assert replay.num_dropped == 0 and torch.equal(lp, rollout)


def test_v2_exact_cut_leaves_other_rows_to_vllm(v2):
    """Rows without a cut (row 1) and greedy rows (row 2): vLLM's ids, processed logits,
    ranks and sampling mask bit for bit; the logprobs are exactlogp's of the same logits
    (the default patch)."""
    got, theirs, rows = v2["exact"], v2["exact_unpatched"], VLLM_ROWS
    for name in ("sampled", "ids", "ranks", "scored", "mask_counts", "mask_bits", "before"):
        assert torch.equal(got[name][rows], theirs[name][rows]), name
    assert torch.equal(got["uniforms"], theirs["uniforms"])
    torch.testing.assert_close(got["logprobs"][rows], theirs["logprobs"][rows])
    # and vLLM's own draw on the cut rows differs somewhere (the test can tell)
    assert not torch.equal(got["sampled"][EXACT_ROWS], theirs["sampled"][EXACT_ROWS])


# --- vLLM 0.33, V1 sampler ---


def test_v1_is_the_real_vllm(v1):
    assert v1["version"] == V1_VERSION
    assert "vllm.v1.sample.sampler.Sampler.forward" in v1["sites"]
    assert v1["idempotent"] and v1["wraps_original"]
    assert v1["unpatch"] is True and v1["restored"] and v1["unpatch_again"] is False


@pytest.mark.parametrize("case", ["raw_logprobs", "processed_logprobs", "greedy_processed",
                                  "token_ids"])  # fmt: skip
def test_v1_sampled_token_logprob_is_exactlogps(v1, case):
    """Column 0 (and the sampled token wherever it repeats) is exactlogp's; the top-k /
    requested-id columns, the sampled ids and ranks stay vLLM's."""
    theirs, got, logits = v1["unpatched"][case], v1["patched"][case], v1["logits"]
    for name in ("sampled", "ids", "ranks"):
        assert torch.equal(got[name], theirs[name]), name
    sampled = got["sampled"][:, 0].long()
    if case == "processed_logprobs":
        t = v1["temperature"]
        keep = ours.vllm_keep_mask(
            logits.float() / torch.where(t < 1e-5, 1.0, t)[:, None], v1["top_k"], v1["top_p"]
        )
        expected = selected_logprobs(
            logits, sampled, temperature=torch.where(t < 1e-5, 1.0, t), keep_mask=keep
        ).logprobs
        # vLLM's own processed logprobs of the top-k agree with that keep-mask
        assert torch.equal(torch.isfinite(theirs["logprobs"]),
                           keep.gather(-1, theirs["ids"].long()))  # fmt: skip
    else:
        expected = selected_logprobs(logits, sampled).logprobs
    same = (got["ids"].long() == sampled[:, None]) & ~torch.isneginf(theirs["logprobs"])
    assert bool(same[:, 0].all())
    assert torch.equal(got["logprobs"][same], expected[:, None].expand_as(same)[same])
    assert torch.equal(got["logprobs"][~same], theirs["logprobs"][~same])
    torch.testing.assert_close(got["logprobs"], theirs["logprobs"], atol=2e-6, rtol=1e-6)


def test_v1_processed_logprobs_with_penalties_are_refused(v1):
    assert v1["refused"].startswith("patch_vllm_sampler: processed_logprobs with penalties")


def test_v1_logits_requested_by_override_are_left_alone(v1):
    """The rejection sampler passes logprobs_mode_override="*_logits": logits, untouched."""
    theirs, got = v1["unpatched"]["override_logits"], v1["patched"]["override_logits"]
    assert torch.equal(got["logprobs"], theirs["logprobs"])
    assert torch.equal(theirs["logprobs"][:, 0], v1["logits"].float().gather(
        -1, theirs["ids"][:, :1].long())[:, 0])  # fmt: skip


def test_v1_unpatch_restores_vllms_bits(v1):
    _assert_same(v1["unpatched_again"], v1["unpatched"])
