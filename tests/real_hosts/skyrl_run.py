"""SkyRL 0.3.0's own log-prob and entropy functions on CPU tensors, unpatched, patched with
exactlogp, and unpatched again; saves what they returned.

Run by tests/test_integrations_skyrl.py as `python skyrl_run.py OUT.pt` in a subprocess
whose PYTHONPATH starts with a SkyRL 0.3.0 directory (`make setup`: skyrl with --no-deps,
plus jaxtyping, wadler-lindig and loguru; pydantic, fsspec, transformers, peft and
megatron-core come from the venv). What runs is SkyRL's own
`skyrl.backends.skyrl_train.utils.torch_utils` (`logprobs_from_logits`,
`chunked_entropy_from_logits`), the FSDP worker's `model_wrapper` that binds both by name,
and the Megatron backend's `distributed.megatron.model_utils.from_parallel_logits_to_logprobs`
over a gloo process group of one rank. Two imports are stub modules:

- `skyrl.backends` (the package's `__init__`): it imports the Tinker backend's base class,
  whose pydantic models use `typing.TypedDict`, which pydantic refuses before Python 3.12
  ("Please use `typing_extensions.TypedDict`") although SkyRL 0.3.0 declares Python >= 3.11.
  The stub is a package whose `__path__` is SkyRL's own directory, so every module under
  it is SkyRL's file; only that `__init__` does not run.
- `flash_attn.bert_padding` (`pad_input`, `unpad_input`; flash-attn is a CUDA build):
  `model_wrapper` imports them by name and nothing here calls them. flash-attn's
  cross-entropy stays absent, so `torch_utils` takes its `logprobs_from_logits_v2` path,
  as SkyRL does on any machine without flash-attn.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import traceback
import types

import torch

B, S, VOCAB = 2, 6, 509


def _stub_imports() -> None:
    import skyrl

    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules["skyrl.backends"] = backends
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    padding.pad_input = padding.unpad_input = None
    sys.modules["flash_attn.bert_padding"] = padding


def _inputs():
    from exactlogp.testing import llm_like_logits

    logits, _ = llm_like_logits(B * (S + 2), VOCAB, torch.float32, seed=3)
    logits = logits.view(B, S + 2, VOCAB)
    generator = torch.Generator().manual_seed(4)
    return {
        "logits32": logits[:, :S].contiguous(),
        "logits16": logits[:, :S].to(torch.bfloat16),
        "padded32": logits,  # two more positions than the target: NeMo-RL's padding path
        "labels": torch.randint(0, VOCAB, (B, S), generator=generator),
        "mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
    }


def _run_all(inp, tu, mw, mg, group):
    x32, x16, labels, mask = inp["logits32"], inp["logits16"], inp["labels"], inp["mask"]
    out = {
        "lp32": tu.logprobs_from_logits(x32, labels),
        "lp16": tu.logprobs_from_logits(x16, labels),
        "ent32": tu.chunked_entropy_from_logits(x32, attention_mask=mask, chunk_size=4),
        "ent16": tu.chunked_entropy_from_logits(x16, attention_mask=mask),
        "wrapper_lp16": mw.logprobs_from_logits(x16, labels),
        "wrapper_ent32": mw.chunked_entropy_from_logits(x32),
        "mg32": mg.from_parallel_logits_to_logprobs(x32, labels, 0, VOCAB, group),
        "mg16": mg.from_parallel_logits_to_logprobs(x16, labels, 0, VOCAB, group),
        "mg_chunk": mg.from_parallel_logits_to_logprobs(x32, labels, 0, VOCAB, group, chunk_size=4),
        "mg_padded": mg.from_parallel_logits_to_logprobs(inp["padded32"], labels, 0, VOCAB, group),
    }
    leaf = x32.clone().requires_grad_(True)
    lp = mg.from_parallel_logits_to_logprobs(leaf, labels, 0, VOCAB, group)
    (lp * torch.linspace(0.5, 1.5, lp.numel()).view(lp.shape)).sum().backward()
    out["mg_grad"] = leaf.grad
    return out


def main(out_path: str) -> None:
    _stub_imports()
    import skyrl
    import skyrl.backends.skyrl_train.distributed.megatron.model_utils as mg
    import skyrl.backends.skyrl_train.utils.torch_utils as tu
    import skyrl.backends.skyrl_train.workers.model_wrapper as mw

    from exactlogp.integrations import skyrl as ours
    from exactlogp.worlds import single_rank

    inp = _inputs()
    saved = {"version": skyrl.__version__, "inputs": inp,
             "flash_ce": tu.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE}  # fmt: skip
    originals = (tu.logprobs_from_logits, mw.chunked_entropy_from_logits,
                 mg.from_parallel_logits_to_logprobs, mg.DistributedLogprob)  # fmt: skip
    with single_rank(torch.device("cpu")) as group:
        saved["unpatched"] = _run_all(inp, tu, mw, mg, group)
        handle = ours.patch_skyrl()
        saved["sites"], saved["skipped"] = list(handle.sites), dict(handle.skipped)
        saved["idempotent"] = ours.patch_skyrl() is handle
        saved["patched"] = _run_all(inp, tu, mw, mg, group)
        saved["unpatch"] = ours.unpatch_skyrl()
        saved["restored"] = (tu.logprobs_from_logits, mw.chunked_entropy_from_logits,
                             mg.from_parallel_logits_to_logprobs,
                             mg.DistributedLogprob) == originals  # fmt: skip
        saved["unpatch_again"] = ours.unpatch_skyrl()
        saved["unpatched_again"] = _run_all(inp, tu, mw, mg, group)
    torch.save(saved, out_path)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
