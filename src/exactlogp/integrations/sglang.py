"""SGLang rollout side: the sampled tokens' logprobs with the trainer's bits.

SGLang (0.5.23) computes the logprob of each sampled token inside
`sglang.srt.layers.sampler.Sampler.forward` and writes it to
`logits_output.next_token_logprobs`. `patch_sglang()` wraps that method: the logits it
receives are kept, SGLang samples as usual, and the sampled tokens' logprobs are replaced
by exactlogp's, as SGLang defines them:

- logits: fp32, cut to the real vocabulary, with penalties, the grammar mask and
  logit_bias already applied (SGLang does that before the sampler);
- temperature-scaled, log_softmax(logits / T) -- exactlogp's fp32(x) / T by IEEE
  division, one T per request -- and never top-k / top-p / min-p renormalised (those act
  only on sampling in SGLang); all-greedy batches and SGLANG_RETURN_ORIGINAL_LOGPROB use
  T = 1; the watermark path scores the logits before the watermark;
- RL mode (`--rl-on-policy-target`): SGLang rounds logits / T to bf16 and returns bf16;
  patched, the logprobs are exactlogp's fp32 of the same logits and temperature, which
  is what a trainer calling exactlogp on its bf16 logits gets.

The top-k / token-id logprob lists stay SGLang's. Refused loudly: a batch with custom
logit processors (they edit the logits inside the sampler, after they were kept) and
speculative-decoding logprobs (`compute_spec_logprobs`, with its by-name copies in the
spec workers).

SGLang runs its sampler in scheduler processes it spawns: set EXACTLOGP_PATCH=sglang and
exactlogp's `sglang.srt.plugins` entry point (`sglang_plugin`) patches each of them.
"""

from __future__ import annotations

import functools

import torch

from ..api import selected_logprobs
from . import _patching

PATCH_KEY = "patch_sglang"
_SAMPLER = "sglang.srt.layers.sampler"
_LOGPROBS = "sglang.srt.layers.logprob_processor"


@_patching.atomic
def patch_sglang() -> _patching.PatchHandle:
    """Wrap SGLang's `Sampler.forward` (see the module docstring) and refuse its
    speculative-decoding logprobs. Idempotent; undo with `unpatch_sglang()`. Raises
    ImportError without SGLang, AttributeError naming a symbol this SGLang moved (and
    changes nothing)."""
    sites = [
        _patching.Site(_SAMPLER, "Sampler.forward", _exact_forward, wraps=True),
        _patching.Site(
            _LOGPROBS, "compute_spec_logprobs", _refuse_spec, wraps=True, everywhere=True
        ),
    ]
    return _patching.apply(PATCH_KEY, sites)


@_patching.atomic
def unpatch_sglang() -> bool:
    """Restore SGLang's own sampler; False if it was not patched."""
    return _patching.undo(PATCH_KEY)


def sglang_plugin() -> None:
    """SGLang `sglang.srt.plugins` entry point (registered as `exactlogp`), run in each
    scheduler process: applies `patch_sglang()` when EXACTLOGP_PATCH names `sglang`."""
    from .autopatch import requested

    if "sglang" in requested():
        patch_sglang()


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperatures) -> torch.Tensor:
    """(B,) fp32 log_softmax(logits / T)[token_ids], as SGLang reports it (clamped to the
    fp32 minimum instead of -inf). `temperatures`: (B,) or (B, 1), or None for T = 1."""
    tau = 1.0 if temperatures is None else temperatures.reshape(-1).to(torch.float32)
    out = selected_logprobs(logits, token_ids.to(torch.int64), temperature=tau, validate=False)
    return out.logprobs.clamp(min=torch.finfo(torch.float32).min)


def _exact_forward(original):
    @functools.wraps(original)
    def forward(self, logits_output, sampling_info, return_logprob, *args, **kwargs):
        if not return_logprob:
            return original(self, logits_output, sampling_info, return_logprob, *args, **kwargs)
        if getattr(sampling_info, "has_custom_logit_processor", False):
            raise NotImplementedError(
                f"{PATCH_KEY}: custom logit processors edit the logits inside SGLang's "
                "sampler, after exactlogp kept them; their logprobs are not reproduced"
            )
        source = kwargs.get("logprob_logits")
        if source is None:
            source = logits_output.next_token_logits
        kept = source.clone()  # SGLang divides and softmaxes the logits in place
        token_ids = original(self, logits_output, sampling_info, return_logprob, *args, **kwargs)
        temperatures = None if _unscaled(sampling_info) else sampling_info.temperatures
        exact = sampled_logprobs(kept, token_ids, temperatures)
        logits_output.next_token_logprobs = exact
        return token_ids

    return forward


def _unscaled(sampling_info) -> bool:
    import sys

    module = sys.modules.get(_SAMPLER)
    original_logprob = bool(getattr(module, "SGLANG_RETURN_ORIGINAL_LOGPROB", False))
    return bool(sampling_info.is_all_greedy) or original_logprob


def _refuse_spec(original):
    @functools.wraps(original)
    def compute_spec_logprobs(*args, **kwargs):
        raise NotImplementedError(
            f"{PATCH_KEY}: speculative-decoding logprobs are not reproduced by exactlogp; "
            "turn speculative decoding off for rollouts whose logprobs the trainer checks, "
            "or unpatch_sglang()"
        )

    return compute_spec_logprobs
