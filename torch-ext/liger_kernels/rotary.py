"""Rotary position embedding (RoPE), the rotate-half form of transformers' ``apply_rotary_pos_emb``.

``liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` returns ``(q_embed, k_embed)`` with

    x_embed = x * cos + rotate_half(x) * sin,    rotate_half([x1, x2]) = [-x2, x1]

where ``cos``/``sin`` are unsqueezed at ``unsqueeze_dim`` and broadcast against ``q`` and ``k``: [B, S, D]
with ``unsqueeze_dim=1`` for [B, H, S, D] queries, ``unsqueeze_dim=2`` for [B, S, H, D], a batch of 1 shared by
every sequence, or any other shape that broadcasts without growing ``q`` and ``k``. Per half:

    out1 = x1 * cos1 - x2 * sin1,    out2 = x1 * sin2 + x2 * cos2

``cos``/``sin`` of width D/2 (the form gpt-oss tags with the same kernel name) stand for both halves.

Differences from transformers, on purpose:

* Math runs in fp32 (fp64 when an input is fp64) with one rounding to the result dtype. transformers computes
  in the input dtype: in bf16 that is three roundings (two products and the sum), so its error is larger.
  In fp32 and fp64 the two agree bit for bit on the PyTorch path.
* The result dtype is ``torch.promote_types(q.dtype, cos.dtype)``, as type promotion gives in Llama's form
  (bf16 queries with fp32 cos/sin under autocast come out fp32; the kernelize layer casts back for the tagged
  functions that do, such as OLMo's); ``q``/``k`` must share a dtype, and so must ``cos``/``sin``.
* Backward saves only ``cos`` and ``sin`` (the map is linear in q and k) and applies the transposed map,
  which for the usual duplicated halves is the rotation by -sin.

Inputs are read in place through their strides (the q/k slices of a fused qkv projection, transposed or
not, need no copy); the results are fresh tensors, dense in the memory order of ``q``/``k``, and nothing the
caller passed is written. ``cos``/``sin`` that require grad get their gradients: the call then runs the
differentiable PyTorch composite.

This module is over 300 lines because the kernel, its launcher, the layout handling, the PyTorch path and
the autograd and torch.library wrappers change together; splitting them would separate the math from its kernel.
"""

import torch

from . import _backend
from ._backend import constexpr, jit, tl, use_triton
from ._launch import Prepared, launch_prepared

OP = "liger_rotary_pos_emb"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NAMESPACE = __name__.split(".")[0]  # unique per build under the Hub loader, like _gated's ops


# ----------------------------------------------------------------------------------------------------------
# Validation: every check runs before any launch.


def _check(q, k, cos, sin, unsqueeze_dim):
    """(cos, sin) unsqueezed at unsqueeze_dim, after checking all four inputs."""
    for arg, value in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{OP}: `{arg}` must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in DTYPES:
            raise TypeError(f"{OP}: `{arg}` must be float16, bfloat16, float32 or float64, got {value.dtype}")
    if q.dtype != k.dtype:
        raise TypeError(f"{OP}: `q` and `k` must have the same dtype, got {q.dtype} and {k.dtype}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"{OP}: `cos` and `sin` must have the same dtype, got {cos.dtype} and {sin.dtype}")
    device = q.device
    for arg, value in (("k", k), ("cos", cos), ("sin", sin)):
        if value.device != device:
            raise ValueError(f"{OP}: `{arg}` must be on the device of `q` ({device}), got {value.device}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"{OP}: `unsqueeze_dim` must be an int, got {type(unsqueeze_dim).__name__}")
    if q.dim() == 0 or q.dim() != k.dim():
        raise ValueError(
            f"{OP}: `q` and `k` must have the same number (>= 1) of dimensions, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{OP}: `q` and `k` must have the same head dim (last dim), got {head_dim} and {k.shape[-1]}")
    if head_dim % 2:
        raise ValueError(f"{OP}: the head dim (last dim of `q` and `k`) must be even, got {head_dim}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"{OP}: `cos` and `sin` must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not -cos.dim() - 1 <= unsqueeze_dim <= cos.dim():
        raise ValueError(
            f"{OP}: `unsqueeze_dim` must be in [{-cos.dim() - 1}, {cos.dim()}] for `cos` of shape "
            f"{tuple(cos.shape)}, got {unsqueeze_dim}"
        )
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if cos.shape[-1] not in (head_dim, head_dim // 2):
        raise ValueError(
            f"{OP}: `cos`/`sin` unsqueezed at {unsqueeze_dim} have shape {tuple(cos.shape)}: the last dim "
            f"must be the head dim {head_dim} or half of it"
        )
    q_shape, k_shape, cos_shape = q.shape, k.shape, cos.shape
    fits = len(cos_shape) <= len(q_shape)
    if fits:  # a loop, not all(generator): this runs on every call
        for i in range(-2, -len(cos_shape) - 1, -1):
            c = cos_shape[i]
            if c != 1 and not c == q_shape[i] == k_shape[i]:
                fits = False
                break
    if not fits:
        raise ValueError(
            f"{OP}: `cos`/`sin` unsqueezed at {unsqueeze_dim} have shape {tuple(cos.shape)}, which does "
            f"not broadcast to `q` {tuple(q.shape)} and `k` {tuple(k.shape)} without growing them"
        )
    return cos, sin


def _result_dtype(q, cos):
    return torch.promote_types(q.dtype, cos.dtype)


def _dense_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor shaped like ``x``, dense in ``x``'s memory order (last dim innermost): what transformers'
    elementwise result would be. The fake (compile-time) outputs use this too, so their strides agree."""
    if x.is_contiguous():
        return _backend.new_tensor(x.shape, dtype=dtype, device=x.device)
    shape, strides = x.shape, x.stride()
    try:
        dense = _DENSE_STRIDES.get((shape, strides))
    except TypeError:  # symbolic sizes (torch.compile's fake tensors): computed, not cached
        dense = _dense_strides(shape, strides)
    if dense is None:
        if len(_DENSE_STRIDES) >= MAX_PLANS:
            _DENSE_STRIDES.clear()
        dense = _DENSE_STRIDES[(shape, strides)] = _dense_strides(shape, strides)
    return _backend.new_strided(shape, dense, dtype=dtype, device=x.device)


def _dense_strides(shape, strides) -> tuple:
    """Dense strides with the dims in the memory order of ``strides`` (the last dim innermost)."""
    lead = sorted(range(len(shape) - 1), key=lambda d: -strides[d])  # stable: ties keep the outer dim first
    dense = [0] * len(shape)
    step = 1
    for d in reversed([*lead, len(shape) - 1]):
        dense[d] = step
        step *= shape[d]
    return tuple(dense)


# The strides of _dense_like's result per (shape, strides) of a non-contiguous x: at decoding sizes the host's
# cost per call is the whole story (q and k arrive as transposed views).
_DENSE_STRIDES = {}


# ----------------------------------------------------------------------------------------------------------
# Triton kernel. One program per token (a position of cos/sin): it loads that token's cos and sin once and
# rotates every head of q and then of k, BLOCK_H heads x D/2 columns at a time. Token and head indices each
# come from up to two strided dims, so [B, H, S, D] and [B, S, H, D] layouts, slices of a fused qkv tensor
# and cos/sin shared across the batch are all read in place. Offsets are int64.


@jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    n_heads,
    inner_heads,
    x_outer_stride,
    x_inner_stride,
    out_outer_stride,
    out_inner_stride,
    cos1,
    cos2,
    sin1,
    sin2,
    cols,
    col_mask,
    HALF: constexpr,
    TWO_HEAD_DIMS: constexpr,
    BLOCK_H: constexpr,
    N_BLOCKS: constexpr,
):
    for block in range(N_BLOCKS):  # a compile-time count: Triton's interpreter cannot loop to a runtime bound
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
        if TWO_HEAD_DIMS:
            outer, inner = heads // inner_heads, heads % inner_heads
            x_rows = outer * x_outer_stride + inner * x_inner_stride
            out_rows = outer * out_outer_stride + inner * out_inner_stride
        else:
            x_rows = heads * x_inner_stride
            out_rows = heads * out_inner_stride
        mask = (heads < n_heads)[:, None] & col_mask[None, :]
        x1_ptrs = x_ptr + x_rows[:, None] + cols[None, :]
        x1 = tl.load(x1_ptrs, mask=mask).to(tl.float32)
        x2 = tl.load(x1_ptrs + HALF, mask=mask).to(tl.float32)
        out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        out2 = x1 * sin2[None, :] + x2 * cos2[None, :]
        out1_ptrs = out_ptr + out_rows[:, None] + cols[None, :]
        tl.store(out1_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out1_ptrs + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    inner_tokens,
    q_tok_outer,
    q_tok_inner,
    k_tok_outer,
    k_tok_inner,
    q_out_tok_outer,
    q_out_tok_inner,
    k_out_tok_outer,
    k_out_tok_inner,
    cos_tok_outer,
    cos_tok_inner,
    sin_tok_outer,
    sin_tok_inner,
    q_heads,
    q_inner_heads,
    q_head_outer,
    q_head_inner,
    q_out_head_outer,
    q_out_head_inner,
    k_heads,
    k_inner_heads,
    k_head_outer,
    k_head_inner,
    k_out_head_outer,
    k_out_head_inner,
    HALF: constexpr,
    BLOCK_D: constexpr,
    HALF_WIDTH_COS: constexpr,
    BACKWARD: constexpr,
    Q_TWO_HEAD_DIMS: constexpr,
    K_TWO_HEAD_DIMS: constexpr,
    BLOCK_HQ: constexpr,
    BLOCK_HK: constexpr,
    Q_BLOCKS: constexpr,
    K_BLOCKS: constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    outer, inner = token // inner_tokens, token % inner_tokens
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < HALF
    cos_row = cos_ptr + outer * cos_tok_outer + inner * cos_tok_inner
    sin_row = sin_ptr + outer * sin_tok_outer + inner * sin_tok_inner
    cos1 = tl.load(cos_row + cols, mask=col_mask).to(tl.float32)
    sin1 = tl.load(sin_row + cols, mask=col_mask).to(tl.float32)
    if HALF_WIDTH_COS:
        cos2, sin2 = cos1, sin1
    else:
        cos2 = tl.load(cos_row + HALF + cols, mask=col_mask).to(tl.float32)
        sin2 = tl.load(sin_row + HALF + cols, mask=col_mask).to(tl.float32)
    if BACKWARD:
        # Forward is [out1, out2] = [[cos1, -sin1], [sin2, cos2]] [x1, x2]; backward applies the transpose
        # [[cos1, sin2], [-sin1, cos2]], i.e. the same map with (sin1, sin2) -> (-sin2, -sin1).
        sin1, sin2 = -sin2, -sin1
    _rotate_heads(
        q_ptr + outer * q_tok_outer + inner * q_tok_inner,
        q_out_ptr + outer * q_out_tok_outer + inner * q_out_tok_inner,
        q_heads,
        q_inner_heads,
        q_head_outer,
        q_head_inner,
        q_out_head_outer,
        q_out_head_inner,
        cos1,
        cos2,
        sin1,
        sin2,
        cols,
        col_mask,
        HALF,
        Q_TWO_HEAD_DIMS,
        BLOCK_HQ,
        Q_BLOCKS,
    )
    _rotate_heads(
        k_ptr + outer * k_tok_outer + inner * k_tok_inner,
        k_out_ptr + outer * k_out_tok_outer + inner * k_out_tok_inner,
        k_heads,
        k_inner_heads,
        k_head_outer,
        k_head_inner,
        k_out_head_outer,
        k_out_head_inner,
        cos1,
        cos2,
        sin1,
        sin2,
        cols,
        col_mask,
        HALF,
        K_TWO_HEAD_DIMS,
        BLOCK_HK,
        K_BLOCKS,
    )


TILE = 2048  # elements of one half-tile (BLOCK_H x BLOCK_D): 16 per thread with 4 warps
NUM_WARPS = 4


def _collapse(dims: list[int], tensors) -> list[tuple[int, list[int]]]:
    """(size, per-tensor stride) for ``dims`` (same sizes in every tensor), merging neighbours that every
    tensor lays out as one strided dim."""
    groups = []
    shape, all_strides = tensors[0].shape, [t.stride() for t in tensors]
    for d in dims:
        size, strides = shape[d], [s[d] for s in all_strides]
        if groups and all(outer == s * size for outer, s in zip(groups[-1][1], strides)):
            groups[-1] = (groups[-1][0] * size, strides)
        else:
            groups.append((size, strides))
    return groups


def _head_args(x, out, cos, max_block_h):
    """(scalar args, two head dims?, BLOCK_H, head blocks) for one of q/k, or None for a layout the kernel
    does not take. Heads are x's dims along which cos/sin are constant; a missing x (None) has none."""
    if x is None:
        return (0, 1, 0, 0, 0, 0), False, 1, 0
    dims = [d for d in range(x.dim() - 1) if cos.shape[d] == 1 and x.shape[d] != 1]
    groups = _collapse(dims, (x, out))
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.insert(0, (1, [0, 0]))
    (outer_size, (x_outer, out_outer)), (inner_size, (x_inner, out_inner)) = groups
    heads = outer_size * inner_size
    block = min(_backend.next_power_of_2(heads), max_block_h)
    return (heads, inner_size, x_outer, x_inner, out_outer, out_inner), outer_size > 1, block, -(-heads // block)


def _plan(q, k, q_out, k_out, cos, sin, backward: bool):
    """(grid, scalar arguments, constexpr arguments) of the launch, or None for a layout the kernel does not
    take: an input whose last dim is strided, or more than two token or head dims left after merging
    neighbours."""
    if any(t is not None and t.stride(-1) != 1 for t in (q, k, cos, sin)):
        return None
    ref = q if q is not None else k
    n = ref.dim()
    cos, sin = cos[(None,) * (n - cos.dim())], sin[(None,) * (n - sin.dim())]
    half = ref.shape[-1] // 2
    block_d = _backend.next_power_of_2(half)
    max_block_h = max(1, TILE // block_d)
    q_args = _head_args(q, q_out, cos, max_block_h)
    k_args = _head_args(k, k_out, cos, max_block_h)
    tensors = [t if t is not None else ref for t in (q, k, q_out, k_out)] + [cos, sin]
    tokens = _collapse([d for d in range(n - 1) if cos.shape[d] != 1], tensors)
    if q_args is None or k_args is None or len(tokens) > 2:
        return None
    while len(tokens) < 2:
        tokens.insert(0, (1, [0] * 6))
    (outer_tokens, outer_strides), (inner_tokens, inner_strides) = tokens
    token_strides = [s for pair in zip(outer_strides, inner_strides) for s in pair]
    constexprs = {
        "HALF": half,
        "BLOCK_D": block_d,
        "HALF_WIDTH_COS": cos.shape[-1] == half,
        "BACKWARD": backward,
        "Q_TWO_HEAD_DIMS": q_args[1],
        "K_TWO_HEAD_DIMS": k_args[1],
        "BLOCK_HQ": q_args[2],
        "BLOCK_HK": k_args[2],
        "Q_BLOCKS": q_args[3],
        "K_BLOCKS": k_args[3],
        "num_warps": NUM_WARPS,
    }
    scalars = (inner_tokens, *token_strides, *q_args[0], *k_args[0])
    return Prepared((outer_tokens * inner_tokens,), scalars, **constexprs)


# Launch plans depend on the tensors' shapes and strides only: computed once per layout, since the host's
# cost per call is the whole story at decoding sizes. Bounded: training with varying lengths meets many.
_PLANS = {}
MAX_PLANS = 1024


def _launch_triton(q, k, q_out, k_out, cos, sin, backward: bool) -> bool:
    """Run the kernel over q and k (either may be None, with its output: that side is skipped). Returns
    False, having launched nothing, for a layout it does not take (see ``_plan``)."""
    layout = [backward]
    for t in (q, k, q_out, k_out, cos, sin):
        layout += (None, None) if t is None else (t.shape, t.stride())
    key = tuple(layout)
    plan = _PLANS.get(key, False)
    if plan is False:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(q, k, q_out, k_out, cos, sin, backward)
    if plan is None:
        return False
    ref = q if q is not None else k
    tensors = [t if t is not None else ref for t in (q, k, q_out, k_out)]
    launch_prepared(_rotary_kernel, (*tensors, cos, sin), plan)
    return True


# ----------------------------------------------------------------------------------------------------------
# PyTorch: the same math with broadcasting, in fp32 (fp64 when an input is fp64).


def _halves(t: torch.Tensor, half: int):
    return (t, t) if t.shape[-1] == half else (t[..., :half], t[..., half:])


def _rotated_halves(x, cos, sin, transpose: bool):
    """(out1, out2) in the compute dtype; ``transpose`` applies the backward (transposed) map."""
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    half = x.shape[-1] // 2
    x = x.to(compute)
    x1, x2 = x[..., :half], x[..., half:]
    cos1, cos2 = _halves(cos.to(compute), half)
    sin1, sin2 = _halves(sin.to(compute), half)
    if transpose:
        sin1, sin2 = -sin2, -sin1
    return x1 * cos1 - x2 * sin1, x1 * sin2 + x2 * cos2


def _rotate_torch_into(x, cos, sin, out, transpose: bool) -> None:
    half = x.shape[-1] // 2
    out1, out2 = _rotated_halves(x, cos, sin, transpose)
    out[..., :half].copy_(out1)
    out[..., half:].copy_(out2)


def _rotate_composite(x, cos, sin, dtype, transpose: bool = False) -> torch.Tensor:
    """Differentiable aten-only form: torch.func, export, cos/sin that need gradients, double backward."""
    return torch.cat(_rotated_halves(x, cos, sin, transpose), dim=-1).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Dispatch, for validated inputs (cos/sin already unsqueezed), without autograd.


def _rotate(q, k, q_out, k_out, cos, sin, backward: bool) -> None:
    ref = q if q is not None else k
    if ref.shape[-1] == 0 or ((q is None or q.numel() == 0) and (k is None or k.numel() == 0)):
        return
    if use_triton(ref) and use_triton(cos):
        if _launch_triton(q, k, q_out, k_out, cos, sin, backward):
            return
        inputs = [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin)]
        # The kernel reads the last dim with unit stride: inputs without one are copied, then planned again.
        if any(a is not b for a, b in zip(inputs, (q, k, cos, sin))):
            if _launch_triton(*inputs[:2], q_out, k_out, *inputs[2:], backward):
                return
    for x, out in ((q, q_out), (k, k_out)):
        if x is not None and x.numel():
            _rotate_torch_into(x, cos, sin, out, backward)


def rotary_forward(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _result_dtype(q, cos)
    q_out, k_out = _dense_like(q, dtype), _dense_like(k, dtype)
    _rotate(q, k, q_out, k_out, cos, sin, backward=False)
    return q_out, k_out


def rotary_backward(d_q, d_k, cos, sin, q_dtype, k_dtype):
    """Gradients for q and k (dtypes q_dtype, k_dtype) from those of the outputs; a None gradient (an
    output that did not reach the loss) gives None."""
    d_q_in = None if d_q is None else _dense_like(d_q, q_dtype)
    d_k_in = None if d_k is None else _dense_like(d_k, k_dtype)
    if d_q is not None or d_k is not None:
        _rotate(d_q, d_k, d_q_in, d_k_in, cos, sin, backward=True)
    return d_q_in, d_k_in


def _composite(q, k, cos, sin):
    dtype = _result_dtype(q, cos)
    return _rotate_composite(q, cos, sin, dtype), _rotate_composite(k, cos, sin, dtype)


# ----------------------------------------------------------------------------------------------------------
# Autograd. Eager calls use a plain autograd.Function (little host cost); torch.compile traces the
# torch.library ops below as single opaque ops. Both save only cos and sin.


def _backward_grads(d_q, d_k, cos, sin, q_dtype, k_dtype, needs_q, needs_k):
    d_q = d_q if needs_q else None
    d_k = d_k if needs_k else None
    # create_graph=True: the gradients must be differentiable themselves; batched gradients (the legacy vmap of
    # autograd.grad(is_grads_batched=True)) have no storage for a kernel
    legacy = _backend.legacy_batched
    if torch.is_grad_enabled() or (d_q is not None and legacy(d_q)) or (d_k is not None and legacy(d_k)):
        return tuple(
            None if d is None else _rotate_composite(d, cos, sin, dtype, transpose=True)
            for d, dtype in ((d_q, q_dtype), (d_k, k_dtype))
        )
    return rotary_backward(d_q, d_k, cos, sin, q_dtype, k_dtype)


class _EagerRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.set_materialize_grads(False)
        return rotary_forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, d_q_out, d_k_out):
        cos, sin = ctx.saved_tensors
        needs_q, needs_k = ctx.needs_input_grad[:2]
        d_q, d_k = _backward_grads(d_q_out, d_k_out, cos, sin, *ctx.dtypes, needs_q, needs_k)
        return d_q, d_k, None, None


# Inductor hands the ops their inputs with the traced strides, so the outputs' strides (dense in the
# inputs' memory order) are those the fake implementations report.
_EXACT_STRIDES = (torch.Tag.needs_exact_strides,)


@torch.library.custom_op(f"{NAMESPACE}::rotary_forward", mutates_args=(), tags=_EXACT_STRIDES)
def rotary_forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_forward(q, k, cos, sin)


@rotary_forward_op.register_fake
def _(q, k, cos, sin):
    dtype = _result_dtype(q, cos)
    return _dense_like(q, dtype), _dense_like(k, dtype)


@torch.library.custom_op(f"{NAMESPACE}::rotary_backward", mutates_args=(), tags=_EXACT_STRIDES)
def rotary_backward_op(
    d_q: torch.Tensor,
    d_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_backward(d_q, d_k, cos, sin, q_dtype, k_dtype)


@rotary_backward_op.register_fake
def _(d_q, d_k, cos, sin, q_dtype, k_dtype):
    return _dense_like(d_q, q_dtype), _dense_like(d_k, k_dtype)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)


def _op_backward(ctx, d_q_out, d_k_out):
    cos, sin = ctx.saved_tensors
    d_q, d_k = rotary_backward_op(d_q_out, d_k_out, cos, sin, *ctx.dtypes)
    return (d_q if ctx.needs_input_grad[0] else None), (d_k if ctx.needs_input_grad[1] else None), None, None


torch.library.register_autograd(rotary_forward_op, _op_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# The public function.


def _needs_composite(q, k, cos, sin) -> bool:
    """torch.func's wrapped tensors, a forward-AD dual level, or a torch.jit.trace: the composite runs (see
    _backend)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return (
        _backend.forward_ad_active() or _backend.exporting() or wrapped(q) or wrapped(k) or wrapped(cos) or wrapped(sin)
    )


def liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: returns ``(q_embed, k_embed)``.
    See the module docstring for the layouts taken and the (deliberate) differences."""
    cos, sin = _check(q, k, cos, sin, unsqueeze_dim)
    grad = torch.is_grad_enabled()
    cos_grad = grad and (cos.requires_grad or sin.requires_grad)
    if torch.compiler.is_compiling():
        if _backend.exporting() or cos_grad or _backend.forward_ad_active():  # the op has no forward-AD rule
            return _composite(q, k, cos, sin)
        return rotary_forward_op(q, k, cos, sin)
    if cos_grad or _needs_composite(q, k, cos, sin):
        return _composite(q, k, cos, sin)
    if grad and (q.requires_grad or k.requires_grad):
        return _EagerRotary.apply(q, k, cos, sin)
    return rotary_forward(q, k, cos, sin)  # no graph to record (inference, decoding): no Function either


# The Hub's function-kernel loaders read these, as for a layer class.
liger_rotary_pos_emb.can_torch_compile = True
liger_rotary_pos_emb.has_backward = True
