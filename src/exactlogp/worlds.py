"""Real torch.distributed worlds on this machine: the one place that starts them, for the
report, the benchmarks, the GPU check and the tests.

- `free_port`: the rendezvous port on 127.0.0.1.
- `World`: `world_size` new processes joined by a gloo (CPU) or NCCL (one GPU per rank)
  process group, each running `fn(rank, world_size, group, *args)`. gloo ranks are
  forked from multiprocessing's fork server, which has imported torch (and megatron-core
  where installed, see worlds_preload.py) once and nothing else, so a rank starts in a
  fraction of a second instead of importing torch itself; NCCL ranks are spawned. Either
  way a rank takes the parent's environment as it is when the world starts. Every rank
  writes its return value, or its error, to a file before the group goes away, so a
  failing rank's own error is on disk before its peers see the connection drop. Rank 0
  reports progress through another small file the parent polls (`progress`), and can
  leave results behind as it goes (`publish`), so a killed process never leaves a lock
  behind and what was done before a crash is kept. No process outlives the `with` block.
- `run_world` / `run_gloo_world`: start, wait, return every rank's value or raise.
- `single_rank`: a process group of this one process, so that TP1 measurements run
  through the same code as TP > 1.

Timeout policy, the same everywhere: a world gets STARTUP_S to start its processes and
join its process group; then every phase of its work (what rank 0 names in `progress`:
a report candidate, a timed run; the whole function for `run_world`) gets `timeout`
seconds from its start before the world is killed. The process group's own timeout is
the larger of the two, so a rank stuck in a collective ends by itself too.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

STARTUP_S = 300.0  # spawning a world and joining its process group, on a busy machine
POLL_S = 0.2
FAILURE_GRACE_S = 1.0
JOINED = ""  # the phase rank 0 reports once the process group is up
PRELOAD = ("exactlogp.worlds_preload",)  # what the fork server imports once
Progress = Callable[[str, int, str], None]  # (phase, steps done, what)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_timeout(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout, STARTUP_S))


def collective_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class Failure:
    error: str  # one line
    traceback: str | None = None
    timed_out: bool = False


class World:
    """A spawned world seen from the parent: start it with `with`, then `wait()`."""

    def __init__(
        self,
        world_size: int,
        fn,
        args: tuple = (),
        *,
        backend: str = "gloo",
        timeout: float = 120.0,
        env: dict | None = None,
        threads: int = 1,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.world_size, self.timeout = world_size, timeout
        self._spec = (world_size, backend, dict(env or {}), timeout, threads)
        self._payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
        self.phase: str | None = None  # the phase rank 0 reported last; None before it joined
        self._procs: list = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._last_line: str | None = None

    def __enter__(self) -> World:
        self._tmp = tempfile.TemporaryDirectory(prefix="exactlogp-world-")
        world_size, backend, env, timeout, threads = self._spec
        environ = dict(os.environ)  # what a process spawned now would see, with `env` on top
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        args = (free_port(), self._tmp.name, world_size, backend, environ, timeout, threads)
        args = (*args, self._payload)
        ctx = _context(backend)
        self._procs = [
            ctx.Process(target=_worker, args=(rank, *args), daemon=True)
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(10)
        self._tmp.cleanup()

    def wait(self, on_progress: Progress | None = None) -> Failure | None:
        """None when every rank finished cleanly; else what went wrong first."""
        since, limit = time.monotonic(), max(self.timeout, STARTUP_S)
        while True:
            phase = self._poll(on_progress)
            if phase is not None:  # a new phase: its own `timeout` from now
                since, limit = time.monotonic(), self.timeout
            procs = self._procs
            if any(p.exitcode is not None and not self._clean(r) for r, p in enumerate(procs)):
                time.sleep(FAILURE_GRACE_S)  # let the other ranks record what they saw
                return self._root_cause()
            if all(p.exitcode is not None for p in procs):
                return None
            if time.monotonic() - since > limit:
                return Failure(
                    f"TimeoutError: no result after {limit:.0f} s; world killed", None, True
                )
            time.sleep(POLL_S)

    def values(self) -> list:
        """Every rank's return value (after a clean `wait`)."""
        return [_load(self._rank_path(rank))[1] for rank in range(self.world_size)]

    def published(self) -> dict:
        """{key: value} of everything rank 0 published, finished or not."""
        out = {}
        for entry in sorted(os.listdir(self._tmp.name)):
            if entry.startswith("pub-") and entry.endswith(".pt"):
                ok, item = _load(os.path.join(self._tmp.name, entry))
                if ok:
                    out[item[0]] = item[1]
        return out

    def _rank_path(self, rank: int) -> str:
        return os.path.join(self._tmp.name, f"rank{rank}.pt")

    def _clean(self, rank: int) -> bool:
        return _load(self._rank_path(rank))[0] is True

    def _root_cause(self) -> Failure:
        """A rank that died without a word first; else the earliest error written (the
        ranks that fail later mostly report the connection the first one dropped)."""
        for rank, p in enumerate(self._procs):
            if p.exitcode is not None and not os.path.exists(self._rank_path(rank)):
                return Failure(f"rank {rank} died with exit code {p.exitcode}")
        failed = [
            (os.stat(self._rank_path(r)).st_mtime_ns, r)
            for r, p in enumerate(self._procs)
            if p.exitcode is not None and _load(self._rank_path(r))[0] is False
        ]
        rank = min(failed)[1]
        value = _load(self._rank_path(rank))[1]
        return Failure(f"rank {rank}: {value['error']}", value["traceback"])

    def _poll(self, on_progress: Progress | None) -> str | None:
        """The phase if rank 0 started a new one since the last poll, else None."""
        try:
            with open(os.path.join(self._tmp.name, "progress")) as f:
                line = f.read()
        except OSError:
            return None
        if line == self._last_line or line.count("\t") != 2:
            return None
        self._last_line = line
        phase, done, what = line.split("\t")
        started = phase if phase != self.phase else None
        self.phase = phase
        if on_progress and phase != JOINED:
            on_progress(phase, int(done), what)
        return started


def run_world(
    world_size: int, fn, *args, backend: str = "gloo", timeout: float = 120.0, threads: int = 1
) -> list:
    """Run fn(rank, world_size, group, *args) in `world_size` fresh processes; return the
    per-rank results (picklable values). `fn` must be importable (a module-level
    function). Every process is ended before this returns, on error or timeout too."""
    with World(world_size, fn, args, backend=backend, timeout=timeout, threads=threads) as world:
        failure = world.wait()
        if failure is None:
            return world.values()
    if failure.timed_out:
        raise TimeoutError(f"{backend} world of {world_size}: {failure.error}")
    raise RuntimeError(f"{failure.error}\n{failure.traceback or ''}".rstrip())


def run_gloo_world(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """`run_world` on gloo: a real process group on 127.0.0.1, one intra-op thread per rank."""
    return run_world(world_size, fn, *args, backend="gloo", timeout=timeout)


@contextlib.contextmanager
def single_rank(device: torch.device, timeout: float = STARTUP_S):
    """The process group of this process alone (gloo; NCCL on CUDA), torn down on exit.

    A default process group that already exists is used as it is, if it has one rank.
    """
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            collective_backend(device),
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=group_timeout(timeout),
        )
    elif dist.get_world_size() != 1:
        raise ValueError(f"single_rank needs a world of one rank, got {dist.get_world_size()}")
    try:
        yield dist.group.WORLD
    finally:
        if own:
            dist.destroy_process_group()


# --- inside a spawned rank ---

_world_dir: str | None = None  # this rank's world folder; None outside a spawned world


def progress(phase: str, done: int, what: str) -> None:
    """Tell the parent where this world is (rank 0); a new phase restarts its timeout."""
    if _world_dir is None:
        return
    tmp = os.path.join(_world_dir, "progress.tmp")
    with open(tmp, "w") as f:
        f.write(f"{phase}\t{done}\t{what}")
    os.replace(tmp, os.path.join(_world_dir, "progress"))


def publish(key: str, value) -> None:
    """Leave `value` for the parent under `key` now, whatever happens to the world later."""
    if _world_dir is None:
        raise RuntimeError("publish is for a rank of a spawned World")
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    _save(os.path.join(_world_dir, f"pub-{name}.pt"), (True, (key, value)))


def _load(path: str):
    """(ok, value) from a result file; (None, None) if there is none yet."""
    if not os.path.exists(path):
        return None, None
    try:
        return torch.load(path, weights_only=False)
    except Exception as exc:  # a rank killed while writing leaves a torn file
        return False, {"error": f"unreadable result: {type(exc).__name__}: {exc}", "traceback": ""}


def _save(path: str, value) -> None:
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the parent dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's clean-up is the only one


def _context(backend: str):
    """gloo: the fork server's multiprocessing context (the first call chooses what it
    preloads; a server already started by other code keeps its own list). NCCL: spawn, so
    that no rank is forked from a process that may have touched CUDA."""
    import torch.multiprocessing as mp

    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(rank, port, tmp, world_size, backend, environ, timeout, threads, payload):
    global _world_dir
    import torch.distributed as dist

    _die_with_parent()  # a fork server's child: the server itself ends with the parent
    os.environ.clear()  # the fork server's environment is the one it started with
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _world_dir = tmp
    torch.set_num_threads(threads)
    try:
        # unpickled only now, so that the modules it imports see the parent's environment
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=group_timeout(timeout),
        )
        if rank == 0:
            progress(JOINED, 0, "joined")
        result = (True, fn(rank, world_size, dist.group.WORLD, *args))
    except BaseException as exc:
        result = (
            False,
            {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()},
        )
    _save(os.path.join(tmp, f"rank{rank}.pt"), result)
    if dist.is_initialized():
        dist.destroy_process_group()
