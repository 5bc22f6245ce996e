"""SGLang rollout side: the sampled tokens' logprobs with the trainer's bits, and
(opt-in) the exact top-k / top-p / min-p cut and draw.

SGLang (0.5.23) samples and computes the logprob of each sampled token inside
`sglang.srt.layers.sampler.Sampler.forward` and writes it to
`logits_output.next_token_logprobs`. `patch_sglang()` wraps that method. By default
(`cut="float"`) the logits it receives are kept, SGLang samples as usual, and the sampled
tokens' logprobs are replaced by exactlogp's, as SGLang defines them:

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

`patch_sglang(cut="exact")` also makes SGLang draw from exactlogp's cut (docs/numerics.md
section 13) in every batch that is not all greedy: SGLang's own sampling (its float
top-k / top-p / min-p and FlashInfer's fused samplers) does not run; the tokens are
`exactlogp.sample` on the logits after SGLang's `_preprocess_logits`, and the reported
logprobs are `exactlogp.processed_logprobs` of those tokens -- the log-softmax over the
kept set, what a trainer replays with the same parameters (see `_exact_cut_forward` and
`exact_cut_params`). All-greedy batches keep SGLang's argmax and the default logprobs.

SGLang runs its sampler in scheduler processes it spawns: set EXACTLOGP_PATCH=sglang (and
EXACTLOGP_SGLANG_CUT=exact for the exact cut) and exactlogp's `sglang.srt.plugins` entry
point (`exactlogp.integrations.autopatch.sglang_plugin`) patches each of them.

Tested against a stand-in of SGLang's sampler (its real module needs CUDA-built
torchvision here): tests/host_stubs/sglang, with SGLang 0.5.23's names and shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from ..api import selected_logprobs
from . import _patching

PATCH_KEY = "patch_sglang"
_SAMPLER = "sglang.srt.layers.sampler"
_LOGPROBS = "sglang.srt.layers.logprob_processor"
CUTS = ("float", "exact")
CUT_ENV = "EXACTLOGP_SGLANG_CUT"  # read by patch_from_env: "exact" for patch_sglang(cut="exact")
# The fields of SGLang's LogprobResult that the exact cut fills (0.5.23).
_RESULT_FIELDS = ("token_logprobs", "top_logprobs_val", "top_logprobs_idx",
                  "token_ids_logprobs_val", "token_ids_logprobs_idx")  # fmt: skip


@_patching.atomic
def patch_sglang(cut: str = "float") -> _patching.PatchHandle:
    """Wrap SGLang's `Sampler.forward` (see the module docstring) and refuse its
    speculative-decoding logprobs.

    cut: "float" (default) leaves SGLang's sampling as it is and reports exactlogp's
    logprobs of what it draws. "exact" draws every batch that is not all greedy with
    `exactlogp.sample` on the exact min-p / top-k / top-p cut and reports
    `exactlogp.processed_logprobs` of the drawn tokens (`_exact_cut_forward` says how
    SGLang's parameters, seeds and logprob lists map). Changing how SGLang samples is the
    user's choice, hence opt-in.

    Idempotent; undo with `unpatch_sglang()`. Raises ValueError for an unknown `cut` (or
    when patched with another cut: unpatch first), ImportError without SGLang,
    AttributeError naming a symbol this SGLang moved, and with cut="exact" RuntimeError
    naming the SGLang version and what its sampler lacks (nothing is changed then)."""
    if cut not in CUTS:
        raise ValueError(f"patch_sglang: cut must be one of {CUTS}, got {cut!r}")
    if cut == "exact":
        _check_exact_cut_takes_effect()
    forward = _exact_cut_forward if cut == "exact" else _exact_forward
    sites = [
        _patching.Site(_SAMPLER, "Sampler.forward", forward, wraps=True),
        _patching.Site(
            _LOGPROBS, "compute_spec_logprobs", _refuse_spec, wraps=True, everywhere=True
        ),
    ]
    return _patching.apply(PATCH_KEY, sites, {"cut": cut} if cut != "float" else None)


@_patching.atomic
def unpatch_sglang() -> bool:
    """Restore SGLang's own sampler; False if it was not patched."""
    return _patching.undo(PATCH_KEY)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=sglang (exactlogp.integrations.autopatch): `patch_sglang` with the
    cut EXACTLOGP_SGLANG_CUT asks for (unset or empty: the default)."""
    del vocab_size  # SGLang's own logits carry their vocabulary
    return patch_sglang(cut=requested_cut())


def requested_cut() -> str:
    """EXACTLOGP_SGLANG_CUT as a `patch_sglang` cut ("float" when unset or empty)."""
    return _patching.env_choice(CUT_ENV, CUTS)


def sglang_version() -> str:
    return _patching.host_version("sglang", PATCH_KEY)


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperatures) -> torch.Tensor:
    """(B,) fp32 log_softmax(logits / T)[token_ids], as SGLang reports it (clamped to the
    fp32 minimum instead of -inf). `temperatures`: (B,) or (B, 1), or None for T = 1."""
    tau = 1.0 if temperatures is None else temperatures.reshape(-1).to(torch.float32)
    out = selected_logprobs(logits, token_ids.to(torch.int64), temperature=tau, validate=False)
    return out.logprobs.clamp(min=torch.finfo(torch.float32).min)


def exact_cut_params(
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    vocab_size: int,
) -> dict[str, torch.Tensor]:
    """exactlogp's per-row sampling parameters for SGLang's normalised ones (the fields
    of `SamplingBatchInfo`: temperatures (B, 1) or (B,) fp32, top_ks (B,) int, top_ps
    and min_ps (B,) fp32), as {"temperature", "top_k", "top_p", "min_p"} (B,) tensors
    for `exactlogp.sample`, `processed_logprobs` and `sampling_mask`.

    SGLang's conventions map as follows: a row with top_k <= 1 is SGLang's greedy (it
    stores a temperature below 1e-6 as temperature 1.0 with top_k 1) and becomes
    exactlogp's greedy row, temperature 0: the argmax (lowest id on ties), scored at
    temperature 1 with no cut, as SGLang scores all-greedy batches; a top_k of at least
    `vocab_size` (SGLang's "no top-k" is 1 << 30) is no cut (0); top_p 1.0 and min_p 0.0
    are no cut in both. A trainer replays a rollout with `processed_logprobs(logits, ids,
    **exact_cut_params(...))` on the same logits."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    fields = {"temperatures": temperatures, "top_ks": top_ks, "top_ps": top_ps, "min_ps": min_ps}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    rows = top_ks.numel()
    for name, value in fields.items():
        if value.numel() != rows or value.dim() > 2:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}, but the batch has {rows} rows "
                f"(top_ks has shape {tuple(top_ks.shape)})"
            )
    if top_ks.is_floating_point():
        raise TypeError(f"top_ks must have an integer dtype, got {top_ks.dtype}")
    device = temperatures.device
    k = top_ks.reshape(-1).to(device=device, dtype=torch.int64)
    greedy = k <= 1
    no_k = greedy | (k >= vocab_size)
    t = temperatures.reshape(-1).to(device=device, dtype=torch.float32)
    p = top_ps.reshape(-1).to(device=device, dtype=torch.float32)
    m = min_ps.reshape(-1).to(device=device, dtype=torch.float32)
    return {
        "temperature": torch.where(greedy, torch.zeros_like(t), t),
        "top_k": torch.where(no_k, torch.zeros_like(k), k),
        "top_p": torch.where(greedy, torch.ones_like(p), p),
        "min_p": torch.where(greedy, torch.zeros_like(m), m),
    }


def row_uniforms(sampling_seed, positions, logits: torch.Tensor) -> torch.Tensor:
    """(B,) float64 in [0, 1): one uniform per row for exactlogp's inverse-CDF draw.

    With SGLang's deterministic inference (`sampling_info.sampling_seed` set: each
    request's seed, 42 where it gave none) the uniform is 53 bits of SGLang's own
    `murmur_hash32(seed, position, c)` (the hash its seeded Gumbel race uses, looked up
    in `sglang.srt.layers.sampler`) at the counters c = V and V + 1 -- the race uses the
    token ids 0 .. V-1 -- high word first: the same request, position and logits draw
    the same token in any batch. Without seeds: `torch.rand` on the logits' device, from
    torch's default generator there (where SGLang's torch.multinomial draws)."""
    rows = logits.shape[0]
    if sampling_seed is None:
        return torch.rand(rows, dtype=torch.float64, device=logits.device)
    if positions is None:
        raise ValueError(
            "patch_sglang(cut='exact'): a batch with sampling_seed needs the tokens' "
            "positions, but the sampler got positions=None"
        )
    hash32 = sys.modules[_SAMPLER].murmur_hash32
    vocab = logits.shape[-1]
    counters = torch.tensor([vocab, vocab + 1], dtype=torch.int64, device=logits.device)
    words = hash32(sampling_seed.to(torch.uint64), positions, counters).to(torch.int64)
    bits = (words[:, 0] << 21) | (words[:, 1] >> 11)
    return bits.to(torch.float64) / float(1 << 53)


def _exact_forward(original):
    @functools.wraps(original)
    def forward(self, logits_output, sampling_info, return_logprob, *args, **kwargs):
        if not return_logprob:
            return original(self, logits_output, sampling_info, return_logprob, *args, **kwargs)
        _refuse_custom_processors(sampling_info)
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


def _exact_cut_forward(original):
    """Sampler.forward with the exact cut (patch_sglang(cut="exact")).

    All-greedy batches (and empty ones) go to SGLang's own forward, with the default
    patch's logprobs. Any other batch: SGLang's `_preprocess_logits` (its custom logit
    processors and NaN handling) runs on `logits_output.next_token_logits`, then

    - the parameters: `exact_cut_params` of the batch's temperatures, top_ks, top_ps,
      min_ps (greedy rows of a mixed batch are exactlogp's greedy rows);
    - the draw: `exactlogp.sample(logits, uniforms=row_uniforms(...), **params)` on those
      fp32 logits -- SGLang's own sampling (float cut, FlashInfer or PyTorch backend, the
      RL and Ascend paths) does not run, and the logits are left as they are (SGLang
      would leave their softmax there). The ids are returned as int32, as SGLang's
      sampling paths return them, after SGLang's `_sync_token_ids_across_tp`;
    - with return_logprob, through SGLang's `LogprobResult.write_output_to`:
      next_token_logprobs = `exactlogp.processed_logprobs(logits, ids, **params)`, the
      log-softmax over the kept set (clamped to the fp32 minimum, as SGLang clamps). The
      top-logprob and token-id lists are made consistent with it rather than left as
      SGLang's (which never reflect the cut): their values are exactlogp's logprobs over
      the same kept set (the sampled token's value is next_token_logprobs, bit for bit),
      the fp32 minimum for a token outside it; the top list is the kept tokens with the
      largest fp32(x) / T. Each list column costs one pass over the logits.
      SGLANG_RETURN_ORIGINAL_LOGPROB still reports the uncut log_softmax at T = 1.

    Refused (NotImplementedError) in such a batch: logprobs with custom logit processors
    (as by default) or with a watermark (`logprob_logits`: the token is drawn from
    logits the watermark edited, so no logprob of the unedited ones is the draw's), and
    SGLang's sampling-mask output (`return_sampling_mask`).
    """
    default = _exact_forward(original)

    @functools.wraps(original)
    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                token_ids_logprobs, positions, *, logprob_logits=None):  # fmt: skip
        logits = logits_output.next_token_logits
        if sampling_info.is_all_greedy or logits.shape[0] == 0:
            extra = {} if logprob_logits is None else {"logprob_logits": logprob_logits}
            return default(self, logits_output, sampling_info, return_logprob,
                           top_logprobs_nums, token_ids_logprobs, positions, **extra)  # fmt: skip
        _refuse_for_exact_cut(sampling_info, return_logprob, logprob_logits)
        from ..cut.api import sample

        logits = self._preprocess_logits(logits, sampling_info)
        params = exact_cut_params(
            sampling_info.temperatures, sampling_info.top_ks, sampling_info.top_ps,
            sampling_info.min_ps, logits.shape[-1],
        )  # fmt: skip
        uniforms = row_uniforms(sampling_info.sampling_seed, positions, logits)
        token_ids = sample(logits, uniforms=uniforms, **params)
        if return_logprob:
            _write_logprobs(logits_output, logits, token_ids, params, top_logprobs_nums,
                            token_ids_logprobs)  # fmt: skip
        token_ids = token_ids.to(torch.int32)
        self._sync_token_ids_across_tp(token_ids, sampling_info)
        return token_ids

    return forward


def _write_logprobs(logits_output, logits, token_ids, params, top_logprobs_nums,
                    token_ids_logprobs) -> None:  # fmt: skip
    from ..cut.api import processed_logprobs

    lists = any(k > 0 for k in top_logprobs_nums) or any(
        ids is not None for ids in token_ids_logprobs
    )
    if _return_original_logprob():
        tau, keep = torch.ones_like(params["temperature"]), None
        exact = sampled_logprobs(logits, token_ids, None)
    else:
        t = params["temperature"]
        tau = torch.where(t == 0, torch.ones_like(t), t)  # greedy rows: temperature 1
        res = processed_logprobs(logits, token_ids, **params)
        exact = res.logprobs.clamp(min=torch.finfo(torch.float32).min)
        keep = res.mask.keep_mask if lists else None
    result = sys.modules[_LOGPROBS].LogprobResult(token_logprobs=exact)
    if any(k > 0 for k in top_logprobs_nums):
        y = logits.to(torch.float32) / tau.unsqueeze(-1)
        if keep is not None:
            y = y.masked_fill(~keep, float("-inf"))
        idx = y.topk(max(top_logprobs_nums), dim=-1).indices
        values = _column_logprobs(logits, idx, tau, keep)
        result.top_logprobs_val = [values[i][:k] for i, k in enumerate(top_logprobs_nums)]
        result.top_logprobs_idx = [idx[i][:k] for i, k in enumerate(top_logprobs_nums)]
    if any(ids is not None for ids in token_ids_logprobs):
        table = _id_table(token_ids_logprobs, logits.shape[-1], logits.device)
        values = _column_logprobs(logits, table, tau, keep)
        result.token_ids_logprobs_val = [
            values.new_empty((0,)) if ids is None else values[i, : len(ids)]
            for i, ids in enumerate(token_ids_logprobs)
        ]
        result.token_ids_logprobs_idx = [[] if ids is None else ids for ids in token_ids_logprobs]
    result.write_output_to(logits_output)


def _id_table(token_ids_logprobs, vocab: int, device) -> torch.Tensor:
    """(B, width) int64 of the requested ids, rows padded with id 0 (values discarded)."""
    width = max(len(ids) for ids in token_ids_logprobs if ids is not None)
    table = torch.zeros(len(token_ids_logprobs), width, dtype=torch.int64)
    for i, ids in enumerate(token_ids_logprobs):
        if ids is None:
            continue
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(
                f"token_ids_logprobs[{i}] holds {bad[0]!r}, outside the vocabulary [0, {vocab})"
            )
        table[i, : len(ids)] = torch.tensor([int(t) for t in ids], dtype=torch.int64)
    return table.to(device)


def _column_logprobs(logits, ids, tau, keep) -> torch.Tensor:
    """(B, K) fp32 exactlogp logprobs of the ids (B, K) at temperature `tau` (B,) over the
    kept columns (all with keep=None); outside the kept set the fp32 minimum."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    rows = torch.arange(ids.shape[0], device=logits.device)
    for j in range(ids.shape[1]):
        target = ids[:, j]
        lp = selected_logprobs(logits, target, temperature=tau, keep_mask=keep, validate=False)
        lp = lp.logprobs
        if keep is not None:
            lp = torch.where(keep[rows, target], lp, float("-inf"))
        out[:, j] = lp
    return out.clamp(min=torch.finfo(torch.float32).min)


def _refuse_custom_processors(sampling_info) -> None:
    if getattr(sampling_info, "has_custom_logit_processor", False):
        raise NotImplementedError(
            f"{PATCH_KEY}: custom logit processors edit the logits inside SGLang's "
            "sampler, after exactlogp kept them; their logprobs are not reproduced"
        )


def _refuse_for_exact_cut(sampling_info, return_logprob: bool, logprob_logits) -> None:
    if return_logprob:
        _refuse_custom_processors(sampling_info)
    if return_logprob and logprob_logits is not None:
        raise NotImplementedError(
            "patch_sglang(cut='exact'): the watermark edits the logits the token is drawn "
            "from, and SGLang reports logprobs of the logits before it, so no processed "
            "logprob is the draw's; turn the watermark off for rollouts whose logprobs the "
            "trainer checks, or patch with cut='float'"
        )
    if getattr(sampling_info, "sampling_mask_batch_indices", None) is not None:
        raise NotImplementedError(
            "patch_sglang(cut='exact'): SGLang's sampling-mask output (return_sampling_mask) "
            "is not built for the exact cut; the kept set is "
            "exactlogp.sampling_mask(logits, **exact_cut_params(...)); request it without "
            "return_sampling_mask, or patch with cut='float'"
        )


def _check_exact_cut_takes_effect() -> None:
    """cut="exact" calls Sampler._preprocess_logits and _sync_token_ids_across_tp, the
    sampler module's murmur_hash32 and LogprobResult's fields and writer."""
    import importlib

    version = sglang_version()
    try:
        sampler = importlib.import_module(_SAMPLER)
        logprobs = importlib.import_module(_LOGPROBS)
    except ImportError as exc:
        raise ImportError(f"{PATCH_KEY}: cannot import SGLang's sampler ({exc}); "
                          "nothing was patched") from exc  # fmt: skip
    cls = getattr(sampler, "Sampler", None)
    result = getattr(logprobs, "LogprobResult", None)
    fields = (
        {f.name for f in dataclasses.fields(result)} if dataclasses.is_dataclass(result) else set()
    )
    needed = {
        "Sampler._preprocess_logits": callable(getattr(cls, "_preprocess_logits", None)),
        "Sampler._sync_token_ids_across_tp": callable(
            getattr(cls, "_sync_token_ids_across_tp", None)
        ),
        f"{_SAMPLER}.murmur_hash32": callable(getattr(sampler, "murmur_hash32", None)),
        f"{_LOGPROBS}.LogprobResult with fields {', '.join(_RESULT_FIELDS)}": (
            set(_RESULT_FIELDS) <= fields and callable(getattr(result, "write_output_to", None))
        ),
    }
    missing = [what for what, ok in needed.items() if not ok]
    if missing:
        raise RuntimeError(
            f"patch_sglang(cut='exact'): SGLang {version} cannot take the exact cut: it lacks "
            f"{missing[0]} (known: SGLang 0.5.23); nothing was patched"
        )


def _return_original_logprob() -> bool:
    module = sys.modules.get(_SAMPLER)
    return bool(getattr(module, "SGLANG_RETURN_ORIGINAL_LOGPROB", False))


def _unscaled(sampling_info) -> bool:
    return bool(sampling_info.is_all_greedy) or _return_original_logprob()


def _refuse_spec(original):
    @functools.wraps(original)
    def compute_spec_logprobs(*args, **kwargs):
        raise NotImplementedError(
            f"{PATCH_KEY}: speculative-decoding logprobs are not reproduced by exactlogp; "
            "turn speculative decoding off for rollouts whose logprobs the trainer checks, "
            "or unpatch_sglang()"
        )

    return compute_spec_logprobs
