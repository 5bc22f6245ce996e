"""The patch machinery under threads, and EXACTLOGP_PATCH applied all or nothing.

Concurrent `patch_<host>()` / `unpatch_<host>()` calls must end with one handle per key,
whose originals are the host's own objects, and an undo must give every binding the patch
touched back its object from before the patch (by identity). The hosts: the real TRL
(`everywhere` sites across its modules), megatron-core and SGLang stand-ins (a class
method wrapped with `wraps=True`).
"""

from __future__ import annotations

import importlib
import random
import re
import sys
import threading
import types

import pytest

import exactlogp
from exactlogp.integrations import _patching, autopatch, megatron, sglang, trl
from integration_stubs import drop_stub_modules, install_megatron, use_stub_package

THREADS = 8
ROUNDS = 3
TRL_MODULES = ["trl.trainer.utils"] + [
    f"trl.trainer.{n}_trainer" for n in ("grpo", "rloo", "kto", "sft", "dpo")
]


@pytest.fixture
def fast_switching():
    """Switch threads every microsecond, so an unsynchronised patch shows its race."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _trl_host(monkeypatch):
    for name in TRL_MODULES:
        importlib.import_module(name)
    sys.modules["trl.trainer"].add_fused_lm_head  # noqa: B018 - binds the lazy export now
    return "trl", trl.patch_trl, trl.unpatch_trl


def _megatron_host(monkeypatch):
    install_megatron(monkeypatch)
    return "megatron", megatron.patch_megatron, megatron.unpatch_megatron


def _sglang_host(monkeypatch):
    use_stub_package(monkeypatch, "sglang")
    importlib.import_module("sglang.srt.layers.sampler")
    importlib.import_module("sglang.srt.speculative.eagle_worker_common")
    return "sglang", sglang.patch_sglang, sglang.unpatch_sglang


@pytest.fixture(params=[_trl_host, _megatron_host, _sglang_host], ids=lambda f: f.__name__[1:-5])
def host(request, monkeypatch):
    package, patch, unpatch = request.param(monkeypatch)
    try:
        yield types.SimpleNamespace(package=package, patch=patch, unpatch=unpatch)
    finally:
        unpatch()
        if package == "sglang":
            drop_stub_modules("sglang")


_EXACTLOGP = exactlogp.__path__[0]


def _ours(value) -> bool:
    """exactlogp's object: defined in it, or a wrapper whose code is (functools.wraps
    gives it the host's name and module)."""
    module = getattr(value, "__module__", None)
    code = getattr(value, "__code__", None)
    return (isinstance(module, str) and module.startswith("exactlogp")) or (
        code is not None and code.co_filename.startswith(_EXACTLOGP)
    )


def _bindings(package: str) -> dict[tuple[str, str], object]:
    """{(owner, attribute): object} over every loaded module of `package` and the classes
    they define (where `Class.method` sites live)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            found[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    found[(f"{name}.{attr}", key)] = member
    return found


def _at_once(fn, threads: int = THREADS) -> list:
    """Call `fn(i)` from `threads` threads released together; their results."""
    barrier = threading.Barrier(threads)
    results: list = [None] * threads
    errors: list = []

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a patch call did not return"
    if errors:
        raise errors[0]
    return results


def _check_patched(handle, before: dict) -> None:
    """Every site `handle` touched holds exactlogp's object, and its original is the host's
    own object from `before`."""
    assert handle.active
    for swap in handle._swaps:
        owner = getattr(swap.owner, "__qualname__", None)
        owner = f"{swap.owner.__module__}.{owner}" if owner else swap.owner.__name__
        assert swap.owner.__dict__[swap.attr] is swap.new, swap.path
        assert _ours(swap.new), swap.path
        assert not _ours(swap.original), f"{swap.path}: exactlogp's object kept as original"
        assert swap.original is before[(owner, swap.attr)], swap.path


def _check_restored(package: str, before: dict) -> None:
    now = _bindings(package)
    changed = [key for key, value in before.items() if key in now and now[key] is not value]
    assert not changed, f"bindings not restored: {changed}"
    left = [key for key, value in now.items() if _ours(value)]
    assert not left, f"exactlogp's objects left in the host: {left}"


def test_concurrent_first_patch_gives_one_handle_and_undo_restores(host, fast_switching):
    before = _bindings(host.package)
    for _ in range(ROUNDS):
        handles = _at_once(lambda i: host.patch())
        assert len({id(h) for h in handles}) == 1, f"{len(set(map(id, handles)))} handles"
        _check_patched(handles[0], before)
        assert _at_once(lambda i: host.unpatch()).count(True) == 1
        assert not handles[0].active
        _check_restored(host.package, before)


def test_concurrent_patch_and_unpatch_end_consistent(host, fast_switching):
    before = _bindings(host.package)
    for round_ in range(ROUNDS):
        plans = [random.Random(round_ * THREADS + i).choices("pud", k=6) for i in range(THREADS)]

        def run(i, plans=plans):
            for op in plans[i]:
                if op == "p":
                    host.patch()
                elif op == "u":
                    host.unpatch()
                else:
                    handle = _patching.active(_key(host.package))
                    if handle is not None:
                        handle.undo()

        _at_once(run)
        handle = _patching.active(_key(host.package))
        if handle is not None:
            _check_patched(handle, before)
        else:
            _check_restored(host.package, before)
        host.patch()
        _check_patched(_patching.active(_key(host.package)), before)
        host.unpatch()
        _check_restored(host.package, before)


def _key(package: str) -> str:
    return {"trl": trl.PATCH_KEY, "megatron": megatron.PATCH_KEY, "sglang": sglang.PATCH_KEY}[
        package
    ]


# --- EXACTLOGP_PATCH / EXACTLOGP_VOCAB_SIZE ---


@pytest.fixture
def env(monkeypatch):
    """TRL and a megatron-core stand-in loaded, vLLM missing, both variables cleared; every
    patch undone afterwards."""
    _trl_host(monkeypatch)
    install_megatron(monkeypatch)
    for name in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.delenv(autopatch.ENV, raising=False)
    monkeypatch.delenv(autopatch.VOCAB_ENV, raising=False)
    before = {package: _bindings(package) for package in ("trl", "megatron")}
    try:
        yield before
    finally:
        trl.unpatch_trl()
        megatron.unpatch_megatron()


def test_a_failed_host_undoes_the_patches_applied_before_it(env, monkeypatch):
    monkeypatch.setenv(autopatch.ENV, "trl, megatron, vllm")
    with pytest.raises(
        ImportError,
        match=r"EXACTLOGP_PATCH='trl, megatron, vllm': vllm failed and the patches this call "
        r"had applied \(trl, megatron\) were undone: patch_vllm_sampler: cannot import vllm",
    ):
        autopatch.apply_from_env()
    assert _patching.active(trl.PATCH_KEY) is None
    assert _patching.active(megatron.PATCH_KEY) is None
    for package, before in env.items():
        _check_restored(package, before)


def test_a_failed_host_leaves_patches_applied_before_the_call(env, monkeypatch):
    mine = trl.patch_trl()
    monkeypatch.setenv(autopatch.ENV, "trl,megatron,vllm")
    with pytest.raises(ImportError, match=r"\(megatron\) were undone"):
        autopatch.apply_from_env()
    assert mine.active and _patching.active(megatron.PATCH_KEY) is None
    _check_restored("megatron", env["megatron"])


def test_hosts_in_the_environment_are_applied_together(env, monkeypatch):
    monkeypatch.setenv(autopatch.ENV, "megatron,trl,megatron")
    monkeypatch.setenv(autopatch.VOCAB_ENV, " 151936 ")
    handles = autopatch.apply_from_env()
    assert list(handles) == ["megatron", "trl"]
    assert all(h.active for h in handles.values())
    assert handles["megatron"].options == {"vocab_size": 151936}


@pytest.mark.parametrize("value", ["1.5", "abc", "0", "-3", "2e5", "1_000", str(2**20 + 1)])
def test_vocab_size_variable_is_checked_by_name(env, monkeypatch, value):
    monkeypatch.setenv(autopatch.ENV, "trl,megatron")
    monkeypatch.setenv(autopatch.VOCAB_ENV, value)
    with pytest.raises(ValueError, match=re.escape(f"EXACTLOGP_VOCAB_SIZE={value!r}")):
        autopatch.apply_from_env()
    assert _patching.active(trl.PATCH_KEY) is None
    assert _patching.active(megatron.PATCH_KEY) is None


def test_unknown_host_is_named_with_the_known_ones(env, monkeypatch):
    monkeypatch.setenv(autopatch.ENV, "trl,torchtune")
    with pytest.raises(
        ValueError,
        match=r"EXACTLOGP_PATCH='trl,torchtune' names unknown hosts \['torchtune'\]; .*"
        r"trl.*verl.*megatron.*vllm.*sglang",
    ):
        autopatch.apply_from_env()
    assert _patching.active(trl.PATCH_KEY) is None


# --- a host whose functions take other arguments is refused before anything changes ---


def _host_module(monkeypatch, fn):
    module = types.ModuleType("signature_host.utils")
    module.f = fn
    monkeypatch.setitem(sys.modules, "signature_host", types.ModuleType("signature_host"))
    monkeypatch.setitem(sys.modules, "signature_host.utils", module)
    return module


def _drop_in(logits, labels, temperature=1.0, *, vocab_size=None):
    """A drop-in: the host's arguments, then exactlogp's keyword-only options."""


def test_check_signatures_accepts_the_hosts_arguments(monkeypatch):
    _host_module(monkeypatch, lambda logits, labels, temperature=1.0: None)
    _patching.check_signatures("patch_x", "signature_host", "signature_host.utils",
                               {"f": _drop_in, "missing": _drop_in}, "Host 1.0")  # fmt: skip


@pytest.mark.parametrize(
    ("theirs", "found"),
    [(lambda logits, labels, temperature=2.0: None, "logits, labels, temperature=2.0"),
     (lambda logits, labels: None, "logits, labels"),
     (lambda logits, labels, temperature=1.0, *, dim=-1: None,
      "logits, labels, temperature=1.0, *, dim=-1")],
)  # fmt: skip
def test_check_signatures_names_the_version_and_both_signatures(monkeypatch, theirs, found):
    _host_module(monkeypatch, theirs)
    with pytest.raises(RuntimeError) as exc:
        _patching.check_signatures(
            "patch_x", "signature_host", "signature_host.utils", {"f": _drop_in}, "Host 1.0"
        )
    assert str(exc.value) == (
        f"patch_x: signature_host of unknown version's signature_host.utils.f takes ({found}); "
        "exactlogp knows (logits, labels, temperature=1.0) of Host 1.0, so nothing was patched"
    )
