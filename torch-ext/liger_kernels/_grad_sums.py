"""Weight-gradient sums over shards: in fp32 (fp64 for fp64) whatever the parameters' dtype, cast once."""

import torch


def accumulate(total, grad):
    """total + grad, the sum kept wide."""
    if grad is None:
        return total
    if total is None:
        wide = torch.promote_types(grad.dtype, torch.float32)
        # A tensor of our own to add into: autograd may hand back a gradient that aliases another one.
        return grad.to(wide) if grad.dtype != wide else grad.clone()
    return total.add_(grad)


def _mm_widens(device: torch.device) -> bool:
    """Whether this PyTorch's mm/addmm take ``out_dtype`` (fp32 results of low-precision GEMMs) on ``device``:
    the GEMM then adds its product into the fp32 sum directly, with no low-precision product and no extra pass."""
    known = _MM_WIDENS.get(device.type)
    if known is None:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        try:
            known = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):  # no out_dtype in this build, or not on this device
            known = False
        _MM_WIDENS[device.type] = known
    return known


_MM_WIDENS = {}  # device type -> bool, probed once


def add_matmul(total, a, b):
    """total + a @ b, total kept wide however low a and b are."""
    wide = torch.promote_types(a.dtype, torch.float32)
    if a.dtype == wide:
        return a @ b if total is None else total.addmm_(a, b)
    if _mm_widens(a.device):
        if total is None:
            return torch.mm(a, b, out_dtype=wide)
        return torch.addmm(total, a, b, out_dtype=wide, out=total)
    return (a @ b).to(wide) if total is None else total.add_(a @ b)


def cast_each(sums, params):
    """The sums cast to their parameters' dtypes, each sum freed as soon as it is cast, so that the wide and
    the low-precision copies of all weights never coexist."""
    grads = []
    for i, p in enumerate(params):
        grads.append(None if sums[i] is None else sums[i].to(p.dtype))
        sums[i] = None
    return grads
