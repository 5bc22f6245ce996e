"""sglang/kernels/ops/sampling/murmur_hash.py (0.5.23): `murmur_hash32(seed, positions,
col_indices)` -> (n, m) uint32, MurmurHash3 (32-bit) of four 4-byte blocks per entry:
the seed's low and high words, the position, the column (hash state starting at 0,
length 16). SGLang runs it as a Triton kernel (a sgl_kernel op on the CPU); here in
int64 torch arithmetic, every product split so that it stays below 2^63."""

import torch

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    low = a * (c & 0xFFFF)
    high = ((a * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor):
    if seed.shape != positions.shape or seed.dim() != 1 or col_indices.dim() != 1:
        raise ValueError("seed and positions must be (n,), col_indices (m,)")
    s = seed.to(torch.int64)
    lo, hi = (s & _M32).view(-1, 1), ((s >> 32) & _M32).view(-1, 1)
    pos = (positions.to(torch.int64) & _M32).view(-1, 1)
    col = (col_indices.to(torch.int64) & _M32).view(1, -1)
    h = torch.zeros_like(lo)
    for block in (lo, hi, pos):
        h = _mix(h, block)
    h = _fmix(_mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1)) ^ 16)
    return h.to(torch.uint32)
