"""What contract exactlogp-linear-v2 costs against v1, on the CPU, per input kind.

v2's logits are the true dot products rounded once; v1's rounded every element to a 20-bit
grid of its row first (linear_contract L2) and were exact only where the grid held every
element. v2 runs v1's integer GEMM and adds, where residuals take part, their binary64
correction (sparse where they are few) and, for the rare logits its bound leaves open,
the exact limb sum. Timed here side by side in one process, interleaved, medians:

  v1: linear_contract.quantize + logits_block over the weight blocks linear.py uses (the
      code v1's linear_logits ran; it is still the first step of v2)
  v2: exactlogp.linear_logits on the same backend

Workloads: exactlogp.testing.lm_head_inputs rows with two channels 1x / 8x / 30x / 100x /
1000x the rest (bf16) and fp32 inputs. Also per workload: the residuals' share of the
elements, the logits left to the exact sum, and the work of the int8 routes (the integer
GEMM's int8 multiply-adds, the correction's binary64 ones) with an H200 estimate from its
peak rates (not measured).

    PYTHONPATH=src python benchmarks/linear_cost.py [--rows 512 --hidden 4096 --vocab 8192]
        [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import exactlogp
from exactlogp import linear_contract as lc
from exactlogp.backends import get_backend
from exactlogp.linear import WEIGHT_BLOCK_ELEMENTS
from exactlogp.testing import lm_head_inputs

WORKLOADS = [("bf16", 1.0), ("bf16", 8.0), ("bf16", 30.0), ("bf16", 100.0), ("bf16", 1000.0),
             ("fp32", 8.0)]  # fmt: skip
H200_INT8 = 1979e12  # dense int8 tensor-core ops/s (peak, spec sheet)
H200_FP64 = 67e12  # fp64 tensor-core flop/s (peak)
H200_BYTES = 4.8e12  # HBM bytes/s: a sparse product is bound by reading its dense rows


def inputs(rows, hidden, vocab, dtype: str, outlier: float, seed: int = 6):
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    return lm_head_inputs(rows, hidden, vocab, kind, seed=seed, outlier=outlier,
                          outlier_channels=2)  # fmt: skip


def v1_logits(h, w, backend) -> torch.Tensor:
    """Contract v1's logits: every element on its row's 20-bit grid, then exact."""
    e, fin = lc.row_exponents(h)
    a, rs = lc.quantize(h, e, fin), lc.unit_scales(e - 2 * lc.QBITS, fin)
    f, ff = lc.row_exponents(w)
    cs = lc.unit_scales(f, ff)
    out = torch.empty(h.shape[0], w.shape[0], dtype=torch.float32)
    step = max(1, WEIGHT_BLOCK_ELEMENTS // h.shape[1])
    for v0 in range(0, w.shape[0], step):
        r = slice(v0, v0 + step)
        c = lc.quantize(w[r], f[r], ff[r])
        lc.logits_block(a, rs, c, cs[r], None, 1.0, backend.exact_dot, out[:, r])
    return out


def census(h, w) -> dict:
    """Residual shares, logits left to the exact sum, and the int8 routes' work."""
    rows = lc.hidden_rows(h)
    f, ff = lc.row_exponents(w)
    n, k = h.shape
    left = nnz_h = nnz_w = 0
    step = max(1, WEIGHT_BLOCK_ELEMENTS // k)
    for v0 in range(0, w.shape[0], step):
        r = slice(v0, v0 + step)
        cols = lc.weight_rows(w[r], f[r], ff[r])
        nnz_w += _nnz(cols.res)
        e, bound = lc.correction(rows, cols)
        if e is not None:
            z, z_out = rows.dot(cols.c, lc.float_exact_dot)
            _, undecided = lc.round_corrected(z, e, bound, rows.scale, lc.unit_scales(f[r], ff[r]),
                                              z_out, rows.shift)  # fmt: skip
            left += 0 if undecided is None else int(undecided.sum())
    nnz_h = _nnz(rows.res)
    v = w.shape[0]
    int8 = 9 * n * v * k  # five diagonals over 9K slice pairs
    dense = rows.res is not None and rows.res.layout == torch.strided
    fp64 = 2 * n * v * k if dense else nnz_h * v + nnz_w * n
    est = 2 * int8 / H200_INT8 + (2 * fp64 / H200_FP64 if dense else 8 * fp64 / H200_BYTES)
    return dict(res_h=nnz_h / (n * k), res_w=nnz_w / (v * k), left=left, int8=int8,
                fp64=fp64, h200_v1=2 * int8 / H200_INT8, h200_v2=est)  # fmt: skip


def _nnz(res) -> int:
    if res is None:
        return 0
    return int(res._nnz()) if res.layout == torch.sparse_csr else int(torch.count_nonzero(res))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    backend = get_backend(args.backend, torch.device("cpu"))
    lines = [
        f"Contract v2 against v1: {args.rows} rows x H {args.hidden} x V {args.vocab}, "
        f"logits forward, backend {args.backend!r}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}; medians of {args.repeats} "
        "interleaved runs (`PYTHONPATH=src python benchmarks/linear_cost.py`)",
        "",
        "| inputs | residual share: hidden / weight | logits to the exact sum | v1 s | "
        "v2 s | v2 / v1 | int8 routes: int8 MACs + fp64 MACs | H200 estimate v1 -> v2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype, outlier in WORKLOADS:
        h, w, _ = inputs(args.rows, args.hidden, args.vocab, dtype, outlier)
        runs = {"v1": [], "v2": []}
        v1_logits(h, w, backend), exactlogp.linear_logits(h, w, backend=backend)  # warm
        for _ in range(args.repeats):
            runs["v1"].append(timed(lambda: v1_logits(h, w, backend)))  # noqa: B023
            runs["v2"].append(timed(lambda: exactlogp.linear_logits(h, w, backend=backend)))  # noqa: B023
        t1, t2 = statistics.median(runs["v1"]), statistics.median(runs["v2"])
        c = census(h, w)
        name = f"{dtype}, two channels {outlier:g}x" if dtype == "bf16" else "fp32"
        lines.append(
            f"| {name} | {c['res_h']:.2%} / {c['res_w']:.3%} | {c['left']} | {t1:.3f} | "
            f"{t2:.3f} | {t2 / t1:.2f}x | {c['int8'] / 1e9:.1f} G + {c['fp64'] / 1e9:.2f} G | "
            f"{c['h200_v1'] * 1e3:.2f} -> {c['h200_v2'] * 1e3:.2f} ms |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_cost.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
