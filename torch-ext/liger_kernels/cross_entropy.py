"""Cross-entropy over rows of logits: the per-row math that the fused linear cross-entropy runs on each chunk
of logits, and a cross-entropy on given logits (the causal-LM loss uses it when it has no hidden states).

Per row ``i`` with target ``y`` (ignored rows contribute nothing), ``s = softcap(x) = c tanh(x / c)`` (or
``s = x``), ``lse = logsumexp(s)``, class weights ``w`` (ones without ``ce_weight``), ``W = sum_j w_j``,
smoothing ``ls`` over ``V`` classes:

    ce_i = (1 - ls) w_y (lse - s_y) + (ls / V) sum_j w_j (lse - s_j)      # F.cross_entropy's, per row
    z_i  = lse_square_scale * lse^2                                       # the z-loss (PaLM)

With ``use_token_scaling`` both are multiplied by ``p_y = exp(s_y - lse)``, held constant in the gradient.
Reductions: "sum" adds the rows; "mean" divides the ce rows by the summed target weights ``sum_i w_{y_i}``
(the count of non-ignored rows without ``ce_weight``), as PyTorch does, and the z rows by the count; "none"
keeps rows (ignored rows 0). An all-ignored batch gives 0 / 0 = nan for "mean", as PyTorch.

The gradient of row ``i`` with respect to ``s_j``, with ``a`` the scale of the ce rows (1/sum of weights for
"mean", 1 for "sum", the incoming gradient for "none") and ``b`` that of the z rows:

    a [((1 - ls) w_y + (ls / V) W) p_j - (ls / V) w_j - [j = y] (1 - ls) w_y] + b 2 lse_square_scale lse p_j

times ``1 - tanh^2(x_j / c)`` for the softcap. The target term is folded in fp32 before the one rounding, so
``p_y - 1`` near 0 loses nothing to the output dtype.

One Triton kernel, ``_ce_rows_kernel``, one program per row, loops over the vocabulary in blocks: the row's
statistics (online logsumexp, the loss terms, the argmax), its gradient (from that lse or one stored before),
or both in one launch (the fused loss's chunks). The gradient may be written over the logits it reads (each
program reads its row's target logit before writing any of it, and each block before writing it).

This module is over 300 lines because the kernel, its PyTorch twins (the CPU path and the references the
option semantics are defined by) and the ops around them change together.
"""

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _backend
from ._backend import constexpr, jit, tl, use_triton
from ._launch import Plans, launch_prepared

REDUCTIONS = ("mean", "sum", "none")
MAX_BLOCK = 4096  # vocabulary columns per loop step: 16 per thread at 8 warps
NUM_WARPS = 8
_LOG2E = constexpr(math.log2(math.e))


class Options(NamedTuple):
    ignore_index: int = -100
    lse_square_scale: float = 0.0
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    use_token_scaling: bool = False


# ----------------------------------------------------------------------------------------------------------
# Validation (shared with the fused linear cross-entropy): every check runs before any launch.


def check_tensor(value, arg: str, op: str, floating: bool = True) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: `{arg}` must be a torch.Tensor, got {type(value).__name__}")
    if floating and value.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{op}: `{arg}` must be float16, bfloat16, float32 or float64, got {value.dtype}")
    return value


def check_target(target, rows_shape, n_classes: int, ignore_index: int, op: str) -> torch.Tensor:
    """``target`` of shape ``rows_shape``, integer; on the CPU its values are checked too (free there; on a
    device that would cost a synchronization, so the kernels make an out-of-range target's loss NaN)."""
    check_tensor(target, "target", op, floating=False)
    is_functorch(target)  # vmap: the clear error, before anything indexes by a mask
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"{op}: `target` must hold integer class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(rows_shape):
        raise ValueError(f"{op}: `target` must have shape {tuple(rows_shape)}, got {tuple(target.shape)}")
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_target_values(target, n_classes, ignore_index, op)
    return target


def _check_target_values(target, n_classes: int, ignore_index: int, op: str) -> None:
    """A CPU target's kept values are class indices."""
    if target.numel() > 0:
        kept = target[target != ignore_index]
        if kept.numel() > 0 and (int(kept.min()) < 0 or int(kept.max()) >= n_classes):
            raise ValueError(
                f"{op}: `target` values must be in [0, {n_classes}) or ignore_index={ignore_index}, got values in "
                f"[{int(kept.min())}, {int(kept.max())}]"
            )


def check_options(op: str, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling):
    if (  # the common case in one expression (what the checks below accept, for Python's own int and floats)
        type(ignore_index) is int
        and type(lse_square_scale) is float
        and type(label_smoothing) is float
        and softcap is None
        and type(use_token_scaling) is bool
        and reduction in REDUCTIONS
        and 0.0 <= label_smoothing <= 1.0  # (NaN and inf fail here)
        and -math.inf < lse_square_scale < math.inf
    ):
        return Options(ignore_index, lse_square_scale, label_smoothing, reduction, None, use_token_scaling)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{op}: `ignore_index` must be an int, got {type(ignore_index).__name__}")
    for arg, value in (("lse_square_scale", lse_square_scale), ("label_smoothing", label_smoothing)):
        real = isinstance(value, (numbers.Real, torch.SymFloat)) and not isinstance(value, bool)
        if not real or not _backend.is_finite(value):
            raise TypeError(f"{op}: `{arg}` must be a finite real number, got {value!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: `label_smoothing` must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: `reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    if softcap is not None:
        real = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
        if not real or not _backend.is_finite(softcap) or not softcap > 0:
            raise ValueError(f"{op}: `softcap` must be None or a finite positive number, got {softcap!r}")
        softcap = float(softcap)
    if not isinstance(use_token_scaling, bool):
        raise TypeError(f"{op}: `use_token_scaling` must be a bool, got {type(use_token_scaling).__name__}")
    return Options(
        int(ignore_index), float(lse_square_scale), float(label_smoothing), reduction, softcap, use_token_scaling
    )


def check_class_weight(ce_weight, n_classes: int, device, op: str):
    if ce_weight is None:
        return None
    check_tensor(ce_weight, "ce_weight", op)
    if tuple(ce_weight.shape) != (n_classes,):
        raise ValueError(f"{op}: `ce_weight` must have shape ({n_classes},), got {tuple(ce_weight.shape)}")
    if ce_weight.device != device:
        raise ValueError(f"{op}: `ce_weight` must be on {device}, got {ce_weight.device}")
    if ce_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: `ce_weight` gets no gradient (as in F.cross_entropy); pass it detached")
    return ce_weight.contiguous()  # the kernels index it densely (a strided view was read as if contiguous)


def check_flag(value, arg: str, op: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: `{arg}` must be a bool, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Triton kernels. One program per row; int64 row offsets (rows * vocabulary exceeds 2**31).


@jit
def _tanh(z):
    # tanh(|z|) = (1 - e) / (1 + e) with e = exp(-2 |z|) <= 1: finite for every z. Near 0, 1 - e cancels (an
    # absolute error of fp32's epsilon, relative 3e-8 / |z|: a softcap far above the logits would quantize them),
    # so below |z| = 0.3 tanh's odd series to z**11 (the next term is 2e-9 of it there).
    a = tl.abs(z)
    e = tl.exp2(-2.0 * _LOG2E * a)
    z2 = z * z
    series = z * (
        1.0
        + z2
        * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0 + z2 * (62.0 / 2835.0 + z2 * (-1382.0 / 155925.0)))))
    )
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.3, series, tl.where(z < 0, -t, t))


@jit
def _capped(x, softcap, SOFTCAP: constexpr):
    if SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x


@jit
def _ce_rows_kernel(
    logits_ptr,
    grad_ptr,
    target_ptr,
    ce_weight_ptr,
    weight_total_ptr,
    lse_ptr,
    ce_ptr,
    z_ptr,
    pred_ptr,
    ce_scale_ptr,
    z_scale_ptr,
    ce_divisor_ptr,
    z_divisor_ptr,
    logits_row_stride,
    grad_row_stride,
    ce_scale_stride,
    z_scale_stride,
    n_cols,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    softcap,
    HAS_CE_WEIGHT: constexpr,
    SOFTCAP: constexpr,
    SMOOTHING: constexpr,
    Z_LOSS: constexpr,
    TOKEN_SCALING: constexpr,
    STORE_PRED: constexpr,
    STATS: constexpr,
    GRAD: constexpr,
    DIVIDE_CE: constexpr,
    DIVIDE_Z: constexpr,
    BLOCK: constexpr,
    N_BLOCKS: constexpr,
):
    """One row per program. STATS: the row's lse, loss terms and prediction, stored. GRAD: the gradient of
    ``a * ce + b * z`` (a, b: the row's scales, divided by the one value at ``ce_divisor_ptr`` or
    ``z_divisor_ptr`` with DIVIDE_CE or DIVIDE_Z), stored in ``grad`` from the lse just computed, or (without
    STATS) from the one stored before. ``grad`` may be the logits themselves (the fused loss's chunk): the
    second loop reads each block before writing its gradient there."""
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(target_ptr + row).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    if y == ignore_index:
        if STATS:
            tl.store(lse_ptr + row, 0.0)
            tl.store(ce_ptr + row, 0.0)
            tl.store(z_ptr + row, 0.0)
            if STORE_PRED:
                tl.store(pred_ptr + row, -1)
        if GRAD:
            for block in range(N_BLOCKS):
                cols = block * BLOCK + tl.arange(0, BLOCK)
                tl.store(grad_row_ptr + cols, tl.zeros((BLOCK,), tl.float32), mask=cols < n_cols)
    else:
        in_range = (y >= 0) & (y < n_cols)
        y_safe = tl.where(in_range, y, 0)
        s_y = _capped(tl.load(row_ptr + y_safe).to(tl.float32), softcap, SOFTCAP)
        if HAS_CE_WEIGHT:
            w_y = tl.load(ce_weight_ptr + y_safe).to(tl.float32)
            weight_total = tl.load(weight_total_ptr).to(tl.float32)
        else:
            w_y = 1.0
            weight_total = n_cols * 1.0  # (not .to: Triton passes n_cols = 1 as a constexpr)
        if STATS:
            m = float("-inf")  # running max of s
            d = 0.0  # running sum of exp(s - m)
            spread = 0.0  # sum_j w_j (s_j - s_y), for the smoothing term
            best = float("-inf")  # argmax of the raw logits (the softcap is monotone, and saturates in fp32)
            best_col = 0
            for block in range(N_BLOCKS):
                start = block * BLOCK
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
                if STORE_PRED:
                    block_best = tl.max(x, axis=0)
                    block_col = start + tl.argmax(x, axis=0, tie_break_left=True)
                    best_col = tl.where(block_best > best, block_col, best_col)
                    best = tl.maximum(best, block_best)
                s = tl.where(mask, _capped(x, softcap, SOFTCAP), float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                # Rescaled from a finite max: while every logit so far is -inf (a masked start of the vocabulary),
                # -inf - -inf would be NaN, where the sum is 0 and stays 0
                m_finite = tl.where(m_new == float("-inf"), 0.0, m_new)
                d = d * tl.exp2((m - m_finite) * _LOG2E) + tl.sum(tl.exp2((s - m_finite) * _LOG2E), axis=0)
                m = m_new
                if SMOOTHING:
                    centered = tl.where(mask, s - s_y, 0.0)
                    if HAS_CE_WEIGHT:
                        w = tl.load(ce_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                        centered = centered * w
                    spread += tl.sum(centered, axis=0)
            lse = m + tl.log(d)
            nll = lse - s_y
            ce = w_y * nll
            if SMOOTHING:
                # sum_j w_j (lse - s_j) = W (lse - s_y) - sum_j w_j (s_j - s_y): centred on s_y, no large cancellation
                ce = (1.0 - label_smoothing) * ce + (label_smoothing / n_cols) * (weight_total * nll - spread)
            z = lse_square_scale * lse * lse
            if TOKEN_SCALING:
                p_y = tl.exp2((s_y - lse) * _LOG2E)
                ce = ce * p_y
                z = z * p_y
            ce = tl.where(in_range, ce, float("nan"))
            tl.store(lse_ptr + row, lse)
            tl.store(ce_ptr + row, ce)
            tl.store(z_ptr + row, z)
            if STORE_PRED:
                tl.store(pred_ptr + row, best_col.to(tl.int64))
        else:
            lse = tl.load(lse_ptr + row)
        if GRAD:
            a = tl.load(ce_scale_ptr + row * ce_scale_stride).to(tl.float32)
            b = tl.load(z_scale_ptr + row * z_scale_stride).to(tl.float32)
            # "mean"'s division of the incoming gradient, rounded as PyTorch's (an aten op fewer per backward)
            if DIVIDE_CE:
                a = tl.div_rn(a, tl.load(ce_divisor_ptr).to(tl.float32))
            if DIVIDE_Z:
                b = tl.div_rn(b, tl.load(z_divisor_ptr).to(tl.float32))
            if TOKEN_SCALING:
                p_y = tl.exp2((s_y - lse) * _LOG2E)
                a = a * p_y
                b = b * p_y
            eps = label_smoothing / n_cols
            coef_w = (1.0 - label_smoothing) * w_y
            if SMOOTHING:  # (without: no 0 * W, NaN for an infinite class weight that no kept target has)
                coef_w += eps * weight_total
            coef_p = a * coef_w
            if Z_LOSS:
                coef_p += b * 2.0 * lse_square_scale * lse
            target_term = a * (1.0 - label_smoothing) * w_y
            poison = tl.where(in_range, 0.0, float("nan"))
            for block in range(N_BLOCKS):
                start = block * BLOCK
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                s = _capped(x, softcap, SOFTCAP)
                g = coef_p * tl.exp2((s - lse) * _LOG2E)
                if SMOOTHING:
                    if HAS_CE_WEIGHT:
                        w = tl.load(ce_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                        g -= a * eps * w
                    else:
                        g -= a * eps
                g = tl.where(cols == y_safe, g - target_term, g)
                if SOFTCAP:
                    t = s / softcap
                    g = g * (1.0 - t * t)
                tl.store(grad_row_ptr + cols, (g + poison).to(grad_ptr.dtype.element_ty), mask=mask)


def _row_stride(scale: torch.Tensor) -> int:
    return scale.stride(0) if scale.numel() > 1 else 0  # one element: the same scale for every row


def _blocks(n_cols: int) -> dict:
    # The trip count is a constexpr (one compilation per vocabulary size): Triton's interpreter cannot loop
    # over a runtime bound.
    block = min(MAX_BLOCK, _backend.next_power_of_2(max(n_cols, 1)))
    return {"BLOCK": block, "N_BLOCKS": -(-n_cols // block)}


def _rows_triton(logits, target, ce_weight, weight_total, opts: Options, stats=None, grad=None, lse=None, scales=None):
    """``_ce_rows_kernel`` over the rows of ``logits``: ``stats`` = (lse, ce, z, pred or None) to write them,
    ``grad`` (may be ``logits``) with ``scales`` = (ce_scale, z_scale), or (ce_scale, z_scale, ce_divisor,
    z_divisor) with 0-d divisors of the scales (None: undivided), to write the gradient, from ``lse`` when
    ``stats`` is None. Absent tensors are stood in for by others (``lse``), never dereferenced."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if stats is None:
        ce = z = pred = lse
    else:
        lse, ce, z, pred = stats
    logits_stride, writes_grad = logits.stride(0), grad is not None
    ce_divisor = z_divisor = None
    if not writes_grad:
        grad, grad_stride, ce_scale, ce_stride, z_scale, z_stride = logits, 0, lse, 0, lse, 0
    else:
        grad_stride = logits_stride if grad is logits else grad.stride(0)
        ce_scale, z_scale, *divisors = scales
        if divisors:
            ce_divisor, z_divisor = divisors
        ce_stride, z_stride = _row_stride(ce_scale), _row_stride(z_scale)
    ints = (logits_stride, grad_stride, ce_stride, z_stride, n_cols, opts.ignore_index)
    flags = (
        ce_weight is not None,
        opts.softcap is not None,
        opts.label_smoothing > 0,
        opts.use_token_scaling,
        opts.lse_square_scale != 0.0,
        stats is not None and pred is not None,
        stats is not None,
        writes_grad,
        ce_divisor is not None,
        z_divisor is not None,
    )
    key = (n_rows, *ints, *flags)
    plan = _ROWS_PLANS.get(key) or _ROWS_PLANS.add(
        key, (n_rows,), ints, **dict(zip(_ROWS_FLAGS, flags)), **_blocks(n_cols), num_warps=NUM_WARPS
    )
    launch_prepared(
        _ce_rows_kernel,
        (logits, grad, target, lse if ce_weight is None else ce_weight, lse if weight_total is None else weight_total,
         lse, ce, z, lse if pred is None else pred, ce_scale, z_scale, lse if ce_divisor is None else ce_divisor,
         lse if z_divisor is None else z_divisor),
        plan,
        (opts.lse_square_scale, opts.label_smoothing, opts.softcap or 1.0),
    )  # fmt: skip


# Launch plans per layout and options (NOTES.md §34): keyed argument by argument at each launch, the rows kernel's
# 22 arguments cost the host three times what the gated kernel's launch does.
_ROWS_PLANS, _SUMS_PLANS, _DIVISORS_PLANS = Plans(), Plans(), Plans()
_ROWS_FLAGS = (
    "HAS_CE_WEIGHT",
    "SOFTCAP",
    "SMOOTHING",
    "TOKEN_SCALING",
    "Z_LOSS",
    "STORE_PRED",
    "STATS",
    "GRAD",
    "DIVIDE_CE",
    "DIVIDE_Z",
)


# The reductions on the Triton path, each one program looping over the rows (the same sums on every run: no
# atomics). "mean"'s divisors and the rows' sums are a few floats per token, but as PyTorch ops they cost the
# host five to nine dispatched ops per call, more than the kernels' launches on a small batch
# (benchmarks/NOTES.md §23).
REDUCE_BLOCK = 1024


@jit
def _compensated_add(total, carry, plain, x):
    """One step of Kahan's summation per lane: ``total - carry`` tracks the exact sum to fp32 rounding whatever
    the row count (a plain per-lane sum of millions of rows drifts by tens of ulps); ``plain`` is the plain sum,
    whose inf or NaN is the answer where the inputs hold one (the compensation turns inf into NaN)."""
    y = x - carry
    t = total + y
    carry = (t - total) - y
    return t, carry, plain + x


@jit
def _zero_lanes(BLOCK: constexpr):
    """A compensated sum's (total, carry, plain) lanes, zero."""
    zeros = tl.zeros((BLOCK,), tl.float32)
    return zeros, zeros, zeros


@jit
def _lanes_sum(total, carry, plain):
    plain = tl.sum(plain, axis=0)
    compensated = tl.sum(total - carry, axis=0)  # (inf - inf where a lane's total overflowed and the plain did not)
    return tl.where((plain - plain == 0) & (compensated - compensated == 0), compensated, plain)


@jit
def _divisors_step(
    target_ptr,
    ce_weight_ptr,
    rows,
    n_rows,
    n_classes,
    ignore_index,
    count,
    total,
    carry,
    plain,
    HAS_CE_WEIGHT: constexpr,
):
    """One block of rows of "mean"'s divisors: the kept rows counted per lane, their class weights added."""
    y = tl.load(target_ptr + rows, mask=rows < n_rows, other=ignore_index).to(tl.int64)
    kept = y != ignore_index
    count += kept.to(tl.int64)
    if HAS_CE_WEIGHT:
        # a kept target out of range counts class 0's weight, as the PyTorch path does (its loss is NaN)
        y_safe = tl.where(kept & (y >= 0) & (y < n_classes), y, 0)
        w = tl.load(ce_weight_ptr + y_safe, mask=kept, other=0.0).to(tl.float32)
        total, carry, plain = _compensated_add(total, carry, plain, w)
    return count, total, carry, plain


@jit
def _divisors_kernel(
    target_ptr,
    ce_weight_ptr,
    weights_ptr,
    count_ptr,
    inv_weights_ptr,
    inv_count_ptr,
    n_rows,
    n_classes,
    ignore_index,
    HAS_CE_WEIGHT: constexpr,
    BLOCK: constexpr,
):
    count = tl.zeros((BLOCK,), tl.int64)
    total, carry, plain = _zero_lanes(BLOCK)
    for start in range(0, n_rows, BLOCK):
        count, total, carry, plain = _divisors_step(
            target_ptr, ce_weight_ptr, start + tl.arange(0, BLOCK), n_rows, n_classes, ignore_index, count, total,
            carry, plain, HAS_CE_WEIGHT,
        )  # fmt: skip
    c = tl.sum(count, axis=0).to(tl.float32)  # an exact count, rounded once
    tl.store(count_ptr, c)
    tl.store(inv_count_ptr, tl.div_rn(1.0, c))  # (PyTorch's division rounds correctly; "/" need not)
    if HAS_CE_WEIGHT:
        w = _lanes_sum(total, carry, plain)
        tl.store(weights_ptr, w)
        tl.store(inv_weights_ptr, tl.div_rn(1.0, w))


@jit
def _sums_kernel(
    ce_ptr,
    z_ptr,
    weights_ptr,
    count_ptr,
    ce_part_ptr,
    z_loss_ptr,
    loss_ptr,
    target_ptr,
    ce_weight_ptr,
    n_rows,
    n_classes,
    ignore_index,
    MEAN: constexpr,
    DIVISORS: constexpr,
    HAS_CE_WEIGHT: constexpr,
    PARTS: constexpr,
    BLOCK: constexpr,
):
    """The rows' sums, divided for "mean" by the divisors at ``weights_ptr`` and ``count_ptr``; with ``DIVISORS``
    those are found here first, in the divisors kernel's lanes and order (the same values bit for bit), and
    written there: one launch where the eager loss's forward took two. The loss is stored, and with ``PARTS``
    its two parts too."""
    ce_total, ce_carry, ce_plain = _zero_lanes(BLOCK)
    z_total, z_carry, z_plain = _zero_lanes(BLOCK)
    count = tl.zeros((BLOCK,), tl.int64)
    w_total, w_carry, w_plain = _zero_lanes(BLOCK)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        mask = rows < n_rows
        ce = tl.load(ce_ptr + rows, mask=mask, other=0.0)
        z = tl.load(z_ptr + rows, mask=mask, other=0.0)
        ce_total, ce_carry, ce_plain = _compensated_add(ce_total, ce_carry, ce_plain, ce)
        z_total, z_carry, z_plain = _compensated_add(z_total, z_carry, z_plain, z)
        if DIVISORS:
            count, w_total, w_carry, w_plain = _divisors_step(
                target_ptr, ce_weight_ptr, rows, n_rows, n_classes, ignore_index, count, w_total, w_carry, w_plain,
                HAS_CE_WEIGHT,
            )  # fmt: skip
    ce_part = _lanes_sum(ce_total, ce_carry, ce_plain)
    z_loss = _lanes_sum(z_total, z_carry, z_plain)
    if MEAN:  # divided after summing, as PyTorch's mean
        if DIVISORS:
            c = tl.sum(count, axis=0).to(tl.float32)
            tl.store(count_ptr, c)
            if HAS_CE_WEIGHT:
                w = _lanes_sum(w_total, w_carry, w_plain)
                tl.store(weights_ptr, w)
            else:
                w = c
        else:
            w = tl.load(weights_ptr)
            c = tl.load(count_ptr)
        ce_part = tl.div_rn(ce_part, w)
        z_loss = tl.div_rn(z_loss, c)
    if PARTS:
        tl.store(ce_part_ptr, ce_part)
        tl.store(z_loss_ptr, z_loss)
    tl.store(loss_ptr, ce_part + z_loss)


_SUMS_FLAGS = ("MEAN", "DIVISORS", "HAS_CE_WEIGHT", "PARTS")


def reduces_on_device(rows: torch.Tensor) -> bool:
    """Whether the reductions of these loss rows run as the kernels above: rows of the eager Functions' forward,
    on the Triton path. Rows that a graph records keep PyTorch's ops: autograd's (rows requiring grad), a
    compiled or exported program's or torch.jit.trace's (a launch is no op of theirs), torch.func's and forward
    AD's (wrapped or dual rows)."""
    return (
        rows.dtype in _backend.TRITON_DTYPES
        and rows.numel() > 0  # (no launch on empty tensors: PyTorch's ops give the 0 and the NaN)
        and not rows.requires_grad
        and not torch.compiler.is_compiling()
        and not _backend.exporting()
        and not _backend.forward_ad_active()
        and use_triton(rows)
        and not torch._C._functorch.is_functorch_wrapped_tensor(rows)
    )


def _divisors_triton(target, ce_weight, opts: Options, rows):
    new, like = _backend.new_tensor, {"dtype": rows.dtype, "device": rows.device}
    count, inv_count = new((), **like), new((), **like)
    if ce_weight is None:
        weights, inv_weights = count, inv_count
    else:
        weights, inv_weights = new((), **like), new((), **like)
    ints = (target.numel(), 0 if ce_weight is None else ce_weight.shape[0], opts.ignore_index)
    key = (*ints, ce_weight is not None)
    plan = _DIVISORS_PLANS.get(key) or _DIVISORS_PLANS.add(
        key, (1,), ints, HAS_CE_WEIGHT=ce_weight is not None, BLOCK=REDUCE_BLOCK, num_warps=4
    )
    tensors = (target, rows if ce_weight is None else ce_weight, weights, count, inv_weights, inv_count)
    launch_prepared(_divisors_kernel, tensors, plan)
    return weights, count, inv_weights, inv_count


def _sums_triton(ce, z, divisors, target=None, ce_weight=None, opts: Options | None = None, parts=True):
    """(ce_part, z_loss, loss): the rows' sums, divided by ``divisors`` (``denominators``' first two, or () for
    "sum"). ``divisors`` None: "mean" with the divisors found in the same launch from ``target``, ``ce_weight``
    and ``opts``, and returned after the sums, as ``denominators``' first two. ``parts`` False: the loss alone,
    the parts None."""
    new, like = _backend.new_tensor, {"dtype": ce.dtype, "device": ce.device}
    loss = new((), **like)
    ce_part, z_loss = (new((), **like), new((), **like)) if parts else (None, None)
    found = divisors is None
    # What the kernel reads only with DIVISORS and HAS_CE_WEIGHT (stood in for by ce where it does not), and
    # where it writes the divisors it finds
    target_arg, weights_arg, n_classes, ignore_index = ce, ce, 0, 0
    if found:
        target_arg, ignore_index = target, opts.ignore_index
        count = new((), **like)
        divisors = (count, count)
        if ce_weight is not None:
            weights_arg, n_classes = ce_weight, ce_weight.shape[0]
            divisors = (new((), **like), count)
    weights, count = divisors[:2] if divisors else (ce, ce)
    ints, flags = (ce.numel(), n_classes, ignore_index), (bool(divisors), found, found and ce_weight is not None, parts)
    key = (*ints, *flags)
    plan = _SUMS_PLANS.get(key) or _SUMS_PLANS.add(
        key, (1,), ints, **dict(zip(_SUMS_FLAGS, flags)), BLOCK=REDUCE_BLOCK, num_warps=4
    )
    tensors = (ce, z, weights, count, loss if ce_part is None else ce_part, loss if z_loss is None else z_loss, loss)
    launch_prepared(_sums_kernel, (*tensors, target_arg, weights_arg), plan)
    return (ce_part, z_loss, loss, divisors) if found else (ce_part, z_loss, loss)


# ----------------------------------------------------------------------------------------------------------
# PyTorch path: the same math in fp32 (fp64 for fp64 logits). ``rows_torch`` is differentiable, so the
# composite (torch.func, torch.export) is the same code; the gradient functions work in place on V-wide
# tensors (a chunk of a fused call may be a few hundred MiB on the CPU).


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """promote_types(dtype, fp32), without dispatching an op for the dtypes the losses take (every call asks)."""
    if dtype in _COMPUTE_DTYPES:
        return _COMPUTE_DTYPES[dtype]
    return torch.promote_types(dtype, torch.float32)


_COMPUTE_DTYPES = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def _row_targets(target, n_cols: int, ignore_index: int):
    kept = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    return kept, in_range, torch.where(kept & in_range, target, 0)


def _softcap_torch(x, opts: Options):
    """(s, t): the softcapped logits and tanh(x / softcap) (None without softcap)."""
    if opts.softcap is None:
        return x, None
    t = torch.tanh(x / opts.softcap)
    return t * opts.softcap, t


def rows_torch(logits, target, ce_weight, opts: Options, want_pred: bool):
    """(lse, ce, z, pred) per row of 2-D ``logits``, as the stats kernel computes them."""
    n_cols = logits.shape[-1]
    x = logits.to(compute_dtype(logits.dtype))
    s, _ = _softcap_torch(x, opts)
    lse = torch.logsumexp(s, dim=-1)
    kept, in_range, y = _row_targets(target, n_cols, opts.ignore_index)
    s_y = s.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    w = ce_weight.to(x.dtype) if ce_weight is not None else None
    ce, z = _row_losses(_centered_sums(s, s_y, w, opts), s_y, lse, y, w, n_cols, opts)
    ce = torch.where(kept, torch.where(in_range, ce, float("nan")), 0.0)
    z = torch.where(kept, z, 0.0)
    pred = torch.where(kept, x.argmax(-1), -1) if want_pred else None
    return lse, ce, z, pred


def _centered_sums(s, s_y, w, opts: Options):
    """sum_j w_j (s_j - s_y) per row, for the smoothing term (None without smoothing)."""
    if opts.label_smoothing == 0:
        return None
    centered = s - s_y.unsqueeze(-1)
    return (centered * w).sum(-1) if w is not None else centered.sum(-1)


def _row_losses(centered_sums, s_y, lse, y, w, n_cols: int, opts: Options):
    nll = lse - s_y
    ce = nll * w[y] if w is not None else nll
    if centered_sums is not None:  # sum_j w_j (lse - s_j) = W (lse - s_y) - sum_j w_j (s_j - s_y), as the kernel
        weight_total = w.sum() if w is not None else n_cols
        spread = weight_total * nll - centered_sums
        ce = (1.0 - opts.label_smoothing) * ce + (opts.label_smoothing / n_cols) * spread
    z = opts.lse_square_scale * lse * lse
    if opts.use_token_scaling:
        p_y = torch.exp(s_y - lse).detach()
        ce, z = ce * p_y, z * p_y
    return ce, z


def _grad_coefficients(s_y, lse, y, kept, in_range, w, n_cols, ce_scale, z_scale, opts: Options):
    """Per row: (coefficient of p_j, of w_j, at j = y) of the gradient, zero for ignored rows, nan for
    out-of-range targets."""
    a, b = ce_scale.to(lse.dtype).expand(lse.shape), z_scale.to(lse.dtype).expand(lse.shape)
    if opts.use_token_scaling:
        p_y = torch.exp(s_y - lse)
        a, b = a * p_y, b * p_y
    # where, not a product: an all-ignored "mean" has an infinite scale, and its rows must still give 0
    a = torch.where(kept, torch.where(in_range, a, float("nan")), 0.0)
    b = torch.where(kept, torch.where(in_range, b, float("nan")), 0.0)
    # an ignored row's stand-in class may weigh inf: its weight must not reach a product with its zero scale
    w_y = torch.where(kept, w[y], 0.0) if w is not None else torch.ones_like(lse)
    eps = opts.label_smoothing / n_cols
    coef_w = (1.0 - opts.label_smoothing) * w_y
    if opts.label_smoothing > 0:  # as the kernel: no 0 * W
        coef_w = coef_w + eps * (w.sum() if w is not None else float(n_cols))
    coef_p = a * coef_w + b * 2.0 * opts.lse_square_scale * lse
    return coef_p, a * eps, a * (1.0 - opts.label_smoothing) * w_y


def _finish_grad(g, y, t, w, smooth, target_term, opts: Options):
    """g holds coef_p * p: subtract the smoothing and target terms, apply the softcap's derivative."""
    if opts.label_smoothing > 0:
        g.sub_(smooth.unsqueeze(-1) * (w if w is not None else 1.0))
    g.scatter_add_(-1, y.unsqueeze(-1), -target_term.unsqueeze(-1))
    if t is not None:
        g.mul_(1.0 - t * t)
    return g


def grad_torch(logits, target, ce_weight, lse, ce_scale, z_scale, opts: Options, out=None) -> torch.Tensor:
    """The gradient kernel's math: d(a * ce + b * z)/d logits per row, in the compute dtype; in ``out`` when
    it has that dtype (it may be ``logits``)."""
    n_cols = logits.shape[-1]
    x = logits.to(compute_dtype(logits.dtype))
    s, t = _softcap_torch(x, opts)
    kept, in_range, y = _row_targets(target, n_cols, opts.ignore_index)
    s_y = s.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    w = ce_weight.to(x.dtype) if ce_weight is not None else None
    coef_p, smooth, target_term = _grad_coefficients(
        s_y, lse.to(x.dtype), y, kept, in_range, w, n_cols, ce_scale, z_scale, opts
    )
    g = out if out is not None and out.dtype == x.dtype else None
    g = torch.sub(s, lse.to(x.dtype).unsqueeze(-1), out=g).exp_().mul_(coef_p.unsqueeze(-1))
    return _finish_grad(g, y, t, w, smooth, target_term, opts)


def stats_and_grad_torch(logits, target, ce_weight, opts: Options, want_pred, ce_scale, z_scale):
    """(lse, ce, z, pred) of ``rows_torch`` and the gradient of ``grad_torch``, written over ``logits``,
    sharing one exponential sweep: p_j = exp(s_j - m) / d."""
    n_cols = logits.shape[-1]
    x = logits.to(compute_dtype(logits.dtype))
    kept, in_range, y = _row_targets(target, n_cols, opts.ignore_index)
    pred = torch.where(kept, x.argmax(-1), -1) if want_pred else None
    s, t = _softcap_torch(x, opts)
    s_y = s.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    w = ce_weight.to(x.dtype) if ce_weight is not None else None
    m = s.amax(-1, keepdim=True)
    centered_sums = _centered_sums(s, s_y, w, opts)
    e = torch.sub(s, m, out=s).exp_()  # s: the logits themselves (fp32/fp64) or a temporary
    d = e.sum(-1)
    lse = m.squeeze(-1) + d.log()
    ce, z = _row_losses(centered_sums, s_y, lse, y, w, n_cols, opts)
    ce = torch.where(kept, torch.where(in_range, ce, float("nan")), 0.0)
    z = torch.where(kept, z, 0.0)
    coef_p, smooth, target_term = _grad_coefficients(s_y, lse, y, kept, in_range, w, n_cols, ce_scale, z_scale, opts)
    g = _finish_grad(e.mul_((coef_p / d).unsqueeze(-1)), y, t, w, smooth, target_term, opts)
    if g.data_ptr() != logits.data_ptr():
        logits.copy_(g)
    return lse, ce, z, pred


# ----------------------------------------------------------------------------------------------------------
# Dispatch for validated 2-D logits and 1-D targets.


def row_stats(logits, target, ce_weight, weight_total, opts: Options, want_pred: bool, out=None):
    """(lse, ce, z, pred) per row, written into ``out`` (four row tensors, pred may be None) when given."""
    n_rows = logits.shape[0]
    loss_dtype = compute_dtype(logits.dtype)
    if out is None:
        new = _backend.new_tensor
        out = (
            new((n_rows,), dtype=loss_dtype, device=logits.device),
            new((n_rows,), dtype=loss_dtype, device=logits.device),
            new((n_rows,), dtype=loss_dtype, device=logits.device),
            new((n_rows,), dtype=torch.int64, device=logits.device) if want_pred else None,
        )
    if use_triton(logits):
        _rows_triton(logits, target, ce_weight, weight_total, opts, stats=out)
    else:
        for dst, src in zip(out, rows_torch(logits, target, ce_weight, opts, want_pred)):
            if dst is not None:
                dst.copy_(src)
    return out


def row_grad(
    logits, target, ce_weight, weight_total, lse, ce_scale, z_scale, opts: Options, grad=None, divisors=(None, None)
):
    """The gradient of ``ce_scale * ce + z_scale * z`` with respect to ``logits``, written into ``grad``
    (``logits`` itself is allowed) or a new tensor of the logits' dtype. Scales: 1-element or per-row, each
    divided first by its entry of ``divisors`` (0-d tensors, or None) where given."""
    if grad is None:
        grad = _backend.new_tensor(logits.shape, dtype=logits.dtype, device=logits.device)
    if use_triton(logits):
        scales = (ce_scale, z_scale, *divisors)
        _rows_triton(logits, target, ce_weight, weight_total, opts, grad=grad, lse=lse, scales=scales)
    else:
        ce_divisor, z_divisor = divisors
        divided = ce_scale if ce_divisor is None else ce_scale / ce_divisor
        if z_divisor is not None:  # (the loss's gradient alone, over the count twice: one division)
            z_scale = divided if z_scale is ce_scale and z_divisor is ce_divisor else z_scale / z_divisor
        ce_scale = divided
        result = grad_torch(logits, target, ce_weight, lse, ce_scale, z_scale, opts, out=grad)
        if result.data_ptr() != grad.data_ptr():
            grad.copy_(result)
    return grad


def row_stats_and_grad(logits, target, ce_weight, weight_total, opts: Options, want_pred, ce_scale, z_scale, out):
    """``row_stats`` into ``out``, then the gradient written over ``logits``."""
    if use_triton(logits):
        _rows_triton(logits, target, ce_weight, weight_total, opts, stats=out, grad=logits, scales=(ce_scale, z_scale))
    else:
        results = stats_and_grad_torch(logits, target, ce_weight, opts, want_pred, ce_scale, z_scale)
        for dst, src in zip(out, results):
            if dst is not None:
                dst.copy_(src)


def class_weight_total(ce_weight):
    return None if ce_weight is None else ce_weight.sum(dtype=compute_dtype(ce_weight.dtype)).reshape(1)


def denominators(target, ce_weight, opts: Options, rows):
    """The divisors of "mean" for the loss rows ``rows``: (sum of the kept targets' class weights, count of kept
    rows), 0-d device tensors (no synchronization: they stay on the device); without class weights both are the
    same tensor. Where the rows reduce on the device (``reduces_on_device``) one kernel writes them, with their
    reciprocals after them (the gradient's scales, see ``row_scales``)."""
    if reduces_on_device(rows):
        return _divisors_triton(target, ce_weight, opts, rows)
    kept = target != opts.ignore_index
    count = kept.sum().to(rows.dtype)  # an exact count (int64), rounded once
    if ce_weight is None:
        return count, count
    n_classes = ce_weight.shape[0]
    y = torch.where(kept & (target >= 0) & (target < n_classes), target, 0)
    # where, not a product with the mask: an ignored row's stand-in class may weigh inf (inf * 0 is NaN)
    return torch.where(kept, ce_weight.to(rows.dtype)[y], 0.0).sum(), count


def reduce_rows(
    ce, z, pred, target, ce_weight, opts: Options, want_accuracy: bool, rows_shape, divisors=None, want_z_loss=True
):
    """(loss, z_loss, token_accuracy) from the row tensors, reduced as ``opts.reduction`` says; ``divisors``:
    ``denominators``' result where the caller has it already. Without ``want_z_loss`` z_loss may be None."""
    if opts.reduction == "none":
        accuracy = None
        if want_accuracy:
            accuracy = ((pred == target) & (target != opts.ignore_index)).to(torch.float32).view(rows_shape)
        return (ce + z).view(rows_shape), z.view(rows_shape), accuracy
    ce_part, z_loss, accuracy, loss = reduced_parts(
        ce, z, pred, target, ce_weight, opts, want_accuracy, divisors, parts=want_z_loss
    )
    return ce_part + z_loss if loss is None else loss, z_loss, accuracy


def reduced_parts(ce, z, pred, target, ce_weight, opts: Options, want_accuracy: bool, divisors=None, parts=True):
    """ "mean" or "sum": (the cross-entropy's share of the loss, z_loss, token_accuracy, the loss); the loss is
    the first plus the second, None where the caller is to add them (the PyTorch path). Without ``parts`` the
    parts may be None (the device's sums then write the loss alone)."""
    loss = None
    if opts.reduction == "mean" and divisors is None:
        divisors = denominators(target, ce_weight, opts, ce)
    if reduces_on_device(ce):
        ce_part, z_loss, loss = _sums_triton(ce, z, divisors if opts.reduction == "mean" else (), parts=parts)
    elif opts.reduction == "sum":
        z_loss, ce_part = z.sum(), ce.sum()
    else:
        z_loss, ce_part = z.sum() / divisors[1], ce.sum() / divisors[0]
    return ce_part, z_loss, _accuracy(pred, target, opts) if want_accuracy else None, loss


def reduced_with_divisors(ce, z, pred, target, ce_weight, opts: Options, want_accuracy: bool, parts=True):
    """``reduced_parts``, then "mean"'s divisors (weights, count) ((), "sum"); where the rows reduce on the device,
    the divisors are found in the sums' launch, and without ``parts`` only the loss is written (its parts
    None)."""
    if opts.reduction == "mean" and reduces_on_device(ce):
        ce_part, z_loss, loss, divisors = _sums_triton(ce, z, None, target, ce_weight, opts, parts)
        return ce_part, z_loss, _accuracy(pred, target, opts) if want_accuracy else None, loss, divisors
    divisors = denominators(target, ce_weight, opts, ce)[:2] if opts.reduction == "mean" else ()
    return (*reduced_parts(ce, z, pred, target, ce_weight, opts, want_accuracy, divisors=divisors or None), divisors)


def _accuracy(pred, target, opts: Options):
    kept = target != opts.ignore_index
    return ((pred == target) & kept).to(torch.float32).sum() / kept.sum()


def row_scales(target, ce_weight, opts: Options, rows, divisors=None):
    """The (ce_scale, z_scale) the gradient kernel reads for a loss computed with its gradient: 1/denominators
    for "mean" (``divisors`` where the caller has them already; the kernel's carry their reciprocals), ones for
    "sum"; 0-d, the same for every row."""
    if opts.reduction == "mean":
        divisors = denominators(target, ce_weight, opts, rows) if divisors is None else divisors
        if len(divisors) == 4:
            return divisors[2], divisors[3]
        weights, count = divisors
        z_scale = torch.reciprocal(count)
        return z_scale if weights is count else torch.reciprocal(weights), z_scale
    ones = torch.ones((), dtype=rows.dtype, device=target.device)
    return ones, ones


# ----------------------------------------------------------------------------------------------------------
# Cross-entropy on given logits. An autograd node maps logits to the ce and z rows; the reduction is plain
# PyTorch on the rows, so backward receives each row's scale (1/sum of weights for "mean", the incoming
# gradient for "none", ...) and writes the gradient in one pass to a fresh tensor, from the logits and the
# lse saved in forward (N floats). The caller's logits are read, never written.

OP = "cross_entropy"


def _rows_forward(logits, target, ce_weight, opts: Options, want_pred: bool):
    return row_stats(logits, target, ce_weight, class_weight_total(ce_weight), opts, want_pred)


def _rows_backward(d_ce, d_z, logits, target, ce_weight, lse, opts: Options):
    zeros = lse.new_zeros(1)
    d_ce = zeros if d_ce is None else d_ce.to(lse.dtype)
    d_z = zeros if d_z is None else d_z.to(lse.dtype)
    return row_grad(logits, target, ce_weight, class_weight_total(ce_weight), lse, d_ce, d_z, opts)


def refuse_in_backward(*d_outs) -> None:
    """The eager nodes' backward: a clear error for double backward and for batched gradients
    (``autograd.grad(is_grads_batched=True)``, ``jacobian(vectorize=True)``: PyTorch's legacy vmap, whose
    tensors no kernel can read and whose batching the rows' in-place gradient does not support)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{OP}: double backward (create_graph=True) is not supported")
    _backend.refuse_batched_gradients(OP, *d_outs)


class _EagerRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ce_weight, opts, want_pred):
        lse, ce, z, pred = _rows_forward(logits, target, ce_weight, opts, want_pred)
        ctx.save_for_backward(logits, target, ce_weight, lse)
        ctx.opts = opts
        if pred is not None:
            ctx.mark_non_differentiable(pred)
        return ce, z, pred

    @staticmethod
    def backward(ctx, d_ce, d_z, d_pred):
        refuse_in_backward(d_ce, d_z)
        logits, target, ce_weight, lse = ctx.saved_tensors
        return _rows_backward(d_ce, d_z, logits, target, ce_weight, lse, ctx.opts), None, None, None, None


class _EagerReduced(torch.autograd.Function):
    """Eager "mean" and "sum" as one node, from the logits to (sum(ce) / W, z_loss = sum(z) / C, accuracy, pred)
    ("sum": W = C = 1); the caller adds the first two into the loss, so that z_loss stays upstream of the loss
    in the graph, as with the reduction in autograd ops. Backward needs only the rows' scales, d ce = d_ce_part
    / W and d z = d_z_loss / C (what autograd would hand the rows through the reduction's own nodes, which
    cost the host about ten aten ops more per backward), and one pass of the gradient kernel.

    ``loss_out``: where the caller does not hand z_loss out (``return_z_loss=False``), nothing can tell whether
    z_loss is upstream of the loss in the graph, so the node's first output is the loss itself (the reduction
    kernel's sum of the two, or their sum here), and the caller's addition, an aten op in forward and a node in
    backward, goes (NOTES.md §32). Backward then hands the loss's gradient to both parts, as that addition's
    node would."""

    @staticmethod
    def forward(ctx, logits, target, ce_weight, opts, want_pred, want_accuracy, loss_out=False):
        lse, ce, z, pred = _rows_forward(logits, target, ce_weight, opts, want_pred)
        ce_part, z_loss, accuracy, loss, divisors = reduced_with_divisors(
            ce, z, pred, target, ce_weight, opts, want_accuracy, parts=not loss_out
        )
        # Without class weights both divisors are the count: saved once.
        ctx.save_for_backward(logits, target, ce_weight, lse, *divisors[ce_weight is None :])
        ctx.opts, ctx.loss_out = opts, loss_out
        if accuracy is not None or pred is not None:
            ctx.mark_non_differentiable(*[t for t in (accuracy, pred) if t is not None])
        ctx.set_materialize_grads(False)
        if loss_out:  # (z_loss not written on the device, and not handed out)
            return (ce_part + z_loss if loss is None else loss), None, accuracy, pred
        return ce_part, z_loss, accuracy, pred

    @staticmethod
    def backward(ctx, d_ce_part, d_z_loss, d_accuracy, d_pred):
        refuse_in_backward(d_ce_part, d_z_loss)
        if ctx.loss_out:  # the first output is the loss, the second never handed out: both parts get the loss's
            d_z_loss = d_ce_part
        logits, target, ce_weight, lse, *divisors = ctx.saved_tensors
        like = d_ce_part if d_ce_part is not None else d_z_loss
        d_ce = torch.zeros_like(like) if d_ce_part is None else d_ce_part
        d_z = torch.zeros_like(like) if d_z_loss is None else d_z_loss
        # "mean" divides d_ce by W and d_z by C (divisors: (W, C), or (C,) where W = C), in the gradient's own
        # launch on the Triton path; an absent gradient's zeros are not divided (0 / 0 would be NaN)
        by = (None, None)
        if divisors:
            by = (divisors[0] if d_ce_part is not None else None, divisors[-1] if d_z_loss is not None else None)
        total = class_weight_total(ce_weight)
        d_logits = row_grad(
            logits, target, ce_weight, total, lse, d_ce.to(lse.dtype), d_z.to(lse.dtype), ctx.opts, divisors=by
        )
        return d_logits, None, None, None, None, None, None


# torch.compile: the same node as a torch.library op with autograd and fake implementations.
NAMESPACE = __name__.split(".")[0]


@torch.library.custom_op(f"{NAMESPACE}::ce_rows", mutates_args=())
def _rows_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    want_pred: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = Options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    lse, ce, z, pred = _rows_forward(logits, target, ce_weight, opts, want_pred)
    return ce, z, pred if pred is not None else target.new_empty((0,), dtype=torch.int64), lse


@_rows_op.register_fake
def _(
    logits,
    target,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    want_pred,
):
    rows, dtype = logits.shape[0], compute_dtype(logits.dtype)
    ce, z, lse = (logits.new_empty((rows,), dtype=dtype) for _ in range(3))
    return ce, z, logits.new_empty((rows if want_pred else 0,), dtype=torch.int64), lse


@torch.library.custom_op(f"{NAMESPACE}::ce_rows_backward", mutates_args=())
def _rows_backward_op(
    d_ce: torch.Tensor,
    d_z: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
) -> torch.Tensor:
    opts = Options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    return _rows_backward(d_ce, d_z, logits, target, ce_weight, lse, opts)


@_rows_backward_op.register_fake
def _(d_ce, d_z, logits, *args):
    return logits.new_empty(logits.shape)


def _rows_setup_context(ctx, inputs, output):
    logits, target, ce_weight, *options = inputs
    ctx.save_for_backward(logits, target, ce_weight, output[3])
    ctx.options = options[:-1]


def _rows_op_backward(ctx, d_ce, d_z, d_pred, d_lse):
    logits, target, ce_weight, lse = ctx.saved_tensors
    zeros = lse.new_zeros(1)
    d_ce = zeros if d_ce is None else d_ce
    d_z = zeros if d_z is None else d_z
    d_logits = _rows_backward_op(d_ce, d_z, logits, target, ce_weight, lse, *ctx.options)
    return (d_logits,) + (None,) * 9


torch.library.register_autograd(_rows_op, _rows_op_backward, setup_context=_rows_setup_context)


EAGER, COMPILED, COMPOSITE = "eager", "compiled", "composite"


def _route(logits) -> str:
    """How the rows of ``logits`` are computed: the eager Functions, the torch.library op (torch.compile), or
    the differentiable PyTorch formulas (export, torch.jit.trace, torch.func, forward AD)."""
    if torch.compiler.is_compiling():
        return COMPOSITE if _backend.exporting() or _backend.forward_ad_active() else COMPILED
    # (torch.func's transforms on plain logits too: PyTorch's apply refuses the eager Functions under them)
    if _backend.exporting() or is_functorch(logits) or _are_transforms_active() or _backend.forward_ad_active():
        return COMPOSITE
    return EAGER


def apply_rows(logits, target, ce_weight, opts: Options, want_pred: bool, route=None):
    """(ce, z, pred) rows of validated 2-D logits, differentiable through ce and z."""
    route = route or _route(logits)
    if route == COMPILED:
        ce, z, pred, _ = _rows_op(logits, target, ce_weight, *opts, want_pred)
        return ce, z, pred if want_pred else None
    if route == COMPOSITE:
        _, ce, z, pred = rows_torch(logits, target, ce_weight, opts, want_pred)
        return ce, z, pred
    return _EagerRows.apply(logits, target, ce_weight, opts, want_pred)


def is_functorch(*tensors) -> bool:
    """torch.func's wrapped tensors: the PyTorch formulas run on them (grad, jacrev). vmap cannot batch the
    per-row masking by target, so it gets a clear error instead of one from inside functorch. (A compiled graph
    handles transforms itself, and the check is opaque to the compiler.)"""
    if torch.compiler.is_compiling():
        return False
    if not any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters()):
        raise NotImplementedError(
            "liger-kernels cross-entropy: torch.func.vmap is not supported (rows are masked by their targets); "
            "loop over the batch, or use torch.func.grad without vmap"
        )
    return True


def cross_entropy(
    logits,
    target,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
    use_token_scaling=False,
):
    """``F.cross_entropy(softcap(logits).float(), target, weight=ce_weight, ...)`` for ``logits`` of shape
    ``(*, V)`` and ``target`` of shape ``(*)``, with the z-loss, token scaling, token accuracy and predicted
    tokens of :func:`~liger_kernels.liger_fused_linear_cross_entropy` and its return convention (the loss, or a
    ``CrossEntropyOutput`` when any ``return_*`` is set). Backward writes the logits' gradient, in their dtype,
    to a new tensor."""
    if (
        # The common case in one expression: plain 2-D logits whose classes are contiguous, 1-D int64 targets, no
        # class weights, the loss alone, reduced, in eager mode (not compiled, exported, traced, transformed or
        # under forward AD): what the checks and the route below accept and where they send it, without their
        # calls (the host's time per call, NOTES.md §33). The tracers' questions first: torch.jit.trace would warn
        # on the shape comparisons.
        not torch.compiler.is_compiling()
        and not _backend.exporting()
        and type(logits) is _Tensor
        and type(target) is _Tensor
        and ce_weight is None
        and return_z_loss is False
        and return_token_accuracy is False
        and return_predicted_tokens is False
        and type(reduction) is str
        and (reduction == "mean" or reduction == "sum")
        and logits.dtype in _FLOAT_DTYPES
        and target.dtype is _INT64
        and logits.dim() == 2
        and target.dim() == 1
        and logits.shape[0] == target.shape[0]
        and logits.shape[1]
        and logits.stride(1) == 1
        and target.is_contiguous()
        and target.device == logits.device
        and not _backend.forward_ad_active()
        and not _are_transforms_active()
        and not _is_wrapped(logits)  # (dead wrappers too, which the route sends to the composite)
        and not _is_wrapped(target)
    ):
        opts = check_options(OP, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
        if target.is_cpu:
            _check_target_values(target, logits.shape[1], opts.ignore_index, OP)
        return _eager_reduced(logits, target, None, opts, False, False, True)[0]
    check_tensor(logits, "logits", OP)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{OP}: `logits` must have shape (*, V) with V >= 1, got {tuple(logits.shape)}")
    opts = check_options(OP, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    n_classes = logits.shape[-1]
    check_target(target, logits.shape[:-1], n_classes, opts.ignore_index, OP)
    if target.device != logits.device:
        raise ValueError(f"{OP}: `target` must be on {logits.device}, got {target.device}")
    ce_weight = check_class_weight(ce_weight, n_classes, logits.device, OP)
    flags = [
        check_flag(v, a, OP)
        for a, v in (
            ("return_z_loss", return_z_loss),
            ("return_token_accuracy", return_token_accuracy),
            ("return_predicted_tokens", return_predicted_tokens),
        )
    ]
    rows = logits if logits.dim() == 2 else logits.reshape(-1, n_classes)  # (each reshape is a dispatched op)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    flat_target = (target if target.dim() == 1 else target.reshape(-1)).to(torch.int64).contiguous()
    route = _route(rows)
    if route == EAGER and opts.reduction != "none":
        first, z_loss, accuracy, pred = _EagerReduced.apply(
            rows, flat_target, ce_weight, opts, flags[1] or flags[2], flags[1], not flags[0]
        )
        loss = first if not flags[0] else first + z_loss
    else:
        ce, z, pred = apply_rows(rows, flat_target, ce_weight, opts, flags[1] or flags[2], route)
        loss, z_loss, accuracy = reduce_rows(ce, z, pred, flat_target, ce_weight, opts, flags[1], target.shape)
    return package(loss, z_loss, accuracy, pred, flags, target.shape)


_Tensor = torch.Tensor
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT64 = torch.int64
_are_transforms_active = torch._C._are_functorch_transforms_active
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_eager_reduced = _backend.c_apply(_EagerReduced)


@dataclass
class CrossEntropyOutput:
    """The loss with the extras asked for (``None`` where not asked)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def package(loss, z_loss, accuracy, pred, flags, rows_shape):
    """The published return convention: the loss alone, or a CrossEntropyOutput when any extra is asked."""
    return_z_loss, return_token_accuracy, return_predicted_tokens = flags
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(
        loss,
        z_loss if return_z_loss else None,
        accuracy if return_token_accuracy else None,
        pred.view(rows_shape) if return_predicted_tokens else None,
    )
