"""vLLM's own V1 sampler (`vllm.v1.sample.sampler.Sampler`, vLLM 0.25 - 0.33) on CPU
tensors, unpatched, patched with exactlogp, and unpatched again; saves what it returned.

Run by tests/test_integrations_vllm_real.py as `python vllm_v1_run.py OUT.pt` in a
subprocess whose PYTHONPATH starts with a vLLM 0.33 directory (`make setup` installs it),
with CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET=1 and TORCHDYNAMO_DISABLE=1 set before
vLLM is imported. What runs is vLLM's `Sampler.forward` (fp32 logits, temperature, its
PyTorch top-k / top-p and exponential-race sampling, log-softmax, `gather_logprobs`) on
its real `SamplingMetadata`. Three host pieces are set for a CPU:

- pinned host memory needs an accelerator's allocator, which vLLM's platform stand-in
  for a machine without one claims: `vllm.utils.torch_utils.PIN_MEMORY` is set to False;

- vLLM's Triton top-k / top-p kernel does not run in Triton's interpreter (see
  vllm_v2_run.py), so `apply_top_k_top_p` takes vLLM's PyTorch implementation
  (`HAS_TRITON = False` in `vllm.v1.sample.ops.topk_topp_sampler`);
- the sampled token's rank (`batched_count_greater_than`) is `torch.compile`d by vLLM;
  TORCHDYNAMO_DISABLE=1 runs it eagerly (an integer count: the same result without a
  C++ compiler and its minutes).
"""

from __future__ import annotations

import sys
import traceback

import torch

VOCAB = 1500


def main(out_path: str) -> None:
    import vllm
    import vllm.utils.torch_utils as torch_utils

    torch_utils.PIN_MEMORY = False  # before the sampler module binds it by name
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    topk_topp.HAS_TRITON = False

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from exactlogp.integrations import vllm as ours
    from exactlogp.testing import llm_like_logits

    logits, _ = llm_like_logits(6, VOCAB, torch.bfloat16, seed=9)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 2.0])
    top_k = torch.tensor([50, VOCAB, VOCAB, VOCAB, VOCAB, 5])
    top_p = torch.tensor([0.9, 1.0, 1.0, 1.0, 0.5, 1.0])

    def metadata(all_greedy=False, num_logprobs=3, token_ids=None):
        n = logits.shape[0]
        return SamplingMetadata(
            temperature=None if all_greedy else temperature, all_greedy=all_greedy,
            all_random=False, top_p=None if all_greedy else top_p,
            top_k=None if all_greedy else top_k,
            generators={i: torch.Generator().manual_seed(100 + i) for i in range(n)},
            max_num_logprobs=num_logprobs, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
            repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
            allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors(), logprob_token_ids=token_ids,
        )  # fmt: skip

    def run_all():
        results = {}
        cases = {
            "raw_logprobs": ("raw_logprobs", metadata(), {}),
            "processed_logprobs": ("processed_logprobs", metadata(), {}),
            "greedy_processed": ("processed_logprobs", metadata(all_greedy=True), {}),
            # explicit token ids instead of the top-k (`logprob_token_ids`, 0.25+)
            "token_ids": (
                "raw_logprobs",
                metadata(num_logprobs=None, token_ids={0: [5, 6], 3: [7], 5: [8, 9]}),
                {},
            ),  # fmt: skip
            # the rejection sampler's bonus-token call: logits asked for, not logprobs
            "override_logits": (
                "raw_logprobs",
                metadata(),
                {"logprobs_mode_override": "raw_logits"},
            ),  # fmt: skip
        }
        for name, (mode, md, kwargs) in cases.items():
            out = Sampler(mode)(logits.clone(), md, **kwargs)
            t = out.logprobs_tensors
            results[name] = {"sampled": out.sampled_token_ids, "ids": t.logprob_token_ids,
                             "logprobs": t.logprobs, "ranks": t.selected_token_ranks}  # fmt: skip
        return results

    saved = {"version": vllm.__version__, "logits": logits, "temperature": temperature,
             "top_k": top_k, "top_p": top_p}  # fmt: skip
    saved["unpatched"] = run_all()
    original = Sampler.__dict__["forward"]
    handle = ours.patch_vllm_sampler()
    saved["sites"] = list(handle.sites)
    saved["idempotent"] = ours.patch_vllm_sampler() is handle
    saved["wraps_original"] = Sampler.__dict__["forward"].__wrapped__ is original
    saved["patched"] = run_all()
    # processed logprobs with penalties are refused before vLLM samples
    md = metadata()
    md.no_penalties = False
    md.presence_penalties = torch.full((6,), 0.5)
    md.prompt_token_ids = torch.zeros(6, 1, dtype=torch.int64)
    try:
        Sampler("processed_logprobs")(logits.clone(), md)
        saved["refused"] = "sampled"
    except ValueError as exc:
        saved["refused"] = str(exc)
    saved["unpatch"] = ours.unpatch_vllm_sampler()
    saved["restored"] = Sampler.__dict__["forward"] is original
    saved["unpatch_again"] = ours.unpatch_vllm_sampler()
    saved["unpatched_again"] = run_all()
    torch.save(saved, out_path)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
