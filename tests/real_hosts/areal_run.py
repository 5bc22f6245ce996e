"""AReaL 1.0.4's own `areal.utils.functional.vocab_parallel` beside
exactlogp.integrations.areal on the same CPU tensors, and `patch_areal()` on AReaL's real
modules (directly and through EXACTLOGP_PATCH=areal: its start-up hook and
`apply_from_env`); saves what both returned.

Run by tests/test_integrations_areal.py as `python areal_run.py OUT.pt` in a subprocess
whose PYTHONPATH starts with an AReaL 1.0.4 directory (`make setup` installs it with
--no-deps), with TORCHDYNAMO_DISABLE=1: AReaL wraps its local path in `torch.compile` at
import, which on a CPU compiles C++ for many seconds; disabled, the same torch operations
run eagerly. What runs is AReaL's `gather_logprobs` / `gather_logprobs_entropy` (its
local path: fp32 cast, division by the temperature, log_softmax, gather, chunks of
`chunk_size` rows) and its package `areal.utils.functional`.

The stub modules (tests/real_hosts/stub_modules.py), each for an import on the way to
`vocab_parallel` that pulls what this machine does not have:
- `areal`: the package over its real directory without running its `__init__.py`, which
  imports AReaL's controllers, launchers and schedulers (`areal.infra`: ray, aiohttp,
  uvloop, torchdata, transformers);
- `areal.infra`: empty, for the same reason (its `__init__` is that import chain);
- `areal.infra.platforms` with `is_npu_available = False` (what a CUDA machine has): the
  one name `vocab_parallel` imports; the real module imports transformers and AReaL's
  colorlog logging to detect the device;
- `areal.utils.functional.functional`: the PPO / DPO losses that the package's
  `__init__` re-exports beside the two functions; the real module imports hydra,
  omegaconf and uvloop through `areal.api.cli_args`. Its nine names are placeholders.
AReaL's engines and its tree-attention module do not import here (their own dependencies,
lark, mbridge and uvloop, are not installed): patch_areal() names them in `skipped`.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
from stub_modules import stub

VOCAB, ROWS, PADDED = 507, 12, 512
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NAMES = ("gather_logprobs", "gather_logprobs_entropy")
LOSSES = (
    "RejectionSamplingResult", "apply_rejection_sampling", "dpo_pair_logratios",
    "dpo_preference_loss", "masked_normalization", "ppo_actor_loss_fn", "ppo_critic_loss_fn",
    "reward_overlong_penalty", "sapo_loss_fn",
)  # fmt: skip


def install_stubs() -> None:
    import importlib.util

    root = Path(importlib.util.find_spec("areal").submodule_search_locations[0])
    stub("areal", path=str(root))
    stub("areal.infra")
    stub("areal.infra.platforms", is_npu_available=False)
    stub("areal.utils.functional.functional", **{name: object() for name in LOSSES})


def with_grad(fn, logits, labels, **kwargs):
    """fn's outputs (a tuple) and the gradient of a weighted sum of them in the logits."""
    x = logits.clone().requires_grad_()
    out = fn(x, labels, **kwargs)
    out = out if isinstance(out, tuple) else (out,)
    weights = torch.linspace(-1.0, 2.0, labels.numel()).view(labels.shape)
    sum((o * weights * (k + 1)).sum() for k, o in enumerate(out)).backward()
    return tuple(o.detach() for o in out), x.grad


def direct(name: str):
    """exactlogp.selected_logprobs called directly, returning what AReaL's `name` does."""
    from exactlogp import selected_logprobs

    def fn(logits, labels, temperature):
        result = selected_logprobs(
            logits, labels, temperature=temperature, with_entropy=name.endswith("_entropy")
        )
        return (result.logprobs, result.entropy) if result.entropy is not None else result.logprobs

    return fn


def side_by_side(vp, ours) -> dict:
    from exactlogp.testing import llm_like_logits

    results = {}
    for dtype, seed in (("bf16", 1), ("fp32", 2)):
        logits, labels = llm_like_logits(ROWS, VOCAB, DTYPES[dtype], seed=seed)
        for temperature in (1.0, 0.7):
            case = {"logits": logits, "labels": labels, "temperature": temperature}
            for name in NAMES:
                kw = {"temperature": temperature}
                case[f"theirs/{name}"] = with_grad(getattr(vp, name), logits, labels, **kw)
                case[f"theirs_chunked/{name}"] = with_grad(
                    getattr(vp, name), logits, labels, chunk_size=5, **kw
                )
                case[f"ours/{name}"] = with_grad(getattr(ours, name), logits, labels, **kw)
                case[f"ours_chunked/{name}"] = with_grad(
                    getattr(ours, name), logits, labels, chunk_size=5, **kw
                )
                case[f"direct/{name}"] = with_grad(direct(name), logits, labels, **kw)
            results[f"{dtype}/{temperature}"] = case
    return results


def patching(vp, functional, ours) -> dict:
    from exactlogp.integrations import autopatch

    own = {name: getattr(vp, name) for name in NAMES}
    logits, labels = torch.randn(ROWS, VOCAB), torch.randint(0, VOCAB, (ROWS,))
    out = {"logits": logits, "labels": labels}
    handle = ours.patch_areal()
    out["sites"], out["skipped"] = list(handle.sites), dict(handle.skipped)
    out["patched_defined"] = all(getattr(vp, n) is getattr(ours, n) for n in NAMES)
    out["patched_reexport"] = all(getattr(functional, n) is getattr(ours, n) for n in NAMES)
    out["idempotent"] = ours.patch_areal() is handle
    # an engine calls the re-export it imported by name
    out["patched_call"] = functional.gather_logprobs_entropy(logits, labels, 0.7)
    out["unpatch"], out["unpatch_again"] = ours.unpatch_areal(), ours.unpatch_areal()
    out["restored"] = all(getattr(vp, n) is own[n] and getattr(functional, n) is own[n]
                          for n in NAMES)  # fmt: skip
    out["unpatched_call"] = functional.gather_logprobs_entropy(logits, labels, 0.7)

    # with vocab_size: the patched functions leave the padding columns out
    padded = torch.cat([logits, torch.zeros(ROWS, PADDED - VOCAB)], -1)
    handle = ours.patch_areal(vocab_size=VOCAB)
    out["vocab_size_options"] = dict(handle.options)
    out["vocab_size_call"] = functional.gather_logprobs(padded, labels)
    try:
        ours.patch_areal()
    except ValueError as exc:
        out["other_options"] = str(exc)
    ours.unpatch_areal()

    # EXACTLOGP_PATCH=areal: what a worker's start-up applies
    os.environ[autopatch.ENV] = "areal"
    handles = autopatch.apply_from_env()
    out["env_patched"] = functional.gather_logprobs is ours.gather_logprobs
    handles["areal"].undo()
    del os.environ[autopatch.ENV]

    # an AReaL whose function takes other arguments is refused, and nothing is patched
    def gather_logprobs(logits, labels, temperature=1.0, tp_group=None):
        raise AssertionError("never called")

    vp.gather_logprobs = gather_logprobs
    try:
        ours.patch_areal()
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["nothing_patched"] = vp.gather_logprobs_entropy is own["gather_logprobs_entropy"] and (
        functional.gather_logprobs is own["gather_logprobs"]
    )
    vp.gather_logprobs = own["gather_logprobs"]
    return out


def startup_hook(vp, ours) -> bool:
    """EXACTLOGP_PATCH=areal's start-up hook (what exactlogp's .pth file installs), with
    `areal` already imported (the stub): it patches AReaL at once. Returns whether it
    did, and unpatches."""
    import _exactlogp_autopatch as hook

    os.environ[hook.ENV] = "areal"
    hook.install()
    patched = all(getattr(vp, n) is getattr(ours, n) for n in NAMES)
    ours.unpatch_areal()
    hook.uninstall()
    del os.environ[hook.ENV]
    return patched


def main(out_path: str) -> None:
    install_stubs()
    import areal.utils.functional as functional
    import areal.utils.functional.vocab_parallel as vp

    from exactlogp.integrations import _patching
    from exactlogp.integrations import areal as ours

    results = {
        "hook_patched": startup_hook(vp, ours),
        "version": _patching.host_version("areal", "test"),
        "vocab_parallel_file": vp.__file__,
        "side_by_side": side_by_side(vp, ours),
        "patch": patching(vp, functional, ours),
    }
    torch.save(results, out_path)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
