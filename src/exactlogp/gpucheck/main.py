"""The GPU check of the Triton backend, in one command: bits, latency, bandwidth, code.

1. Bits: the Triton backend on the GPU against a CPU backend, forward outputs and
   gradients, entropy on and off, on the Qwen3-Next shape (1024 x 151936 bf16), its TP4
   shard (1024 x 37984, local passes), the four TP4 shards combined exactly on the GPU
   against the whole vocabulary, and fp16/fp32 cases with temperature, keep-mask,
   padding, ignored and NaN rows, each Triton path (direct kernels, value tables) forced on
   some of them. Every row is compared (--ref-rows N: the first N only),
   against the fused "cpu" backend (held bitwise to the torch reference by the tests, and
   fast enough for every row) or, with --ref-backend reference, the torch reference.
   The finalize kernel alone on drawn records (testing.finalize_inputs: boundary limb
   sums, every bad flag, ignored rows) against contract.finalize on the CPU, every field.
   And the forward with validate=False under torch.cuda.set_sync_debug_mode("error").
2. Latency (CUDA events, L2 flushed before each run; median of --repeats after --warmup
   runs, the steps interleaved in a seeded order shuffled per round; beside each forward
   its host time, the CPU's seconds inside one call) on the TP4 shard and
   the full vocabulary, bf16. The headline is exactlogp's whole forward (max pass, term
   pass and the fused finalize, through the public API, on a TP group of one) on the TP4
   shard. Against it: the real megatron-core `vocab_parallel_cross_entropy`, eager torch
   fp32 log_softmax + gather and torch.compile'd fp32 logsumexp + gather, forward and
   forward+backward (exactlogp.report.candidates at TP1); and exactlogp's parts: the two
   local passes, the finalize kernel alone (beside the unfused contract.finalize in torch
   ops), the forward replayed from a CUDA graph.
3. The max pass's achieved HBM bandwidth (bytes read / time), beside a device copy's.
4. The kernels compiled for this GPU's architecture and their code checked (ptx.py).
5. The exact fused LM head (linear.py): bits of the Triton backend against the reference on
   the CPU; batch invariance on the device (rows' logits and logprobs one row per call, 7
   per call and all at once: the exact head must agree, the torch bf16 / fp32 heads'
   differences are counted); its latency against the bf16 LM-head GEMM + megatron-core's CE
   at the TP4 shard (every route), a decode step on a prepared weight, a training-size block
   and the whole vocabulary; head_logits_kernel on each candidate tile (HEAD_TILES), whose
   logits must be the default tile's bits.
6. Processed logprobs (processed.py): processed_logprobs, its keep mask and thresholds,
   and sample, on the device against the CPU bit for bit (each cut alone, all three,
   per-row top-k), and their latency beside the plain forward and a sort-based sampler.
7. Where the time goes (profile.py): GEMM ceilings at the real shapes, kernels and launches
   per call (torch.profiler), the host's functions (cProfile), forward+backward from a CUDA
   graph, and an exactness probe of bf16 tl.dot on integer slices.

The stages run in the order bits, fused LM head, processed logprobs, latency, bandwidth,
compiled code, profile, and
gpu_check.json and gpu_check.md are written to --out after each one, so a run cut short
keeps the stages it finished ("stages run" in the report).

    PYTHONPATH=src python benchmarks/gpu_check.py --out reports/gpu
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/gpu_check.py --tiny --out /tmp/gc

--tiny runs every stage on tiny shapes; without a GPU it runs the kernels in the Triton
interpreter on the CPU (TRITON_INTERPRET=1 must be set) and skips the CUDA-only parts
with a note. CPU timings of the interpreter mean nothing; they only prove the code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import torch

import exactlogp

from .. import contract
from . import bits, linear, processed, profile, speed

STAGES = ("bits", "latency", "bandwidth", "ptx", "fused", "processed", "profile")


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "exactlogp": exactlogp.__version__, "contract": contract.CONTRACT,
           "device": str(device), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}  # fmt: skip
    for module in ("triton", "megatron.core"):
        try:
            env[module] = __import__(module, fromlist=["x"]).__version__
        except Exception as exc:
            env[module] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "sm_count": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}  # fmt: skip
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True,
                                           timeout=30).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            env["driver"] = f"unknown ({type(exc).__name__})"
    return env


def _us(t: dict | None) -> str:
    if t is None:
        return "-"
    return f"{t['median'] * 1e6:.1f} ({t['p10'] * 1e6:.1f}-{t['p90'] * 1e6:.1f})"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# exactlogp Triton backend: GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- stages run: {', '.join(report.get('stages_done', [])) or 'none yet'}"]
    lines += ["", "## 1. Bits: Triton on the device vs a CPU backend (every row)", "",
              "| case | entropy | output | result |", "|---|---|---|---|"]  # fmt: skip
    for r in report["bits"]:
        extra = {k: v for k, v in r.items() if k not in ("case", "entropy", "output", "status")}
        lines.append(f"| {r['case']} | {r['entropy']} | {r['output']} | {r['status']}"
                     f"{' ' + json.dumps(extra) if extra else ''} |")  # fmt: skip
    if report.get("sync"):
        lines += ["", "| host sync check | result | detail |", "|---|---|---|"]
        lines += [f"| {r['check']} | {r['status']} | {r['detail']} |" for r in report["sync"]]
    if report.get("invariance"):
        lines += ["", "| batch invariance on the device | rows per call vs all at once "
                  "| rows whose logits differ | logprobs differing |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['head']} | {r['batch']} vs {r['against']} | "
                  f"{r['logits_rows_differing']}/{r['rows']} | {r['logprobs_differing']}/{r['rows']} |"
                  for r in report["invariance"]]  # fmt: skip
    lines += ["", "## 2. Latency (median, p10-p90, microseconds)", ""]
    lines += [speed.headline(report["latency"], env["device"]), ""]
    lines += ["| shape | candidate | forward | forward+backward | host time of a forward |",
              "|---|---|---|---|---|"]  # fmt: skip
    for r in report["latency"]:
        host = r.get("host_forward")
        lines.append(f"| {r['shape']} {r['rows']}x{r['cols']} | {r['candidate']} "
                     f"| {_us(r['forward'])} | {_us(r['forward_backward'])} "
                     f"| {'-' if host is None else f'{host * 1e6:.1f}'} |")  # fmt: skip
    lines += ["", "## 3. Bandwidth", "", "| what | bytes | median us | GB/s |", "|---|---|---|---|"]
    for r in report["bandwidth"]:
        lines.append(
            f"| {r['what']} | {r['bytes']} | {r['median'] * 1e6:.1f} | {r['GB_per_s']:.0f} |"
        )
    if report["ptx"]:
        from .ptx import Result
        from .ptx import markdown as ptx_markdown

        results = [Result(**r) for r in report["ptx"]]
        lines += ["", "## 4. Compiled code", "", ptx_markdown(results, report["ptx_arch"])]
    if report.get("profile"):
        lines += profile.markdown(report["profile"])
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _ptx(device, quick: bool, report: dict, log) -> None:
    if device.type != "cuda":
        report["notes"].append("PTX check skipped: the kernels run in the Triton interpreter")
        return
    from . import ptx

    props = torch.cuda.get_device_properties(device)
    report["ptx_arch"] = props.major * 10 + props.minor
    from triton.compiler.errors import CompilationError

    try:
        results = ptx.check(report["ptx_arch"], quick)
    except CompilationError:  # the kernels' own code is wrong: a failure, not a note
        raise
    except Exception as exc:  # no compiler for this target here: say why
        report["notes"].append(f"PTX check failed to compile: {type(exc).__name__}: {exc}")
        return
    report["ptx"] = [asdict(r) for r in results]
    log(f"  {sum(r.ok for r in results)}/{len(results)} kernel variants keep the contract")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the reports")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter OK)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per figure (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--ref-rows",
        type=int,
        default=None,
        help="check only the first rows of each case (default: every row)",
    )
    parser.add_argument("--ref-backend", choices=("cpu", "reference"), default=None,
                        help="the CPU backend compared with (default: cpu where it builds)")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=STAGES)
    args = parser.parse_args(argv)
    log = print  # the command's console

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not (args.tiny and os.environ.get("TRITON_INTERPRET") == "1"):
        log("no CUDA device: run with --tiny under TRITON_INTERPRET=1 to test the script on CPU")
        return 2
    if not args.tiny:
        torch.set_num_threads(os.cpu_count() or 1)  # the CPU reference checks 10^7+ logits
    if args.repeats < 20 and not args.tiny:
        parser.error("--repeats must be >= 20 for reported figures")
    shapes = ({"tp4-shard": (2, 128), "full-vocab": (2, 512)} if args.tiny else
              {"tp4-shard": (1024, bits.QWEN3_NEXT_VOCAB // bits.TP),
               "full-vocab": (1024, bits.QWEN3_NEXT_VOCAB)})  # fmt: skip
    report = {"environment": environment(device), "bits": [], "sync": [], "latency": [],
              "invariance": [], "bandwidth": [], "ptx": [], "ptx_arch": None, "notes": [],
              "stages_done": []}  # fmt: skip
    if device.type == "cpu":
        report["notes"].append("CPU run in the Triton interpreter: timings are not GPU "
                               "figures; CUDA graphs and the bandwidth stage were skipped")  # fmt: skip
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    def save(stage: str) -> None:  # after every stage: a run cut short keeps what it did
        report["elapsed_s"] = time.perf_counter() - started
        report["stages_done"].append(stage)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "gpu_check.md").write_text(markdown(report))
        log(f"  [{stage} done, {report['elapsed_s']:.0f} s; written to {args.out}]")

    if "bits" not in args.skip:
        log("bits")
        report["bits"], report["sync"] = bits.run(
            device, args.tiny, args.ref_rows, log, args.ref_backend
        )
        save("bits")
    if "fused" not in args.skip:
        log("the fused LM head")
        report["bits"] += linear.run_bits(device, args.tiny, log)
        report["invariance"] = linear.batch_invariance(device, args.tiny, log)
        report["latency"] += linear.latency(device, args.tiny, args.repeats, args.warmup, log)
        save("fused")
    if "processed" not in args.skip:
        log("processed logprobs and sample (the exact cut)")
        report["bits"] += processed.run_bits(device, args.tiny, log)
        report["latency"] += processed.latency(device, args.tiny, args.repeats, args.warmup, log)
        save("processed")
    if "latency" not in args.skip:
        log("latency")
        rows, notes = speed.latency(shapes, device, args.repeats, args.warmup, log)
        report["latency"] = rows + report["latency"]
        report["notes"] += notes
        save("latency")
    if "bandwidth" not in args.skip and device.type == "cuda":
        log("bandwidth")
        report["bandwidth"] = speed.bandwidth(shapes, device, args.repeats, args.warmup)
        save("bandwidth")
    if "ptx" not in args.skip:
        log("compiled code")
        _ptx(device, args.tiny, report, log)
        save("ptx")
    if "profile" not in args.skip:
        log("where the time goes")
        report["profile"], notes = profile.run(device, args.tiny, args.repeats, args.warmup, log)
        report["notes"] += notes
        save("profile")
    log(markdown(report))
    ok = all(bits.passed(r) for r in report["bits"])
    ok = ok and all(linear.invariance_passed(r) for r in report["invariance"])
    ok = ok and all(linear.tiles_passed(r) for r in report["latency"])
    ok = ok and all(r["status"] == "no-sync" for r in report["sync"])
    return 0 if ok and all(r["ok"] for r in report["ptx"]) else 1
