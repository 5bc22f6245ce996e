"""Binds compute_spec_logprobs by name, as SGLang 0.5.23's spec workers do."""

from sglang.srt.layers.logprob_processor import compute_spec_logprobs


def draft_logprobs(batch, logits_output, predict):
    return compute_spec_logprobs(batch, logits_output, predict)
