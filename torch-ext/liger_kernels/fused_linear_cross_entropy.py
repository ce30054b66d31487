"""Fused linear cross-entropy: ``cross_entropy(softcap(input @ weight.T + bias), target)`` without ever holding
the N x V logits.

The tokens are processed in chunks of rows. For each chunk: one GEMM writes its logits into a buffer this
function owns, the cross-entropy kernels (cross_entropy.py: Triton on GPUs, PyTorch on CPU, MPS and fp64)
compute the loss rows and then write the logits' gradient over the logits, and GEMMs turn that gradient into
the chunk's rows of the input gradient and add its share of the weight (and bias) gradient to an accumulator
in fp32 (or ``accum_dtype``). Peak memory beyond the inputs: one chunk of logits, the gradients, the
accumulator.

Chunk rows (:func:`chunk_rows`): ``4 H / itemsize`` rounded down to a power of two, so that a chunk's logits
take about ``4 V H`` bytes, the size of the fp32 weight-gradient accumulator the op holds anyway: the logits
never cost more memory than the weight gradient. At least 32 rows (GEMM efficiency), at most 1 GiB of logits,
at most N. On the PyTorch path the itemsize is that of the fp32/fp64 compute dtype, its temporaries' dtype.
(N = 32768, H = 4096, V = 128256 in bf16: 4096 rows, 8 chunks of 1002 MiB; peak beyond the inputs: the fp32
accumulator, one chunk and the input gradient, 3.2 GiB, where the logits alone would take 7.8 GiB.)

Gradients are computed in forward for "mean" and "sum"; backward scales them by the incoming gradient in
place and hands them over, or, where the graph is retained or saved-tensor hooks are active, scales copies
(a later backward then finds them as forward left them). For "none" the incoming
gradient is per row and must weight each row before the rows are summed into the weight gradient, so forward
keeps the row logsumexps and backward recomputes the chunks' logits.

The loss is fp32 (fp64 for fp64 inputs). Under autocast the GEMMs run in the autocast dtype, like
``F.linear`` would (fp64 inputs stay fp64: autocast casts none), and each gradient is returned in its parameter's
dtype (from the fp32 accumulator).

This module is over 300 lines because the chunking, the autograd Function, the torch.library ops and the
PyTorch path of one computation change together.
"""

import contextlib

import torch
import torch.nn.functional as F

from . import _backend, _replay
from . import cross_entropy as _ce
from ._backend import constexpr, jit, tl, use_triton
from ._grad_sums import matmul_into
from ._launch import Plans, launch_prepared
from .cross_entropy import CrossEntropyOutput, Options

__all__ = ["CrossEntropyOutput", "LigerFusedLinearCrossEntropyFunction", "liger_fused_linear_cross_entropy"]

OP = "liger_fused_linear_cross_entropy"
MIN_CHUNK_ROWS = 32
MAX_CHUNK_BYTES = 1 << 30


def chunk_rows(n_rows: int, hidden: int, vocab: int, dtype: torch.dtype, triton: bool) -> int:
    """Rows of logits per chunk (see the module docstring)."""
    itemsize = (dtype if triton else _ce.compute_dtype(dtype)).itemsize
    rows = max(4 * hidden // itemsize, MIN_CHUNK_ROWS)
    rows = max(1, min(rows, MAX_CHUNK_BYTES // max(vocab * itemsize, 1)))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n_rows))


# ----------------------------------------------------------------------------------------------------------
# Validation: every check runs before any launch.


def _validate(
    input,
    weight,
    target,
    bias,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    return_z_loss,
    accum_dtype,
    use_token_scaling,
    return_token_accuracy,
    return_predicted_tokens,
    op=OP,
):
    _ce.check_tensor(input, "input", op)
    _ce.check_tensor(weight, "weight", op)
    if input.dim() == 0:
        raise ValueError(f"{op}: `input` must have shape (*, H), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{op}: `weight` must have shape (V, H) = (V, {input.shape[-1]}) with V >= 1, got {tuple(weight.shape)}"
        )
    if weight.device != input.device:
        raise ValueError(
            f"{op}: `input` and `weight` must be on the same device, got {input.device} and {weight.device}"
        )
    autocast = _replay.autocast_enabled(input.device.type)  # False on devices without autocast (meta)
    if autocast and torch.float64 in (input.dtype, weight.dtype, getattr(bias, "dtype", None)):
        # Autocast casts no float64 tensor: F.linear computes in float64 where every operand is, and fails where one
        # is float64 and another is not; so here (the dtype checks below then run as without autocast)
        autocast = False
    dtype = torch.get_autocast_dtype(input.device.type) if autocast else input.dtype
    if not autocast and weight.dtype != input.dtype:
        raise TypeError(f"{op}: `input` and `weight` must have the same dtype, got {input.dtype} and {weight.dtype}")
    vocab = weight.shape[0]
    if bias is not None:
        _ce.check_tensor(bias, "bias", op)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"{op}: `bias` must have shape ({vocab},), got {tuple(bias.shape)}")
        if bias.device != input.device:
            raise ValueError(f"{op}: `bias` must be on {input.device}, got {bias.device}")
        if not autocast and bias.dtype != input.dtype:
            raise TypeError(f"{op}: `bias` must have the dtype of `input` ({input.dtype}), got {bias.dtype}")
    opts = _ce.check_options(op, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    _ce.check_target(target, input.shape[:-1], vocab, opts.ignore_index, op)
    if target.device != input.device:
        raise ValueError(f"{op}: `target` must be on {input.device}, got {target.device}")
    ce_weight = _ce.check_class_weight(ce_weight, vocab, input.device, op)
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"{op}: `accum_dtype` must be None or a floating torch.dtype, got {accum_dtype!r}")
    flags = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    if not (
        type(return_z_loss) is bool and type(return_token_accuracy) is bool and type(return_predicted_tokens) is bool
    ):
        flags = tuple(
            _ce.check_flag(v, a, op)
            for a, v in (
                ("return_z_loss", return_z_loss),
                ("return_token_accuracy", return_token_accuracy),
                ("return_predicted_tokens", return_predicted_tokens),
            )
        )
    if ce_weight is not None and not ce_weight.is_contiguous():
        ce_weight = ce_weight.contiguous()
    return opts, dtype, ce_weight, flags


# ----------------------------------------------------------------------------------------------------------
# The chunked computation, for validated inputs. ``needs`` = (input, weight, bias) gradients wanted.


def _no_autocast(device_type: str):
    # The accumulating GEMMs must not be recast to the autocast dtype; inputs are cast explicitly instead.
    # Entering torch.autocast costs the host as much as a few aten ops: only where autocast is on.
    if device_type in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _prepare(input, weight, target, bias, dtype):
    # Rows as they are where they already are: each reshape, and each .to() even where it returns the tensor
    # itself, is a dispatched call, host time on small calls.
    x = input if input.dim() == 2 else input.reshape(-1, input.shape[-1])
    t = target if target.dim() == 1 else target.reshape(-1)
    if not (t.dtype == torch.int64 and t.is_contiguous()):
        t = t.to(torch.int64).contiguous()
    return _as(x, dtype), _as(weight, dtype), t, _as(bias, dtype)


def _as(tensor, dtype):
    """``tensor.to(dtype)`` (None stays None), without the call where it would return the tensor itself."""
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


def _rows(start, stop, n_rows, *tensors) -> tuple:
    """Rows start:stop of each tensor (None stays None); the tensors themselves when that is all of them (one
    chunk: small inputs, where each slice's dispatch is a measurable share of the call)."""
    if start == 0 and stop == n_rows:
        return tensors
    return tuple(None if t is None else t[start:stop] for t in tensors)


def _chunks(x, w, b):
    """(start, stop, logits of rows start:stop) in one buffer reused by every chunk."""
    n_rows, vocab = x.shape[0], w.shape[0]
    if n_rows == 0:
        return
    rows = chunk_rows(n_rows, x.shape[1], vocab, x.dtype, use_triton(x))
    buffer = _backend.new_tensor((min(rows, n_rows), vocab), dtype=x.dtype, device=x.device)
    w_t = w.t()
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        logits = buffer if stop - start == buffer.shape[0] else buffer[: stop - start]
        (x_rows,) = _rows(start, stop, n_rows, x)
        if b is None:
            torch.mm(x_rows, w_t, out=logits)
        else:
            torch.addmm(b, x_rows, w_t, out=logits)
        yield start, stop, logits


# Converting the fp32 weight-gradient accumulator to the weight's dtype at the end holds both at once. Where
# the loop's chunk buffer, freed by then, was at least the converted copy's size (Llama-3's head at 4096-row
# chunks: 1002 MiB each), that costs no more than the loop held: the accumulator is then one tensor, converted
# at once, and on CUDA one GEMM per chunk adds into it. Elsewhere it is held in slabs of vocabulary rows, each
# converted and freed in turn and the pieces joined, so that the conversion never holds more than a slab's
# worth beyond the accumulator's own bytes. Where the sums upcast the chunk's gradient (no fp32 sums of
# bf16/fp16 GEMMs: the CPU, ROCm, XPU; or accum_dtype=float64), it is upcast at most SLAB_BYTES of the
# accumulator's rows at a time, never the whole chunk (twice the chunk buffer in fp32).
SLAB_BYTES = 256 << 20


def _one_accumulator(n_rows: int, hidden: int, vocab: int, dtype, triton: bool, weight_dtype) -> bool:
    """Whether the weight-gradient accumulator is one tensor rather than slabs (see above): the chunk buffer
    of ``dtype`` logits for ``n_rows`` rows holds the gradient converted to ``weight_dtype``."""
    if n_rows == 0:
        return False
    chunk = min(chunk_rows(n_rows, hidden, vocab, dtype, triton), n_rows)
    return chunk * vocab * dtype.itemsize >= vocab * hidden * weight_dtype.itemsize


def _accumulators(x, w, weight_dtype, dtype, accum_dtype, needs, device):
    """(grad_x, grad_w, grad_b); grad_w is a list of (first vocab row, accumulator slab) or None: one slab
    where the accumulator is already in the dtype returned (``weight_dtype``, the parameter's own)."""
    n_rows, hidden, vocab = x.shape[0], x.shape[1], w.shape[0]
    acc = accum_dtype or _ce.compute_dtype(dtype)
    grad_x = _backend.new_tensor((n_rows, hidden), dtype=dtype, device=device) if needs[0] else None
    grad_w = None
    if needs[1]:
        rows = vocab
        if acc != weight_dtype and not _one_accumulator(n_rows, hidden, vocab, dtype, use_triton(x), weight_dtype):
            rows = _slab_rows(hidden, acc)
        # unwritten: the first chunk's GEMMs write every element (zeros only where no chunk runs)
        new = _backend.new_tensor if n_rows else torch.zeros
        grad_w = [(start, new((min(rows, vocab - start), hidden), dtype=acc, device=device))
                  for start in range(0, vocab, rows)]  # fmt: skip
    grad_b = torch.zeros((vocab,), dtype=acc, device=device) if needs[2] else None
    return grad_x, grad_w, grad_b


def _slab_rows(hidden: int, acc) -> int:
    """Vocabulary rows of SLAB_BYTES of an ``acc`` accumulator; a multiple of 8 from 8 rows on, so that a slab
    starts 16-byte aligned in a bf16 chunk, for cuBLAS."""
    rows = max(1, SLAB_BYTES // max(hidden * acc.itemsize, 1))
    return rows - (rows % 8 if rows >= 8 else 0)


def _cublas_sums_in_fp32(acc_dtype: torch.dtype, device_type: str, operand_dtype: torch.dtype) -> bool:
    # bf16/fp16 operands, fp32 accumulator: cuBLAS adds the product in fp32, no V x H temporary (PyTorch's
    # out_dtype takes no other operands)
    return (
        operand_dtype in (torch.bfloat16, torch.float16)
        and acc_dtype == torch.float32
        and device_type == "cuda"
        and (torch.version.cuda is not None)
    )


def _accumulate(grad_logits, x_rows, w, grad_x_rows, grad_w, grad_b, first):
    """The chunk's rows of the input gradient, and its share of the weight and bias gradients added to the
    accumulators; ``first``: the first chunk, whose GEMMs write the weight's slabs instead of adding."""
    if grad_x_rows is not None:
        torch.mm(grad_logits, w, out=grad_x_rows)
    if grad_w is not None:
        acc_dtype = grad_w[0][1].dtype
        cublas = _cublas_sums_in_fp32(acc_dtype, grad_logits.device.type, grad_logits.dtype)
        upcast = grad_logits.dtype != acc_dtype and not cublas
        x_acc = x_rows.to(acc_dtype) if upcast else x_rows  # once per chunk, not per slab
        for start, slab in grad_w:
            rows = slab.shape[0]
            part = (grad_logits if rows == grad_logits.shape[1] else grad_logits[:, start : start + rows]).t()
            if cublas:  # the GEMM sums in fp32 into the slab (and writes it, for the first chunk)
                matmul_into(slab, part, x_acc, first=first)
                continue
            # same dtype, or the chunk's gradient upcast a slab's worth of rows at a time, never the whole chunk
            step = _slab_rows(x_acc.shape[1], acc_dtype) if upcast else rows
            for r0 in range(0, rows, step):
                rows_of, piece = (slab, part) if step >= rows else (slab[r0 : r0 + step], part[r0 : r0 + step])
                piece = piece.to(acc_dtype) if upcast else piece
                if first:
                    torch.mm(piece, x_acc, out=rows_of)
                else:
                    rows_of.addmm_(piece, x_acc)
    if grad_b is not None:
        grad_b += grad_logits.sum(0, dtype=grad_b.dtype)


def _returned(grad, like):
    if grad is None:
        return None
    grad = _as(grad, like.dtype)
    return grad if grad.shape == like.shape else grad.view(like.shape)


def _returned_weight(grad_w, weight):
    """The slabs joined in the weight's dtype; each slab is freed as soon as it is converted."""
    if grad_w is None:
        return None
    if len(grad_w) == 1:
        return _returned(grad_w.pop()[1], weight)
    pieces = []
    while grad_w:
        pieces.append(grad_w.pop(0)[1].to(weight.dtype))
    return torch.cat(pieces).view(weight.shape)


def forward_core(
    input,
    weight,
    target,
    bias,
    ce_weight,
    opts: Options,
    dtype,
    accum_dtype,
    want_pred,
    want_accuracy,
    needs,
    want_z_loss=True,
):
    """(loss, z_loss, token_accuracy, pred, lse, grad_input, grad_weight, grad_bias); the gradients are those of
    the loss (for an incoming gradient of 1) when reduction is "mean" or "sum" and ``needs`` asks, else None.
    Without ``want_z_loss`` z_loss may be None."""
    x, w, t, b = _prepare(input, weight, target, bias, dtype)
    n_rows, device = x.shape[0], x.device
    loss_dtype = _ce.compute_dtype(dtype)
    new = _backend.new_tensor
    lse, ce, z = (new((n_rows,), dtype=loss_dtype, device=device) for _ in range(3))
    pred = new((n_rows,), dtype=torch.int64, device=device) if want_pred or want_accuracy else None
    grads_now = opts.reduction != "none" and any(needs)
    grad_x, grad_w, grad_b = _accumulators(
        x, w, weight.dtype, dtype, accum_dtype, needs if grads_now else (False,) * 3, device
    )
    divisors = _ce.denominators(t, ce_weight, opts, ce) if opts.reduction == "mean" else None
    scales = _ce.row_scales(t, ce_weight, opts, ce, divisors=divisors) if grads_now else None
    weight_total = _ce.class_weight_total(ce_weight)
    for start, stop, logits in _chunks(x, w, b):
        rows = _rows(start, stop, n_rows, t, lse, ce, z, pred, x, grad_x)
        rows_t, out, x_rows, grad_x_rows = rows[0], rows[1:5], rows[5], rows[6]
        if not grads_now:
            _ce.row_stats(logits, rows_t, ce_weight, weight_total, opts, pred is not None, out=out)
        else:
            _ce.row_stats_and_grad(logits, rows_t, ce_weight, weight_total, opts, pred is not None, *scales, out=out)
            _accumulate(logits, x_rows, w, grad_x_rows, grad_w, grad_b, start == 0)
        del logits  # the chunk buffer goes before the gradients are converted
    loss, z_loss, accuracy = _ce.reduce_rows(
        ce, z, pred, t, ce_weight, opts, want_accuracy, target.shape, divisors=divisors, want_z_loss=want_z_loss
    )
    return (
        loss,
        z_loss,
        accuracy,
        pred,
        lse,
        _returned(grad_x, input),
        _returned_weight(grad_w, weight),
        _returned(grad_b, bias),
    )


def backward_rows_core(d_loss, input, weight, target, bias, ce_weight, lse, opts: Options, dtype, accum_dtype, needs):
    """reduction="none": the gradients for per-row incoming gradients ``d_loss``, the chunks recomputed."""
    x, w, t, b = _prepare(input, weight, target, bias, dtype)
    d_rows = d_loss.reshape(-1).to(lse.dtype).contiguous()
    grad_x, grad_w, grad_b = _accumulators(x, w, weight.dtype, dtype, accum_dtype, needs, x.device)
    weight_total = _ce.class_weight_total(ce_weight)
    for start, stop, logits in _chunks(x, w, b):
        d = d_rows[start:stop]
        _ce.row_grad(logits, t[start:stop], ce_weight, weight_total, lse[start:stop], d, d, opts, grad=logits)
        grad_x_rows = None if grad_x is None else grad_x[start:stop]
        _accumulate(logits, x[start:stop], w, grad_x_rows, grad_w, grad_b, start == 0)
        del logits
    return _returned(grad_x, input), _returned_weight(grad_w, weight), _returned(grad_b, bias)


def composite(input, weight, target, bias, ce_weight, opts: Options, want_pred, want_accuracy):
    """Plain differentiable PyTorch with the full logits: for torch.func transforms and torch.export."""
    logits = F.linear(input, weight, bias).reshape(-1, weight.shape[0])
    t = target.reshape(-1).to(torch.int64)
    _, ce, z, pred = _ce.rows_torch(logits, t, ce_weight, opts, want_pred or want_accuracy)
    loss, z_loss, accuracy = _ce.reduce_rows(ce, z, pred, t, ce_weight, opts, want_accuracy, target.shape)
    return loss, z_loss.detach(), accuracy, pred


# ----------------------------------------------------------------------------------------------------------
# Autograd. Eager calls use an autograd.Function; torch.compile gets torch.library ops (below).

DOUBLE_BACKWARD = (
    f"{OP}: double backward (create_graph=True) is not supported: the gradients are computed in forward and are "
    "not themselves differentiable"
)


def _forward(
    ctx, input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, want_pred, want_accuracy, want_z_loss=True
):
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    with _no_autocast(input.device.type):
        loss, z_loss, accuracy, pred, lse, *grads = forward_core(
            input,
            weight,
            target,
            bias,
            ce_weight,
            opts,
            dtype,
            accum_dtype,
            want_pred,
            want_accuracy,
            needs,
            want_z_loss,
        )
    ctx.args = (opts, dtype, accum_dtype, needs)
    if opts.reduction == "none":
        ctx.save_for_backward(input, weight, target, bias, ce_weight, lse)
    else:  # saved, so that autograd drops them after a backward that does not retain the graph
        ctx.save_for_backward(*grads)
        ctx.in_place = not _backend.saved_tensor_hooks_active()
    return loss, z_loss, accuracy, pred


# ----------------------------------------------------------------------------------------------------------
# Scaling the gradients computed in forward by the incoming gradient. ``grad * d_loss`` or ``grad.mul_(d_loss)``
# with a 0-d GPU d_loss of another dtype runs PyTorch's unvectorized mixed-dtype kernel: 3.6 ms a step for a
# Llama-3-8B head at 64k tokens, for a multiplication by 1 in the usual ``loss.backward()`` (benchmarks/NOTES.md
# §21). This kernel reads d_loss on the device (no host sync); each gradient is multiplied by the fp32 d_loss
# and rounded once (PyTorch's GPU multiply first rounds d_loss to the gradient's dtype). In place, it writes
# nothing where d_loss is 1.

SCALE_BLOCK = 4096


@jit
def _scale_kernel(grad_ptr, d_loss_ptr, out_ptr, n_elements, IN_PLACE: constexpr, BLOCK: constexpr):
    scale = tl.load(d_loss_ptr).to(tl.float32)
    if not IN_PLACE or scale != 1.0:  # (a NaN scale multiplies)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, (grad * scale).to(out_ptr.dtype.element_ty), mask=mask)


_SCALE_PLANS = Plans()


def _scaled(grad, d_loss, in_place: bool):
    """``grad * d_loss`` for a 0-d ``d_loss``; with ``in_place``, written over ``grad`` without bumping its version
    (see ``_backward``). The kernel runs where Triton takes the gradient: not for fp64 gradients (autocast hands
    them back for fp64 parameters, and a forced Triton backend would refuse them), nor under compiled autograd,
    whose tracer needs PyTorch ops."""
    if grad is None:
        return None
    if (
        grad.dtype in _backend.TRITON_DTYPES
        and use_triton(grad)
        and grad.is_contiguous()
        and d_loss.device == grad.device
        and grad.numel() > 0
        and not torch.compiler.is_compiling()
    ):
        n = grad.numel()
        out = grad if in_place else _backend.new_like(grad)
        key = (n, in_place)
        plan = _SCALE_PLANS.get(key) or _SCALE_PLANS.add(
            key, ((n + SCALE_BLOCK - 1) // SCALE_BLOCK,), (n,), IN_PLACE=in_place, BLOCK=SCALE_BLOCK, num_warps=8
        )
        launch_prepared(_scale_kernel, (grad, d_loss, out), plan)
        return out
    if not in_place:
        return grad * d_loss
    with torch.autograd._unsafe_preserve_version_counter(grad):
        return grad.mul_(d_loss)


def _backward(ctx, d_loss):
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)
    _backend.refuse_batched_gradients(OP, d_loss)
    opts, dtype, accum_dtype, needs = ctx.args
    if opts.reduction == "none":
        input, weight, target, bias, ce_weight, lse = ctx.saved_tensors
        with _no_autocast(input.device.type):
            return backward_rows_core(
                d_loss, input, weight, target, bias, ce_weight, lse, opts, dtype, accum_dtype, needs
            )
    grads = ctx.saved_tensors
    # The gradients for an incoming gradient of 1 are scaled in place and handed over only where nothing can read
    # them again: not under saved-tensor hooks (offloading, checkpointing: their unpacked copies), and not where
    # the graph is retained (a second backward must find them unscaled: rescaling by a ratio of incoming
    # gradients would divide by a first one of 0).
    in_place = ctx.in_place and not _backend.graph_is_retained()
    return tuple(_scaled(grad, d_loss, in_place) for grad in grads)


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, want_pred, want_accuracy, want_z_loss
    ):
        loss, z_loss, accuracy, pred = _forward(
            ctx, input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, want_pred, want_accuracy, want_z_loss
        )
        ctx.mark_non_differentiable(*[t for t in (z_loss, accuracy, pred) if t is not None])
        ctx.set_materialize_grads(False)  # no zeros made for the gradients of the non-differentiable outputs
        return loss, z_loss, accuracy, pred

    @staticmethod
    def backward(ctx, d_loss, d_z_loss, d_accuracy, d_pred):
        if d_loss is None:  # (the loss is the one differentiable output: not reached in practice)
            return (None,) * 11
        grad_input, grad_weight, grad_bias = _backward(ctx, d_loss)
        return grad_input, grad_weight, None, grad_bias, None, None, None, None, None, None, None


class LigerFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction.apply(input, weight, target, bias=None, ce_weight=None,
    ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
    return_z_loss=False, accum_dtype=None, use_token_scaling=False, return_token_accuracy=False,
    return_predicted_tokens=False)`` -> ``(loss, z_loss, token_accuracy, predicted_tokens)``, each extra None
    unless asked for. :func:`liger_fused_linear_cross_entropy` is the same with less host cost and a
    torch.compile path."""

    @staticmethod
    def forward(
        ctx,
        _input,
        weight,
        target,
        bias=None,
        ce_weight=None,
        ignore_index=-100,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="mean",
        softcap=None,
        return_z_loss=False,
        accum_dtype=None,
        use_token_scaling=False,
        return_token_accuracy=False,
        return_predicted_tokens=False,
    ):
        opts, dtype, ce_weight, flags = _validate(
            _input,
            weight,
            target,
            bias,
            ce_weight,
            ignore_index,
            lse_square_scale,
            label_smoothing,
            reduction,
            softcap,
            return_z_loss,
            accum_dtype,
            use_token_scaling,
            return_token_accuracy,
            return_predicted_tokens,
            op="LigerFusedLinearCrossEntropyFunction",
        )
        ctx.composite = ctx.compiled = None
        if _backend.exporting():  # torch.export, torch.jit.trace: aten ops only (the full logits), as the function
            ctx.save_for_backward(_input, weight, bias, target, ce_weight)
            ctx.composite = (opts, flags, _replay.autocast_state(_input.device.type))
            loss, z_loss, accuracy, pred = composite(_input, weight, target, bias, ce_weight, opts, flags[2], flags[1])
        elif torch.compiler.is_compiling():  # one opaque torch.library op, as the function under torch.compile
            needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
            scalars = (*opts, dtype, accum_dtype, flags[2], flags[1], *needs)
            loss, z_loss, accuracy, pred, lse, *grads = _forward_op(_input, weight, target, bias, ce_weight, *scalars)
            if opts.reduction == "none":
                ctx.save_for_backward(_input, weight, target, bias, ce_weight, lse)
            else:
                ctx.save_for_backward(*grads)
            ctx.compiled = (_backward_op_scalars(scalars), opts.reduction, needs)
        else:
            loss, z_loss, accuracy, pred = _forward(
                ctx, _input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, flags[2], flags[1], flags[0]
            )
        extras = (
            z_loss if flags[0] else None,
            accuracy if flags[1] else None,
            pred.view(target.shape) if flags[2] else None,
        )
        ctx.mark_non_differentiable(*[t for t in extras if t is not None])
        return (loss, *extras)

    @staticmethod
    def backward(ctx, d_loss, *unused):
        if ctx.composite is not None:
            grad_input, grad_weight, grad_bias = _composite_backward(ctx, d_loss)
        elif ctx.compiled is not None:
            grad_input, grad_weight, grad_bias = _op_grads(ctx.saved_tensors, d_loss, *ctx.compiled)
        else:
            grad_input, grad_weight, grad_bias = _backward(ctx, d_loss)
        return (grad_input, grad_weight, None, grad_bias) + (None,) * 11


def _composite_backward(ctx, d_loss):
    """The public Function's backward after a traced forward: the composite again, differentiated."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)  # as on the usual path
    input, weight, bias, target, ce_weight = ctx.saved_tensors
    opts, flags, autocast = ctx.composite
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip((input, weight, bias), needs)]
    with torch.enable_grad(), _replay.replay_autocast(autocast):  # the forward's autocast, as it computed
        loss = composite(leaves[0], leaves[1], target, leaves[2], ce_weight, opts, flags[2], flags[1])[0]
    wanted = [t for t, n in zip(leaves, needs) if n]
    grads = iter(torch.autograd.grad(loss, wanted, d_loss) if wanted else ())
    return tuple(next(grads) if n else None for n in needs)


# torch.compile: the forward (with the gradients for "mean"/"sum") and the "none" backward as torch.library
# ops; absent results are empty tensors there. The namespace is the package's module name, unique per build.
NAMESPACE = __name__.split(".")[0]
_Tensors8 = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


@torch.library.custom_op(f"{NAMESPACE}::flce_forward", mutates_args=())
def _forward_op(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    dtype: torch.dtype,
    accum_dtype: torch.dtype | None,
    want_pred: bool,
    want_accuracy: bool,
    needs_input: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> _Tensors8:
    opts = Options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    with _no_autocast(input.device.type):
        results = forward_core(
            input,
            weight,
            target,
            bias,
            ce_weight,
            opts,
            dtype,
            accum_dtype,
            want_pred,
            want_accuracy,
            (needs_input, needs_weight, needs_bias),
        )
    empties = (torch.float32, torch.int64, None, input.dtype, weight.dtype, bias.dtype if bias is not None else None)
    return tuple(
        r if r is not None else input.new_empty((0,), dtype=e) for r, e in zip(results, (None, None) + empties)
    )


@_forward_op.register_fake
def _(
    input,
    weight,
    target,
    bias,
    ce_weight,
    ignore_index,
    lse_square_scale,
    label_smoothing,
    reduction,
    softcap,
    use_token_scaling,
    dtype,
    accum_dtype,
    want_pred,
    want_accuracy,
    needs_input,
    needs_weight,
    needs_bias,
):
    loss_dtype, n_rows = _ce.compute_dtype(dtype), target.numel()
    loss_shape = tuple(target.shape) if reduction == "none" else ()
    grads_now = reduction != "none"

    def empty(shape, dtype_):
        return input.new_empty(shape, dtype=dtype_)

    return (
        empty(loss_shape, loss_dtype),
        empty(loss_shape, loss_dtype),
        empty(loss_shape if want_accuracy else (0,), torch.float32),
        empty((n_rows,) if want_pred or want_accuracy else (0,), torch.int64),
        empty((n_rows,), loss_dtype),
        empty(input.shape if grads_now and needs_input else (0,), input.dtype),
        empty(weight.shape if grads_now and needs_weight else (0,), weight.dtype),
        empty(bias.shape if grads_now and needs_bias else (0,), bias.dtype if bias is not None else input.dtype),
    )


@torch.library.custom_op(f"{NAMESPACE}::flce_backward_rows", mutates_args=())
def _backward_rows_op(
    d_loss: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ce_weight: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    use_token_scaling: bool,
    dtype: torch.dtype,
    accum_dtype: torch.dtype | None,
    needs_input: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = Options(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, use_token_scaling)
    with _no_autocast(input.device.type):
        grads = backward_rows_core(
            d_loss,
            input,
            weight,
            target,
            bias,
            ce_weight,
            lse,
            opts,
            dtype,
            accum_dtype,
            (needs_input, needs_weight, needs_bias),
        )
    return tuple(g if g is not None else input.new_empty((0,)) for g in grads)


@_backward_rows_op.register_fake
def _(d_loss, input, weight, target, bias, ce_weight, lse, *args):
    needs_input, needs_weight, needs_bias = args[-3:]
    return (
        input.new_empty(input.shape if needs_input else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        input.new_empty(bias.shape if needs_bias else (0,), dtype=bias.dtype if needs_bias else input.dtype),
    )


def _backward_op_scalars(scalars) -> tuple:
    """The forward op's scalar arguments the "none" backward op takes: all but want_pred, want_accuracy."""
    return tuple(scalars[:8]) + tuple(scalars[-3:])


def _op_setup_context(ctx, inputs, output):
    input, weight, target, bias, ce_weight, *scalars = inputs
    ctx.scalars = _backward_op_scalars(scalars)
    ctx.reduction = scalars[3]
    ctx.needs = scalars[-3:]
    if ctx.reduction == "none":
        ctx.save_for_backward(input, weight, target, bias, ce_weight, output[4])
    else:
        ctx.save_for_backward(*output[5:])


def _op_grads(saved, d_loss, scalars, reduction, needs) -> tuple:
    """(grad_input, grad_weight, grad_bias) from what the forward op's caller saved: the inputs and lse for
    "none" (the backward op recomputes), else the gradients the forward op computed, scaled."""
    if reduction == "none":
        input, weight, target, bias, ce_weight, lse = saved
        grads = _backward_rows_op(d_loss, input, weight, target, bias, ce_weight, lse, *scalars)
    else:  # out of place: the compiler plans the buffers
        grads = [g * d_loss for g in saved]
    return tuple(g if need else None for g, need in zip(grads, needs))


def _op_backward(ctx, d_loss, *unused):
    grads = _op_grads(ctx.saved_tensors, d_loss, ctx.scalars, ctx.reduction, ctx.needs)
    return (grads[0], grads[1], None, grads[2]) + (None,) * 14


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


def _apply(
    input, weight, target, bias, ce_weight, opts: Options, dtype, accum_dtype, want_pred, want_accuracy, want_z_loss
):
    """(loss, z_loss, token_accuracy, pred) with autograd, for validated inputs; without ``want_z_loss`` z_loss may be
    None."""
    if _backend.exporting() or _backend.forward_ad_active():  # aten ops only; dual tensors' tangents
        return composite(input, weight, target, bias, ce_weight, opts, want_pred, want_accuracy)
    if torch.compiler.is_compiling():
        grad_on = torch.is_grad_enabled()
        needs = (
            grad_on and input.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        )
        loss, z_loss, accuracy, pred, *_ = _forward_op(
            input, weight, target, bias, ce_weight, *opts, dtype, accum_dtype, want_pred, want_accuracy, *needs
        )
        return loss, z_loss.detach(), accuracy.detach(), pred
    # torch.func's transforms: the PyTorch formulas, on wrapped tensors and on plain ones the transformed function
    # reads (PyTorch's apply refuses this Function under an active transform)
    if _ce.is_functorch(input, weight, bias) or _transforms_active():
        return composite(input, weight, target, bias, ce_weight, opts, want_pred, want_accuracy)
    # No transform is active here, so a wrapped tensor is a dead wrapper one let out: unwrapped, as PyTorch's apply
    # does, before any kernel reads it (the differentiable tensors were asked above)
    if _is_wrapped(target) or ce_weight is not None and _is_wrapped(ce_weight):
        target, ce_weight = _unwrap_dead((target, ce_weight))
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (input, weight, bias)):
        with _no_autocast(input.device.type):  # no gradient wanted: the loss alone, no autograd node
            results = forward_core(
                input,
                weight,
                target,
                bias,
                ce_weight,
                opts,
                dtype,
                accum_dtype,
                want_pred,
                want_accuracy,
                (False, False, False),
                want_z_loss,
            )
        return results[:4]
    # autograd's C++ apply directly, where PyTorch's Python apply would only unwrap dead wrappers and call it
    return _eager_function(
        input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, want_pred, want_accuracy, want_z_loss
    )


_eager_function = _backend.c_apply(_EagerFunction)
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap_dead = torch._functorch.utils.unwrap_dead_wrappers
_transforms_active = torch._C._are_functorch_transforms_active


def liger_fused_linear_cross_entropy(
    input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    return_z_loss=False,
    accum_dtype=None,
    use_token_scaling=False,
    return_token_accuracy=False,
    return_predicted_tokens=False,
):
    """``F.cross_entropy(softcap(input @ weight.T + bias).float(), target, weight=ce_weight, ignore_index=...,
    label_smoothing=..., reduction=...)`` plus the z-loss ``lse_square_scale * logsumexp^2`` (averaged over the
    non-ignored rows for "mean", unweighted), without materializing the logits.

    ``input`` (*, H), ``weight`` (V, H), ``target`` (*) integer (``ignore_index`` rows count for nothing),
    ``bias`` (V,), ``ce_weight`` (V,) class weights. ``softcap``: logits become ``softcap * tanh(logits /
    softcap)``. ``use_token_scaling``: each row's loss is multiplied by its (detached) target probability.
    ``accum_dtype``: dtype of the weight/bias gradient accumulator (default fp32, fp64 for fp64 inputs).

    Returns the loss (fp32; fp64 for fp64 inputs; shaped like ``target`` for reduction="none"), or, when any
    ``return_*`` flag is set, a :class:`CrossEntropyOutput` with ``loss`` and the extras asked for:
    ``z_loss`` (its share of the loss), ``token_accuracy`` (argmax == target over the non-ignored rows, per row
    for "none") and ``predicted_tokens`` (the argmax, -1 for ignored rows). Only ``loss`` is differentiable.
    """
    opts, dtype, ce_weight, flags = _validate(
        input,
        weight,
        target,
        bias,
        ce_weight,
        ignore_index,
        lse_square_scale,
        label_smoothing,
        reduction,
        softcap,
        return_z_loss,
        accum_dtype,
        use_token_scaling,
        return_token_accuracy,
        return_predicted_tokens,
    )
    loss, z_loss, accuracy, pred = _apply(
        input, weight, target, bias, ce_weight, opts, dtype, accum_dtype, flags[2], flags[1], flags[0]
    )
    return _ce.package(loss, z_loss, accuracy, pred, flags, target.shape)
