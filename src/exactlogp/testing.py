"""Ground truth, case generators, shard simulation and gloo worlds, for tests and tools.

- `fp64_reference`: the exact answer to within ~2^-45 relative, accurate near
  logprob = 0 (log1p of the non-argmax terms; fp64 logsumexp is not).
- `mpmath_row`: a single row at 60 significant digits.
- `simulate_shards`: the four stages over an arbitrary split of the vocabulary in one
  process, combining the partials exactly as the two collectives would.
- `run_gloo_world`: a real torch.distributed world of processes on 127.0.0.1
  (`exactlogp.worlds`, the one module that starts worlds).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from typing import NamedTuple

import torch

from . import contract, worlds
from .backends import ShardPlan, get_backend
from .temperature import Temperature

# --- case generators ---


def llm_like_logits(
    num_rows: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str | torch.device = "cpu",
    targets: str = "sampled",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits shaped like an LM head's, and targets sampled from their softmax.

    A Gaussian bulk (std 2.5) plus, per row, a few dominant logits 8..30 above it; the
    targets are drawn from softmax(logits) as an RL rollout would draw them, so many are
    near-certain tokens with logprob close to 0. targets="uniform" draws them uniformly
    instead (for timing: no (N, V) fp64 softmax, and no candidate's time depends on
    which token is the target). Everything is drawn on `device` by a generator seeded
    there: the same numbers for the same device type.
    """
    if targets not in ("sampled", "uniform"):
        raise ValueError(f"targets must be 'sampled' or 'uniform', got {targets!r}")
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen, device=device) * 2.5
    num_peaks = min(vocab, 4)
    peaks = torch.randint(0, vocab, (num_rows, num_peaks), generator=gen, device=device)
    lift = 8.0 + 22.0 * torch.rand(num_rows, num_peaks, generator=gen, device=device)
    x.scatter_add_(1, peaks, lift)
    x = x.to(dtype)
    if targets == "uniform":
        return x, torch.randint(0, vocab, (num_rows,), generator=gen, device=device)
    probs = torch.softmax(x.double(), dim=-1)
    return x, torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def lm_head_inputs(
    num_rows: int,
    hidden: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    logit_std: float = 3.0,
    outlier: float = 8.0,
    outlier_channels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (N, H), weight (V, H), target (N,)) shaped like an LM head's at work.

    Hidden rows are RMS-normed (times a norm weight around 1, with a few large channels,
    as trained models have: `outlier_channels` of them, H // 64 by default, `outlier`
    times the rest); weight rows are Gaussian, scaled so that the logits spread with std
    ~logit_std. A third of the rows point at one weight row (confident rows, their top
    logit far above the rest), a few are flat (small logits). Targets are drawn from the
    rows' fp64 softmax, as a rollout draws them.
    """
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(num_rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (logit_std / hidden**0.5)
    confident = torch.arange(num_rows) % 3 == 0
    favourite = torch.randint(0, vocab, (num_rows,), generator=gen)
    h = torch.where(confident.unsqueeze(-1), h + 6.0 * w[favourite] * hidden**0.5 / logit_std, h)
    flat = torch.arange(num_rows) % 7 == 5
    h = torch.where(flat.unsqueeze(-1), 0.05 * h, h)
    gamma = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    channels = max(1, hidden // 64) if outlier_channels is None else outlier_channels
    gamma[torch.randint(0, hidden, (channels,), generator=gen)] *= outlier
    rms = h.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    h = torch.where(flat.unsqueeze(-1), h, h * rms) * gamma
    h, w = h.to(dtype), w.to(dtype)
    logits = h.double() @ w.double().T
    target = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
    return h, w, target


def exact_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, V) fp32: fl32(sum_k hidden[n, k] weight[v, k]) correctly rounded (ties to even; a
    nonzero sum rounds to a zero of its sign, an exact zero is +0; overflow is inf) -- the
    definition of contract exactlogp-linear-v2's logits, by Python integer arithmetic and
    independent of exactlogp's code. For tests: H N V Python multiplications. Every finite
    bf16 / fp16 / fp32 value is an integer times 2^-149, so each dot product is one Python
    integer times 2^-298."""

    def ints(x: torch.Tensor):
        return [[int(v * 2.0**149) for v in row] for row in x.double().tolist()]

    hs, ws = ints(hidden), ints(weight)
    out = [[_round_fp32(sum(a * b for a, b in zip(hr, wr, strict=True)), -298) for wr in ws]
           for hr in hs]  # fmt: skip
    return torch.tensor(out, dtype=torch.float32).reshape(len(hs), len(ws))


def _round_fp32(m: int, exp: int) -> float:
    """The fp32 nearest to m 2^exp (ties to even), as a Python float."""
    if m == 0:
        return 0.0
    sign, m = (-1.0 if m < 0 else 1.0), abs(m)
    q = max(m.bit_length() + exp - 24, -149)  # the exponent of an fp32 ulp there
    shift = q - exp
    if shift > 0:
        n, rem, half = m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1)
        n += rem > half or (rem == half and n & 1)
    else:
        n = m << -shift
    if n and n.bit_length() + q > 128:  # n 2^q >= 2^128: past fp32's largest
        return sign * float("inf")
    return sign * math.ldexp(n, q)


def heavy_tailed_logits(
    num_rows: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str | torch.device = "cpu",
    df: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with a Student-t bulk (`df` degrees of freedom, scale 2.5) and uniform
    targets: far more columns near the top of a row than a Gaussian bulk gives, and
    values spread over many more binades (more distinct values per row). Drawn in blocks
    of rows, so the draw needs no more than a few (rows, V) fp32 blocks of memory."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.empty(num_rows, vocab, dtype=dtype, device=device)
    block = max(1, (1 << 22) // max(vocab, 1))
    for r in range(0, num_rows, block):
        rows = min(block, num_rows - r)
        z = torch.randn(rows, vocab, generator=gen, device=device)
        chi2 = torch.zeros_like(z)
        for _ in range(df):
            chi2 += torch.randn(rows, vocab, generator=gen, device=device) ** 2
        x[r : r + rows] = (2.5 * z / torch.sqrt(chi2 / df)).to(dtype)
    return x, torch.randint(0, vocab, (num_rows,), generator=gen, device=device)


def python_random_logits(
    num_rows: int, vocab: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from Python's `random` alone, reproducible across torch versions (golden vectors)."""
    rng = random.Random(seed)
    rows, targets = [], []
    for _ in range(num_rows):
        row = [rng.gauss(0.0, 3.0) for _ in range(vocab)]
        for _ in range(3):
            row[rng.randrange(vocab)] += rng.uniform(5.0, 25.0)
        rows.append(row)
        targets.append(rng.randrange(vocab))
    return torch.tensor(rows, dtype=torch.float64).to(dtype), torch.tensor(targets)


class FinalizeInputs(NamedTuple):
    """Arguments of `contract.finalize` (and Backend.finalize) after the all_reduce."""

    row_max: torch.Tensor  # (N,) fp32
    record: torch.Tensor  # (N, NUM_COLS) int64
    target: torch.Tensor  # (N,) int64
    vocab_size: int | None
    ignore_index: int
    bad_temperature: torch.Tensor | None  # (N,) bool


def finalize_inputs(
    num_rows: int,
    seed: int = 0,
    vocab_size: int | None = 1000,
    ignore_index: int = -100,
    with_bad_temperature: bool = True,
) -> FinalizeInputs:
    """Combined row records drawn directly, for testing finalize on its own (CPU tensors).

    Well-formed rows (one owner, S >= 1) take limb sums from every region: S exactly 1 or
    a few units of 2^-84 above, uniform and log-uniform sums up to 2^62, low limbs that
    carry into the high limb, high limbs whose int64 -> fp64 conversion is a tie, S on
    either side of a power of two and of 2^k sqrt(1/2) (where log_c's reduction changes),
    W zero (no entropy) or not, and fp32 maxima and target logits from subnormal to huge.
    Other rows carry each BAD_* condition alone and together (S then arbitrary, even 0),
    are ignored (with garbage flags that must not count), or are beyond what the local
    passes can produce (S = 0 or negative limb sums in a well-formed row; the contract
    then gives NaN or garbage, which a backend must still reproduce).
    """
    rng = random.Random(seed)
    rows = [_finalize_row(rng, vocab_size, ignore_index) for _ in range(num_rows)]
    row_max = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    record = torch.tensor([r[1] for r in rows], dtype=torch.int64).reshape(-1, contract.NUM_COLS)
    target = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    bad_tau = torch.tensor([r[3] for r in rows], dtype=torch.bool)
    return FinalizeInputs(
        row_max, record, target, vocab_size, ignore_index,
        bad_tau if with_bad_temperature else None,
    )  # fmt: skip


_ONE = 1 << (2 * contract.FRAC_BITS)  # S = 1 in units of 2^-84
_SQRT_HALF_MANT = int(contract.SQRT_HALF * 2**53)  # SQRT_HALF = _SQRT_HALF_MANT * 2^-53


def _random_f32(rng: random.Random) -> float:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice([0.0, -0.0, 2.0**-149, -(2.0**-140), 3.4e38, -3.4e38, 1.0])
    if kind == 1:
        return rng.uniform(-1.0, 1.0) * 2.0 ** rng.randrange(-149, 128)
    return rng.gauss(0.0, 10.0)


def _limb_sum(rng: random.Random) -> int:
    """S in units of 2^-84, S >= 1, from a region chosen at random."""
    kind = rng.randrange(7)
    if kind == 0:
        return _ONE + rng.choice([0, 0, 1, 2, (1 << 42) - 1, 1 << 42, rng.randrange(1 << 42)])
    if kind == 1:
        return _ONE + rng.randrange((1 << 104) - _ONE)  # high limb uniform below 2^62
    if kind == 2:
        return _ONE + rng.getrandbits(rng.randrange(1, 104))
    if kind == 3:  # the high limb is a tie between two binary64 values
        s = rng.randrange(1, 10)
        hi = (((1 << 52) | rng.getrandbits(52)) << s) | (1 << (s - 1))
        return (hi << 42) | rng.getrandbits(42)
    if kind == 4:  # near 2^62 in the high limb
        return ((1 << 104) - 1) - rng.getrandbits(rng.randrange(1, 70))
    j = rng.randrange(1, 21)  # S = 2^j sqrt(1/2) or 2^j, then a few steps either side
    base = (_SQRT_HALF_MANT << (j + 31)) if kind == 5 else (1 << (84 + j))
    step = rng.choice([1, 1 << rng.randrange(1, 60)])
    return max(_ONE, base + rng.randrange(-3, 4) * step)


def _limbs(value: int, rng: random.Random) -> tuple[int, int]:
    """(hi, lo) with hi 2^42 + lo == value, lo sometimes far above 2^42 (carries)."""
    hi, lo = value >> 42, value & contract.LIMB_MASK
    if rng.random() < 0.4:
        carry = min(hi, rng.choice([1, rng.randrange(1, 1 << 20)]))
        hi, lo = hi - carry, lo + (carry << 42)
    return hi, lo


def _finalize_row(rng: random.Random, vocab_size: int | None, ignore_index: int):
    """(row_max, record as a list, target, bad temperature) of one row."""
    top = vocab_size if vocab_size is not None else contract.MAX_VOCAB
    target = rng.randrange(top)
    e_hi, e_lo = _limbs(_limb_sum(rng), rng)
    w_hi, w_lo = (0, 0) if rng.random() < 0.3 else _limbs(rng.getrandbits(103), rng)
    t_bits = int(torch.tensor(_random_f32(rng)).view(torch.int32))  # sign-extended
    row_max, owners, masked, nonfinite, bad_tau = _random_f32(rng), 1, 0, 0, False
    kind = rng.random()
    if kind < 0.25:  # problems, one or several
        for _ in range(rng.randrange(1, 4)):
            problem = rng.randrange(8)
            if problem == 0:
                target = rng.choice([-1, -(1 << 40)])
            elif problem == 1:
                target = top + rng.randrange(3)
            elif problem == 2:
                owners = rng.choice([0, 2, 3])
            elif problem == 3:
                masked = rng.choice([1, 2])
            elif problem == 4:
                nonfinite = rng.choice([1, 5])
            elif problem == 5:
                row_max = float("-inf")
            elif problem == 6:
                bad_tau = True
            else:
                e_hi, e_lo = rng.choice([(0, 0), (rng.getrandbits(62), rng.getrandbits(62))])
        if target == ignore_index:
            target = -7 if ignore_index != -7 else -8
    elif kind < 0.4:  # ignored, with flags that must not count
        target, owners = ignore_index, rng.choice([0, 0, 2])
        nonfinite, bad_tau = rng.choice([0, 3]), rng.random() < 0.5
        row_max = rng.choice([row_max, float("-inf")])
        e_hi, e_lo = rng.choice([(0, 0), (e_hi, e_lo)])
    elif kind < 0.43:  # beyond what partials produce: S = 0, negative limb sums
        e_hi, e_lo = rng.choice([(0, 0), (-(1 << 42), 0), (-rng.getrandbits(50), 12345)])
        t_bits = (t_bits & 0xFFFFFFFF) - (rng.getrandbits(31) << 32)  # garbage above bit 31
    elif target == ignore_index:
        target = (target + 1) % top
    record = [e_hi, e_lo, w_hi, w_lo, t_bits, owners, masked, nonfinite]
    return row_max, record, target, bad_tau


# --- ground truth ---


class Fp64Reference(NamedTuple):
    logprobs: torch.Tensor  # (N,) fp64
    entropy: torch.Tensor  # (N,) fp64
    lse: torch.Tensor  # (N,) fp64
    probs: torch.Tensor  # (N, V) fp64 softmax (0 at invalid columns)
    scale: dict  # output name -> (N,) fp64: what its error bound scales with


def scaled_full_logits(logits, temperature=1.0, keep_mask=None, vocab_size=None):
    """(N, V) fp64 y with invalid columns at -inf, exactly as the contract's stage 1."""
    y = contract.scaled_logits(logits, Temperature.of(temperature).column()).to(torch.float64)
    valid = contract.valid_columns(y.shape[-1], 0, vocab_size, keep_mask, y.device)
    return torch.where(valid, y, float("-inf"))


def fp64_reference(logits, target, temperature=1.0, keep_mask=None, vocab_size=None):
    """Independent fp64 ground truth for full (unsharded) 2-D logits."""
    return fp64_softmax_reference(
        scaled_full_logits(logits, temperature, keep_mask, vocab_size), target
    )


def fp64_softmax_reference(y: torch.Tensor, target: torch.Tensor) -> Fp64Reference:
    """fp64_reference of (N, V) fp64 values y taken as they are (-inf: invalid columns),
    e.g. an fp64 GEMM's logits, with no rounding to fp32 first."""
    m, arg = y.max(dim=-1, keepdim=True)
    d = y - m
    e = torch.exp(d)
    rest = e.scatter(-1, arg, 0.0).sum(-1)  # all terms but one copy of the max
    log_s = torch.log1p(rest)
    s = 1.0 + rest
    w = torch.where(e > 0, e * (-d), 0.0).sum(-1)
    d_t = d.gather(-1, target.clamp(0, y.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    logprobs, entropy, lse = d_t - log_s, log_s + w / s, m.squeeze(-1) + log_s
    tail = w / s + rest / s
    return Fp64Reference(
        logprobs=logprobs,
        entropy=entropy,
        lse=lse,
        probs=e / s.unsqueeze(-1),
        scale={
            "logprobs": logprobs.abs() + tail,
            "entropy": entropy + tail,
            "lse": m.squeeze(-1).abs() + log_s + tail,
        },
    )


def mpmath_row(y_row, target: int, digits: int = 60) -> tuple[float, float, float]:
    """(logprob, entropy, lse) of one fp64 row (-inf allowed) at `digits` digits."""
    import mpmath

    with mpmath.workdps(digits):
        vals = [mpmath.mpf(float(v)) for v in y_row if float(v) != float("-inf")]
        m = max(vals)
        terms = [mpmath.exp(v - m) for v in vals]
        s = mpmath.fsum(terms)
        log_s = mpmath.log(s)
        w = mpmath.fsum(t * (m - v) for t, v in zip(terms, vals, strict=False))
        return (
            float((mpmath.mpf(float(y_row[target])) - m) - log_s),
            float(log_s + w / s),
            float(m + log_s),
        )


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """Spacing of fp32 above |x| (fp64), the unit the accuracy bound is stated in."""
    a = x.abs().to(torch.float32)
    return (torch.nextafter(a, torch.tensor(float("inf"))) - a).to(torch.float64)


def error_bound(scale: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bound on |our fp64 value before rounding - the fp64 reference|, from `scale`.

    docs/numerics.md derives ours, 2^-49 scale + vocab 2^-85; the reference's exp and
    summation add at most 2^-45 scale for the row lengths tested. Anything beyond the
    final rounding's 0.5 ulp is held to this.
    """
    return 2.0**-44 * scale + vocab * 2.0**-84


# --- stage-by-stage simulation of a sharded run in one process ---


def simulate_shards(
    logits: torch.Tensor,  # (N, V_total) full rows, padding included
    target: torch.Tensor,  # (N,)
    boundaries: list[int],  # shard k holds columns [boundaries[k], boundaries[k+1])
    *,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    keep_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    with_entropy: bool = True,
    backend: str = "reference",
    row_order: list[torch.Tensor] | None = None,
) -> contract.Finalized:
    """Run local max / partials per shard, combine (MAX, int64 SUM), finalize.

    `row_order`, if given, is one permutation of the rows per shard: each shard then
    processes its rows in that order, as a differently batched rank would.
    """
    impl = get_backend(backend, logits.device)
    n = logits.shape[0]
    tau = Temperature.of(temperature)
    shards = list(zip(boundaries[:-1], boundaries[1:], strict=False))
    orders = row_order or [torch.arange(n)] * len(shards)

    def run(k, fn):
        lo, hi = shards[k]
        perm = orders[k]
        inv = torch.argsort(perm)
        part_tau = tau if not tau.per_row else Temperature(1.0, tau.rows[perm])
        mask = None if keep_mask is None else keep_mask[perm, lo:hi]
        plan = ShardPlan(lo, vocab_size, ignore_index, with_entropy)
        return fn(logits[perm, lo:hi], target[perm], part_tau, mask, plan, perm)[inv]

    row_max = torch.full((n,), float("-inf"))
    for k in range(len(shards)):
        local = run(k, lambda x, t, tau_, m, p, perm: impl.row_max(x, tau_, m, p))
        row_max = torch.maximum(row_max, local)  # the all_reduce(MAX)
    record = torch.zeros(n, contract.NUM_COLS, dtype=torch.int64)
    for k in range(len(shards)):
        record += run(  # the all_reduce(SUM)
            k, lambda x, t, tau_, m, p, perm: impl.partials(x, t, tau_, m, row_max[perm], p)
        )
    return impl.finalize(row_max, record, target, vocab_size, ignore_index, tau.bad())


# --- bitwise helpers ---


def sha256(*tensors: torch.Tensor) -> str:
    """SHA-256 over the raw bytes (and dtype and shape) of the tensors, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def compare_bits(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """{"status": "bitwise-equal" | "equal-except-NaN-payload" | "DIFFERENT", ...}; a
    difference also gives "count" and the "first" differing index with both values
    ("got", "want"), or the dtype and shape mismatch ("detail").

    The contract fixes where NaN appears, not its sign or payload (docs/numerics.md, §7).
    """
    got, want = actual.detach().cpu(), expected.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        detail = f"{got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        return {"status": "DIFFERENT", "detail": detail}
    differ = bit_pattern(got) != bit_pattern(want)
    if not differ.any():
        return {"status": "bitwise-equal"}
    if got.is_floating_point():
        nan_pairs = torch.isnan(got) & torch.isnan(want)
        if not (differ & ~nan_pairs).any():
            return {"status": "equal-except-NaN-payload", "count": int(differ.sum())}
        differ &= ~nan_pairs
    first = tuple(int(i) for i in torch.nonzero(differ)[0])
    return {"status": "DIFFERENT", "count": int(differ.sum()), "first": first,
            "got": repr(got[first].item()), "want": repr(want[first].item())}  # fmt: skip


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bits everywhere, and NaN exactly where the other has NaN (`compare_bits`)."""
    res = compare_bits(actual, expected)
    if res["status"] != "DIFFERENT":
        return
    if "detail" in res:
        raise AssertionError(f"{what}: {res['detail']}")
    raise AssertionError(
        f"{what}: {res['count']} element(s) differ in bits; first at {res['first']}: "
        f"{res['got']} vs {res['want']}"
    )


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """t's bits as an integer tensor of its element size, on the CPU (integers as they are)."""
    t = t.detach().cpu().contiguous()
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    return t.view(view) if t.is_floating_point() else t


# --- real process groups on this machine: exactlogp.worlds ---

run_gloo_world = worlds.run_gloo_world


def fp64_reference_grad(
    ref: Fp64Reference,
    target: torch.Tensor,
    g_logprobs: torch.Tensor,
    g_entropy: torch.Tensor,
    g_lse: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """(N, V) fp64 analytic d/dx of sum(g_lp*logprob + g_ent*entropy + g_lse*lse)."""
    p = ref.probs
    col = lambda v: v.to(torch.float64).unsqueeze(-1)  # noqa: E731
    log_p = torch.where(p > 0, torch.log(p), 0.0)
    onehot = torch.zeros_like(p).scatter(-1, target.unsqueeze(-1), 1.0)
    g = col(g_logprobs) * (onehot - p) - col(g_entropy) * p * (log_p + col(ref.entropy))
    g = g + col(g_lse) * p
    # y = x / tau with tau rounded to fp32, so dy/dx = 1 / fp32(tau)
    tau = torch.as_tensor(temperature).to(torch.float32).to(torch.float64)
    return g / (col(tau) if tau.dim() else tau)


@contextlib.contextmanager
def grad_keep_bytes(budget: int):
    """linear.GRAD_KEEP_BYTES = budget inside the block (the forwards it runs decide their
    backwards' path: 0 puts every backward on the predicted grid); restored after."""
    from . import linear

    keep, linear.GRAD_KEEP_BYTES = linear.GRAD_KEEP_BYTES, budget
    try:
        yield
    finally:
        linear.GRAD_KEEP_BYTES = keep
