"""sglang/srt/sampling/sampling_params.py (0.5.23): the constant that stands for "no
top-k". `SamplingParams.normalize` maps top_k -1 to it, and a temperature below 1e-6
(greedy) to temperature 1.0 with top_k 1."""

TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6  # named _SAMPLING_EPS in SGLang
