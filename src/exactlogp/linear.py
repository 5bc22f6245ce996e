"""The exact fused LM head: hidden states and LM-head weights to logprobs, entropy and lse.

    linear_logits(hidden, weight, bias, logit_scale=s)          the logits of contract
                                                                exactlogp-linear-v2, fp32
    linear_selected_logprobs(hidden, weight, target, bias=b, logit_scale=s, **kw)
        == selected_logprobs(linear_logits(hidden, weight, b, logit_scale=s), target, **kw)
        bitwise, for every output, without an [N, V] logits tensor

The logits are exact dot products rounded once (linear_contract.py), so they are the same
bits for any batch, row order, vocab shard, TP degree and backend -- and so are the
logprobs the softmax contract makes of them.

Forward, per block of ROW_BLOCK rows (the same blocks on every rank):
  logits (ROW_BLOCK, V_local) fp32 <- exact integer GEMMs over blocks of weight rows
  autograd.forward_pipeline on them: MAX (with the agreement values), partials, SUM, finalize
Backward (blocks of weight rows outer, all rows inner), never more than GRAD_KEEP_BYTES of
[N, V] kept:
  where dL/dz fit GRAD_KEEP_BYTES (the forward decides):
    pass 1: logits -> dL/dz (backend.grad) -> weight and bias gradient, exact per column;
            the per-row maxima of the hidden gradient's terms; dL/dz kept
    all_reduce(MAX) of those maxima (as exponents): the grid G_n of each row
    pass 2: kept dL/dz -> the hidden gradient's two integer slices -> int64 sums
  else, from each row's largest logit per weight-exponent class saved by the forward
  (_GridBound):
    the grid predicted from them (all_reduce(MAX)), then one pass: logits -> dL/dz ->
            weight and bias gradient, the maxima, and the hidden slices on the predicted grid
    all_reduce(MAX): the true grid; rows whose prediction missed are sliced again from
            their own logits (none on the rows measured, numerics.md section 12)
  (in a TP group every rank makes both MAX all_reduces: ranks may choose differently)
  one all_reduce(SUM) of int64 (2, N, H): every rank gets the whole hidden gradient
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import agreement, contract, distributed, validation
from . import linear_contract as lc
from .api import LogprobResult, eager_only, shaped_result
from .autograd import (
    Forward,
    forward_pipeline,
    once_differentiable,
    save_forward,
    saved_grad_stats,
    validate_rows,
)
from .backends import Backend, get_backend
from .call import Call, LinearOptions, device_of, make_call
from .prepared import PreparedLMHead, unwrap

ROW_BLOCK = 256  # rows per forward block: fixed, so every rank issues the same collectives
LOGITS_BUDGET = 128 << 20  # bytes of fp32 logits computed per pass over the weight (at
# least one block): several blocks share one quantization of the weight
WEIGHT_BLOCK_ELEMENTS = 1 << 21  # quantized weight rows per GEMM: at most 16 MiB of fp64
GRAD_BLOCK_ELEMENTS = 1 << 21  # backward temporaries per block of weight rows, per row
GRAD_KEEP_BYTES = 256 << 20  # the backward keeps dL/dz (fp32) between its passes up to this


def _linear_fields(hidden, bias, scale: float) -> dict:
    return dict(
        contract=agreement.contract_key(contract.CONTRACT, lc.LOGITS_CONTRACT),
        hidden=hidden.shape[-1],
        hidden_dtype=agreement.dtype_code(hidden.dtype),
        logit_scale=contract.fp32_bits(scale),
        bias=int(bias is not None),
    )


# --- the logits of a block of rows ---


class _Weight:
    """The weight shard's exponents, quantized one block of rows at a time -- or, on a
    backend with a fused head, sliced once into its int8 diagonal layout (kept by a
    PreparedLMHead across calls, by this object for one call)."""

    def __init__(self, weight, bias, scale: float, backend, prepared=None):
        self.weight, self.bias, self.scale, self.backend = weight, bias, scale, backend
        self.prepared = prepared or PreparedLMHead(weight, backend)
        self.f, self.finite = self.prepared.f, self.prepared.finite
        self.col_scale = self.prepared.col_scale
        h = max(weight.shape[1], 1)
        self.block = max(1, WEIGHT_BLOCK_ELEMENTS // h)
        self.fused = backend.fused_head(weight.device)

    @property
    def c3(self) -> torch.Tensor:
        """(V_local, 3H) int8: the fused head's weight layout."""
        return self.prepared.c3(self.backend)

    def slices(self, size: int):
        for v0 in range(0, self.weight.shape[0], size):
            yield slice(v0, min(v0 + size, self.weight.shape[0]))

    def quantized(self, rows: slice) -> lc.WeightRows:
        """These weight rows' integers (P, H) fp64 and residuals (linear_contract L2)."""
        return lc.weight_rows(self.weight[rows], self.f[rows], self.finite[rows])

    def blocks(self, size: int | None = None):
        """(slice, WeightRows) over the shard's rows."""
        for rows in self.slices(size or self.block):
            yield rows, self.quantized(rows)

    def hidden(self, hidden) -> lc.HiddenRows:
        """The hidden rows' integers -- fp64 (R, H), or the (R, 3H) int8 diagonal layout on
        a fused head -- row scales 2^(e - 2 QBITS) (NaN marks a non-finite row) and
        residuals."""
        a3 = None
        if self.fused:
            e, finite = lc.row_exponents(hidden)
            a3 = self.backend.head_slices(hidden, e, finite, reverse=True)
        return lc.hidden_rows(hidden, a3)

    def kernel_takes(self, h: lc.HiddenRows, rows: slice) -> bool:
        """Whether the fused kernel computes these logits: a fused head, and no residual in
        the hidden rows (none split off) or these weight rows -- where L4 of v1's integers is
        contract v2's value."""
        return self.fused and h.a3 is not None and h.res is None and self.prepared.on_grid(rows)

    def logits(self, h: lc.HiddenRows, rows: slice, cols=None, out=None, max_of=None):
        """(R, P) fp32 logits of weight rows `rows` (cols: their WeightRows, made here if
        None). A fused head runs its kernel where no residual takes part (with max_of,
        (logits, their row max): TritonBackend.head_logits); else contract v2's correction
        follows the exact integer GEMM (with max_of, (logits, None))."""
        bias = None if self.bias is None else self.bias[rows]
        if self.kernel_takes(h, rows):
            return self.backend.head_logits(
                h.a3, h.scale, self.c3[rows], self.col_scale[rows], bias, self.scale, out, max_of
            )
        cols = self.quantized(rows) if cols is None else cols
        out = lc.logits_rows(
            h, cols, self.col_scale[rows], bias, self.scale, self.backend.exact_dot, out
        )
        return out if max_of is None else (out, None)


def _logits(hidden, w: _Weight, max_of=None):
    """(R, V_local) fp32: contract exactlogp-linear-v2 for these rows. With max_of =
    (temperature of these rows, real columns): (logits, Backend.row_max of them) on a fused
    head, whose kernel finds the max as it writes the logits; (logits, None) elsewhere."""
    h = w.hidden(hidden)
    out = torch.empty(hidden.shape[0], w.weight.shape[0], dtype=torch.float32, device=hidden.device)
    whole = slice(0, w.weight.shape[0])
    if w.kernel_takes(h, whole):  # one kernel over the whole shard
        return w.logits(h, whole, out=out, max_of=max_of)
    for rows, cols in w.blocks():
        w.logits(h, rows, cols, out[:, rows])
    return out if max_of is None else (out, None)


# --- the autograd functions ---


class LinearLogitsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, scale, backend, prepared):
        ctx.save_for_backward(hidden, weight, bias)
        ctx.scale, ctx.backend, ctx.prepared = scale, backend, prepared
        return _logits(hidden, _Weight(weight, bias, scale, backend, prepared))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logits):
        hidden, weight, bias = ctx.saved_tensors
        w = _Weight(weight, bias, ctx.scale, ctx.backend, ctx.prepared)
        g = g_logits.to(torch.float64) * ctx.scale  # exact: fp32 * fp32
        live = g.abs().amax(-1) != 0  # also true for NaN
        grads = _Grads(hidden, w, live, ctx.needs_input_grad)
        for rows in w.slices(_grad_block(hidden.shape[0])):
            grads.weight_block(rows, g[:, rows])
            grads.track(rows, g[:, rows])
        big = grads.grid()
        for rows, cols in w.blocks(_grad_block(hidden.shape[0])):
            grads.hidden_block(rows, cols.c, g[:, rows], big)
        return grads.hidden(big), grads.dw, grads.db, None, None, None


class LinearSelectedLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, call: Call, prepared, grad_mode: bool):
        w = _Weight(weight, bias, call.linear.logit_scale, call.backend, prepared)
        n = hidden.shape[0]
        # a strong hash of each row's bits rides the MAX: ranks with other hidden states fail
        # (replay: and other kept sets, their hash added to it)
        hashes = agreement.row_hash(hidden) if call.group.distributed else None
        kept = call.kept  # replay: the kept sets, masks of a block at a time
        entries = None if kept is None else kept.shard(call.plan.vocab_start, weight.shape[0])
        if kept is not None and hashes is not None:
            hashes = (hashes + kept.row_hash()) & ((1 << 24) - 1)
        per_pass = max(1, LOGITS_BUDGET // (4 * max(weight.shape[0], 1) * ROW_BLOCK)) * ROW_BLOCK
        # where the backward cannot keep dL/dz, it slices the hidden gradient on a grid
        # predicted from the logits seen here (and checks the prediction per row)
        bound = None  # (grad_mode: the caller's; needs_input_grad is set under no_grad too)
        if grad_mode and ctx.needs_input_grad[0] and 4 * n * weight.shape[0] > GRAD_KEEP_BYTES:
            bound = _GridBound(w, call.plan, n, hidden.device)
        parts = []
        real = call.plan.real_columns(weight.shape[0])
        for p0 in range(0, n, per_pass):  # one pass over the weight for up to per_pass rows
            span = slice(p0, min(n, p0 + per_pass))
            max_of = (call.temperature.take(span), real)
            logits, local_max = _logits(hidden[span], w, max_of)
            if bound is not None:
                bound.add(p0, logits, target[span])
            for r0 in range(p0, span.stop, ROW_BLOCK):  # the same on every rank
                rows = slice(r0, min(n, r0 + ROW_BLOCK))
                tau = call.temperature.take(rows)
                fields = None if hashes is None else hashes[:, rows]
                block = logits[r0 - p0 : rows.stop - p0]
                known = None if local_max is None else local_max[r0 - p0 : rows.stop - p0]
                mask = None if entries is None else entries.rows_mask(rows, weight.shape[0])
                known = known if mask is None else None  # the max over the kept columns
                parts.append(forward_pipeline(block, target[rows], tau, mask, call, fields, known))
            del logits, block  # before the next pass allocates its own
        forward = _combine(parts, n, hidden.device)
        if kept is not None:
            forward = forward._replace(fin=kept.malformed(forward.fin, forward.ranks))
        if call.validate:
            validate_rows(forward, target, call)
        ctx.call, ctx.hashes, ctx.prepared, ctx.bound = call, hashes, prepared, bound
        ctx.entries = entries
        ctx.poisoned = None if forward.ranks is None else _HostFlag(forward.ranks.poison)
        return save_forward(ctx, (hidden, weight, bias, target), forward)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logprobs, g_entropy, g_lse):
        g_ent = g_entropy if ctx.call.with_entropy else torch.zeros_like(g_logprobs)
        upstream = torch.stack([g_logprobs, g_ent, g_lse], dim=-1).to(torch.float32)
        inputs, stats, tau = saved_grad_stats(ctx, (g_logprobs, g_entropy, g_lse))
        hidden, weight, bias, target = inputs
        call = ctx.call
        scale = call.linear.logit_scale
        w = _Weight(weight, bias, scale, call.backend, ctx.prepared)
        h = w.hidden(hidden)
        grads = _Grads(hidden, w, ~stats.silent, ctx.needs_input_grad)
        block = _grad_block(hidden.shape[0])
        bound = ctx.bound if grads.needs_hidden else None
        keep = bound is None and grads.needs_hidden  # the forward saw them fit
        dlogits = _DLogits(w, h, target, tau, stats, call, keep, ctx.entries)
        if bound is None:  # pass 1: dW, db and the rows' largest terms
            for rows in w.slices(block):
                g = dlogits(rows, None if w.fused else w.quantized(rows), first=True)
                grads.weight_block(rows, g)
                grads.track(rows, g)
        if not grads.needs_hidden:  # no collective: nothing the ranks must pair
            return None, grads.dw, grads.db, None, None, None, None
        group = call.group
        if not group.distributed:
            big = _hidden_passes(grads, w, dlogits, block, bound)
            return grads.hidden(big), grads.dw, grads.db, None, None, None, None
        # the backward's collectives, under the group's lock as the forward's are
        with distributed.serialized(group):
            if ctx.poisoned:  # the forward failed closed on every rank: no collective here
                grads.disagree = torch.ones((), dtype=torch.bool, device=hidden.device)
                dh = grads.poison(torch.empty_like(hidden))
                return dh, grads.poison(grads.dw), grads.poison(grads.db), None, None, None, None
            rows_check = torch.cat([target.unsqueeze(0), ctx.hashes, agreement.row_hash(upstream)])
            check = BackwardCheck(call, rows_check)
            big = _hidden_passes(grads, w, dlogits, block, bound, group, check)
            dh = grads.hidden(big, group)
        return (
            grads.poison(dh),
            grads.poison(grads.dw),
            grads.poison(grads.db),
            None,
            None,
            None,
            None,
        )


def _hidden_passes(grads, w, dlogits, block, bound, group=None, check=None) -> torch.Tensor:
    """The hidden gradient's grid G (N,) and its slices summed into grads.z.

    A rank without a bound has run pass 1 (dW, db, the rows' largest terms, dL/dz kept);
    it takes the grid and runs pass 2 over the kept dL/dz. A rank with a _GridBound takes
    the grid predicted from it and runs one pass that makes dW, db, the largest terms and
    the hidden slices on the predicted grid, then the true grid, and slices again, from
    their own logits, only the rows whose prediction missed (one host sync to count them). The same integers either way: a row's slices
    depend only on its own dL/dz and G.

    In a TP group, whether a rank keeps a bound depends on its shard's width, so every
    rank makes the same two all_reduce(MAX): the guess (the bound's prediction, or the
    largest terms pass 1 found; `check` rides it, before anything sized by the vocabulary)
    and the true grid."""
    if bound is None:
        if group is not None:  # the guess every rank makes: its largest terms, `check`
            grads.grid(group, check, top=grads.row_max)
        big = grads.grid(group)
        for rows, cols in w.blocks(block):  # pass 2
            grads.hidden_block(rows, cols.c, dlogits(rows, cols), big)
        return big
    guess = grads.grid(group, check, top=dlogits.predicted_top(bound))
    for rows, cols in w.blocks(block):  # the one pass
        g = dlogits(rows, cols)
        grads.weight_block(rows, g)
        grads.track(rows, g)
        grads.hidden_block(rows, cols.c, g, guess, guessed=True)
    big = grads.grid(group)
    missed = torch.nonzero((big != guess) & ~grads.row_bad).squeeze(1)
    grads.missed = missed.numel()
    if grads.missed:
        grads.z[:, missed] = 0
        again = dlogits.rows(missed)
        for rows, cols in w.blocks(_grad_block(grads.missed)):
            grads.hidden_block(rows, cols.c, again(rows, cols), big[missed], index=missed)
    return big


class _GridBound:
    """What the backward predicts each row's hidden-gradient grid G_n from, saved by the
    forward of a call whose dL/dz the backward cannot keep (GRAD_KEEP_BYTES).

    G_n is the binade of max_v |g_nv| 2^(f_v - QBITS) (g = dL/dz, f_v the weight row's
    exponent). Given the row, a column's g is a function of its logit alone
    (contract.grad_block), and without an entropy gradient |g| grows with the logit (as
    far as exp_c does, section 13 of numerics.md): within the weight rows of one exponent
    the largest term is at the largest logit. So per row this keeps the largest logit of
    this shard's non-target columns in each of CLASSES exponent classes (f_top - k, the
    last one holding every lower f: an upper bound there) and the target's own logit and
    f where this shard owns it: the backward's gradient of those few columns gives the
    predicted largest term. A prediction is checked per row against the true grid, so a
    wrong one (an entropy gradient, exp_c's rare decreasing pair, the lumped class) costs
    time, never bits. One read of the logits per pass (Backend.class_max), no host sync,
    nothing of size [N, V] kept."""

    CLASSES = 32

    def __init__(self, w: _Weight, plan, n: int, device):
        v = w.weight.shape[0]
        valid = w.finite & (torch.arange(v, device=device) < plan.real_columns(v))
        low = torch.iinfo(torch.int64).min
        f_top = torch.where(valid, w.f, low).amax() if v else torch.zeros((), dtype=torch.int64)
        f_top = torch.where(f_top == low, 0, f_top).to(device)  # no valid column: any value
        cls = torch.where(valid, (f_top - w.f).clamp(0, self.CLASSES - 1), self.CLASSES)
        self.cls = cls.to(torch.int32)
        self.f_class = f_top - torch.arange(self.CLASSES, device=device)
        self.zmax = torch.full((n, self.CLASSES), -torch.inf, device=device)
        self.z_t = torch.full((n,), -torch.inf, device=device)
        self.f_t = torch.zeros(n, dtype=torch.int64, device=device)
        self.owned = torch.zeros(n, dtype=torch.bool, device=device)
        self.plan, self.f, self.backend = plan, w.f, w.backend

    def add(self, r0: int, z: torch.Tensor, target: torch.Tensor) -> None:
        """Rows r0.. of their logits z (R, V_local) fp32 (left as they are)."""
        r, v = z.shape
        if r == 0 or v == 0:
            return
        col = self.plan.target_columns(target, v)  # -1 where not owned here
        owned = col >= 0
        at = col.clamp(min=0)
        rows = slice(r0, r0 + r)
        self.zmax[rows] = self.backend.class_max(z, self.cls, col, self.CLASSES)
        z_t = z.gather(1, at.unsqueeze(1)).squeeze(1)
        self.z_t[rows] = torch.where(owned, z_t, -torch.inf)
        self.f_t[rows] = self.f[at]
        self.owned[rows] = owned


class _DLogits:
    """dL/dz * logit_scale (N, P) fp64 of a block of weight rows, from its logits computed
    again. With `keep`, the first pass's dL/dz (fp32, before the exact scaling) are kept
    until the second pass reads them: the logits are then computed once in the backward
    instead of twice (GRAD_KEEP_BYTES bounds what is kept), and the values are the same."""

    def __init__(self, w: _Weight, h: lc.HiddenRows, target, tau, stats, call: Call,
                 keep: bool, entries=None, index=None):  # fmt: skip
        self.w, self.h, self.target = w, h, target
        self.tau, self.stats, self.call = tau, stats, call
        self.kept: dict[int, torch.Tensor] | None = {} if keep else None
        # replay: the kept entries (replay.ShardEntries) and the call's rows these are
        self.entries, self.index = entries, index

    def __call__(self, rows: slice, cols=None, first: bool = False) -> torch.Tensor:
        g = None if self.kept is None else self.kept.pop(rows.start, None)
        if g is None:
            z = self.w.logits(self.h, rows, cols)
            plan = replace(self.call.plan, vocab_start=self.call.plan.vocab_start + rows.start)
            mask = None
            if self.entries is not None:
                mask = self.entries.cols_mask(rows, z.shape[0], self.index)
            g = self.call.backend.grad(z, self.target, self.tau, mask, self.stats, plan)
            if first and self.kept is not None:
                self.kept[rows.start] = g
        return self._scaled(g)

    def _scaled(self, g: torch.Tensor) -> torch.Tensor:
        g64 = g.to(torch.float64)  # not in place below: g may be kept, or already fp64
        return g64 if self.w.scale == 1.0 else g64 * self.w.scale  # exact

    def rows(self, index: torch.Tensor) -> _DLogits:
        """The same for the rows `index` (M,) alone."""
        stats = contract.GradStats(*(t[index] for t in self.stats))
        return _DLogits(self.w, self.h.take(index), self.target[index],
                        self.tau.take(index), stats, self.call, False, self.entries,
                        index)  # fmt: skip

    def predicted_top(self, bound: _GridBound) -> torch.Tensor:
        """(N,) fp64: each row's predicted largest |term| of the hidden gradient: the
        gradient (backend.grad, the same code as every column's) of the bound's columns --
        each class's largest logit, then the target -- times 2^(f - QBITS)."""
        n, c = bound.zmax.shape
        z = torch.cat([bound.zmax, bound.z_t.unsqueeze(1)], 1)
        ignore = self.call.plan.ignore_index
        base = 1 if ignore == c else 0  # the target's id is never ignore_index
        other = base + c + 1 if base + c + 1 != ignore else base + c + 2  # owned by no one
        target = torch.where(bound.owned, base + c, other)
        plan = replace(self.call.plan, vocab_start=base, vocab_size=None)
        g = self._scaled(self.call.backend.grad(z, target, self.tau, None, self.stats, plan))
        f = torch.cat([bound.f_class.expand(n, c), bound.f_t.unsqueeze(1)], 1)
        return (g * contract.pow2(f - lc.QBITS)).abs().amax(-1)


class _HostFlag:
    """`any()` of a device bool tensor, read on the host later without waiting then: the
    copy is queued now, and reading waits only for the work queued before it."""

    def __init__(self, t: torch.Tensor):
        self.host = t.reshape(-1).to("cpu", non_blocking=True)
        self.event = None
        if t.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def __bool__(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host.any())


class BackwardCheck:
    """What the ranks' backwards of one call must share, riding the backward's MAX: the
    call's key and, per row, the target, the hidden states' hash and the upstream
    gradients' hash (agreement.row_hash of (dL/dlogprob, dL/dentropy, dL/dlse))."""

    FIELDS = ("target", "hidden states", "hidden states", "upstream gradient",
              "upstream gradient")  # fmt: skip

    def __init__(self, call: Call, rows: torch.Tensor):
        self.call, self.rows = call, rows.to(torch.int64)  # (len(FIELDS), N)

    def header(self, group: distributed.Group) -> None:
        """validate=True: the forward's fixed-size agreement all_gather first, marked as a
        backward, so that a backward paired with another call (or with a forward, by
        threads sharing the group) raises on every rank before any collective sized by
        the call."""
        fields = replace(self.call.fields, phase=agreement.PHASE_BACKWARD)
        agreement.agree(group, fields, self.call.layout, None, self.rows.device)

    def payload(self) -> torch.Tensor:
        key = torch.full((1,), self.call.call_key, dtype=torch.int64, device=self.rows.device)
        return torch.cat([agreement.as_pairs(self.rows), agreement.as_pairs(key)])

    def read(self, reduced: torch.Tensor) -> torch.Tensor:
        """() bool on the device: any value differed between ranks. validate=True: raises
        on every rank (one host sync) naming the first row and value that differ."""
        k, n = self.rows.shape
        hi, lo = agreement.from_pairs(reduced, k, n)
        differs = hi != lo
        key_hi, key_lo = agreement.from_pairs(reduced[2 * k * n :], 1, 1)
        key_differs = (key_hi != key_lo).any()
        disagree = differs.any() | key_differs
        if self.call.validate and bool(disagree):
            if bool(key_differs):
                raise ValueError(self._message("the call (its key)"))
            field, row = (int(i) for i in torch.nonzero(differs)[0])
            raise ValueError(self._message(f"the {self.FIELDS[field]} of row {row}"))
        return disagree

    @staticmethod
    def _message(what: str) -> str:
        return (
            f"the ranks of tp_group disagree in the backward of linear_selected_logprobs on "
            f"{what}: every rank must backpropagate the same loss through the same call, "
            "in the same order (did a rank scale or mask its loss differently, or run its "
            "backwards in another order?)"
        )


def _grad_block(num_rows: int) -> int:
    return max(1, min(lc.K_CHUNK, GRAD_BLOCK_ELEMENTS // max(num_rows, 1)))


class _Grads:
    """The three gradients of z = h W^T + b, accumulated block of weight rows by block."""

    def __init__(self, hidden, w: _Weight, live, needs):
        self.hidden_in, self.w, self.live = hidden, w, live
        self.needs_hidden, needs_weight, needs_bias = needs[0], needs[1], needs[2]
        n, h = hidden.shape
        dev = hidden.device
        self.dw = torch.empty_like(w.weight) if needs_weight else None
        self.db = torch.empty_like(w.bias) if needs_bias and w.bias is not None else None
        if needs_weight:  # h quantized per column over the live rows
            self.eps, self.finite_eps = lc.column_exponents(hidden, live)
            masked = torch.where(live.unsqueeze(-1), hidden, 0.0)
            self.a_col = lc.quantize(masked, self.eps, self.finite_eps, dim=0)
        else:  # the bias alone needs no h
            self.eps = torch.zeros(0, dtype=torch.int64, device=dev)
            self.finite_eps = torch.ones(0, dtype=torch.bool, device=dev)
            self.a_col = torch.zeros(n, 0, dtype=torch.float64, device=dev)
        self.row_max = torch.zeros(n, dtype=torch.float64, device=dev)
        self.z = torch.zeros(2, n, h, dtype=torch.int64, device=dev)
        self.disagree = None  # () bool once a BackwardCheck was read
        self.missed = None  # rows whose predicted grid missed (_hidden_passes), for tests

    def weight_block(self, rows: slice, g: torch.Tensor) -> None:
        if self.dw is None and self.db is None:
            return
        dw, db = lc.grad_weight_block(
            g, self.a_col, self.eps, self.finite_eps, self.w.backend.exact_dot
        )
        if self.dw is not None:
            self.dw[rows] = dw.to(self.dw.dtype)
        if self.db is not None:
            self.db[rows] = db.to(self.db.dtype)

    def track(self, rows: slice, g: torch.Tensor) -> None:
        """The rows' largest |term| of the hidden gradient in this block (NaN and inf
        make it non-finite: the row's gradient is NaN)."""
        if not self.needs_hidden or g.shape[-1] == 0:
            return
        top = lc.hidden_grad_terms(g, self.w.f[rows]).abs().amax(-1)
        self.row_max = torch.maximum(self.row_max, top)  # NaN propagates

    def grid(self, group: distributed.Group | None = None, check=None, top=None):
        """(N,) int64 G_n: 2^(G_n - 1) <= max over the whole vocabulary (all ranks) < 2^G_n;
        a row with nothing anywhere gets 0, a non-finite one is marked bad. With a group:
        one all_reduce(MAX), which also carries `check` (a BackwardCheck) if given. `top`:
        a predicted (N,) largest |term| instead of the tracked one (marks nothing bad)."""
        guessed = top is not None
        top = self.row_max if top is None else top
        bad = ~torch.isfinite(top)
        top = torch.where(bad, 0.0, top)
        _, e = torch.frexp(top)
        none = -(1 << 40)
        n = top.shape[0]
        packed = torch.stack([torch.where(top > 0, e.to(torch.int64), none), bad.to(torch.int64)])
        if group is not None:
            if check is not None:
                if check.call.validate:
                    check.header(group)
                packed = torch.cat([packed.reshape(-1), check.payload()])
            else:
                packed = packed.reshape(-1)
            distributed.all_reduce_max_(packed, group)
            if check is not None:
                self.disagree = check.read(packed[2 * n :])
            packed = packed[: 2 * n].view(2, n)
        if not guessed:
            self.row_bad = packed[1] != 0
        return torch.where(packed[0] == none, 0, packed[0])

    def poison(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """`grad` with NaN everywhere when the ranks' backwards disagreed (no host sync)."""
        if grad is None or self.disagree is None:
            return grad
        return grad.masked_fill(self.disagree, float("nan"))

    def hidden_block(self, rows: slice, c, g, big, guessed=False, index=None) -> None:
        """Adds this block's two slices of sum_v D[n, v] C[v, k] (a NaN row of g spoils
        only its own row of the sums, which comes out NaN anyway) -- into the rows `index`
        of the sums if given. `guessed`: `big` is a prediction, wrong for some rows; their
        terms are clamped to +-2^G so that even there the GEMM's operands stay within
        exact_dot's |.| <= 2^20 (those rows' sums are discarded and made again; a no-op on
        the rows where it is right, |term| < 2^G there)."""
        y = lc.hidden_grad_terms(g, self.w.f[rows])
        if guessed:
            limit = contract.pow2(big).unsqueeze(-1)
            y = torch.clamp(y, -limit, limit)
        d1, d2 = lc.hidden_grad_slices(y, big)
        z1 = self.w.backend.exact_dot(d1, c.transpose(0, 1)).to(torch.int64)
        z2 = self.w.backend.exact_dot(d2, c.transpose(0, 1)).to(torch.int64)
        if index is None:
            self.z[0] += z1
            self.z[1] += z2
        else:
            self.z[0].index_add_(0, index, z1)
            self.z[1].index_add_(0, index, z2)

    def hidden(self, big, group: distributed.Group | None = None) -> torch.Tensor | None:
        if not self.needs_hidden:
            return None
        if group is not None:
            distributed.all_reduce_sum_(self.z, group)
        dh = lc.hidden_grad_round(self.z[0], self.z[1], big)
        dh = torch.where(self.row_bad.unsqueeze(-1), torch.full_like(dh, float("nan")), dh)
        return dh.to(self.hidden_in.dtype)


def _combine(parts: list[Forward], n: int, device) -> Forward:
    """One Forward for all rows from the blocks'; a disagreement found in any block poisons
    every row, as it would in a single block."""
    if not parts:
        empty = torch.empty(0, device=device)
        fin = contract.Finalized(
            logprobs=empty, entropy=empty, lse=empty,
            s_hi=empty.double(), s_lo=empty.double(), log_s=empty.double(),
            entropy64=empty.double(), bad=empty.long(), ignored=empty.bool(),
        )  # fmt: skip
        record = torch.zeros(0, contract.NUM_COLS, dtype=torch.int64, device=device)
        return Forward(empty, fin, record, None)
    cat = lambda ts: torch.cat(list(ts))  # noqa: E731
    fin = contract.Finalized(*(cat(getattr(p.fin, f) for p in parts)
                               for f in contract.Finalized._fields))  # fmt: skip
    row_max, record = cat(p.row_max for p in parts), cat(p.record for p in parts)
    ranks = None
    if parts[0].ranks is not None:
        rs = [p.ranks for p in parts]
        poison = torch.stack([r.poison.any() for r in rs]).any().expand(n)
        ranks = agreement.RankCheck(
            poison, cat(r.rows for r in rs), torch.stack([r.call for r in rs]).any(),
            cat(r.target_max for r in rs), cat(r.target_min for r in rs),
            torch.cat([r.differs for r in rs], dim=1), torch.stack([r.kinds for r in rs]).any(0),
            rs[0].vocab_end,
        )  # fmt: skip
        nan = torch.full((), float("nan"), device=device)
        fin = fin._replace(
            logprobs=torch.where(poison, nan, fin.logprobs),
            entropy=torch.where(poison, nan, fin.entropy),
            lse=torch.where(poison, nan, fin.lse),
            bad=fin.bad | torch.where(poison, contract.BAD_RANKS, 0),
        )
    return Forward(row_max, fin, record, ranks)


# --- the public functions ---


@eager_only
def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor | PreparedLMHead,
    bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    backend: str | Backend = "auto",
) -> torch.Tensor:
    """The logits of contract exactlogp-linear-v2: (..., V_local) fp32, exact dot products
    of hidden (..., H) and weight (V_local, H) rounded once, + bias, * logit_scale.

    The same bits for any batch, row order, vocab shard and backend. Differentiable w.r.t.
    hidden, weight and bias (exact integer sums, rounded once; the hidden gradient is this
    shard's part -- linear_selected_logprobs sums it over the TP group itself). `weight`
    may be a PreparedLMHead (prepare_lm_head): the same bits, less work per call.
    """
    weight, prepared = unwrap(weight)
    scale = validation.check_linear(hidden, weight, bias, logit_scale)
    impl = get_backend(backend, hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])
    out = LinearLogitsFunction.apply(h, weight, bias, scale, impl, prepared)
    return out.view(*hidden.shape[:-1], weight.shape[0])


@eager_only
def linear_selected_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor | PreparedLMHead,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    validate: bool = True,
    backend: str | Backend = "auto",
) -> LogprobResult:
    """selected_logprobs of the exact logits linear_logits(hidden, weight, bias, logit_scale)
    -- bitwise the same outputs -- computed in blocks of rows, without [N, V] logits.

    Args:
        hidden: (..., H) bf16/fp16/fp32 final hidden states, the same on every TP rank
            (taken from before any copy-to-tensor-parallel region: the hidden gradient is
            summed over the vocab shards here, on every rank).
        weight: (V_local, H) this rank's LM-head rows, hidden's dtype, or a PreparedLMHead
            of them (prepare_lm_head: for a weight that several calls share).
        target: (...) global token ids, hidden's shape without H.
        bias: (V_local,) or None.
        logit_scale: multiplies the logits (fp32) before the temperature divides them
            (Cohere's logit_scale; pass 1 / logits_scaling for Granite).
        The other arguments are those of selected_logprobs (no keep_mask).

    Gradients: hidden (the whole, summed over the TP group: one int64 all_reduce), weight
    and bias (this shard's rows), exact integer sums rounded once; rows without a gradient
    (ignored, or zero upstream) take part in nothing.
    """
    weight, prepared = unwrap(weight)
    group = distributed.resolve(tp_group)
    with distributed.serialized(group):
        call = agreement.checked(
            group, validate, device_of(hidden, group), linear_call,
            hidden=hidden, weight=weight, bias=bias, logit_scale=logit_scale, target=target,
            group=group, vocab_start=vocab_start, vocab_size=vocab_size,
            temperature=temperature, ignore_index=ignore_index, with_entropy=with_entropy,
            validate=validate, backend=backend,
        )  # fmt: skip
        outputs = LinearSelectedLogprobsFunction.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, bias,
            target.reshape(-1).to(torch.int64), call, prepared, torch.is_grad_enabled(),
        )  # fmt: skip
    return shaped_result(call, *outputs)


def linear_call(*, hidden, weight, bias, logit_scale, kind=agreement.KIND_LINEAR,
                **options) -> Call:  # fmt: skip
    """The fused head's call (linear_selected_logprobs, linear_replay_logprobs): the head's
    arguments, the shared checks, then the call extended with the head's options."""
    scale = validation.check_linear(hidden, weight, bias, logit_scale)
    call = make_call(
        source=hidden, num_cols=weight.shape[0], has_keep_mask=False,
        grads=agreement.grads_field(hidden, weight, bias), kind=kind,
        extra_fields=_linear_fields(hidden, bias, scale), source_name="hidden",
        logits_name="the logits hidden @ weight.T", **options,
    )  # fmt: skip
    return replace(call, linear=LinearOptions(scale, bias is not None))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group):
        parts = distributed.all_gather(shard, group)
        ctx.rows = slice(group.rank * shard.shape[0], (group.rank + 1) * shard.shape[0])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rows], None


def gather_sequence_parallel(hidden_shard: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole (N, H) hidden states from this rank's sequence-parallel shard (N / TP, H),
    for linear_selected_logprobs: all_gather in forward, and in backward this rank's slice
    of the gradient -- the op already returns the whole hidden gradient on every rank, so a
    reduce-scatter (Megatron's gather_from_sequence_parallel_region) would count it TP
    times. Shards must have equal sizes (as sequence parallelism makes them)."""
    group = distributed.resolve(tp_group)
    if not group.distributed:
        return hidden_shard
    sizes = (
        distributed.all_gather_int64(
            torch.tensor([hidden_shard.shape[0]], device=hidden_shard.device), group
        )
        .flatten()
        .tolist()
    )
    if len(set(sizes)) > 1:
        raise ValueError(
            f"sequence-parallel shards must have equal sizes, got {sizes} rows per rank"
        )
    return _GatherRows.apply(hidden_shard, group)


__all__ = [
    "LOGITS_CONTRACT",
    "gather_sequence_parallel",
    "linear_logits",
    "linear_selected_logprobs",
]
LOGITS_CONTRACT = lc.LOGITS_CONTRACT
