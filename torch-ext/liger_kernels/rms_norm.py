"""RMSNorm over the last dimension: ``x_normed = x / sqrt(mean(x**2, -1) + eps)``, scaled by ``offset + weight``,
fused forward and backward.

``x`` has shape ``[*, H]`` and ``weight`` shape ``[H]``. ``x_normed`` is always computed in fp32 (in fp64 when
``x`` or ``weight`` is fp64, on the PyTorch path; ``LlamaRMSNorm`` computes fp64 inputs in fp32). The two
castings say where the dtypes meet:

* ``casting="llama"`` (default): transformers' ``LlamaRMSNorm`` (Mistral, Qwen2/3, Phi-3, ...) exactly:
  ``(offset + weight) * x_normed.to(x.dtype)``. ``x_normed`` is rounded to ``x``'s dtype first; the product is
  taken in ``promote_types(weight.dtype, x.dtype)``, which is also the output dtype (a fp32 weight on bf16
  ``x`` gives fp32, as eager PyTorch does), and rounds once. With bf16 or fp16 operands that product is exact
  in fp32, so the output equals eager's bit for bit whenever ``x_normed.to(x.dtype)`` does.
* ``casting="gemma"``: ``(x_normed * (offset + weight.float())).to(x.dtype)``, everything in fp32 and one
  rounding at the end; the output has ``x``'s dtype. ``GemmaRMSNorm`` is this with ``offset=1.0`` (it stores
  ``weight - 1``); ``offset=0.0`` is the ``(weight * x_normed).to(input_dtype)`` form of some models.

Gradients: ``d_x`` in ``x``'s dtype, ``d_weight`` in ``weight``'s. For ``llama`` the weight gradient is
``sum(d_y * x_normed.to(x.dtype))`` over rows, as autograd through the eager module computes it; the rounding
of ``x_normed`` passes gradients straight through.

Backends (``_backend.use_triton``): Triton on CUDA/ROCm/XPU for fp16/bf16/fp32 ``x`` and ``weight``; the
PyTorch path (the same math with PyTorch ops) on CPU, MPS, and for fp64. The Triton forward saves ``rstd``
(fp32, one per row) for backward; backward writes ``d_x`` per row and reduces ``d_weight`` deterministically:
each program (as many as the device runs at once) sums its rows in fp32 into one row of a ``[programs, H]``
buffer, which a second kernel then sums in a fixed order. No float atomics: the same inputs give the same bits.

Autograd contract: a second derivative (``create_graph=True``) is computed by the PyTorch formulas, which
are differentiable, on either backend. ``torch.func`` transforms of :func:`rms_norm` run the differentiable
PyTorch form; :class:`LigerRMSNormFunction` is a ctx-style Function, which ``torch.func`` refuses with its own
error. Under ``torch.compile`` :func:`rms_norm` is one ``torch.library`` op (no graph break); exported
programs get the PyTorch form (aten ops only).

This module is over 300 lines because the kernels, their launch parameters, the PyTorch path and the autograd
and torch.library wrappers change together (the Triton tutorials' layout).
"""

import math
import numbers

import torch

from . import _backend
from ._backend import constexpr, jit, tl
from ._gated import NAMESPACE
from ._launch import launch

OP = "rms_norm"
CASTINGS = ("llama", "gemma")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# ----------------------------------------------------------------------------------------------------------
# Validation: every check runs before any launch.


def _check_real(value, arg: str) -> float:
    if isinstance(value, float) and _backend.is_finite(value):  # the common case, without the ABC check
        return value if torch.compiler.is_compiling() else float(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{OP}: `{arg}` must be a real number, got {type(value).__name__}")
    if not _backend.is_finite(value):
        raise ValueError(f"{OP}: `{arg}` must be finite, got {value}")
    return value if isinstance(value, torch.SymFloat) else float(value)


def check_inputs(x, weight, eps, offset, casting) -> tuple[float, float, bool]:
    """Validated ``(eps, offset, llama)``; raises TypeError/ValueError naming the argument."""
    for arg, value in (("x", x), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{OP}: `{arg}` must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in DTYPES:
            raise TypeError(f"{OP}: `{arg}` must be float32, float16, bfloat16 or float64, got {value.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{OP}: `x` must have at least one dimension (the last is normalized), got a 0-d tensor")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{OP}: `weight` must have shape [H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"{OP}: `x` and `weight` must be on the same device, got {x.device} and {weight.device}")
    eps = _check_real(eps, "eps")
    if eps < 0:
        raise ValueError(f"{OP}: `eps` must be >= 0, got {eps}")
    offset = _check_real(offset, "offset")
    if casting not in CASTINGS:
        raise ValueError(f"{OP}: `casting` must be one of {CASTINGS}, got {casting!r}")
    return eps, offset, casting == "llama"


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, llama: bool) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if llama else x.dtype


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _backend.use_triton(x) and weight.dtype in _backend.TRITON_DTYPES


def _needs_composite(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs the kernels cannot take by pointer (torch.func's wrapped tensors, tensor subclasses such as
    DTensor), and exported programs: they get the differentiable PyTorch form, which dispatches as usual."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    plain = (torch.Tensor, torch.nn.Parameter)
    return (
        type(x) not in plain
        or type(weight) not in plain
        or wrapped(x)
        or wrapped(weight)
        or _backend.exporting()
        or _backend.forward_ad_active()
    )


# ----------------------------------------------------------------------------------------------------------
# Triton kernels. A forward program normalizes BLOCK_ROWS rows; a backward program walks every programs-th
# block of BLOCK_ROWS rows, with the next blocks' loads in flight through shared memory, keeping its
# weight-gradient sum in registers. Interleaved, not a contiguous range each: all programs then stream through
# neighbouring rows at once, which the H200's memory serves faster (8192 x 8192 bf16: 88-89% of copy with
# contiguous ranges, 92.6-93.0% interleaved; benchmarks/NOTES.md §16).
# A row of up to MAX_BLOCK_COLS columns is held in registers whole (ONE_BLOCK); wider rows are looped over in
# blocks of MAX_BLOCK_COLS columns, twice (sum of squares, then the output), the second pass reading mostly
# from L2.
# Offsets are int64: rows * row_stride exceeds 2**31 for large activations.

MAX_BLOCK_COLS = 8192
FORWARD_TILE = 8192  # elements per forward program: several rows per program when rows are narrow
BACKWARD_TILE = 8192  # elements per backward step (benchmarks/NOTES.md §13: 2 rows of 4096 a step beat 1)
MAX_BLOCK_ROWS = 256
ELEMENTS_PER_THREAD = 16  # of the tile: sets num_warps
# Backward programs resident per multiprocessor: ~128 registers a thread (no spills, compiled for sm_90) fit
# 512 threads. More programs than fit would only add rows to the partial-sum buffer.
BACKWARD_THREADS_PER_SM = 512
# Blocks of rows a backward program has in flight (software pipelining through shared memory): STAGES - 1
# tiles of d_y and x wait in shared memory, 64 KiB a program for 3 stages of an 8192-element bf16 tile (on
# the H200, 3 stages beat 4 by 4-8% at H = 4096 and 8192: NOTES.md §13). Fewer stages where that would exceed
# BACKWARD_SHARED_BYTES or half the device's shared memory per block.
BACKWARD_STAGES = 3
BACKWARD_SHARED_BYTES = 96 * 1024


@jit
def _rms_norm_forward_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    eps,
    offset,
    LLAMA: constexpr,
    STORE_RSTD: constexpr,
    BLOCK_ROWS: constexpr,
    BLOCK_COLS: constexpr,
    ONE_BLOCK: constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows[:, None] * x_row_stride
    y_rows = y_ptr + rows[:, None] * n_cols
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_COLS)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        x_normed = x * rstd[:, None]
        if LLAMA:  # round x_normed to x's dtype before the product, as the eager module does
            x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_rows + cols[None, :], (x_normed * weight[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
            x_normed = x * rstd[:, None]
            if LLAMA:
                x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_rows + cols[None, :], (x_normed * weight[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# With x_normed = x * rstd and y = w * x_normed (w = offset + weight):
#   d_x = rstd * (d_xn - x_normed * mean(d_xn * x_normed)),  d_xn = d_y * w   (rstd depends on the whole row)
#   d_weight = sum over rows of d_y * x_normed                (x_normed rounded to x's dtype for llama)


@jit
def _rms_norm_backward_kernel(
    d_y_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    d_x_ptr,
    d_weight_ptr,
    n_rows,
    n_cols,
    d_y_row_stride,
    x_row_stride,
    blocks_per_program,
    offset,
    LLAMA: constexpr,
    STORE_D_X: constexpr,
    STORE_D_WEIGHT: constexpr,
    BLOCK_ROWS: constexpr,
    BLOCK_COLS: constexpr,
    ONE_BLOCK: constexpr,
    STAGES: constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n_programs = tl.num_programs(0).to(tl.int64)
    d_weight_row = d_weight_ptr + pid * n_cols
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        d_weight = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        # STAGES: the compiler pipelines this loop, copying the next STAGES - 1 blocks of d_y and x into shared
        # memory (cp.async) while this one is computed, so each program keeps several blocks in flight.
        for block in tl.range(0, blocks_per_program, num_stages=STAGES):
            rows = (block * n_programs + pid) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            d_y = tl.load(d_y_ptr + rows[:, None] * d_y_row_stride + cols[None, :], mask=mask, other=0.0)
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            d_y = d_y.to(tl.float32)
            x_normed = x.to(tl.float32) * rstd[:, None]
            if STORE_D_X:
                d_x_normed = d_y * weight[None, :]
                mean_dot = tl.sum(d_x_normed * x_normed, axis=1) / n_cols
                d_x = (d_x_normed - x_normed * mean_dot[:, None]) * rstd[:, None]
                tl.store(d_x_ptr + rows[:, None] * n_cols + cols[None, :], d_x.to(d_x_ptr.dtype.element_ty), mask=mask)
            if STORE_D_WEIGHT:
                if LLAMA:
                    x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
                d_weight += d_y * x_normed
        if STORE_D_WEIGHT:
            tl.store(d_weight_row + cols, tl.sum(d_weight, axis=0), mask=col_mask)
    else:  # wide rows, one at a time; this program's partial sum lives in its row of the buffer
        if STORE_D_WEIGHT:
            for start in range(0, n_cols, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                tl.store(d_weight_row + cols, tl.zeros([BLOCK_COLS], dtype=tl.float32), mask=cols < n_cols)
        for block in range(blocks_per_program):
            row = block * n_programs + pid
            if row < n_rows:
                rstd = tl.load(rstd_ptr + row)
                d_y_row = d_y_ptr + row * d_y_row_stride
                x_row = x_ptr + row * x_row_stride
                dot = tl.zeros([BLOCK_COLS], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK_COLS):
                    cols = start + tl.arange(0, BLOCK_COLS)
                    mask = cols < n_cols
                    d_y = tl.load(d_y_row + cols, mask=mask, other=0.0).to(tl.float32)
                    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
                    dot += d_y * weight * x
                mean_dot = tl.sum(dot, axis=0) * rstd / n_cols  # mean(d_xn * x_normed)
                for start in range(0, n_cols, BLOCK_COLS):
                    cols = start + tl.arange(0, BLOCK_COLS)
                    mask = cols < n_cols
                    d_y = tl.load(d_y_row + cols, mask=mask, other=0.0).to(tl.float32)
                    x_normed = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * rstd
                    if STORE_D_X:
                        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
                        d_x = (d_y * weight - x_normed * mean_dot) * rstd
                        tl.store(d_x_ptr + row * n_cols + cols, d_x.to(d_x_ptr.dtype.element_ty), mask=mask)
                    if STORE_D_WEIGHT:
                        if LLAMA:
                            x_normed = x_normed.to(x_ptr.dtype.element_ty).to(tl.float32)
                        partial = tl.load(d_weight_row + cols, mask=mask, other=0.0)
                        tl.store(d_weight_row + cols, partial + d_y * x_normed, mask=mask)


# The weight gradient: the programs' partial sums added in a fixed order (deterministic), and cast to the
# weight's dtype in the same pass; one launch where torch's sum and cast would take two. Each program loads
# all partial rows of its columns at once (up to SUM_MAX_PARTIALS rows a step): the kernel is short, so one
# round trip to memory instead of several is most of its time.
SUM_TILE = 2048
SUM_MAX_PARTIALS = 512


def _sum_config(programs: int) -> tuple[int, int]:
    block_partials = min(_backend.next_power_of_2(programs), SUM_MAX_PARTIALS)
    return block_partials, max(1, SUM_TILE // block_partials)


@jit
def _sum_partials_kernel(
    partial_ptr, d_weight_ptr, n_partials, n_cols, BLOCK_PARTIALS: constexpr, BLOCK_COLS: constexpr
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    total = tl.zeros([BLOCK_PARTIALS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_PARTIALS):
        partials = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (partials < n_partials)[:, None] & col_mask[None, :]
        total += tl.load(partial_ptr + partials[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(d_weight_ptr + cols, tl.sum(total, axis=0).to(d_weight_ptr.dtype.element_ty), mask=col_mask)


# Launch parameters depend on H only; computed once per width (and cleared when the constants above change).
_CONFIGS = {}
_SLOTS = {}
_STAGES = {}


def clear_launch_cache() -> None:
    """Forget the cached launch parameters (after changing the constants above, e.g. in a benchmark sweep)."""
    _CONFIGS.clear()
    _STAGES.clear()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv, a constexpr function whose host-side call costs microseconds


def _warps(elements: int) -> int:
    return max(1, min(16, elements // (32 * ELEMENTS_PER_THREAD)))


def _config(n_cols: int):
    """(ONE_BLOCK, BLOCK_COLS, forward BLOCK_ROWS, forward warps, backward BLOCK_ROWS, backward warps,
    backward programs per multiprocessor)."""
    config = _CONFIGS.get(n_cols)
    if config is None:
        one_block = n_cols <= MAX_BLOCK_COLS
        block_cols = _backend.next_power_of_2(n_cols) if one_block else MAX_BLOCK_COLS
        forward_rows = min(MAX_BLOCK_ROWS, max(1, FORWARD_TILE // block_cols)) if one_block else 1
        backward_rows = min(MAX_BLOCK_ROWS, max(1, BACKWARD_TILE // block_cols)) if one_block else 1
        backward_warps = _warps(backward_rows * block_cols)
        config = _CONFIGS[n_cols] = (
            one_block,
            block_cols,
            forward_rows,
            _warps(forward_rows * block_cols),
            backward_rows,
            backward_warps,
            max(1, BACKWARD_THREADS_PER_SM // (32 * backward_warps)),
        )
    return config


def _program_slots(device: torch.device) -> int:
    """Multiprocessors (CUDA/ROCm) or Xe cores (XPU); the interpreter on CPU gets 2, so that tests run
    several programs, each over several blocks of rows."""
    slots = _SLOTS.get(device)
    if slots is None:
        if device.type == "cuda":
            slots = torch.cuda.get_device_properties(device).multi_processor_count
        elif device.type == "xpu":
            properties = torch.xpu.get_device_properties(device)
            slots = getattr(properties, "gpu_subslice_count", None) or getattr(properties, "max_compute_units", 64)
        else:
            slots = 2
        _SLOTS[device] = slots
    return slots


def _shared_bytes_per_block(device: torch.device) -> int:
    """Shared memory a program may take: the opt-in maximum on CUDA (227 KiB on Hopper), the LDS size on
    ROCm (which reports no opt-in figure), 64 KiB elsewhere."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
            value = getattr(properties, name, None)
            if value:
                return value
        return 48 * 1024
    return 64 * 1024


def _backward_stages(n_cols: int, x_dtype, d_y_dtype, device: torch.device) -> int:
    key = (n_cols, x_dtype, d_y_dtype, device)
    stages = _STAGES.get(key)
    if stages is None:
        _, block_cols, _, _, block_rows, _, _ = _config(n_cols)
        stage_bytes = block_rows * block_cols * (x_dtype.itemsize + d_y_dtype.itemsize)
        budget = min(BACKWARD_SHARED_BYTES, _shared_bytes_per_block(device) // 2)
        stages = _STAGES[key] = max(1, min(BACKWARD_STAGES, 1 + budget // stage_bytes))
    return stages


def _backward_grid(n_rows: int, n_cols: int, device: torch.device):
    """(programs, blocks of BLOCK_ROWS rows per program): as many programs as fit on the device at once,
    each with an equal share of the rows; every program gets at least one block."""
    _, _, _, _, block_rows, _, programs_per_sm = _config(n_cols)
    row_blocks = _cdiv(n_rows, block_rows)
    blocks_per_program = _cdiv(row_blocks, min(row_blocks, _program_slots(device) * programs_per_sm))
    return _cdiv(row_blocks, blocks_per_program), blocks_per_program


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, H] with a unit column stride, without a copy where its leading dims collapse."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that do not collapse into one row stride
        return t.reshape(-1, t.shape[-1])


def _forward_triton(x, weight, eps, offset, llama, store_rstd):
    rows = _as_rows(x)
    if weight.stride(0) != 1:  # the kernels read it element after element: a strided or expanded view is copied
        weight = weight.contiguous()
    n_rows, n_cols = rows.shape
    one_block, block_cols, block_rows, warps, _, _, _ = _config(n_cols)
    y = _backend.new_tensor(x.shape, dtype=_out_dtype(x, weight, llama), device=x.device)
    rstd = _backend.new_tensor((n_rows,), dtype=torch.float32, device=x.device) if store_rstd else y
    launch(
        _rms_norm_forward_kernel,
        (_cdiv(n_rows, block_rows),),
        (
            rows,
            weight,
            y,
            rstd,
            n_rows,
            n_cols,
            rows.stride(0),
            eps,
            offset,
        ),
        LLAMA=llama,
        STORE_RSTD=store_rstd,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        ONE_BLOCK=one_block,
        num_warps=warps,
    )
    return y, (rstd if store_rstd else None)


def _backward_triton(d_y, x, weight, rstd, offset, llama, needs_x, needs_w):
    rows, d_y_rows = _as_rows(x), _as_rows(d_y)
    if weight.stride(0) != 1:  # (as in forward)
        weight = weight.contiguous()
    n_rows, n_cols = rows.shape
    one_block, block_cols, _, _, block_rows, warps, _ = _config(n_cols)
    programs, blocks_per_program = _backward_grid(n_rows, n_cols, x.device)
    d_x = _backend.new_tensor(x.shape, dtype=x.dtype, device=x.device) if needs_x else rows
    partial = _backend.new_tensor((programs, n_cols), dtype=torch.float32, device=x.device) if needs_w else rows
    launch(
        _rms_norm_backward_kernel,
        (programs,),
        (
            d_y_rows,
            rows,
            weight,
            rstd,
            d_x,
            partial,
            n_rows,
            n_cols,
            d_y_rows.stride(0),
            rows.stride(0),
            blocks_per_program,
            offset,
        ),
        LLAMA=llama,
        STORE_D_X=needs_x,
        STORE_D_WEIGHT=needs_w,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        ONE_BLOCK=one_block,
        STAGES=_backward_stages(n_cols, x.dtype, d_y.dtype, x.device),
        num_warps=warps,
    )
    d_weight = None
    if needs_w:
        d_weight = _backend.new_tensor((n_cols,), dtype=weight.dtype, device=x.device)
        block_partials, block_cols = _sum_config(programs)
        launch(
            _sum_partials_kernel,
            (_cdiv(n_cols, block_cols),),
            (partial, d_weight, programs, n_cols),
            BLOCK_PARTIALS=block_partials,
            BLOCK_COLS=block_cols,
        )
    return (d_x if needs_x else None), d_weight


# ----------------------------------------------------------------------------------------------------------
# PyTorch path: the same math with PyTorch ops. These are differentiable, which the double backward and
# torch.func use. With offset 0 the llama output is the eager module's own expression.


def _forward_torch(x, weight, eps, offset, llama, rstd=None):
    compute = _compute_dtype(x, weight)
    x_c = x.to(compute)
    if rstd is None:
        rstd = torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)
    x_normed = x_c * rstd
    if llama:
        if offset == 0.0:
            return weight * x_normed.to(x.dtype), rstd
        y = (weight.to(compute) + offset) * x_normed.to(x.dtype)
        return y.to(_out_dtype(x, weight, llama)), rstd
    return (x_normed * (offset + weight.to(compute))).to(x.dtype), rstd


def _backward_torch(d_y, x, weight, rstd, eps, offset, llama, needs_x=True, needs_w=True):
    """``rstd``: [rows] as the forward saved it, or None to recompute it (differentiably) from ``x``."""
    compute = _compute_dtype(x, weight)
    x_c = x.to(compute)
    if rstd is None:
        rstd = torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)
    else:
        rstd = rstd.view(*x.shape[:-1], 1)
    x_normed = x_c * rstd
    d_y = d_y.to(compute)
    d_x = d_weight = None
    if needs_x:
        d_x_normed = d_y * (weight.to(compute) + offset)
        d_x = (d_x_normed - x_normed * (d_x_normed * x_normed).mean(-1, keepdim=True)) * rstd
        d_x = d_x.to(x.dtype)
    if needs_w:
        if llama:
            x_normed = x_normed.to(x.dtype).to(compute)
        d_weight = (d_y * x_normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return d_x, d_weight


# ----------------------------------------------------------------------------------------------------------
# Dispatch, for validated inputs.


def _rows_of(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def norm_forward(x, weight, eps, offset, llama, store_rstd, triton=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, rstd)``; ``rstd`` ([rows], fp32 or fp64) only with ``store_rstd``. No autograd. ``triton``: the
    backend, when the caller has already asked ``_use_triton``."""
    if x.numel() == 0:
        y = torch.empty(x.shape, dtype=_out_dtype(x, weight, llama), device=x.device)
        rstd = torch.empty(_rows_of(x), dtype=_compute_dtype(x, weight), device=x.device)
        return y, (rstd if store_rstd else None)
    if _use_triton(x, weight) if triton is None else triton:
        return _forward_triton(x, weight, eps, offset, llama, store_rstd)
    y, rstd = _forward_torch(x, weight, eps, offset, llama)
    return y, (rstd.reshape(-1) if store_rstd else None)


def norm_backward(d_y, x, weight, rstd, eps, offset, llama, needs_x=True, needs_w=True, triton=None):
    """``(d_x, d_weight)``, None where not needed. With grad mode on (``create_graph=True``) or torch.func's
    wrapped tensors, the differentiable PyTorch formulas, with ``rstd`` recomputed from ``x``. ``triton``:
    the backend the forward ran (its ``rstd`` is fp32 either way), or None to ask ``_use_triton``."""
    if x.numel() == 0:
        d_x = torch.zeros_like(x) if needs_x else None
        d_weight = torch.zeros_like(weight) if needs_w else None
        return d_x, d_weight
    if d_y.shape != x.shape:  # a broadcast gradient
        d_y = d_y.expand(x.shape)
    # (and a gradient batched by the legacy vmap of autograd.grad(is_grads_batched=True): no storage either)
    if torch.is_grad_enabled() or _needs_composite(d_y, x) or _backend.legacy_batched(d_y):
        return _backward_torch(d_y, x, weight, None, eps, offset, llama, needs_x, needs_w)
    if (_use_triton(x, weight) if triton is None else triton) and rstd.dtype == torch.float32:
        return _backward_triton(d_y, x, weight, rstd, offset, llama, needs_x, needs_w)
    return _backward_torch(d_y, x, weight, rstd, eps, offset, llama, needs_x, needs_w)


# ----------------------------------------------------------------------------------------------------------
# torch.library ops: under torch.compile rms_norm is one opaque op (no graph break, scalars stay Python
# numbers), with a fake (shape) implementation and autograd. The namespace is the package's module name,
# unique per loaded build.


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_forward", mutates_args=())
def rms_norm_forward_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, llama: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_forward(x, weight, eps, offset, llama, store_rstd=True)


@rms_norm_forward_op.register_fake
def _(x, weight, eps, offset, llama):
    y = x.new_empty(x.shape, dtype=_out_dtype(x, weight, llama))
    return y, x.new_empty((_rows_of(x),), dtype=_compute_dtype(x, weight))


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    d_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    llama: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_backward(d_y, x, weight, rstd, eps, offset, llama)


@rms_norm_backward_op.register_fake
def _(d_y, x, weight, rstd, eps, offset, llama):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _op_setup_context(ctx, inputs, output):
    x, weight, eps, offset, llama = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.args = (eps, offset, llama)
    ctx.mark_non_differentiable(output[1])


def _op_backward(ctx, d_y, d_rstd):
    x, weight, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable formulas
        d_x, d_weight = _backward_torch(d_y, x, weight, None, *ctx.args)
    else:
        d_x, d_weight = rms_norm_backward_op(d_y, x, weight, rstd, *ctx.args)
    needs = ctx.needs_input_grad
    return (d_x if needs[0] else None), (d_weight if needs[1] else None), None, None, None


torch.library.register_autograd(rms_norm_forward_op, _op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Eager autograd: a ctx-style Function (its apply costs the host least; see _gated.py).


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, llama):
        ctx.triton = None
        if _backend.exporting():  # the public Function under torch.export: aten ops only, as rms_norm
            ctx.triton = False
            y, rstd = _forward_torch(x, weight, eps, offset, llama)
            rstd = rstd.reshape(-1)
        elif torch.compiler.is_compiling():
            y, rstd = rms_norm_forward_op(x, weight, eps, offset, llama)
        else:
            ctx.triton = _use_triton(x, weight)  # asked once for both passes (it reads the environment)
            y, rstd = norm_forward(x, weight, eps, offset, llama, store_rstd=True, triton=ctx.triton)
        ctx.save_for_backward(x, weight, rstd)
        ctx.args = (eps, offset, llama)
        return y

    @staticmethod
    def backward(ctx, d_y):
        x, weight, rstd = ctx.saved_tensors
        needs_x, needs_w = ctx.needs_input_grad[:2]
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            d_x, d_weight = rms_norm_backward_op(d_y, x, weight, rstd, *ctx.args)
        else:
            d_x, d_weight = norm_backward(d_y, x, weight, rstd, *ctx.args, needs_x, needs_w, ctx.triton)
        return (d_x if needs_x else None), (d_weight if needs_w else None), None, None, None


class LigerRMSNormFunction(_RMSNorm):
    """``LigerRMSNormFunction.apply(x, weight, eps=1e-6, offset=0.0, casting="llama")``: RMSNorm with autograd
    (see the module docstring for the castings). The first five positional arguments of the peer
    liger-kernel's Function, whose ``casting_mode`` takes the same values for these two castings."""

    @staticmethod
    def forward(ctx, x, weight, eps=1e-6, offset=0.0, casting="llama"):
        eps, offset, llama = check_inputs(x, weight, eps, offset, casting)
        return _RMSNorm.forward(ctx, x, weight, eps, offset, llama)


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama"):
    """RMSNorm of ``x`` ([*, H]) with ``weight`` ([H]); see the module docstring. Under torch.compile a
    torch.library op; under torch.func or export, or for tensor subclasses, the differentiable PyTorch form."""
    eps, offset, llama = check_inputs(x, weight, eps, offset, casting)
    if torch.compiler.is_compiling():
        if _backend.exporting() or _backend.forward_ad_active():  # the custom op has no forward-AD rule
            return _forward_torch(x, weight, eps, offset, llama)[0]
        return rms_norm_forward_op(x, weight, eps, offset, llama)[0]
    if _needs_composite(x, weight):
        return _forward_torch(x, weight, eps, offset, llama)[0]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, offset, llama)
    return norm_forward(x, weight, eps, offset, llama, store_rstd=False)[0]
