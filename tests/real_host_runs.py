"""One script of tests/real_hosts in a subprocess whose path starts with a real host's
directory under .venv/hosts (`make setup` installs each host there with --no-deps): the
tests never import the host themselves. Without that directory the test skips, or with
EXACTLOGP_REAL_HOSTS=required (`make test`) fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import exactlogp

HOSTS = Path(sys.prefix) / "hosts"  # the Makefile's $(HOSTS)
SCRIPTS = Path(__file__).parent / "real_hosts"
SRC = Path(exactlogp.__file__).resolve().parents[1]


def start(script: str, host: str, tmp: Path, drop: tuple[str, ...] = (), **extra: str):
    """Start `script` with HOSTS/`host` first on its path; (process, output path), or
    (None, the reason it cannot run). TORCHDYNAMO_DISABLE=1: the hosts' `torch.compile`d
    functions run eagerly (compiling C++ on a CPU takes many seconds). `drop`: more
    variables to leave out of its environment than EXACTLOGP_PATCH; `extra`: more to set."""
    directory = HOSTS / host
    if not directory.is_dir():
        return None, f"{host} is not installed in {directory} (run `make setup`)"
    out = tmp / f"{script}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("EXACTLOGP_PATCH", *drop)}
    env.update(
        CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1",
        PYTHONPATH=os.pathsep.join([str(directory), str(SRC)]), **extra,
    )  # fmt: skip
    cmd = [sys.executable, str(SCRIPTS / f"{script}.py"), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out


def finish(started, timeout: float = 300.0) -> dict:
    """What the script saved; skips (or fails) when it could not start."""
    proc, out = started
    if proc is None:
        if os.environ.get("EXACTLOGP_REAL_HOSTS") == "required":
            pytest.fail(out)
        pytest.skip(out)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"the subprocess ran past {timeout} s:\n{log.decode(errors='replace')}")
    assert proc.returncode == 0, log.decode(errors="replace")
    return torch.load(out, weights_only=True)
