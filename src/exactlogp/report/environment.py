"""The report's header facts: machine, software versions and the project's git state."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from .candidates.base import package_version


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device, collective_backend: str, threads: dict) -> dict:
    nccl = None
    if collective_backend == "nccl":
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {
        "device": describe_device(device),
        "gpu_count": torch.cuda.device_count() if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "collective_backend": collective_backend,
        "nccl": nccl,
        "gloo": collective_backend == "gloo",
        "vllm": package_version("vllm"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": {str(tp): n for tp, n in threads.items()},
        "load_average_at_start": _load_average(),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def project_git_state() -> tuple[str | None, bool | None]:
    """(commit, tracked_tree_dirty) of the checkout this package runs from, if any."""
    root = Path(__file__).resolve().parents[3]
    try:
        commit = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no") != ""
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, dirty


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
    )
    return out.stdout.strip()
