"""OpenRLHF 0.11.2's own `openrlhf.models.utils` beside exactlogp.integrations.openrlhf on
the same CPU tensors, `patch_openrlhf()` on OpenRLHF's real modules (directly and through
EXACTLOGP_PATCH=openrlhf: its start-up hook, as `openrlhf` is first imported, and
`apply_from_env`), and OpenRLHF's own `Actor.forward` patched; saves what they returned.

Run by tests/test_integrations_openrlhf.py as `python openrlhf_run.py OUT.pt` in a
subprocess whose PYTHONPATH starts with an OpenRLHF 0.11.2 directory (`make setup`
installs it with --no-deps), with TORCHDYNAMO_DISABLE=1 (`compute_entropy` is
`torch.compile`d at import; disabled, the same torch operations run eagerly). Importing
`openrlhf.models.utils` runs `openrlhf/models/__init__.py`, which imports the actor, the
losses and the reward model with their dependencies: transformers, peft, sympy and
pylatexenc are the environment's own (`make setup`'s verl extra and torch bring them). The
stub modules (tests/real_hosts/stub_modules.py):
- `deepspeed`: `models/utils.py` and `models/model.py` import it at the top, for ZeRO-3
  helpers that nothing here calls; it is not installed here (it builds CUDA operators);
- `flash_attn`, `flash_attn.bert_padding` (`index_first_axis`, `pad_input`, `rearrange`,
  `unpad_input`), `flash_attn.utils`, `flash_attn.utils.distributed` (`all_gather`):
  `models/ring_attn_utils.py` imports these at the top for packed samples, unused here;
  flash-attn is CUDA-only. The `flash_attn` stub is no package, so OpenRLHF's
  `log_probs_from_logits` finds no `flash_attn.ops.triton.cross_entropy` and takes its
  torch path, as on a machine without flash-attn.
One attribute is set on OpenRLHF's `Actor`: `packing_samples = False`, which its
`__init__` sets only when it loads a model by name (here it is given a tiny Qwen3).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
from stub_modules import stub

VOCAB, BATCH, SEQ = 501, 2, 6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}  # fmt: skip
NAMES = ("log_probs_from_logits", "compute_entropy")


def install_stubs() -> None:
    stub("deepspeed")
    stub("flash_attn")
    stub("flash_attn.bert_padding", index_first_axis=None, pad_input=None, rearrange=None,
         unpad_input=None)  # fmt: skip
    stub("flash_attn.utils")
    stub("flash_attn.utils.distributed", all_gather=None)


def with_grad(fn, logits, *args, **kwargs):
    """fn's output and the gradient of a weighted sum of it in the logits. fn gets a copy
    that is not a leaf: OpenRLHF divides it in place, which a leaf refuses."""
    x = logits.clone().requires_grad_()
    out = fn(x.clone(), *args, **kwargs)
    out.backward(torch.linspace(-1.0, 2.0, out.numel()).view(out.shape).to(out.dtype))
    return out.detach(), x.grad


def direct(dtype):
    """exactlogp.selected_logprobs called directly, in OpenRLHF's output dtype."""
    from exactlogp import selected_logprobs

    def log_probs(logits, labels, temperature=1.0):
        return selected_logprobs(logits, labels, temperature=temperature).logprobs.to(dtype)

    def entropy(logits):
        zeros = torch.zeros(logits.shape[:-1], dtype=torch.int64)
        return selected_logprobs(logits, zeros, with_entropy=True).entropy.to(dtype)

    return {"log_probs_from_logits": log_probs, "compute_entropy": entropy}


def side_by_side(utils, ours) -> dict:
    from exactlogp.testing import llm_like_logits

    results = {}
    for key, dtype in DTYPES.items():
        flat, flat_labels = llm_like_logits(BATCH * SEQ, VOCAB, torch.float32, seed=len(key))
        logits, labels = flat.to(dtype).view(BATCH, SEQ, VOCAB), flat_labels.view(BATCH, SEQ)
        case = {"logits": logits, "labels": labels}
        mine = {"theirs": utils, "ours": ours}
        if dtype != torch.float64:  # outside the contract: no exactlogp to call
            mine["direct"] = direct(dtype)
        for who, fns in mine.items():
            fns = fns if isinstance(fns, dict) else {n: getattr(fns, n) for n in NAMES}
            for t in (1.0, 0.7):
                fn = fns["log_probs_from_logits"]
                case[f"{who}/log_probs/{t}"] = with_grad(fn, logits, labels, t)
            case[f"{who}/entropy"] = with_grad(fns["compute_entropy"], logits)
        for who, fn in (("theirs", utils.log_probs_from_logits),
                        ("ours", ours.log_probs_from_logits)):  # fmt: skip
            given = logits.clone()
            fn(given, labels, 0.7)
            case[f"{who}/logits_after"] = given  # what the caller's tensor holds afterwards
            ignored = labels.clone()
            ignored[0, 1] = ignored[1, 4] = -100
            try:
                case[f"{who}/ignored"] = fn(logits.clone(), ignored)
            except RuntimeError as exc:
                case[f"{who}/ignored"] = str(exc)
        results[key] = case
    return results


def patching(utils, actor, ours) -> dict:
    from exactlogp.integrations import autopatch

    own = {name: getattr(utils, name) for name in NAMES}
    out = {"own_actor": all(getattr(actor, n) is own[n] for n in NAMES)}
    handle = ours.patch_openrlhf()
    out["sites"], out["skipped"] = list(handle.sites), dict(handle.skipped)
    out["patched"] = all(getattr(m, n) is getattr(ours, n) for m in (utils, actor) for n in NAMES)
    out["idempotent"] = ours.patch_openrlhf() is handle
    out["actor_forward"] = actor_forward(actor)
    out["unpatch"], out["unpatch_again"] = ours.unpatch_openrlhf(), ours.unpatch_openrlhf()
    out["restored"] = all(getattr(m, n) is own[n] for m in (utils, actor) for n in NAMES)
    out["actor_forward_unpatched"] = actor_forward(actor)

    os.environ[autopatch.ENV] = "openrlhf"  # what a worker's start-up applies
    handles = autopatch.apply_from_env()
    out["env_patched"] = actor.log_probs_from_logits is ours.log_probs_from_logits
    handles["openrlhf"].undo()
    del os.environ[autopatch.ENV]

    # an OpenRLHF whose function takes other arguments is refused, and nothing is patched
    def compute_entropy(logits, dim=-1):
        raise AssertionError("never called")

    utils.compute_entropy = compute_entropy
    try:
        ours.patch_openrlhf()
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["nothing_patched"] = all(getattr(actor, n) is own[n] for n in NAMES) and (
        utils.log_probs_from_logits is own["log_probs_from_logits"]
    )
    utils.compute_entropy = own["compute_entropy"]
    return out


def actor_forward(actor_module) -> dict:
    """OpenRLHF's own Actor.forward on a tiny random Qwen3 (fp32): its action log-probs and
    entropy, and the LM head's logits it scored (from a hook)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, pad_token_id=0)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    actor = actor_module.Actor(model, temperature=0.7)
    actor.packing_samples = False  # set by __init__ only for a model loaded by name
    seen = {}  # the hook returns None: a value would replace the head's output
    model.lm_head.register_forward_hook(lambda m, i, o: seen.update(logits=o.detach().clone()))
    sequences = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    action_mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        log_probs, output = actor(sequences, action_mask, attention_mask, return_output=True,
                                  return_entropy=True)  # fmt: skip
    return {"sequences": sequences, "action_mask": action_mask, "logits": seen["logits"],
            "action_log_probs": log_probs, "entropy": output.entropy}  # fmt: skip


def import_under_the_startup_hook():
    """EXACTLOGP_PATCH=openrlhf's start-up hook (what exactlogp's .pth file installs):
    OpenRLHF is patched as `openrlhf` is first imported. Returns whether it was, and
    unpatches."""
    import _exactlogp_autopatch as hook

    os.environ[hook.ENV] = "openrlhf"
    hook.install()
    import openrlhf.models.actor as actor

    from exactlogp.integrations import openrlhf as ours

    patched = all(getattr(actor, n) is getattr(ours, n) for n in NAMES)
    ours.unpatch_openrlhf()
    hook.uninstall()
    del os.environ[hook.ENV]
    return patched


def main(out_path: str) -> None:
    install_stubs()
    hook_patched = import_under_the_startup_hook()
    import openrlhf.models.actor as actor
    import openrlhf.models.utils as utils

    from exactlogp.integrations import _patching
    from exactlogp.integrations import openrlhf as ours

    results = {
        "hook_patched": hook_patched,
        "version": _patching.host_version("openrlhf", "test"),
        "utils_file": utils.__file__,
        "side_by_side": side_by_side(utils, ours),
        "patch": patching(utils, actor, ours),
    }
    torch.save(results, out_path)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
