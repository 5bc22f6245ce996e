"""Stand-ins for megatron-core modules, so the adapters' logic runs without them, and a
vllm.v1.sample.sampler module built in a test for the patch's error paths (vLLM's own code
runs in test_integrations_vllm_real.py).

Only the names the adapters touch exist; each stub's behaviour is the documented one of
the real module (Megatron's vocabulary-range rule).
"""

from __future__ import annotations

import sys
import types


class FakeGroup:
    """An opaque process-group object, as Megatron's parallel state hands out."""


def _module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def install_megatron(monkeypatch, *, rank: int = 0, world_size: int = 1, initialized=True):
    """megatron.core with a tensor-parallel state of (rank, world_size); returns the modules."""
    group = FakeGroup() if initialized else None

    def megatron_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        raise AssertionError("the stub's own cross-entropy must not be reached once patched")

    def fused_cross_entropy(vocab_parallel_logits, target, tp_group):
        raise AssertionError("the stub's own fused cross-entropy must not be reached once patched")

    class VocabUtility:
        @staticmethod
        def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size):
            start = rank * per_partition_vocab_size
            return start, start + per_partition_vocab_size

    mods = types.SimpleNamespace()
    _module(monkeypatch, "megatron")
    _module(monkeypatch, "megatron.core")
    mods.parallel_state = _module(
        monkeypatch,
        "megatron.core.parallel_state",
        get_tensor_model_parallel_group=lambda check_initialized=True: group,
        get_tensor_model_parallel_rank=lambda: rank,
        get_tensor_model_parallel_world_size=lambda: world_size,
    )
    mods.tensor_parallel = _module(
        monkeypatch,
        "megatron.core.tensor_parallel",
        vocab_parallel_cross_entropy=megatron_cross_entropy,
    )
    mods.cross_entropy = _module(
        monkeypatch,
        "megatron.core.tensor_parallel.cross_entropy",
        vocab_parallel_cross_entropy=megatron_cross_entropy,
    )
    mods.utils = _module(
        monkeypatch, "megatron.core.tensor_parallel.utils", VocabUtility=VocabUtility
    )
    _module(monkeypatch, "megatron.core.fusions")
    mods.fused = _module(
        monkeypatch,
        "megatron.core.fusions.fused_cross_entropy",
        fused_vocab_parallel_cross_entropy=fused_cross_entropy,
    )
    for name in ("models", "models.common", "models.common.language_module"):
        _module(monkeypatch, f"megatron.core.{name}")

    tensor_parallel = mods.tensor_parallel

    def compute_language_model_loss(labels, logits, fusion=False):
        # The two call forms of megatron-core's LanguageModule: through the package
        # attribute, and through the name imported into this module.
        labels = labels.transpose(0, 1).contiguous()
        if fusion:
            loss = mods.language_module.fused_vocab_parallel_cross_entropy(logits, labels, None)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        return loss.transpose(0, 1).contiguous()

    mods.language_module = _module(
        monkeypatch,
        "megatron.core.models.common.language_module.language_module",
        fused_vocab_parallel_cross_entropy=fused_cross_entropy,
        compute_language_model_loss=compute_language_model_loss,
    )
    mods.originals = {
        "plain": megatron_cross_entropy,
        "fused": fused_cross_entropy,
    }
    mods.group = group
    return mods


def install_vllm_sampler(monkeypatch, sampler_cls) -> types.ModuleType:
    """vllm.v1.sample.sampler holding `sampler_cls` as `Sampler`."""
    for name in ("vllm", "vllm.v1", "vllm.v1.sample"):
        _module(monkeypatch, name)
    return _module(monkeypatch, "vllm.v1.sample.sampler", Sampler=sampler_cls)


STUB_ROOT = __import__("pathlib").Path(__file__).parent / "host_stubs"


def use_stub_package(monkeypatch, name: str):
    """Import `name` from tests/host_stubs for this test only; returns the package."""
    import importlib

    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.syspath_prepend(str(STUB_ROOT))
    package = importlib.import_module(name)
    return package


def drop_stub_modules(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        module = sys.modules[key]
        if str(STUB_ROOT) in str(getattr(module, "__file__", "") or ""):
            del sys.modules[key]
