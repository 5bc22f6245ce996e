"""vLLM's own V2 model runner sampling and logprob code on CPU tensors, unpatched, patched
with exactlogp, and unpatched again; saves everything it returned for the test to check.

Run by tests/test_integrations_vllm_real.py as `python vllm_v2_run.py OUT.pt` in a
subprocess whose PYTHONPATH starts with a vLLM 0.34 directory (`make setup` installs it),
with CUDA_VISIBLE_DEVICES="" and TRITON_INTERPRET=1 set before vLLM is imported (else
vLLM's triton_utils finds no active GPU driver and replaces Triton with placeholders).

What runs is vLLM's: `Sampler.__call__` (its logits processors -- logit bias, penalties,
bad words --, its temperature, min-p and Gumbel-sampling Triton kernels, top-k / top-p,
`compute_topk_scores` with its log-softmax and rank kernels), `PromptLogprobsWorker`
(prompt logprobs and prompt token-id logprobs), the request and sampling state classes
and `InputBatch.make_dummy`. Two host pieces cannot run on a CPU and are replaced here:

- Pinned host memory needs an accelerator's allocator: vLLM's platform stand-in for a
  machine without one still says it is available, so `vllm.utils.torch_utils.PIN_MEMORY`
  is set to False, and `vllm.v1.worker.gpu.buffer_utils.UvaBuffer`, which pins host memory
  and maps it into the GPU (CUDA's unified virtual addressing, a driver call), becomes
  `HostBuffer`: on a CPU the host tensor is the device tensor, so it keeps UvaBuffer's
  fields with `uva()` returning the host tensor.
- vLLM's Triton top-k / top-p kernel does not run in Triton's interpreter (its `tl.range`
  loop variable is a Python int there: "'int' object has no attribute 'to'"), so
  `apply_top_k_top_p` takes vLLM's own PyTorch implementation (`HAS_TRITON = False` in
  `vllm.v1.sample.ops.topk_topp_sampler`), the path vLLM takes without Triton.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

import numpy as np
import torch

VOCAB = 1500  # two blocks of the logprob kernel's 1024, the second one partial
MAX_REQS = 8


class HostBuffer:
    """vLLM's UvaBuffer on a CPU: the pinned host tensor and its device view are one."""

    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype, device="cpu")
        self.np = self.cpu.numpy()

    def uva(self, n=None):
        return self.cpu if n is None else self.cpu[:n]


def main(out_path: str) -> None:
    import vllm
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils

    torch_utils.PIN_MEMORY = False
    buffer_utils.UvaBuffer = HostBuffer
    topk_topp.HAS_TRITON = False

    import vllm.v1.worker.cpu.logprob as cpu_logprob
    import vllm.v1.worker.gpu.sample.logprob as logprob
    import vllm.v1.worker.gpu.sample.prompt_logprob as prompt_logprob
    import vllm.v1.worker.gpu.sample.sampler as sampler_module
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler as rejection
    from vllm.outputs import SamplingMask
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.sample.states import SamplingStates
    from vllm.v1.worker.gpu.states import RequestState

    from exactlogp.integrations import vllm as ours
    from exactlogp.integrations._vllm_uniforms import row_uniforms
    from exactlogp.testing import llm_like_logits

    device = torch.device("cpu")
    scored = []  # what the sampler handed compute_topk_scores, per call
    their_topk_scores = sampler_module.compute_topk_scores
    their_scorer = logprob.compute_topk_scores

    def spy(logits, *args, **kwargs):
        scored.append(logits.detach().clone())
        return their_topk_scores(logits, *args, **kwargs)

    sampler_module.compute_topk_scores = spy  # records only; calls vLLM's function

    def new_sampler(mode, params, return_sampling_mask=False):
        states = RequestState(MAX_REQS, 32, 64, 0, VOCAB, device)
        # reasoning_config is the only field of VllmConfig the sampler reads
        config = type("Config", (), {"reasoning_config": None})()
        sampler = sampler_module.Sampler(
            config, MAX_REQS, VOCAB, device, states, mode,
            return_sampling_mask=return_sampling_mask,
        )  # fmt: skip
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        for i, p in enumerate(params):
            states.add_request(f"r{i}", len(prompt), prompt, len(prompt), 16)
            sampler.add_request(states.req_id_to_index[f"r{i}"], p)
        states.apply_staged_writes()
        sampler.apply_staged_writes()
        slots = [states.req_id_to_index[f"r{i}"] for i in range(len(params))]
        batch = InputBatch.make_dummy(len(params), len(params), InputBuffers(8, 64, device))
        mapping = torch.tensor(slots, dtype=torch.int64)
        batch = dataclasses.replace(
            batch, idx_mapping=mapping, idx_mapping_np=np.array(slots),
            expanded_idx_mapping=mapping,
        )  # fmt: skip
        return sampler, batch

    # the exact cut (patch_vllm_sampler(cut="exact")): rows 0, 3, 4, 5 have a cut (row 5
    # after a logit bias), row 1 none, row 2 is greedy; vLLM also returns its sampling mask
    exact_params = [
        SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.05, logprobs=2, seed=41),
        SamplingParams(temperature=1.0, logprobs=2, seed=42),
        SamplingParams(temperature=0.0, top_k=5, logprobs=2, seed=43),
        SamplingParams(temperature=2.0, min_p=0.02, logprobs=2, seed=44),
        SamplingParams(temperature=1.8, top_p=0.9, logprobs=2, seed=45),
        SamplingParams(temperature=2.0, top_k=20, logit_bias={7: 5.0}, logprobs=2, seed=46),
    ]  # fmt: skip
    logits_exact, _ = llm_like_logits(len(exact_params), VOCAB, torch.float32, seed=9)
    logits_exact = (logits_exact / 3).to(torch.bfloat16)  # flatter: cuts keep tens of ids
    before_temperature = []  # what vLLM's apply_temperature was handed, per call
    their_apply_temperature = SamplingStates.apply_temperature

    def temperature_spy(self, logits, *args, **kwargs):
        before_temperature.append(logits.detach().clone())
        return their_apply_temperature(self, logits, *args, **kwargs)

    def run_exact():
        sampler, batch = new_sampler("processed_logprobs", exact_params, True)
        batch.seq_lens.fill_(9)  # past the 8-token prompts: each row samples a token
        scored.clear()
        before_temperature.clear()
        out = sampler(logits_exact.clone(), batch)
        t, mask = out.logprobs_tensors, out.sampling_mask_tensors
        st = sampler.sampling_states
        slots = batch.expanded_idx_mapping
        pos = batch.positions[batch.logits_indices]
        # compact ids past each row's count are unset memory: -1 there
        past = torch.arange(mask.token_ids.shape[1]) >= mask.counts.unsqueeze(-1)
        # what a user gets: vLLM's scheduler CSR, sliced per request, and the public
        # SamplingMask its output processor builds from the slices
        lists = mask.tolists()
        public = [
            SamplingMask([p for p in lists.slice_request(i, 1).to_nested_list()])
            for i in range(len(exact_params))
        ]
        return {
            "sampled": out.sampled_token_ids, "ids": t.logprob_token_ids,
            "logprobs": t.logprobs, "ranks": t.selected_token_ranks, "scored": scored[0],
            "before": before_temperature[0], "mask_ids": mask.token_ids.masked_fill(past, -1),
            "mask_bits": mask.packed_mask, "mask_counts": mask.counts,
            "sampling_masks": [m.token_ids for m in public],
            "temperature": st.temperature.gpu[slots], "top_k": st.top_k.gpu[slots],
            "top_p": st.top_p.gpu[slots], "min_p": st.min_p.gpu[slots],
            "uniforms": row_uniforms(st.seeds.gpu, slots, pos, VOCAB),
        }  # fmt: skip

    def run_watermarked():
        """vLLM's GPUWatermarkSampler (what the V2 runner builds with a watermark config;
        its watermarker is never reached here: the refusal comes first): a watermarked
        request with top_k=20 is refused under the exact cut, one without a cut is not."""
        from vllm.v1.watermarking.gpu_sampler import GPUWatermarkSampler

        out = {}
        for name, params in (("cut", SamplingParams(temperature=1.0, top_k=20, seed=3)),
                             ("no cut", SamplingParams(temperature=0.0, seed=3))):  # fmt: skip
            params.watermarking = True
            states = RequestState(MAX_REQS, 32, 64, 0, VOCAB, device)
            config = type("Config", (), {"reasoning_config": None})()
            sampler = GPUWatermarkSampler(object(), config, MAX_REQS, VOCAB, device, states,
                                          "processed_logprobs")  # fmt: skip
            states.add_request("w", 8, [3, 1, 4, 1, 5, 9, 2, 6], 8, 16)
            sampler.add_request(states.req_id_to_index["w"], params)
            states.apply_staged_writes()
            sampler.apply_staged_writes()
            slot = states.req_id_to_index["w"]
            batch = InputBatch.make_dummy(1, 1, InputBuffers(8, 64, device))
            mapping = torch.tensor([slot], dtype=torch.int64)
            batch = dataclasses.replace(batch, idx_mapping=mapping,
                                        idx_mapping_np=np.array([slot]),
                                        expanded_idx_mapping=mapping)  # fmt: skip
            batch.seq_lens.fill_(9)
            try:
                sampler(logits_exact[:1].clone(), batch)
                out[name] = "sampled"
            except NotImplementedError as exc:
                out[name] = str(exc)
        return out

    # "plain": temperature, greedy, min-p, top-k, top-p (the trainer can rebuild these);
    # "edited": logit bias and penalties change the logits before the temperature.
    plain = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, logprobs=3, seed=11),
        SamplingParams(temperature=1.0, logprobs=3, seed=12),
        SamplingParams(temperature=0.0, logprobs=3, seed=13),
        SamplingParams(temperature=1.3, min_p=0.05, logprobs=3, seed=14),
        SamplingParams(temperature=0.9, top_p=0.5, logprobs=3, seed=15),
        SamplingParams(temperature=2.0, top_k=5, logprobs=3, seed=16),
    ]
    edited = [
        SamplingParams(temperature=0.8, logit_bias={7: 5.0, 8: -3.0}, presence_penalty=0.5,
                       logprobs=2, seed=21),
        SamplingParams(temperature=1.1, repetition_penalty=1.3, frequency_penalty=0.2,
                       top_k=40, logprobs=2, seed=22),
    ]  # fmt: skip
    # bad words: the engine turns words into token ids with the tokenizer; set the ids
    edited[1]._bad_words_token_ids = [[7], [9]]
    # more top logprobs than ours.EXACT_COLUMNS: column 0 exactlogp's, the rest vLLM's
    many = [SamplingParams(temperature=1.0, logprobs=ours.EXACT_COLUMNS + 3, seed=31 + i)
            for i in range(2)]  # fmt: skip
    logits_plain, _ = llm_like_logits(len(plain), VOCAB, torch.bfloat16, seed=5)
    logits_edited, _ = llm_like_logits(len(edited), VOCAB, torch.bfloat16, seed=6)

    # prompt logprobs: two prompts prefilled at once, a stand-in LM head for the model
    prompts = [[5, 17, 1200, 44, 9], [1, 2, 3, 1499, 600, 70, 8]]
    head = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(7))
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(8))
    prompt_logits = []

    def logits_fn(h):
        out = (h @ head.T).to(torch.bfloat16)
        prompt_logits.append(out.clone())
        return out

    id_table = np.array([[17, 0, 1499], [1200, -1, 3], [44, 44, 2], [9, 1, 1]])

    def run_prompts():
        prompt_logits.clear()
        states = RequestState(MAX_REQS, 32, 64, 0, VOCAB, device)
        worker = prompt_logprob.PromptLogprobsWorker(MAX_REQS, device, "raw_logprobs")
        for i, p in enumerate(prompts):
            states.add_request(f"p{i}", len(p), p, 0, 4)
            extra = {"prompt_logprob_token_ids": id_table} if i == 0 else {}
            worker.add_request(
                f"p{i}", states.req_id_to_index[f"p{i}"],
                SamplingParams(prompt_logprobs=2, max_tokens=4, **extra),
            )  # fmt: skip
        states.apply_staged_writes()
        slots = [states.req_id_to_index[f"p{i}"] for i in range(2)]
        lens = np.array([len(p) for p in prompts], dtype=np.int32)
        starts = np.array([0, lens[0], lens.sum()], dtype=np.int32)
        batch = InputBatch.make_dummy(2, int(lens.sum()), InputBuffers(8, 64, device))
        mapping = torch.tensor(slots, dtype=torch.int64)
        batch = dataclasses.replace(
            batch, req_ids=["p0", "p1"], idx_mapping=mapping, idx_mapping_np=np.array(slots),
            expanded_idx_mapping=mapping, num_scheduled_tokens=lens,
            query_start_loc=torch.from_numpy(starts), query_start_loc_np=starts,
            prefill_len_np=lens, num_computed_prefill_tokens_np=np.zeros(2, dtype=np.int32),
        )  # fmt: skip
        by_ids = worker.compute_prompt_token_id_logprobs(
            logits_fn, hidden, batch, states.prompt_len.np
        )
        logits_for_ids = torch.cat(prompt_logits)
        prompt_logits.clear()
        tensors = worker.compute_prompt_logprobs(
            logits_fn, hidden, batch, states.all_token_ids.gpu,
            states.num_computed_tokens.gpu, states.prompt_len.np,
        )  # fmt: skip
        out = {"logits": torch.cat(prompt_logits), "ids_logits": logits_for_ids}
        out["ids_scores"] = by_ids["p0"]
        out["ids_table"] = torch.from_numpy(id_table)
        for name in ("p0", "p1"):
            t = tensors[name]
            out[name] = {"ids": t.logprob_token_ids, "logprobs": t.logprobs,
                         "ranks": t.selected_token_ranks}  # fmt: skip
        return out

    def run_all():
        results = {}
        runs = [("plain", plain, logits_plain, "raw_logprobs"),
                ("plain", plain, logits_plain, "processed_logprobs"),
                ("edited", edited, logits_edited, "processed_logprobs"),
                ("many", many, logits_plain[:2], "raw_logprobs")]  # fmt: skip
        for case, params, logits, mode in runs:
            sampler, batch = new_sampler(mode, params)
            scored.clear()
            out = sampler(logits.clone(), batch)
            t = out.logprobs_tensors
            results[f"{case}/{mode}"] = {
                "sampled": out.sampled_token_ids, "ids": t.logprob_token_ids,
                "logprobs": t.logprobs, "ranks": t.selected_token_ranks, "scored": scored[0],
            }  # fmt: skip
        results["prompt"] = run_prompts()
        # the spec-decode rejection sampler binds compute_topk_scores by name
        ids = torch.stack([logits_plain.float().argmax(-1), torch.full((6,), 42)], -1)
        spec = rejection.compute_topk_scores(logits_plain, 1, ids[:, 0])
        results["spec"] = {"ids": spec.logprob_token_ids, "logprobs": spec.logprobs}
        # the CPU model runner's scorer (its torch.compile'd functions run eagerly here)
        cpu = cpu_logprob.compute_topk_scores(logits_plain, 2, ids[:, 0])
        results["cpu_runner"] = {"ids": cpu.logprob_token_ids, "logprobs": cpu.logprobs}
        return results

    saved = {"version": vllm.__version__, "logits_plain": logits_plain,
             "logits_edited": logits_edited, "head": head, "hidden": hidden,
             "temperature_plain": torch.tensor([p.temperature for p in plain]),
             "temperature_edited": torch.tensor([p.temperature for p in edited]),
             "top_k_plain": torch.tensor([p.top_k if p.top_k > 0 else VOCAB for p in plain]),
             "top_p_plain": torch.tensor([p.top_p for p in plain]),
             "min_p_plain": torch.tensor([p.min_p for p in plain]),
             "same_scorer_in_spec": rejection.compute_topk_scores is logprob.compute_topk_scores}  # fmt: skip
    saved["unpatched"] = run_all()

    # a vLLM whose compute_topk_scores no longer calls compute_token_logprobs is refused
    # and nothing is patched
    def elsewhere(logits, num_logprobs, sampled_token_ids, *args, **kwargs):
        return torch.log_softmax(logits.float(), -1)

    logprob.compute_topk_scores = elsewhere
    try:
        ours.patch_vllm_sampler()
        saved["refused"] = "patched"
    except RuntimeError as exc:
        saved["refused"] = str(exc)
    logprob.compute_topk_scores = their_scorer
    saved["nothing_patched"] = not hasattr(logprob.compute_token_logprobs, "__wrapped__")
    handle = ours.patch_vllm_sampler()
    saved["sites"] = list(handle.sites)
    saved["idempotent"] = ours.patch_vllm_sampler() is handle
    saved["skipped"] = [str(s) for s in handle.skipped]
    saved["patched"] = run_all()
    saved["unpatch"] = ours.unpatch_vllm_sampler()
    saved["unpatched_again"] = run_all()

    # a sampler whose sample() no longer calls _sample_random cannot take the exact cut
    their_sample = sampler_module.Sampler.sample
    sampler_module.Sampler.sample = lambda self, *a, **k: their_sample(self, *a, **k)
    try:
        ours.patch_vllm_sampler(cut="exact")
        saved["exact_refused"] = "patched"
    except RuntimeError as exc:
        saved["exact_refused"] = str(exc)
    sampler_module.Sampler.sample = their_sample
    saved["exact_nothing_patched"] = not hasattr(logprob.compute_token_logprobs, "__wrapped__")

    SamplingStates.apply_temperature = temperature_spy  # records only; calls vLLM's
    saved["logits_exact"] = logits_exact
    saved["exact_unpatched"] = run_exact()
    exact = ours.patch_vllm_sampler(cut="exact")
    saved["exact_sites"] = list(exact.sites)
    saved["exact_options"] = str(exact.options)
    try:
        ours.patch_vllm_sampler()
        saved["exact_then_default"] = "patched"
    except ValueError as exc:
        saved["exact_then_default"] = str(exc)
    saved["exact"] = run_exact()
    # speculative decoding's verification with a cut request is refused (before any work)
    sampler, batch = new_sampler("processed_logprobs", exact_params)
    try:
        names = ("logits", "draft_logits", "draft_sampled", "pos", "cu_num_logits",
                 "idx_mapping", "expanded_idx_mapping", "expanded_local_pos",
                 "seq_lens_upper_bound_np")  # fmt: skip
        rejection.RejectionSampler._verify(
            type("Verify", (), {"sampler": sampler})(), idx_mapping_np=batch.idx_mapping_np,
            **dict.fromkeys(names),
        )  # fmt: skip
        saved["exact_spec_refused"] = "verified"
    except NotImplementedError as exc:
        saved["exact_spec_refused"] = str(exc)
    saved["exact_repeat"] = run_exact()
    saved["exact_watermark"] = run_watermarked()
    saved["exact_unpatch"] = ours.unpatch_vllm_sampler()
    saved["exact_unpatched_again"] = run_exact()
    SamplingStates.apply_temperature = their_apply_temperature
    # vLLM's own plugin loader, as its engine core and workers run it at start-up
    from vllm.plugins import load_general_plugins

    os.environ["EXACTLOGP_PATCH"] = "vllm"
    os.environ["EXACTLOGP_VLLM_CUT"] = "exact"
    os.environ["VLLM_PLUGINS"] = "exactlogp"
    load_general_plugins()
    saved["plugin_patched"] = hasattr(logprob.compute_token_logprobs, "__wrapped__")
    saved["plugin_cut"] = hasattr(sampler_module.Sampler.sample, "__wrapped__")
    torch.save(saved, out_path)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
