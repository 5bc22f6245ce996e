"""The compiled-kernel cache is a security boundary: what is loaded from it is executed.

A cache directory must be this user's and writable by nobody else; a library is loaded
only when it matches the SHA-256 recorded after its build (a damaged one is rebuilt); the
compiler is looked up only to build. And backend="auto" says so when it falls back to the
slow reference backend.
"""

import os
import shutil
import stat
import warnings

import pytest
import torch

from exactlogp import backends
from exactlogp.backends import cpu_build
from exactlogp.temperature import ONE


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A private cache holding one freshly built, verified library: the one compile of this
    module, a rebuild. The cache first holds the library this session uses (built by the
    default cache once) cut to a third, with its SHA-256 record, as a crash mid-write
    leaves it. -> (cache, the rebuilt library, the good library's bytes, the stat of the
    record it replaced)."""
    good = cpu_build.build()  # the default cache's, as backend="cpu" loads it
    root = tmp_path_factory.mktemp("cache")
    os.chmod(root, 0o700)
    good_bytes = good.read_bytes()
    (root / good.name).write_bytes(good_bytes[: len(good_bytes) // 3])
    shutil.copyfile(good.with_name(good.name + ".sha256"), root / (good.name + ".sha256"))
    planted_record = os.stat(root / (good.name + ".sha256"))
    mp = pytest.MonkeyPatch()
    mp.setenv("EXACTLOGP_CACHE_DIR", str(root))
    try:
        path = cpu_build.build()
    finally:
        mp.undo()
    return root, path, good_bytes, planted_record


@pytest.fixture
def cache_copy(built, tmp_path, monkeypatch):
    """A private copy of the built cache, named by EXACTLOGP_CACHE_DIR."""
    root, path = built[:2]
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    os.chmod(copy, 0o700)
    monkeypatch.setenv("EXACTLOGP_CACHE_DIR", str(copy))
    return copy / path.name


def test_build_records_a_sha256_that_load_checks(built):
    root, path, _, planted_record = built
    assert cpu_build.verified(path)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    record = root / (path.name + ".sha256")
    assert os.stat(record).st_ino != planted_record.st_ino  # written by this build
    assert record.read_text().strip() == cpu_build._file_sha256(path)


def test_a_damaged_or_planted_library_is_not_trusted(cache_copy):
    good = cache_copy.read_bytes()
    cache_copy.write_bytes(good[:1000])  # a crash mid-write, or a full disk
    assert not cpu_build.verified(cache_copy)
    cache_copy.write_bytes(b"\x7fELF planted")
    assert not cpu_build.verified(cache_copy)
    cache_copy.write_bytes(good)
    assert cpu_build.verified(cache_copy)
    os.unlink(cache_copy.with_name(cache_copy.name + ".sha256"))  # no record: not trusted
    assert not cpu_build.verified(cache_copy)


def test_a_truncated_library_is_rebuilt_not_loaded(built, cache_copy):
    root, path, good, _ = built  # the fixture's build() found the library cut to a third
    assert path == root / path.name and cpu_build.verified(path)
    assert len(path.read_bytes()) == len(good)
    assert cache_copy.name == path.name  # a copy of that cache, named by EXACTLOGP_CACHE_DIR
    assert cpu_build.build() == cache_copy  # verified: no compile
    cpu_build.load()  # and it loads, with contract.py's constants


def test_a_cached_library_loads_without_a_compiler(cache_copy, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "")
    assert cpu_build.build() == cache_copy
    cpu_build.load()
    os.unlink(cache_copy)
    with pytest.raises(cpu_build.CpuBuildError, match="no C compiler found"):
        cpu_build.build()


def test_a_cache_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("EXACTLOGP_CACHE_DIR", str(shared))
    with pytest.raises(cpu_build.CpuBuildError, match=r"other users may write to it \(mode 777\)"):
        cpu_build.build()
    os.chmod(shared, 0o770)
    with pytest.raises(cpu_build.CpuBuildError, match=r"mode 770"):
        cpu_build.build()


def test_a_symlinked_or_foreign_cache_directory_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("EXACTLOGP_CACHE_DIR", str(link))
    with pytest.raises(cpu_build.CpuBuildError, match="it is a symbolic link"):
        cpu_build.build()
    monkeypatch.setenv("EXACTLOGP_CACHE_DIR", str(real))
    owner = os.stat(real).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 4242)  # as another user would see it
    with pytest.raises(cpu_build.CpuBuildError, match=rf"owned by uid {owner}, not by this user"):
        cpu_build.build()


def test_a_planted_temporary_fallback_directory_is_never_used(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.delenv("EXACTLOGP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))  # the first choice cannot be made
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", None)  # re-read TMPDIR
    planted = tmp_path / f"exactlogp-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)  # another user made it first, open to all
    (planted / "exactlogp_cpu-planted.so").write_bytes(b"not ours")
    with pytest.raises(cpu_build.CpuBuildError) as info:
        cpu_build.build()
    assert f"{planted}: other users may write to it" in str(info.value)
    assert "cannot create it" in str(info.value)


def test_auto_says_once_why_it_falls_back_to_the_reference_backend(monkeypatch):
    monkeypatch.setattr(backends, "_cache", {})
    monkeypatch.setattr(backends, "_load_errors", {"cpu": "CpuBuildError: no C compiler found"})
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"uses the reference backend on cpu .* because "
                      r"backend='cpu': CpuBuildError: no C compiler found"):  # fmt: skip
        backend = backends.get_backend("auto", torch.device("cpu"))
    assert backend.name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        backends.get_backend("auto", torch.device("cpu"))


def test_a_compiler_without_openmp_builds_single_threaded_kernels_once(
    tmp_path, monkeypatch, caplog
):
    """A compiler that rejects the OpenMP flag still gives kernels (on the calling thread
    only, the same bits), says so, and is not asked again while that library is cached."""
    from exactlogp.backends.base import ShardPlan
    from exactlogp.backends.cpu import CpuBackend
    from exactlogp.testing import llm_like_logits

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("EXACTLOGP_CACHE_DIR", str(cache))
    monkeypatch.setattr(cpu_build, "OPENMP_FLAGS", ("-fexactlogp-no-such-openmp-flag",))
    with caplog.at_level("WARNING", logger=cpu_build.__name__):
        path = cpu_build.build()
    assert "-serial-" in path.name and cpu_build.verified(path)
    assert "cannot build with OpenMP" in caplog.text
    monkeypatch.setattr(cpu_build, "_compile", lambda *a, **k: pytest.fail("compiled again"))
    assert cpu_build.build() == path

    serial = CpuBackend(num_threads=2)
    assert "-serial-" in serial._lib._name
    x, target = llm_like_logits(16, 3000, torch.bfloat16, seed=4)
    plan = ShardPlan(0, None, -100, True)
    ref = backends.get_backend("reference", torch.device("cpu"))
    got, want = (
        serial.forward_unsharded(x, target, ONE, None, plan),
        ref.forward_unsharded(x, target, ONE, None, plan),
    )
    assert torch.equal(got[1], want[1])  # the row record
    assert torch.equal(got[2].logprobs.view(torch.int32), want[2].logprobs.view(torch.int32))
