"""How a tiled call is laid out: whether it tiles at all, how many shards, and where they start.

* The shard count is a function of the shapes alone, so it needs no communication: ceil(S / H) shards, so
  that each shard's S x I intermediates are about the size of one weight matrix; but no shard of fewer than
  MIN_SHARD_TOKENS rows (batch x shard length), below which the GEMMs lose efficiency and each shard's own
  host cost (a Python-level loop step with its own launches) shows; and at most MAX_AUTO_SHARDS.
* Under torch.distributed no collective runs, except where the parameters are gathered inside each shard
  (DeepSpeed ZeRO-3 parameters, or FSDP2 units inside the MLP): there ranks must run the same number of
  shards or a rank would wait forever in a gather, so the count is the maximum over ranks. Such engines
  already require every rank to call the module; nothing else pays for a collective (rank-0-only
  evaluation, generation, MoE experts called a different number of times per rank).
* Some calls run untiled, because only the plain call is exact there (``untiled_reason``), or because
  tiling would not lower the peak (``tiling_pays``).
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from ._gated import transforms_active
from ._grad_sums import narrow_sums

OP = "apply_tiled_mlp"
MAX_AUTO_SHARDS = 100
# Measured on an H200 (benchmarks/NOTES.md §13): bf16 GEMMs of M = 1024 rows run at 60-75% of their large-M
# rate for H = 1024 and M = 2048 at 85%; each shard costs ~0.5 ms of host time. At H 1024, I 2816 and S 8192,
# 4 shards of 2048 tokens take 3.2 ms where ceil(S / H) = 8 shards took 5.5. From H = 2048 on, ceil(S / H)
# shards are already at least this long.
MIN_SHARD_TOKENS = 2048


def check_num_shards(num_shards) -> int | None:
    if num_shards is None:
        return None
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{OP}: `num_shards` must be None (automatic) or an int >= 1, got {num_shards!r}")
    return num_shards


def auto_num_shards(x: torch.Tensor) -> int:
    """min(ceil(S / H), rows // MIN_SHARD_TOKENS, MAX_AUTO_SHARDS), at least 1 (see the module docstring). The
    minimum counts the rows a shard's GEMMs see: batch x shard length, so a batch of short sequences tiles."""
    seq_len, hidden = x.shape[-2], x.shape[-1]
    rows = math.prod(x.shape[:-1])
    return max(1, min(math.ceil(seq_len / max(hidden, 1)), rows // MIN_SHARD_TOKENS, MAX_AUTO_SHARDS))


def num_shards_for(requested: int | None, x: torch.Tensor, gathers_per_shard: bool) -> int:
    if requested is not None:
        return requested
    count = auto_num_shards(x)
    return harmonize_num_shards(count, x) if gathers_per_shard else count


def harmonize_num_shards(num_shards: int, x: torch.Tensor) -> int:
    """The maximum over ranks (extra shards are empty), for engines that gather parameters per shard."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return num_shards
    device = torch.device("cpu") if dist.get_backend() == "gloo" or x.device.type == "meta" else x.device
    count = torch.tensor([num_shards], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def shard_bounds(seq_len: int, num_shards: int) -> list[tuple]:
    """(start, length) of each shard; sizes differ by at most one, trailing shards may be empty."""
    base, extra = divmod(seq_len, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        length = base + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def gathers_per_shard(mlp_module, zero3_params) -> bool:
    """Whether the module's parameters are gathered inside every shard's call: ZeRO-3 parameters (among
    ``zero3_params``, or any of the module's own, trainable or frozen: a frozen one is gathered all the same),
    or FSDP2 units strictly inside the MLP (an FSDP2 unit at the MLP or above gathers once around the call)."""
    if zero3_params:
        return True
    if isinstance(mlp_module, nn.Module) and any(hasattr(p, "ds_id") for p in mlp_module.parameters()):
        return True
    fsdp = _fsdp_module_class()
    if fsdp is None or not isinstance(mlp_module, nn.Module):
        return False
    return any(isinstance(m, fsdp) for m in mlp_module.modules() if m is not mlp_module)


def _has_backward_hooks(mlp_module) -> bool:
    hooks = nn.modules.module
    if hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        return True
    if not isinstance(mlp_module, nn.Module):
        return False
    return any(m._backward_hooks or m._backward_pre_hooks for m in mlp_module.modules() if m is not mlp_module)


def _has_forward_hooks(mlp_module) -> bool:
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    if not isinstance(mlp_module, nn.Module):
        return False
    return any(m._forward_hooks or m._forward_pre_hooks for m in mlp_module.modules() if m is not mlp_module)


def _has_buffers(mlp_module) -> bool:
    return isinstance(mlp_module, nn.Module) and next(mlp_module.buffers(), None) is not None


def untiled_reason(mlp_module, x: torch.Tensor, params) -> str | None:
    """Why this call must run as the plain ``fn(mlp_module, x)``, or None to tile it.

    * torch.func transforms: their wrapped tensors cannot cross the tiled Function's recompute.
    * Module backward hooks inside the MLP (gradient monitors, per-layer clipping, K-FAC): tiled, they would
      fire once per shard with a slice of the gradient instead of once with all of it. (A hook on the MLP
      module itself fires around the whole call either way.)
    * Module forward hooks inside the MLP, and buffers (spectral_norm's power iteration, running
      statistics): both may carry state from call to call, and a tiled call runs each module once per shard
      in forward and again in the recompute. DeepSpeed ZeRO-3 and FSDP2 hooks only gather and release
      parameters: those modules still tile.
    """
    if transforms_active(x, *params):
        return "torch.func transform"
    if _has_backward_hooks(mlp_module):
        return "module backward hooks"
    engine = gathers_per_shard(mlp_module, [p for p in params if hasattr(p, "ds_id")])
    if not engine and _has_forward_hooks(mlp_module):
        return "module forward hooks"
    if _has_buffers(mlp_module):
        return "module buffers"
    return None


def tiling_pays(
    tokens: int, hidden: int, intermediate: int, itemsize: int, num_shards: int, weight_dtype=None, summed: int = 3
) -> bool:
    """Whether the tiled gated MLP holds less memory at its peak than the fused untiled one, for ``tokens``
    rows of width ``hidden``, ``intermediate`` columns in the MLP and activations of ``itemsize`` bytes;
    ``weight_dtype`` (the projections'; None: bf16 for 2-byte activations, fp32 otherwise) sets the sums';
    ``summed``: how many of the three projections have gradients to sum (the frozen ones have none).

    Untiled, gate, up and the activation's output (the down projection's input) live from forward to
    backward, and backward adds d_hidden: about 4 x tokens x I activations. Tiled, the same four exist for one
    shard at a time, and low-precision weights add fp32 gradient sums for the three projections (3 x H x I x 4
    bytes; fp32 weights, and bf16 ones over at most MAX_NARROW_SUM_SHARDS shards, sum in their own dtype:
    _grad_sums). What both hold alike (x, the output, the weights' gradients) cancels. Shapes only: no sync,
    no collective, the same answer on every rank."""
    if num_shards <= 1:
        return False
    per_activation = tokens * intermediate * itemsize
    saved = 4 * per_activation * (1.0 - 1.0 / num_shards)
    if weight_dtype is None:
        weight_dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    wide_sums = weight_dtype.itemsize < 4 and not narrow_sums(num_shards, weight_dtype)
    sums = summed * hidden * intermediate * 4 if wide_sums else 0
    return saved > sums
