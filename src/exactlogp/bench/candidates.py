"""The candidates the CPU benchmark times, each on the same logits and targets.

- exactlogp-cpu: `selected_logprobs(backend="cpu")`, loss = -logprobs (entropy off, as CE).
- exactlogp-cpu+entropy: the same with with_entropy=True (the RL case), loss adds it.
- exactlogp-cpu-direct: exactlogp-cpu with value tables off (value_tables="never"): the
  contract evaluated column by column, the same bits, to show what the tables save.
- megatron-core: the real `megatron.core.tensor_parallel.vocab_parallel_cross_entropy`,
  with megatron's parallel_state set up over a one-rank gloo process group (TP = 1).
- torch-fp32: `log_softmax(logits.float())` + gather, the plain PyTorch pipeline.

Each candidate gives `forward(x, target)` and `forward_backward(x, target)`; both return
what the step produced so that nothing is freed before the timer stops.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import exactlogp


@dataclass(frozen=True)
class Candidate:
    name: str
    forward: Callable[[torch.Tensor, torch.Tensor], object]
    forward_backward: Callable[[torch.Tensor, torch.Tensor], object]


def bench_inputs(num_rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """LM-head-like logits (Gaussian bulk, std 2.5, four peaks 8..30 above it per row) and
    uniform random targets: the time of every candidate does not depend on which token is
    the target, and this avoids an [N, V] fp64 softmax to sample them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen).mul_(2.5)
    peaks = torch.randint(0, vocab, (num_rows, 4), generator=gen)
    x.scatter_add_(1, peaks, 8.0 + 22.0 * torch.rand(num_rows, 4, generator=gen))
    target = torch.randint(0, vocab, (num_rows,), generator=gen)
    return x.to(dtype), target


def _with_grad(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


@contextmanager
def _value_tables(mode: str | None):
    """The registered CPU backend in value-table mode `mode` (None: as it is)."""
    from exactlogp.backends import get_backend

    backend = get_backend("cpu", torch.device("cpu"))
    before = backend.value_tables
    backend.value_tables = mode or before
    try:
        yield
    finally:
        backend.value_tables = before


def _exactlogp(with_entropy: bool, value_tables: str | None = None) -> Candidate:
    def run(x, target):
        with _value_tables(value_tables):
            return exactlogp.selected_logprobs(x, target, backend="cpu", with_entropy=with_entropy)

    def loss(res):
        out = -res.logprobs.sum()
        return out + res.entropy.sum() if with_entropy else out

    def fwd_bwd(x, target):
        xg = _with_grad(x)
        with _value_tables(value_tables):
            loss(run(xg, target)).backward()
        return xg.grad

    name = "exactlogp-cpu+entropy" if with_entropy else "exactlogp-cpu"
    return Candidate(name + ("-direct" if value_tables == "never" else ""), run, fwd_bwd)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_tp1():
    """megatron-core's vocab_parallel_cross_entropy, with its TP group (one gloo rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return vocab_parallel_cross_entropy


def close_megatron() -> None:
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _megatron() -> Candidate:
    ce = megatron_tp1()

    # Megatron subtracts the max and exponentiates in place in an fp32 copy of bf16/fp16
    # logits; fp32 logits would be changed in place, so they are cloned (the clone is
    # part of the timed work then; the benchmark's default dtype is bf16, which needs none).
    def own(x):
        return x.clone() if x.dtype == torch.float32 else x

    def fwd(x, target):
        return ce(own(x), target)

    def fwd_bwd(x, target):
        xg = _with_grad(own(x))
        ce(xg, target).sum().backward()
        return xg.grad

    return Candidate("megatron-core", fwd, fwd_bwd)


def _torch_fp32() -> Candidate:
    def fwd(x, target):
        return torch.log_softmax(x.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)

    def fwd_bwd(x, target):
        xg = _with_grad(x)
        (-fwd(xg, target)).sum().backward()
        return xg.grad

    return Candidate("torch-fp32", fwd, fwd_bwd)


_FACTORIES = {
    "exactlogp-cpu": lambda: _exactlogp(False),
    "exactlogp-cpu+entropy": lambda: _exactlogp(True),
    "exactlogp-cpu-direct": lambda: _exactlogp(False, "never"),
    "megatron-core": _megatron,
    "torch-fp32": _torch_fp32,
}
CANDIDATES = tuple(_FACTORIES)


def make(name: str) -> Candidate:
    if name not in _FACTORIES:
        raise ValueError(f"candidate must be one of {CANDIDATES}, got {name!r}")
    return _FACTORIES[name]()
