"""Build and load the fused CPU kernels (csrc/exactlogp_cpu.c) on first use.

The C source ships inside the package and is compiled by the system C compiler into a
cache directory, keyed by a hash of the source, the generated constants header and the
flags; later processes load the cached library with ctypes, and look for a compiler only
when they have to build (a cached library loads on a machine without one). Nothing needs
Python headers, a build step at install time, torch headers or a network, and a source
checkout on PYTHONPATH works like an installed wheel. Without a compiler the package still
works with the reference backend; backend="cpu" then says why it cannot.

The cache is a security boundary: a library found there is executed. So the cache
directory must be owned by this user and writable by nobody else (created 0700, checked
with lstat: no symlink, right owner, no group/world write); every library is verified
against a SHA-256 sidecar written after its atomic rename, and one that does not match
(truncated by a crash, damaged, planted) is rebuilt instead of loaded.

The numeric constants are not written in the C source: `constants_header()` generates
them from contract.py (C99 hex literals, exact), so there is one definition of each.
The instruction set is picked for this CPU ("avx512" or "avx2" on x86-64 CPUs that have
them, else "baseline"; $EXACTLOGP_CPU_ISA overrides) and is part of the cache key, so a
cache shared between machines never hands one a library it cannot run. The kernels are
built with OpenMP and run on torch's own OpenMP threads (libgomp is linked by its soname,
which resolves to the copy torch has loaded); a compiler that cannot build with OpenMP
gives a "-serial" library instead, whose kernels run on the calling thread, and is not
asked again while that library is cached.
`python -m exactlogp.backends.cpu_build` builds ahead of time (`make setup` does).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from .. import contract

try:
    import fcntl
except ImportError:  # not POSIX: no build lock, the atomic rename still keeps builds safe
    fcntl = None

log = logging.getLogger(__name__)

SOURCE_NAME = "exactlogp_cpu.c"
HEADER_NAME = "exactlogp_constants.h"
# No FMA contraction and no fast-math: every + - * / must be the single IEEE operation
# the contract names. The x86-64 builds pass -mfma for the one FMA the source writes itself
# (exact_product_add, where the product is exact and the FMA rounds as the add does); with
# -ffp-contract=off the compiler makes no other.
CFLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-pthread",
    "-ffp-contract=off",
    "-fno-fast-math",
)
# Each build is the same arithmetic at another vector width (4 doubles, or 8 with AVX-512).
ISA_FLAGS = {
    "baseline": (),
    "avx2": ("-mavx2", "-mf16c", "-mfma"),
    "avx512": (
        "-mavx2", "-mf16c", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl",
    ),
}  # fmt: skip
# The kernels run on torch's OpenMP threads: -fopenmp links libgomp by its soname, which
# resolves to the copy torch has loaded. A compiler without OpenMP builds them without
# (then every call runs on the calling thread; the same bits).
OPENMP_FLAGS = ("-fopenmp",)
# the CPU flags (/proc/cpuinfo) each x86-64 build needs, best first
ISA_CPU_FLAGS = {
    "avx512": ("avx2", "f16c", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "f16c", "fma"),
}
COMPILE_TIMEOUT_S = 600


class CpuBuildError(RuntimeError):
    """The fused CPU kernels cannot be built or loaded here; the message says why."""


class CpuCompileError(CpuBuildError):
    """The C compiler ran and rejected the source for this instruction set."""


# --- 1. the constants header, generated from contract.py ---

_SCALARS = (
    "CUTOFF", "MAGIC", "LIMB_SCALE", "INV_LN2_32", "LN2_32_HI", "LN2_32_LO",
    "LIMB_UNIT", "LIMB2_UNIT", "SQRT_HALF", "LN2_HI", "LN2_LO",
)  # fmt: skip
_INTEGERS = (
    "FRAC_BITS", "NUM_COLS", "COL_E_HI", "COL_E_LO", "COL_W_HI", "COL_W_LO",
    "COL_TARGET_BITS", "COL_OWNERS", "COL_TARGET_MASKED", "COL_NONFINITE",
    "BAD_TARGET_RANGE", "BAD_TARGET_OWNER", "BAD_TARGET_MASKED", "BAD_NONFINITE",
    "BAD_NO_VALID_COLUMN", "BAD_TEMPERATURE", "BAD_RANKS",
)  # fmt: skip


def _table_bits() -> int:
    bits = len(contract.EXP2_TABLE).bit_length() - 1
    if len(contract.EXP2_TABLE) != 1 << bits:
        raise CpuBuildError(f"EXP2_TABLE length {len(contract.EXP2_TABLE)} is not a power of 2")
    return bits


def _c_double(value: float) -> str:
    return f"({float(value).hex()})"


def constants_header() -> str:
    """The C header of every contract constant the kernels use, exact to the bit."""
    lines = [f"/* Generated from exactlogp/contract.py ({contract.CONTRACT}); do not edit. */"]
    lines += [f"#define ELP_{name} {_c_double(getattr(contract, name))}" for name in _SCALARS]
    lines.append(f"#define ELP_TABLE_BITS {_table_bits()}")
    table = ", ".join(_c_double(v) for v in contract.EXP2_TABLE)
    lines.append(f"#define ELP_EXP2_TABLE {{{table}}}")
    lines.append(f"#define ELP_EXP_POLY_LEN {len(contract.EXP_POLY)}")
    poly = ", ".join(_c_double(v) for v in contract.EXP_POLY)
    lines.append(f"#define ELP_EXP_POLY {{{poly}}}")
    lines.append(f"#define ELP_LOG_POLY_LEN {len(contract.LOG_POLY)}")
    poly = ", ".join(_c_double(v) for v in contract.LOG_POLY)
    lines.append(f"#define ELP_LOG_POLY {{{poly}}}")
    lines += [f"#define ELP_{name} {int(getattr(contract, name))}" for name in _INTEGERS]
    return "\n".join(lines) + "\n"


def expected_constants() -> list[float]:
    """contract.py's values in the order `elp_constants` reports the compiled ones."""
    values = [float(getattr(contract, name)) for name in _SCALARS]
    values += list(contract.EXP2_TABLE) + list(contract.EXP_POLY) + list(contract.LOG_POLY)
    return values + [float(getattr(contract, name)) for name in _INTEGERS]


def compiled_constants(lib: ctypes.CDLL) -> list[float]:
    """The constants the loaded library computes with, read back from it."""
    buf = (ctypes.c_double * 128)()
    count = lib.elp_constants(buf, len(buf))
    return list(buf[:count])


# --- 2. compile into the cache ---


def default_isa() -> str:
    """$EXACTLOGP_CPU_ISA, else the best x86-64 build this CPU's flags allow ("avx512",
    then "avx2"), else "baseline"."""
    isa = os.environ.get("EXACTLOGP_CPU_ISA")
    if isa:
        if isa not in ISA_FLAGS:
            raise CpuBuildError(
                f"EXACTLOGP_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {isa!r}"
            )
        return isa
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "baseline"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "baseline"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    return next(
        (isa for isa, need in ISA_CPU_FLAGS.items() if all(f in flags for f in need)),
        "baseline",
    )


def find_compiler() -> str:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC")
    candidates = [cc] if cc else ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    looked = f"CC={cc!r}" if cc else "cc, gcc and clang on PATH"
    raise CpuBuildError(
        f"no C compiler found (looked for {looked}); install one (e.g. gcc) to use "
        "backend='cpu', or use backend='reference'"
    )


def cache_dir() -> Path:
    """$EXACTLOGP_CACHE_DIR, else $XDG_CACHE_HOME/exactlogp or ~/.cache/exactlogp."""
    root = os.environ.get("EXACTLOGP_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "exactlogp"


def _candidate_dirs() -> list[Path]:
    """Where the kernels may live: cache_dir(), then a per-user directory in the temporary
    directory (not when $EXACTLOGP_CACHE_DIR names the one place to use)."""
    if os.environ.get("EXACTLOGP_CACHE_DIR"):
        return [cache_dir()]
    return [cache_dir(), Path(tempfile.gettempdir()) / f"exactlogp-{os.getuid()}"]


def private_dir_problem(path: Path) -> str | None:
    """Why `path` may not hold code this process executes, or None when it is a real
    directory (not a symlink) owned by this user that no other user can write."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it: {exc}"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_cache_dir() -> Path:
    """The first candidate directory that is, or can be made, private to this user."""
    refused = []
    for path in _candidate_dirs():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            refused.append(f"{path}: cannot create it: {exc}")
            continue
        problem = private_dir_problem(path)
        if problem is None:
            return path
        refused.append(f"{path}: {problem}")
    raise CpuBuildError(
        "no private cache directory for the compiled CPU kernels (a library found there is "
        "executed, so it must be a directory of this user's that nobody else can write): "
        + "; ".join(refused)
        + ". Set EXACTLOGP_CACHE_DIR to such a directory (e.g. one created with mode 0700)."
    )


def _source() -> str:
    return resources.files(__package__).joinpath("csrc", SOURCE_NAME).read_text()


def _flags(isa: str, openmp: bool = True) -> tuple[str, ...]:
    return (*CFLAGS, *(OPENMP_FLAGS if openmp else ()), *ISA_FLAGS[isa])


def _library_name(source: str, header: str, isa: str, openmp: bool = True) -> str:
    key = "\0".join((source, header, " ".join(_flags(isa, openmp)), platform.machine()))
    kind = isa if openmp else f"{isa}-serial"
    return f"exactlogp_cpu-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def _sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_sha256(path: Path) -> str | None:
    """SHA-256 of the file at `path` (never following a symlink), None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(library: Path) -> bool:
    """The library is there and matches the SHA-256 written next to it after its build."""
    try:
        fd = os.open(_sidecar(library), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd) as f:
            recorded = f.read().strip()
    except OSError:
        return False
    return recorded != "" and _file_sha256(library) == recorded


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _compile(
    compiler: str, source: str, header: str, isa: str, target: Path, openmp: bool = True
) -> None:
    """Compile into a private directory, rename into place (atomic, so processes building
    at the same time never load a half-written library), then record its SHA-256."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        (Path(tmp) / SOURCE_NAME).write_text(source)
        (Path(tmp) / HEADER_NAME).write_text(header)
        out = Path(tmp) / target.name
        cmd = [compiler, *_flags(isa, openmp), "-o", str(out), str(Path(tmp) / SOURCE_NAME)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CpuBuildError(f"running the C compiler {compiler} failed: {exc}") from exc
        if run.returncode != 0:
            raise CpuCompileError(
                f"compiling the CPU kernels ({isa}) with {compiler} failed:\n"
                f"{run.stderr.strip()[-2000:]}"
            )
        digest = _file_sha256(out)
        os.replace(out, target)
        _write_atomic(_sidecar(target), digest + "\n")


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One build at a time per cache directory: the processes of a freshly started
    process group would otherwise all compile the same library at once."""
    if fcntl is None:
        yield
        return
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(directory / ".build.lock", flags, 0o600), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(isa: str | None = None) -> Path:
    """Path of the verified compiled library for `isa` (default: this CPU's), compiled
    first unless the private cache holds it intact."""
    isa = isa or default_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    source, header = _source(), constants_header()
    directory = _private_cache_dir()
    target = directory / _library_name(source, header, isa)
    serial = directory / _library_name(source, header, isa, openmp=False)
    if verified(target):
        return target
    if verified(serial):  # this compiler could not build with OpenMP before
        return serial
    with _build_lock(directory):
        if verified(target):  # another process may have built it meanwhile
            return target
        if verified(serial):  # this compiler could not build with OpenMP before
            return serial
        if os.path.lexists(target):
            log.warning("exactlogp: %s fails its SHA-256 check; rebuilding it", target)
        log.info("compiling the exactlogp CPU kernels (%s, once) into %s", isa, target)
        compiler = find_compiler()
        try:
            _compile(compiler, source, header, isa, target)
            return target
        except CpuCompileError as exc:
            try:
                _compile(compiler, source, header, isa, serial, openmp=False)
            except CpuCompileError:
                raise exc from None
            log.warning(
                "exactlogp: %s cannot build with OpenMP (%s); the CPU kernels run on the "
                "calling thread only (the same bits, slower)",
                compiler,
                str(exc)[-300:],
            )
            return serial


# --- 3. load ---


def load(isa: str | None = None) -> ctypes.CDLL:
    """The compiled kernels, checked to carry contract.py's constants. When the ISA is
    picked here and the compiler cannot build the AVX-512 variant, the AVX2 one is used."""
    try:
        path = build(isa)
    except CpuCompileError as exc:
        if isa is not None or os.environ.get("EXACTLOGP_CPU_ISA") or default_isa() != "avx512":
            raise
        log.warning("exactlogp: the AVX-512 CPU kernels did not build (%s); using AVX2", exc)
        path = build("avx2")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise CpuBuildError(f"loading the compiled CPU kernels {path} failed: {exc}") from exc
    if compiled_constants(lib) != expected_constants():
        raise CpuBuildError(f"{path} was built with other constants than contract.py; delete it")
    return lib


if __name__ == "__main__":  # `python -m exactlogp.backends.cpu_build`: build ahead of time
    try:
        print(build())
    except CpuBuildError as exc:
        print(f"exactlogp: backend='cpu' unavailable: {exc}", file=sys.stderr)
        sys.exit(1)
