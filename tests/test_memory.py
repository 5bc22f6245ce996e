"""The reference backend works in row blocks: its extra memory is set by the block size,
not by the number of rows, and stays far below 1 GiB at the Qwen3-Next vocabulary.

Measured in a fresh process as the rise of the peak resident set size over the peak
after the inputs exist (ru_maxrss); the gradient itself (the size of the input) is
counted in the backward figure. The full 1024-row shape is measured by
benchmarks/reference_memory.py (a minute of CPU time, too long for every test run).
"""

import subprocess
import sys

SCRIPT = """
import resource, sys, torch, exactlogp
rows, backward = int(sys.argv[1]), sys.argv[2] == "1"
x = torch.empty(rows, 151936, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
t = torch.randint(0, 151936, (rows,))
x.requires_grad_(backward)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak()
res = exactlogp.selected_logprobs(x, t, backend="reference", with_entropy=backward)
if backward:
    (res.logprobs.sum() + res.entropy.sum()).backward()
print(peak() - base)
"""


def extra_mib(rows: int, backward: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(rows), "1" if backward else "0"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def test_reference_forward_memory_does_not_grow_with_rows():
    few, many = extra_mib(16, backward=False), extra_mib(128, backward=False)
    assert few < 256 and many < 256
    assert many < few + 32, (few, many)


def test_reference_backward_memory_is_bounded_beyond_the_gradient():
    gradient_mib = 64 * 151936 * 2 / 2**20
    assert extra_mib(64, backward=True) < 256 + gradient_mib
