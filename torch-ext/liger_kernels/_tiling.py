"""How a tiled call is laid out: whether it tiles at all, how many shards, and where they start.

* The shard count is a function of the shapes alone, so it needs no communication: ceil(S / H) shards, so
  that each shard's S x I intermediates are about the size of one weight matrix; but no shard of fewer than
  MIN_SHARD_TOKENS rows (batch x shard length), below which the GEMMs lose efficiency and each shard's own
  host cost (a Python-level loop step with its own launches) shows; and at most MAX_AUTO_SHARDS. On the
  gated fast path that count runs as half as many shards of two column blocks of I (``split_columns``).
* Under torch.distributed no collective runs, except where DeepSpeed gathers the parameters inside each
  shard (a user's fn calling ZeRO-3 projections of an MLP that is not a ZeRO-3 leaf; see _zero3 for the
  layouts that gather once per call instead): there ranks must run the same number of shards or a rank
  would wait forever in a gather, so the count is the maximum over ranks. ZeRO-3 already requires every rank
  to call the module; nothing else pays for a collective (rank-0-only evaluation, generation, MoE experts
  called a different number of times per rank).
* Some calls run untiled, because only the plain call is exact there (``untiled_reason``), or because
  tiling would not lower the peak (``tiling_pays``).
"""

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import _zero3
from ._gated import transforms_active
from ._grad_sums import narrow_sums

OP = "apply_tiled_mlp"
MAX_AUTO_SHARDS = 100
# Measured on an H200 (benchmarks/NOTES.md §13): bf16 GEMMs of M = 1024 rows run at 60-75% of their large-M
# rate for H = 1024 and M = 2048 at 85%; each shard costs ~0.5 ms of host time. At H 1024, I 2816 and S 8192,
# 4 shards of 2048 tokens take 3.2 ms where ceil(S / H) = 8 shards took 5.5. From H = 2048 on, ceil(S / H)
# shards are already at least this long.
MIN_SHARD_TOKENS = 2048
# The host's cost per shard is fixed (a loop step of Python and launches, ~0.4 ms), so for a narrow MLP a
# shard must also carry enough GEMM work: rows x H x I multiply-adds per projection of at least what a
# 2048-token shard does at H 2048, I 8192. At H 1024, I 2816, S 8192 (the whole fused MLP 1.45 ms) the token
# rule alone gave 4 shards and 3.8 ms; this one leaves that MLP untiled (benchmarks/NOTES.md §14).
MIN_SHARD_WORK = 2048 * 2048 * 8192


def check_num_shards(num_shards) -> int | None:
    if num_shards is None:
        return None
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{OP}: `num_shards` must be None (automatic) or an int >= 1, got {num_shards!r}")
    return num_shards


def auto_num_shards(x: torch.Tensor, intermediate: int | None = None) -> int:
    """min(ceil(S / H), rows // min_rows, MAX_AUTO_SHARDS), at least 1 (see the module docstring), where
    min_rows is MIN_SHARD_TOKENS, or for an MLP of ``intermediate`` columns enough rows for MIN_SHARD_WORK if
    that is more. The minimum counts the rows a shard's GEMMs see: batch x shard length, so a batch of short
    sequences tiles."""
    seq_len, hidden = x.shape[-2], x.shape[-1]
    rows = math.prod(x.shape[:-1])
    min_rows = MIN_SHARD_TOKENS
    if intermediate:
        min_rows = max(min_rows, math.ceil(MIN_SHARD_WORK / (max(hidden, 1) * intermediate)))
    return max(1, min(math.ceil(seq_len / max(hidden, 1)), rows // max(min_rows, 1), MAX_AUTO_SHARDS))


# The gated fast path's backward can also split I: everything between its recomputed GEMMs is elementwise in
# the I columns, so a shard's backward may run in column blocks, holding gate, up and d_hidden for I / blocks
# columns at a time. The weight-gradient sums are then read and written once per token shard, not per block:
# each fp32-summed shard costs one pass over the three sums inside the weight-gradient GEMMs (3 H I x 8
# bytes; 0.31 ms at the Llama-8B MLP on an H200, 4-5% of the step at ceil(S / H) shards: benchmarks/NOTES.md
# §17), and two token shards sum in bf16 with no fp32 sums at all. Half as many token shards of two blocks
# each hold the backward activations of the automatic count; the forward, not split, holds gate, up and the
# output of a shard twice as long (below the backward's peak with its sums: unchanged peaks measured from 32k
# to 128k at the Llama-8B MLP, and 0.29 GiB less in the 4-layer model at 16k). Two blocks only: d_x adds the
# blocks' four GEMM products in the gradient's own dtype (one rounding more than the untiled MLP's three), and
# each block's GEMMs keep at least MIN_BLOCK_COLUMNS columns.
MIN_BLOCK_COLUMNS = 2048
COLUMN_BLOCKS = 2


class Split(NamedTuple):
    """An automatic count as the gated fast path runs it: token shards, and column blocks of I per shard."""

    shards: int
    blocks: int


def split_columns(num_shards: int, intermediate: int | None) -> Split:
    """(token shards, column blocks of I per shard) for an automatic count of ``num_shards``, on the gated fast
    path of an MLP with ``intermediate`` columns (None: not that path, no blocks). Blocks only where at least
    two token shards remain: one shard would run the whole sequence's forward at once."""
    if intermediate is None or num_shards < 2 * COLUMN_BLOCKS or intermediate // COLUMN_BLOCKS < MIN_BLOCK_COLUMNS:
        return Split(num_shards, 1)
    return Split(math.ceil(num_shards / COLUMN_BLOCKS), COLUMN_BLOCKS)


def num_shards_for(requested: int | None, x: torch.Tensor, agree: bool, intermediate: int | None = None) -> int:
    """The shard count: ``requested``, or the automatic one (agreed across ranks where ``agree``)."""
    if requested is not None:
        return requested
    count = auto_num_shards(x, intermediate)
    return harmonize_num_shards(count, x) if agree else count


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


@functools.cache
def _fsdp_module_classes() -> tuple:
    """FSDP2's unit class and FSDP1's wrapper, where this torch has them."""
    classes = []
    for name in ("FSDPModule", "FullyShardedDataParallel"):
        try:
            classes.append(getattr(__import__("torch.distributed.fsdp", fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(classes)


class Structure(NamedTuple):
    """What a tiled call reads of the MLP module, walked once per call (the call's host cost: see
    ``structure``)."""

    modules: tuple  # the MLP and every module inside it ((), for an fn without a module)
    params: tuple  # every parameter of the MLP, once, trainable or frozen


def structure(mlp_module) -> Structure:
    if not isinstance(mlp_module, nn.Module):
        return Structure((), ())
    return Structure(tuple(mlp_module.modules()), tuple(mlp_module.parameters()))


def fsdp_units_inside(found: Structure) -> bool:
    """FSDP units (FSDP2's ``fully_shard``, or FSDP1 wrappers) strictly inside the MLP, which gather their
    parameters on every call (a unit at the MLP or above gathers once around the call)."""
    fsdp = _fsdp_module_classes()
    return bool(fsdp) and any(isinstance(m, fsdp) for m in found.modules[1:])


def engine_managed(found: Structure, params) -> bool:
    """Whether DeepSpeed ZeRO-3 manages parameters of the call (among ``params`` or the module's own,
    trainable or frozen), hooking the modules inside the MLP to gather them."""
    return any(_zero3.is_zero3(p) for p in (*params, *found.params))


def _has_backward_hooks(found: Structure) -> bool:
    hooks = nn.modules.module
    if hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in found.modules[1:])


def _has_forward_hooks(found: Structure, ignore=None) -> bool:
    """Forward hooks inside the MLP (or global ones); ``ignore(hook)`` True leaves one out (DeepSpeed's)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    tables = [table for m in found.modules[1:] for table in (m._forward_hooks, m._forward_pre_hooks)]
    return any(not (ignore and ignore(hook)) for table in tables for hook in table.values())


def _has_buffers(found: Structure) -> bool:
    return any(b is not None for m in found.modules for b in m._buffers.values())


def untiled_reason(mlp_module, x: torch.Tensor, params, found: Structure | None = None) -> str | None:
    """Why this call must run as the plain ``fn(mlp_module, x)``, or None to tile it.

    * torch.func transforms: their wrapped tensors cannot cross the tiled Function's recompute.
    * FSDP units inside the MLP (FSDP2's ``fully_shard`` on the projections; FSDP1 wrappers likewise):
      each unit's forward swaps in
      unsharded parameters that are not the module's registered ones, and reduces their gradients in its
      own backward hook, so a tiled call could neither deliver their gradients once nor gather once.
      Shard at the MLP or above (one gather around the call) to tile.
    * Module backward hooks inside the MLP (gradient monitors, per-layer clipping, K-FAC): tiled, they would
      fire once per shard with a slice of the gradient instead of once with all of it. (A hook on the MLP
      module itself fires around the whole call either way.)
    * Module forward hooks inside the MLP, and buffers (spectral_norm's power iteration, running
      statistics): both may carry state from call to call, and a tiled call runs each module once per shard
      in forward and again in the recompute. DeepSpeed ZeRO-3's own hooks only gather and release
      parameters: those do not count (a user's hook beside them does).
    """
    found = structure(mlp_module) if found is None else found
    if transforms_active(x, *params):
        return "torch.func transform"
    if fsdp_units_inside(found):
        return "FSDP units inside the MLP"
    if _has_backward_hooks(found):
        return "module backward hooks"
    if _has_forward_hooks(found, _zero3.is_engine_hook if engine_managed(found, params) else None):
        return "module forward hooks"
    if _has_buffers(found):
        return "module buffers"
    return None


def tiling_pays(
    tokens: int,
    hidden: int,
    intermediate: int,
    itemsize: int,
    num_shards: int,
    weight_dtype=None,
    summed: int = 3,
    blocks: int = 1,
) -> bool:
    """Whether the tiled gated MLP holds less memory at its peak than the fused untiled one, for ``tokens``
    rows of width ``hidden``, ``intermediate`` columns in the MLP and activations of ``itemsize`` bytes;
    ``weight_dtype`` (the projections'; None: bf16 for 2-byte activations, fp32 otherwise) sets the sums';
    ``summed``: how many of the three projections have gradients to sum (the frozen ones have none).

    Untiled, gate, up and the activation's output (the down projection's input) live from forward to
    backward, and backward adds d_hidden: about 4 x tokens x I activations. Tiled, the same four exist for one
    shard at a time, and low-precision weights add fp32 gradient sums for the three projections (3 x H x I x 4
    bytes; fp32 weights, and bf16 ones over at most MAX_NARROW_SUM_SHARDS shards, sum in their own dtype:
    _grad_sums). ``blocks``: column blocks of I per shard in backward (``split_columns``): the four then exist
    for one block of one shard in backward, while the forward (not split) holds gate, up and the output for a
    whole shard: the larger of the two counts. What both hold alike (x, the output, the weights' gradients)
    cancels. Shapes only: no sync, no collective, the same answer on every rank."""
    if num_shards * blocks <= 1:
        return False
    per_activation = tokens * intermediate * itemsize
    held = max(3.0 / num_shards, 4.0 / (num_shards * blocks))
    saved = per_activation * (4.0 - held)
    if weight_dtype is None:
        weight_dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    wide_sums = weight_dtype.itemsize < 4 and not narrow_sums(num_shards, weight_dtype)
    sums = summed * hidden * intermediate * 4 if wide_sums else 0
    return saved > sums
