"""exactlogp.integrations.nemo_rl, tested against a stand-in of NeMo-RL's
`nemo_rl/distributed/model_utils.py` (NVIDIA-NeMo/RL@7ea279abfbeb; NeMo-RL is not on the
package index: `nemo-rl` 0.0.0 there is an empty placeholder, tests/host_stubs/README.md).

Side by side on the same logits: the stand-in's own values within a stated tolerance of
the fp64 truth, ours within one fp32 ulp of it and bit for bit `exactlogp` called
directly; the patch reaching the module and the by-name copy in the Megatron trainer; a
gloo world of two ranks for the tensor-parallel paths (ours bitwise equal at TP 1 and 2,
the stand-in's own all-reduce path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from exactlogp import processed_logprobs, selected_logprobs
from exactlogp.integrations import autopatch
from exactlogp.integrations import nemo_rl as ours
from exactlogp.testing import fp64_reference, llm_like_logits, ulp32
from exactlogp.worlds import run_gloo_world, single_rank
from integration_stubs import STUB_ROOT, drop_stub_modules, use_stub_package

B, S, VOCAB = 2, 6, 507
HOST_TOL = 2e-5  # NeMo-RL's fp32 log-softmax of logits up to ~30 (a few fp32 ulps of 30)


@pytest.fixture(scope="module")
def group():
    """A gloo group of this one process: NeMo-RL's functions always all-reduce."""
    with single_rank(torch.device("cpu")) as g:
        yield g


@pytest.fixture
def host(monkeypatch):
    use_stub_package(monkeypatch, "nemo_rl")
    import nemo_rl.algorithms.logits_sampling_utils as sampling
    import nemo_rl.distributed.model_utils as model_utils
    import nemo_rl.models.megatron.train as train

    yield types.SimpleNamespace(mu=model_utils, sampling=sampling, train=train)
    ours.unpatch_nemo_rl()
    drop_stub_modules("nemo_rl")


def _case(dtype=torch.float32, positions=S, seed=0):
    logits, _ = llm_like_logits(B * positions, VOCAB, dtype, seed=seed)
    target = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))
    return logits.view(B, positions, VOCAB), target


def _direct(logits, target, **kw):
    """exactlogp called directly on what NeMo-RL's shift keeps: position t, target t + 1."""
    return selected_logprobs(logits[:, : S - 1], target[:, 1:], **kw).logprobs


def _truth(logits, target):
    x = logits[:, : S - 1].reshape(-1, VOCAB)
    return fp64_reference(x, target[:, 1:].reshape(-1)).logprobs.view(B, S - 1)


# --- values, side by side ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("positions", [S, S + 2])  # more logit positions: NeMo-RL pads
def test_values_side_by_side(host, group, dtype, chunk_size, positions):
    logits, target = _case(dtype, positions)
    args = (logits, target, 0, VOCAB, group)
    theirs = host.mu.from_parallel_logits_to_logprobs(*args, chunk_size=chunk_size)
    got = ours.from_parallel_logits_to_logprobs(*args, chunk_size=chunk_size)
    assert got.shape == theirs.shape == (B, S - 1) and got.dtype == theirs.dtype == torch.float32
    truth = _truth(logits, target)
    assert (theirs.double() - truth).abs().max() <= HOST_TOL
    assert ((got.double() - truth).abs() <= ulp32(truth)).all()
    assert torch.equal(got, _direct(logits, target))


def test_gradient_matches_the_host(host, group):
    logits, target = _case()
    grads = []
    for fn in (host.mu.from_parallel_logits_to_logprobs, ours.from_parallel_logits_to_logprobs,
               lambda x, t, *a: _direct(x, t)):  # fmt: skip
        leaf = logits.clone().requires_grad_(True)
        out = fn(leaf, target, 0, VOCAB, group)
        (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum().backward()
        grads.append(leaf.grad)
    theirs, got, direct = grads
    assert torch.equal(got, direct)
    assert (got - theirs).abs().max() <= 1e-6
    assert (got[:, S - 1 :] == 0).all()  # the dropped last position


def test_autograd_entries_take_a_shifted_target(host, group):
    logits, target = _case()
    direct = selected_logprobs(logits, target).logprobs
    for name, extra in (("DistributedLogprob", ()), ("ChunkedDistributedLogprob", (2,))):
        theirs = getattr(host.mu, name).apply(logits, target, 0, VOCAB, *extra, group)
        got = getattr(ours, name).apply(logits, target, 0, VOCAB, *extra, group)
        assert torch.equal(got, direct) and got.dtype == theirs.dtype
        assert (theirs - got).abs().max() <= HOST_TOL
    frozen = ours.DistributedLogprob.apply(logits.requires_grad_(True), target, 0, VOCAB, group,
                                           True)  # fmt: skip
    assert not frozen.requires_grad and torch.equal(frozen, direct)  # inference_only


def _kept_targets(logits, k):
    """Targets among each position's k largest logits, so that both cuts keep most."""
    top = logits.topk(k, dim=-1).indices  # (B, positions, k)
    pick = torch.randint(0, k, (B, S), generator=torch.Generator().manual_seed(5))
    nxt = top.gather(-1, pick.unsqueeze(-1)).squeeze(-1)  # next token from position t
    return torch.cat([nxt[:, -1:], nxt[:, :-1]], dim=1)  # target[:, t + 1] = nxt[:, t]


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (None, 0.9), (20, 0.9)])
def test_sampling_params_give_the_exact_cut(host, group, top_k, top_p):
    logits, _ = _case()
    target = _kept_targets(logits, 3)
    params = host.sampling.TrainingSamplingParams(top_k=top_k, top_p=top_p, temperature=0.5)
    theirs = host.mu.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, group,
                                                      sampling_params=params)  # fmt: skip
    got = ours.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, group,
                                                sampling_params=params)  # fmt: skip
    exact = processed_logprobs(logits[:, : S - 1], target[:, 1:], top_k=top_k,
                               top_p=None if top_p == 1.0 else top_p).logprobs  # fmt: skip
    assert torch.equal(got, exact)  # the temperature field is not read, as in NeMo-RL
    assert torch.equal(torch.isinf(got), torch.isinf(theirs))  # the same kept sets here
    finite = torch.isfinite(got)
    assert (got[finite] - theirs[finite]).abs().max() <= HOST_TOL
    cls = ours.ChunkedDistributedLogprobWithSampling
    shifted = cls.apply(logits[:, : S - 1], target[:, 1:], group, top_k, top_p, 2)
    assert torch.equal(shifted, exact)


def test_no_filter_is_the_plain_path(host, group):
    logits, target = _case()
    for params in (host.sampling.TrainingSamplingParams(),
                   host.sampling.TrainingSamplingParams(top_k=-1, top_p=1.0),
                   host.sampling.TrainingSamplingParams(top_k=0)):  # fmt: skip
        got = ours.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, group,
                                                    sampling_params=params)  # fmt: skip
        assert torch.equal(got, _direct(logits, target))


def test_ignore_index_and_tp_group_none(host):
    logits, target = _case()
    target[0, 2] = -100
    got = ours.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None)
    assert got[0, 1] == 0 and torch.equal(got, _direct(logits, target))


class _Group:
    def __init__(self, size):
        self._size = size

    def rank(self):
        return 0

    def size(self):
        return self._size


def test_bad_calls_raise_naming_the_argument(host):
    logits, target = _case()
    outside = target.clone()
    outside[1, 3] = VOCAB  # NeMo-RL scores it 0 (every rank masks it); a ValueError here
    with pytest.raises(NotImplementedError, match="cp_group has 2 ranks.*load-balanced"):
        ours.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, cp_group=_Group(2))
    one = ours.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, cp_group=_Group(1))
    assert torch.equal(one, _direct(logits, target))
    cases = [
        ((logits, target, 0, VOCAB - 1, None), {}, "vocab_end_index"),
        ((logits, target, True, VOCAB, None), {}, "vocab_start_index"),
        ((logits[0], target, 0, VOCAB, None), {}, r"\[B, S, V_local\]"),
        ((logits[:, :3], target, 0, VOCAB, None), {}, "at most their 3 positions"),
        ((logits, target, 0, VOCAB, None), {"chunk_size": 0}, "chunk_size"),
        (
            (logits, outside, 0, VOCAB, None),
            {},
            rf"target\[1, 2\] = {VOCAB} is not a column.*target\[:, 1:\]",
        ),
    ]
    for args, kwargs, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            ours.from_parallel_logits_to_logprobs(*args, **kwargs)
    assert torch.equal(target, _case()[1])  # nothing mutated


# --- the patch ---


def test_patch_reaches_the_module_and_its_copies(host, group):
    logits, target = _case()
    originals = {n: host.mu.__dict__[n] for n in ours.SIGNATURES}
    handle = ours.patch_nemo_rl()
    assert ours.patch_nemo_rl() is handle and not handle.skipped
    assert "nemo_rl.models.megatron.train.from_parallel_logits_to_logprobs" in handle.sites
    assert host.train.from_parallel_logits_to_logprobs is ours.from_parallel_logits_to_logprobs
    for name in ours.SIGNATURES:
        assert host.mu.__dict__[name] is getattr(ours, name)
    got = host.mu.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, group)
    assert torch.equal(got, _direct(logits, target))
    assert ours.unpatch_nemo_rl() and not ours.unpatch_nemo_rl()
    assert {n: host.mu.__dict__[n] for n in ours.SIGNATURES} == originals
    assert (
        host.train.from_parallel_logits_to_logprobs is originals["from_parallel_logits_to_logprobs"]
    )


def test_patch_with_vocab_size_leaves_the_padding_out(host, group):
    logits, target = _case()
    ours.patch_nemo_rl(vocab_size=500)
    with pytest.raises(ValueError, match="already applied"):
        ours.patch_nemo_rl()
    target = target.clamp(max=499)
    got = host.mu.from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, group)
    assert torch.equal(got, _direct(logits, target, vocab_size=500))
    got = host.mu.DistributedLogprob.apply(logits, target, 0, VOCAB, group)
    assert torch.equal(got, selected_logprobs(logits, target, vocab_size=500).logprobs)


def test_patch_refuses_another_convention(host, monkeypatch):
    def moved(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
              inference_only=False, cp_group=None, chunk_size=None, sampling_params=None,
              temperature=1.0):  # fmt: skip
        raise AssertionError("not to be called")

    monkeypatch.setattr(host.mu, "from_parallel_logits_to_logprobs", moved)
    with pytest.raises(RuntimeError, match=r"nemo_rl 0\.6\.0's .*from_parallel_logits_to_"
                                           r"logprobs takes .*temperature\).*nothing was "
                                           r"patched"):  # fmt: skip
        ours.patch_nemo_rl()
    assert (
        host.mu.from_parallel_logits_to_logprobs is moved
        and host.mu.DistributedLogprob is not ours.DistributedLogprob
    )


def test_patch_from_env(host, monkeypatch):
    monkeypatch.setenv("EXACTLOGP_PATCH", "nemo_rl")
    monkeypatch.setenv("EXACTLOGP_VOCAB_SIZE", "500")
    handles = autopatch.apply_from_env()
    assert handles["nemo_rl"].options == {"vocab_size": 500}
    assert host.mu.from_parallel_logits_to_logprobs.func is ours.from_parallel_logits_to_logprobs


def test_the_start_up_hook_patches_nemo_rl_when_imported():
    """EXACTLOGP_PATCH=nemo_rl: the hook's finder patches at the first `import nemo_rl`."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTLOGP_")}
    env.update(EXACTLOGP_PATCH="nemo_rl",
               PYTHONPATH=os.pathsep.join([str(root / "src"), str(STUB_ROOT)]))  # fmt: skip
    code = (
        "import nemo_rl.distributed.model_utils as m, exactlogp.integrations.nemo_rl as x; "
        "print(m.from_parallel_logits_to_logprobs is x.from_parallel_logits_to_logprobs)"
    )
    startup = (root / "src" / "exactlogp-autopatch.pth").read_text().strip()
    done = subprocess.run([sys.executable, "-c", f"{startup}\n{code}"], env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


# --- a gloo world of two ranks ---

TP_VOCAB = 508  # even shards: NeMo-RL's top-k / top-p path needs V_local * TP = V


def _tp_world(rank, world_size, group, logits, target, bounds):
    sys.path.insert(0, str(STUB_ROOT))
    import nemo_rl.distributed.model_utils as mu
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    from exactlogp.integrations import nemo_rl as ours

    start, end = bounds[rank]
    shard = logits[..., start:end].contiguous()
    s, e = rank * TP_VOCAB // 2, (rank + 1) * TP_VOCAB // 2
    half = logits[..., s:e].contiguous()
    params = TrainingSamplingParams(top_k=20, top_p=0.9)
    out = {
        "ours": ours.from_parallel_logits_to_logprobs(shard, target, start, end, group),
        "theirs": mu.from_parallel_logits_to_logprobs(shard, target, start, end, group),
        "ours_cut": ours.from_parallel_logits_to_logprobs(half, target, s, e, group,
                                                          sampling_params=params),
        "theirs_cut": mu.from_parallel_logits_to_logprobs(half, target, s, e, group,
                                                          sampling_params=params),
    }  # fmt: skip
    ours.patch_nemo_rl()
    out["patched"] = mu.from_parallel_logits_to_logprobs(shard, target, start, end, group)
    ours.unpatch_nemo_rl()
    return out


def test_tp2_gloo_world_is_bitwise_tp1():
    logits, _ = llm_like_logits(B * S, TP_VOCAB, torch.float32, seed=7)
    logits = logits.view(B, S, TP_VOCAB)
    target = _kept_targets(logits, 3)
    bounds = [(0, 300), (300, TP_VOCAB)]  # uneven shards with their explicit ranges
    results = run_gloo_world(2, _tp_world, logits, target, bounds, timeout=120)
    tp1 = ours.from_parallel_logits_to_logprobs(logits, target, 0, TP_VOCAB, None)
    cut_tp1 = processed_logprobs(logits[:, : S - 1], target[:, 1:], top_k=20, top_p=0.9).logprobs
    x = logits[:, : S - 1].reshape(-1, TP_VOCAB)
    truth = fp64_reference(x, target[:, 1:].reshape(-1)).logprobs.view(B, S - 1)
    for out in results:
        assert torch.equal(out["ours"], tp1) and torch.equal(out["patched"], tp1)
        assert (out["theirs"].double() - truth).abs().max() <= HOST_TOL  # its all-reduce path
        assert torch.equal(out["ours_cut"], cut_tp1)
        assert torch.equal(torch.isinf(out["theirs_cut"]), torch.isinf(cut_tp1))
        finite = torch.isfinite(cut_tp1)
        assert (out["theirs_cut"][finite] - cut_tp1[finite]).abs().max() <= HOST_TOL
