"""Weight-gradient sums over shards: in fp32 (fp64 for fp64) whatever the parameters' dtype, cast once; or,
for bf16 parameters over at most MAX_NARROW_SUM_SHARDS shards, in bf16 itself.

Against float64, summing bf16 weight gradients in bf16 (each shard's product added in one rounding) gave
1.22x the untiled bf16 error over 2 shards, 1.58x over 4, 2.1x over 8 and 5.7x over 64 (H 256, I 512, 8192
tokens); the contract is 1.5x. Up to 2 shards the fp32 sums (3 H I x 4 bytes for a gated MLP, twice the
weights) are not needed, and tiling then saves memory wherever it splits the activations at all. Not fp16:
each shard's product is rounded before the sum, and with fp16's range one shard's can overflow where the
total would not."""

import torch

from . import _backend
from ._backend import constexpr, jit, tl, use_triton
from ._launch import launch

MAX_NARROW_SUM_SHARDS = 2
NARROW = (torch.bfloat16,)


def narrow_sums(num_shards: int, dtype: torch.dtype) -> bool:
    """Whether gradients of a ``dtype`` parameter over ``num_shards`` shards are summed in ``dtype`` itself."""
    return dtype in NARROW and num_shards <= MAX_NARROW_SUM_SHARDS


def accumulate(total, grad, narrow: bool = False):
    """total + grad, the sum kept wide (or in grad's dtype when ``narrow``)."""
    if grad is None:
        return total
    if total is None:
        wide = grad.dtype if narrow else torch.promote_types(grad.dtype, torch.float32)
        # A tensor of our own to add into: autograd may hand back a gradient that aliases another one.
        return grad.to(wide) if grad.dtype != wide else grad.clone()
    return total.add_(grad)


def mm_widens(device: torch.device, into: bool = False) -> bool:
    """Whether this PyTorch's mm/addmm take ``out_dtype`` (fp32 results of low-precision GEMMs) on ``device``:
    the GEMM then adds its product into the fp32 sum directly, with no low-precision product and no extra pass.
    ``into``: whether mm also writes such a result into a given tensor (``out=``)."""
    known = _MM_WIDENS.get((device.type, into))
    if known is None:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        out = torch.empty(1, 1, dtype=torch.float32, device=device) if into else None
        try:
            known = torch.mm(a, a, out_dtype=torch.float32, out=out).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):  # no out_dtype in this build, or not on this device
            known = False
        _MM_WIDENS[(device.type, into)] = known
    return known


_MM_WIDENS = {}  # (device type, into) -> bool, probed once


def add_matmul(total, a, b, narrow: bool = False):
    """total + a @ b, total kept wide however low a and b are (or in a's dtype when ``narrow``: the GEMM adds
    its fp32 product into it with one rounding)."""
    wide = a.dtype if narrow else torch.promote_types(a.dtype, torch.float32)
    if a.dtype == wide:
        return a @ b if total is None else total.addmm_(a, b)
    if mm_widens(a.device):
        if total is None:
            return torch.mm(a, b, out_dtype=wide)
        return torch.addmm(total, a, b, out_dtype=wide, out=total)
    return (a @ b).to(wide) if total is None else total.add_(a @ b)


def matmul_into(total, a, b, narrow: bool = False, first: bool = False):
    """a @ b added into ``total``, a preallocated sum (a slice of one, for column blocks), or written into it
    by the GEMM itself where ``first`` (nothing to read or zero first)."""
    if not first:
        return add_matmul(total, a, b, narrow)
    if a.dtype == total.dtype:
        return torch.mm(a, b, out=total)
    if mm_widens(a.device, into=True):
        return torch.mm(a, b, out_dtype=total.dtype, out=total)
    return add_matmul(total.zero_(), a, b, narrow)


def row_sum(grad, narrow: bool = False):
    """A shard's bias gradient, the sum of ``grad``'s rows: kept wide (not rounded to grad's dtype before it
    joins the wide sum, as a GEMM's product is not), or in grad's dtype when ``narrow``."""
    return grad.sum(0) if narrow else grad.sum(0, dtype=torch.promote_types(grad.dtype, torch.float32))


def cast_each(sums, params):
    """The sums cast to their parameters' dtypes, each sum freed as soon as it is cast, so that the wide and
    the low-precision copies of all weights never coexist."""
    grads = []
    for i, p in enumerate(params):
        grads.append(None if sums[i] is None else sums[i].to(p.dtype))
        sums[i] = None
    return grads


@jit
def _cast_transposed_kernel(total_ptr, grad_ptr, rows, cols, col_tiles, BLOCK: constexpr):
    # grad[c, r] = total[r, c] in grad's dtype, one BLOCK x BLOCK tile per program. Triton loads the tile along
    # total's rows and stores it along grad's, swapping the layout through shared memory, so both the read and
    # the write are coalesced (PyTorch's copy of a transposed view writes element by element).
    tile = tl.program_id(0)
    r = (tile // col_tiles) * BLOCK + tl.arange(0, BLOCK)
    c = (tile % col_tiles) * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    values = tl.load(total_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask)
    tl.store(grad_ptr + c[None, :].to(tl.int64) * rows + r[:, None], values.to(grad_ptr.dtype.element_ty), mask=mask)


CAST_BLOCK = 64


def cast_transposed(total, dtype):
    """``total.t()`` as a contiguous tensor of ``dtype``, in one pass: the gradient of a weight whose sum was
    kept transposed (``_tiled_gated``'s column blocks add into rows of the down projection's sum)."""
    rows, cols = total.shape
    grad = _backend.new_tensor((cols, rows), dtype=dtype, device=total.device)
    if (
        total.dtype in _backend.TRITON_DTYPES
        and dtype in _backend.TRITON_DTYPES
        and use_triton(total)
        and total.is_contiguous()
        and total.numel() > 0
    ):
        col_tiles = (cols + CAST_BLOCK - 1) // CAST_BLOCK
        grid = (((rows + CAST_BLOCK - 1) // CAST_BLOCK) * col_tiles,)
        launch(_cast_transposed_kernel, grid, (total, grad, rows, cols, col_tiles), BLOCK=CAST_BLOCK, num_warps=4)
        return grad
    return grad.copy_(total.t())
