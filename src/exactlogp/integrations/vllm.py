"""Rollout side: vLLM's logprobs with the trainer's bits.

`patch_vllm_sampler()` makes vLLM compute every logprob it returns with exactlogp (V2
model runner: `compute_token_logprobs`, vLLM 0.25-0.34; V1 runner: the sampler's
sampled-token logprob, vLLM <= 0.33); exactlogp's vLLM plugin (`autopatch.vllm_plugin`)
applies it in vLLM's worker processes when EXACTLOGP_PATCH names `vllm`. Opt-in, `patch_vllm_sampler(cut="exact")`
(EXACTLOGP_VLLM_CUT=exact for the plugin) also makes vLLM 0.34's V2 sampler cut and draw
with exactlogp (docs/numerics.md section 13) for requests with top-k / top-p / min-p.

`rollout_logprobs` takes the logits vLLM's sampler sees (gathered, or still split over
vLLM's tensor-parallel group) and gives, per sampled token, vLLM's "raw" logprob (log
softmax of the logits) or its "processed" one (after temperature, min-p and the top-k /
top-p cut). A trainer that calls exactlogp on the same logits with the same temperature
and keep-mask gets the same bits at any TP degree.

Padding: vLLM pads its LM head to a multiple of 64 and Megatron to a multiple of
128 * TP; pass `vocab_size` (the real vocabulary) and padding never counts.
"""

from __future__ import annotations

import functools
import numbers

import torch

from ..api import LogprobResult, selected_logprobs
from . import _patching

PATCH_KEY = "patch_vllm_sampler"
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE for ParallelLMHead
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: rows below it are greedy and scored at temperature 1


def vllm_padded_vocab_size(vocab_size: int, padding: int = VOCAB_PADDING) -> int:
    """The LM-head width vLLM uses: vocab_size rounded up to a multiple of `padding`."""
    return -(-vocab_size // padding) * padding


def rollout_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    with_entropy: bool = False,
    validate: bool = True,
) -> LogprobResult:
    """Logprobs of the sampled `token_ids` under the distribution vLLM sampled from.

    Args:
        logits: (N, V_cols) the sampler's input, any float dtype vLLM uses; with
            `tp_group`, this rank's vocabulary shard (rank r holds columns from
            r * V_cols unless `vocab_start` says otherwise).
        token_ids: (N,) the sampled global token ids.
        temperature: float or (N,) per request; values below 1e-5 (greedy requests) are
            scored at 1.0, as vLLM's sampler does. Defaults to the raw logprobs.
        top_k: int or (N,) ints in [1, vocab]; vocab (or more) means no cut.
        top_p: float or (N,) in (0, 1]; 1.0 means no cut.
        min_p: float or (N,) in [0, 1]; 0 means no cut.
        keep_mask: (N, V_cols) bool of columns still allowed (e.g. by other processors);
            combined with the top-k / top-p mask.
        vocab_size: the real vocabulary; padding columns never count.
        tp_group: vLLM's tensor-parallel group (`get_tp_group().device_group`) when the
            logits are still sharded; top-k / top-p then need the gathered logits.
    Returns:
        `LogprobResult` (logprobs, entropy, lse) fp32 (N,).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D (N, V) tensor, got {_describe(logits)}")
    tau = _per_row_temperature(temperature, logits)
    if top_k is not None or top_p is not None or min_p is not None:
        if tp_group is not None:
            raise ValueError(
                "top_k / top_p / min_p need whole rows: pass the gathered logits (tp_group=None), "
                "or build the keep_mask from them and pass it with each shard"
            )
        scaled = _scaled(logits, tau, vocab_size)
        cut = _pad_columns(vllm_keep_mask(scaled, top_k, top_p, min_p), logits)
        keep_mask = cut if keep_mask is None else keep_mask & cut
    return selected_logprobs(
        logits,
        token_ids,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=tau,
        keep_mask=keep_mask,
        with_entropy=with_entropy,
        validate=validate,
    )


def vllm_keep_mask(
    scaled_logits: torch.Tensor,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, V) bool: the columns vLLM's sampler keeps after its min-p, top-k and top-p cuts.

    `scaled_logits` are the fp32 logits after temperature (real vocabulary only). The
    steps are those of vLLM's sampler, in its order: min-p keeps every value >=
    max + log(min_p) (0 means no cut); then, on its PyTorch path, top-k keeps every value >= the k-th
    largest; top-p sorts ascending, takes the fp32 softmax and its running sum, drops the
    columns whose running sum is <= 1 - p and always keeps the largest. Top-p reads float
    rounding, so the trainer should reuse this mask rather than rebuild it.
    """
    if not isinstance(scaled_logits, torch.Tensor) or scaled_logits.dim() != 2:
        raise ValueError(f"scaled_logits must be a 2-D tensor, got {_describe(scaled_logits)}")
    y = scaled_logits.to(torch.float32)
    num_rows, vocab = y.shape
    keep = torch.ones_like(y, dtype=torch.bool)
    if min_p is not None:
        mp = _per_row("min_p", min_p, num_rows, y.device, torch.float32, -1.0, 1.0)
        if bool((mp < 0).any()):
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
        threshold = y.max(dim=-1, keepdim=True).values + torch.log(mp).unsqueeze(-1)
        keep &= (y >= threshold) | (mp == 0).unsqueeze(-1)
        y = torch.where(keep, y, float("-inf"))
    if top_k is not None:
        k = _per_row("top_k", top_k, num_rows, y.device, torch.int64, 1, None).clamp(max=vocab)
        kth = torch.sort(y, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        keep &= y >= kth
    if top_p is not None:
        p = _per_row("top_p", top_p, num_rows, y.device, torch.float32, 0.0, 1.0)
        keep &= _top_p_keep(torch.where(keep, y, float("-inf")), p)
    return keep


def shard_keep_mask(keep_mask: torch.Tensor, vocab_start: int, num_cols: int) -> torch.Tensor:
    """A trainer shard's columns [vocab_start, vocab_start + num_cols) of a rollout's
    (N, V) keep-mask; columns past V (padding) are False."""
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
        raise TypeError(f"keep_mask must be a bool tensor, got {_describe(keep_mask)}")
    out = torch.zeros(keep_mask.shape[:-1] + (num_cols,), dtype=torch.bool, device=keep_mask.device)
    stop = min(vocab_start + num_cols, keep_mask.shape[-1])
    if stop > vocab_start:
        out[..., : stop - vocab_start] = keep_mask[..., vocab_start:stop]
    return out


# --- patching vLLM ---

_V2_LOGPROB = "vllm.v1.worker.gpu.sample.logprob"  # the V2 model runner (0.25+; only one in 0.34)
_V1_SAMPLER = "vllm.v1.sample.sampler"  # the V1 model runner (0.25-0.33 still ship it)
_EXACT_MODES = ("raw_logprobs", "processed_logprobs")
EXACT_COLUMNS = 32  # logprob columns per token computed exactly; past that, column 0 only


CUTS = ("vllm", "exact")
CUT_ENV = (
    "EXACTLOGP_VLLM_CUT"  # read by patch_from_env: "exact" for patch_vllm_sampler(cut="exact")
)
_V2_SAMPLER = "vllm.v1.worker.gpu.sample.sampler"
_V2_REJECTION = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"


@_patching.atomic
def patch_vllm_sampler(cut: str = "vllm") -> _patching.PatchHandle:
    """Make vLLM report exactlogp's logprobs, in this process.

    cut: "vllm" (default) leaves vLLM's sampling as it is: vLLM's own min-p / top-k /
    top-p cut and draw, and exactlogp's logprobs of what it returns. "exact" (V2 model
    runner only) also makes the sampler cut and draw with exactlogp for every request
    with a temperature above 0 and a top-k, top-p or min-p: the cut of docs/numerics.md
    section 13 on the logits after vLLM's logit bias, penalties, bad words and custom
    processors, at the request's temperature, and `exactlogp.sample` with one uniform
    per row from the request's seed and position (vLLM's own hash; see
    `_exact_sample`). Such a row's processed logits are then y = fp32(logit) / T on the
    kept set and -inf elsewhere, so its processed logprobs are exactlogp's
    `processed_logprobs` and vLLM's `return_sampling_mask` is the exact kept set. Rows
    without a cut and greedy rows are sampled by vLLM as before. The spec-decoding
    rejection sampler is not wired: its verification step raises NotImplementedError
    for a request with a cut. Changing how vLLM samples is the user's choice, hence
    opt-in.

    V2 model runner (vLLM 0.25+, the only runner from 0.34): replaces
    `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs`, which every logprob vLLM
    returns goes through (the sampler, the spec-decode rejection sampler, top-k columns),
    plus its by-name copy in `...sample.prompt_logprob` and the CPU runner's
    `vllm.v1.worker.cpu.logprob.compute_token_logprobs`. Whatever logits vLLM hands it are
    scored as they are: "raw_logprobs" the model's logits (after the grammar mask),
    "processed_logprobs" the logits after logit bias, penalties, bad words, custom
    processors, temperature (fp32 division), min-p and top-k / top-p (cut tokens -inf,
    i.e. dropped: the renormalisation over the surviving tokens is `keep_mask`). The
    `*_logits` modes are logits, not logprobs, and stay vLLM's. Columns past
    EXACT_COLUMNS (requests asking for more top logprobs) keep vLLM's values except the
    sampled token's (column 0).

    V1 model runner (vLLM <= 0.33): wraps `vllm.v1.sample.sampler.Sampler.forward` (the
    sampled token's logprob, with top-k logprobs or `logprob_token_ids`; processed mode
    reproduces temperature, top-k and top-p and raises for penalties, bad words and
    allowed-token masks; the mode is forward's `logprobs_mode_override` when given, and
    the logits modes are left alone).

    Raises RuntimeError naming the vLLM version and the reason when the patch could not
    take effect (no known sampler, or a `compute_topk_scores` that no longer calls
    `compute_token_logprobs`), ImportError without vLLM. Applies to this process only:
    vLLM samples in its engine-core / worker processes, so use the plugin
    (`EXACTLOGP_PATCH=vllm`, `exactlogp.integrations.autopatch.vllm_plugin`). Idempotent;
    undo with `unpatch_vllm_sampler()`.
    """
    if cut not in CUTS:
        raise ValueError(f"patch_vllm_sampler: cut must be one of {CUTS}, got {cut!r}")
    version = vllm_version()
    sites = []
    v2 = _module(_V2_LOGPROB)
    if cut == "exact":
        _check_exact_cut_takes_effect(v2, version)
    if v2 is not None:
        _check_v2_takes_effect(v2, version)
        sites += [
            _patching.Site(_V2_LOGPROB, "compute_token_logprobs", _exact_token_logprobs, wraps=True),
            _patching.Site("vllm.v1.worker.gpu.sample.prompt_logprob", "compute_token_logprobs",
                           _exact_token_logprobs, wraps=True, optional=True),
            _patching.Site("vllm.v1.worker.cpu.logprob", "compute_token_logprobs",
                           _exact_token_logprobs, wraps=True, optional=True),
        ]  # fmt: skip
    if _module(_V1_SAMPLER) is not None:
        sites.append(_patching.Site(_V1_SAMPLER, "Sampler.forward", _exact_forward, wraps=True))
    if not sites:
        raise RuntimeError(
            f"patch_vllm_sampler: vLLM {version} has neither the V2 model runner's "
            f"{_V2_LOGPROB} nor the V1 {_V1_SAMPLER}; exactlogp knows vLLM 0.25 to 0.34, "
            "so nothing was patched"
        )
    if cut == "exact":
        sites += [
            _patching.Site(_V2_SAMPLER, "Sampler.sample", _exact_sample, wraps=True),
            _patching.Site(_V2_REJECTION, "RejectionSampler._verify", _refuse_exact_verify,
                           wraps=True, optional=True),
        ]  # fmt: skip
    return _patching.apply(PATCH_KEY, sites, {"cut": cut} if cut != "vllm" else None)


@_patching.atomic
def unpatch_vllm_sampler() -> bool:
    """Restore vLLM's own functions; False if they were not patched."""
    return _patching.undo(PATCH_KEY)


def patch_from_env(vocab_size: int | None = None) -> _patching.PatchHandle:
    """EXACTLOGP_PATCH=vllm (exactlogp.integrations.autopatch): `patch_vllm_sampler` with
    the cut EXACTLOGP_VLLM_CUT asks for (unset, empty or "vllm": the default cut)."""
    del vocab_size  # vLLM's own logits carry their vocabulary
    return patch_vllm_sampler(cut=requested_cut())


def requested_cut() -> str:
    """EXACTLOGP_VLLM_CUT as a `patch_vllm_sampler` cut ("vllm" when unset or empty)."""
    return _patching.env_choice(CUT_ENV, CUTS)


def vllm_version() -> str:
    return _patching.host_version("vllm", "patch_vllm_sampler")


def _module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _check_v2_takes_effect(module, version: str) -> None:
    """compute_topk_scores must look compute_token_logprobs up as a module global."""
    scorer = getattr(module, "compute_topk_scores", None) or getattr(
        module, "compute_topk_logprobs", None
    )
    code = getattr(scorer, "__code__", None)
    if code is None or "compute_token_logprobs" not in code.co_names:
        raise RuntimeError(
            f"patch_vllm_sampler: vLLM {version}'s {module.__name__} does not route its "
            "logprobs through compute_token_logprobs (compute_topk_scores no longer calls "
            "it), so replacing it would not take effect; nothing was patched"
        )


def _check_exact_cut_takes_effect(v2, version: str) -> None:
    """cut="exact" wraps the V2 Sampler.sample and hooks two calls it makes."""
    why = None
    if v2 is None:
        why = f"it has no V2 model runner ({_V2_LOGPROB})"
    else:
        sampler = getattr(_module(_V2_SAMPLER), "Sampler", None)
        states = _module("vllm.v1.worker.gpu.sample.states")
        states = getattr(states, "SamplingStates", None)
        needed = {
            "Sampler.sample calling _sample_random": (sampler, "sample", "_sample_random"),
            "Sampler.apply_sampling_params calling apply_temperature": (
                sampler, "apply_sampling_params", "apply_temperature"),
            "SamplingStates.apply_temperature": (states, "apply_temperature", None),
            "Sampler._sample_random": (sampler, "_sample_random", None),
        }  # fmt: skip
        for what, (owner, name, calls) in needed.items():
            code = getattr(getattr(owner, name, None), "__code__", None)
            if code is None or (calls is not None and calls not in code.co_names):
                why = f"its V2 sampler lacks {what}"
                break
    if why is not None:
        raise RuntimeError(
            f"patch_vllm_sampler(cut='exact'): vLLM {version} cannot take the exact cut: "
            f"{why} (known: vLLM 0.34's V2 model runner); nothing was patched"
        )


def _cut_rows(states, requests: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p) of the sampler's `states` and whether
    the row takes the exact cut: a temperature above 0 and a top-k, top-p or min-p."""
    t = states.temperature.gpu[requests]
    k = states.top_k.gpu[requests].to(torch.int64)
    p = states.top_p.gpu[requests]
    m = states.min_p.gpu[requests]
    cut = (t != 0) & ((k < states.vocab_size) | (p != 1) | (m != 0))
    return t, k, p, m, cut


def _exact_sample(original):
    """Sampler.sample with the exact cut (patch_vllm_sampler(cut="exact")).

    vLLM's own sample() runs unchanged, with two of its calls hooked for this call only:
    `sampling_states.apply_temperature` keeps a copy of the logits it is handed (after
    logit bias, penalties, bad words, custom processors and the thinking budget, before
    temperature and min-p), and `_sample_random` -- vLLM's top-k / top-p and draw (Gumbel,
    or a fused sampler where vLLM picks one) -- is followed by the exact rows: for every
    row with a cut, the processed logits become y = fp32(x) / T on exactlogp's kept set
    and -inf elsewhere, and the sampled id exactlogp's draw. The other rows keep vLLM's
    values bit for bit (vLLM's noise is per row). vLLM's work on the cut rows is
    overwritten, not skipped.
    """

    @functools.wraps(original)
    def sample(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, *args, **kw):
        states = self.sampling_states
        cut = _cut_slots(states, idx_mapping_np, logits.shape[-1])  # on the host
        if not cut.any():
            return original(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np,
                            *args, **kw)  # fmt: skip
        _refuse_watermarks(self, idx_mapping_np, cut)
        before = []
        their_temperature, their_random = states.apply_temperature, self._sample_random

        def apply_temperature(x, *a, **k):
            before.append(x.clone())
            return their_temperature(x, *a, **k)

        def sample_random(processed, mapping, mapping_np, pos, *a, **k):
            sampled, processed = their_random(processed, mapping, mapping_np, pos, *a, **k)
            if not before:
                raise RuntimeError(
                    "patch_vllm_sampler(cut='exact'): vLLM's sampler did not apply its "
                    "temperature, so the logits to cut were not seen"
                )
            return _exact_rows(states, before[-1], sampled, processed, mapping, pos)

        with _instance_attrs((states, "apply_temperature", apply_temperature),
                             (self, "_sample_random", sample_random)):  # fmt: skip
            return original(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np,
                            *args, **kw)  # fmt: skip

    return sample


def _exact_rows(states, x, sampled, processed, requests, pos):
    """Overwrite the cut rows of vLLM's (sampled, processed logits) with exactlogp's."""
    from .. import contract
    from ..cut.api import sample, sampling_mask
    from ._vllm_uniforms import row_uniforms

    t, k, p, m, cut = _cut_rows(states, requests.to(torch.int64))
    rows = torch.nonzero(cut).flatten()
    params = dict(temperature=t[rows], top_k=k[rows], top_p=p[rows], min_p=m[rows])
    xr = x[rows]
    keep = sampling_mask(xr, **params).keep_mask
    u = row_uniforms(states.seeds.gpu, requests[rows], pos[rows], x.shape[-1])
    drawn = sample(xr, uniforms=u, **params)
    y = contract.scaled_logits(xr, t[rows].unsqueeze(-1))
    processed[rows] = torch.where(keep, y, float("-inf")).to(processed.dtype)
    # -1: a row without a finite value (exactlogp draws nothing); vLLM's id stays
    sampled[rows] = torch.where(drawn >= 0, drawn, sampled[rows]).to(sampled.dtype)
    return sampled, processed


def _cut_slots(states, requests, vocab_size: int):
    """(len(requests),) host bool: which request slots take the exact cut (a temperature
    above 0 and a top-k, top-p or min-p). Reads each field's host copy where vLLM keeps
    one, else its device tensor (a sampler state vLLM accepts need not have both)."""
    t, k, p, m = (_host(getattr(states, f))[requests]
                  for f in ("temperature", "top_k", "top_p", "min_p"))  # fmt: skip
    vocab = getattr(states, "vocab_size", vocab_size)
    return (t != 0) & ((k < vocab) | (p != 1) | (m != 0))


def _host(field):
    """A UVA-backed sampler field's host array (`.np`), else its `.gpu` tensor copied."""
    found = getattr(field, "np", None)
    return found if found is not None else field.gpu.cpu().numpy()


def _refuse_watermarks(sampler, requests, cut) -> None:
    """vLLM's GPUWatermarkSampler draws watermarked tokens in its own `_sample_random`;
    the exact cut's draw would replace them without a word. Watermarked requests with a
    cut are refused (those without a cut keep vLLM's watermarked draw)."""
    marks = getattr(sampler, "watermarking", None)
    if marks is None:
        return
    if (_host(marks)[requests] & cut).any():
        raise NotImplementedError(
            "patch_vllm_sampler(cut='exact'): a watermarked request (vLLM's watermark "
            "sampler) with top-k / top-p / min-p: the exact cut would replace the "
            "watermark's draw; run watermarked requests without a cut, or patch with "
            "cut='vllm'"
        )


def _refuse_exact_verify(original):
    """The spec-decoding rejection sampler draws with vLLM's own cut: with cut="exact",
    a verification step for a request with a cut raises instead of sampling outside the
    set the trainer replays."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _verify(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        requests, logits = bound.get("idx_mapping_np"), bound.get("logits")
        vocab = logits.shape[-1] if isinstance(logits, torch.Tensor) else 1 << 62
        if requests is not None and _cut_slots(self.sampler.sampling_states, requests,
                                               vocab).any():  # fmt: skip
            raise NotImplementedError(
                "patch_vllm_sampler(cut='exact'): speculative decoding's rejection sampler "
                "keeps vLLM's own top-k / top-p / min-p cut; run requests with a cut without "
                "speculative decoding, or patch with cut='vllm'"
            )
        return original(self, *args, **kwargs)

    return _verify


class _instance_attrs:
    """Set attributes on instances for a `with` block; put back what was there after."""

    _MISSING = object()

    def __init__(self, *triples):
        self.triples = triples
        self.saved = []

    def __enter__(self):
        for obj, name, value in self.triples:
            self.saved.append((obj, name, obj.__dict__.get(name, self._MISSING)))
            setattr(obj, name, value)

    def __exit__(self, *exc):
        for obj, name, old in reversed(self.saved):
            if old is self._MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)
        self.saved.clear()
        return False


def _exact_token_logprobs(original):
    @functools.wraps(original)
    def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return token_logprobs(logits, token_ids, fallback=original)

    return compute_token_logprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, fallback=None) -> torch.Tensor:
    """(B, K) fp32 exactlogp logprobs of `token_ids` (B, K) under softmax(logits) (B, V),
    vLLM's `compute_token_logprobs` contract: -inf logits are dropped columns, ids
    outside [0, V) give -inf, a row with a NaN or +inf logit gives NaN (no host sync).
    Past EXACT_COLUMNS columns, columns 1.. come from `fallback` when given."""
    ids = token_ids.to(torch.int64)
    num_cols = ids.shape[-1]
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    exact = num_cols if fallback is None or num_cols <= EXACT_COLUMNS else 1
    if exact < num_cols:
        out.copy_(fallback(logits, token_ids))
    valid = (ids >= 0) & (ids < logits.shape[-1])
    for k in range(exact):
        target = torch.where(valid[:, k], ids[:, k], -100)
        out[:, k] = selected_logprobs(logits, target, validate=False).logprobs
    out[:, :exact].masked_fill_(~valid[:, :exact], float("-inf"))
    return out


def sampled_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, sampling_metadata, logprobs_mode: str
) -> torch.Tensor:
    """(N,) fp32 exact logprobs of `sampled` for one vLLM batch, as `logprobs_mode` defines
    them. `logits` are the sampler's input before it edits them in place."""
    if logprobs_mode == "processed_logprobs":
        _check_processed_supported(sampling_metadata)
    if logprobs_mode == "raw_logprobs" or sampling_metadata.all_greedy:
        # Raw, and all-greedy batches in processed mode: the logits as given, temperature 1.
        return rollout_logprobs(logits, sampled).logprobs
    return rollout_logprobs(
        logits,
        sampled,
        temperature=sampling_metadata.temperature,
        top_k=sampling_metadata.top_k,
        top_p=sampling_metadata.top_p,
    ).logprobs


def _exact_forward(original):
    @functools.wraps(original)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        # forward(logits, sampling_metadata, predict_bonus_token=False,
        #         logprobs_mode_override=None): the override (the rejection sampler asks
        # for logits with it) wins over the sampler's mode
        override = kwargs.get("logprobs_mode_override", args[1] if len(args) > 1 else None)
        mode = override or getattr(self, "logprobs_mode", None)
        num = sampling_metadata.max_num_logprobs
        # logprob_token_ids (0.25+): logprobs of given ids, column 0 the sampled token
        by_ids = bool(getattr(sampling_metadata, "logprob_token_ids", None))
        if mode not in _EXACT_MODES or not (by_ids or (num is not None and num >= 0)):
            return original(self, logits, sampling_metadata, *args, **kwargs)
        if mode == "processed_logprobs":
            _check_processed_supported(sampling_metadata)  # before sampling, not after
        # The sampler edits fp32 logits in place (temperature, masks); keep the input.
        kept = logits.clone() if logits.dtype == torch.float32 else logits
        output = original(self, logits, sampling_metadata, *args, **kwargs)
        sampled = output.sampled_token_ids[:, 0].to(torch.int64)
        exact = sampled_logprobs(kept, sampled, sampling_metadata, mode)
        tensors = output.logprobs_tensors
        # Column 0 holds the sampled token; it may appear again among the top-k columns.
        # Padding columns of logprob_token_ids rows (id 0, -inf) stay as they are.
        values = tensors.logprobs
        same = tensors.logprob_token_ids.to(torch.int64) == sampled.unsqueeze(-1)
        same &= ~torch.isneginf(values)
        values.copy_(torch.where(same, exact.to(values.dtype).unsqueeze(-1), values))
        return output

    return forward


def _check_processed_supported(sampling_metadata) -> None:
    active = []
    if not getattr(sampling_metadata, "no_penalties", True):
        active.append("penalties")
    if getattr(sampling_metadata, "allowed_token_ids_mask", None) is not None:
        active.append("allowed_token_ids")
    if getattr(sampling_metadata, "bad_words_token_ids", None):
        active.append("bad_words")
    if active:
        raise ValueError(
            f"{PATCH_KEY}: processed_logprobs with {', '.join(active)} is not reproduced; "
            "only temperature, top_k and top_p are"
        )


# --- helpers ---


def _per_row_temperature(temperature, logits: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 on the logits' device; greedy rows (< GREEDY_EPS) become 1.0.

    Always a tensor: a per-row tensor divisor is an IEEE division on every device, as
    in vLLM's sampler (a Python-float divisor can become a reciprocal multiply on GPU).
    """
    num_rows = logits.shape[0]
    if isinstance(temperature, torch.Tensor):
        tau = temperature.to(device=logits.device, dtype=torch.float32)
        if tau.dim() == 0:
            tau = tau.expand(num_rows)
        if tau.shape != (num_rows,):
            raise ValueError(
                f"temperature tensor shape {tuple(temperature.shape)} must be () or ({num_rows},)"
            )
    elif isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        tau = torch.full((num_rows,), float(temperature), dtype=torch.float32, device=logits.device)
    else:
        raise TypeError(
            f"temperature must be a float or a tensor, got {type(temperature).__name__}"
        )
    return torch.where(tau < GREEDY_EPS, torch.ones_like(tau), tau)


def _scaled(logits: torch.Tensor, tau: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """fp32 logits / temperature over the real vocabulary, the bits exactlogp uses."""
    real = logits if vocab_size is None else logits[:, :vocab_size]
    return real.to(torch.float32) / tau.unsqueeze(-1)


def _pad_columns(mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    if mask.shape[-1] == logits.shape[-1]:
        return mask
    return shard_keep_mask(mask, 0, logits.shape[-1])


def _top_p_keep(y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ascending, order = torch.sort(y, dim=-1)
    running = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop = running <= 1 - p.unsqueeze(-1)
    drop[:, -1] = False  # the largest always stays
    return torch.empty_like(drop).scatter_(-1, order, ~drop)


def _per_row(name, value, num_rows, device, dtype, low, high) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        out = value.to(device=device, dtype=dtype)
        if out.dim() == 0:
            out = out.expand(num_rows)
        if out.shape != (num_rows,):
            raise ValueError(
                f"{name} tensor shape {tuple(value.shape)} must be () or ({num_rows},)"
            )
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        out = torch.full((num_rows,), value, dtype=dtype, device=device)
    else:
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    too_low = out < low if dtype == torch.int64 else out <= low
    if bool(too_low.any()) or (high is not None and bool((out > high).any())):
        bound = f">= {low}" if dtype == torch.int64 else f"in ({low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return out


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
