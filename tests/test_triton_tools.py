"""The Triton tooling scripts run end to end on a machine without a GPU.

- benchmarks/triton_ptx_check.py (exactlogp.gpucheck.ptx) compiles the kernels for sm_90 (no GPU needed) and checks
  the machine code: no FMA, IEEE divisions only, every fp64 immediate a contract constant.
- benchmarks/gpu_check.py --tiny (exactlogp.gpucheck) runs every stage of the GPU check in
  the Triton interpreter, so that it works the first time a GPU is available.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exactlogp.contract import Finalized

pytest.importorskip("triton", reason="Triton is not installed: no Triton backend")

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, interpret: bool, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_compiled_kernels_keep_the_contract(tmp_path):
    done = _run([str(ROOT / "benchmarks" / "triton_ptx_check.py"), "--quick"], tmp_path, False)
    if done.returncode == 2:
        pytest.skip(f"Triton cannot compile for sm_90 here: {done.stdout.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    # max, terms, finalize, gradient, the exact cut's chunk maxima, the value tables'
    # kernels and the exact GEMM, at the Qwen3-Next shape and at one row (a decode step),
    # and the fused head's two kernels and its backward's class maxima: all compile and
    # keep the contract
    assert done.stdout.count("| yes |") == 26 and "| NO |" not in done.stdout, done.stdout
    assert "| chunk_max[bfloat16+tau] | yes |" in done.stdout, done.stdout
    assert "| head_logits_kernel" in done.stdout or "| head[" in done.stdout, done.stdout
    assert "| finalize[" in done.stdout and ":sums |" in done.stdout, done.stdout
    assert "| exact_dot[rows=1] | yes |" in done.stdout, done.stdout


def test_gpu_check_runs_end_to_end_in_the_interpreter(tmp_path):
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    out = tmp_path / "report"
    args = [script, "--tiny", "--out", str(out), "--repeats", "1", "--warmup", "0"]
    done = _run(args, tmp_path, interpret=not torch.cuda.is_available())
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    drawn = [r for r in report["bits"] if r["case"].startswith("finalize-records")]
    others = [r for r in report["bits"] if r not in drawn]
    assert others and all(r["status"] == "bitwise-equal" for r in others)
    # the drawn records include S = 0 rows, whose arithmetic NaN payload the device picks
    assert {r["status"] for r in drawn} <= {"bitwise-equal", "equal-except-NaN-payload"}
    assert {r["output"] for r in drawn} == set(Finalized._fields)
    # every stage ran and was written (bandwidth needs CUDA)
    cuda = torch.cuda.is_available()
    stages = ["bits", "fused", "processed", "latency", *(["bandwidth"] if cuda else []),
              "ptx", "profile"]  # fmt: skip
    assert any(r["case"].startswith("processed") for r in others)  # the exact cut's bits
    assert report["stages_done"] == stages
    # where the time goes: every part ran and the probe's integers were checked
    prof = report["profile"]
    assert {r["call"] for r in prof["kernels"]} >= {"core op forward", "core op forward+backward"}
    assert all(r["kernels"] for r in prof["kernels"]) and len(prof["host"]) == 2
    assert len(prof["ceilings"]) == 5 and len(prof["bf16_probe"]) == 6
    assert all(r["wrong"] == 0 for r in prof["bf16_probe"]) or cuda  # numpy adds exactly
    # batch invariance: three heads x two batch sizes; the exact head agrees with itself
    assert len(report["invariance"]) == 6
    exact = [r for r in report["invariance"] if r["must_agree"]]
    assert len(exact) == 2
    assert all(r["logits_rows_differing"] == 0 == r["logprobs_differing"] for r in exact)
    candidates = {r["candidate"] for r in report["latency"]}
    assert {"torch_full[row_block=all]", "exactlogp finalize kernel alone"} <= candidates
    if importlib.util.find_spec("megatron") is not None:  # the real baseline ran too
        assert {"megatron_ce", "exactlogp[triton,validate=false]"} <= candidates
    else:
        assert "exactlogp[triton,validate=false]" in candidates
    # the fused head on its shapes (a decode step on a prepared weight among them), and
    # head_logits_kernel on every tile with the default tile's bits
    from exactlogp.backends.triton.linear_kernels import HEAD_TILES

    shapes = {r["shape"] for r in report["latency"]}
    assert {"fused-head tp4-shard 4x48", "fused-head decode-step 2x48"} <= shapes, shapes
    assert any("prepared weight" in c for c in candidates)
    tiles = [r for r in report["latency"] if r["shape"].startswith("head-logits tiles")]
    assert len(tiles) == len(HEAD_TILES) and all(r["bits_equal_default"] for r in tiles)
    text = (out / "gpu_check.md").read_text()
    assert "## 1. Bits" in text and "**Headline: exactlogp forward" in text
