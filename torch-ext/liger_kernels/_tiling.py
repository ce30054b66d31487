"""How a tiled call is laid out: whether it tiles at all, how many shards, and where they start.

* The shard count is a function of the shapes alone, so it needs no communication: ceil(S / H) shards, so
  that each shard's S x I intermediates are about the size of one weight matrix; but no shard of fewer than
  MIN_SHARD_TOKENS rows (batch x shard length), below which the GEMMs lose efficiency and each shard's own
  host cost (a Python-level loop step with its own launches) shows; and at most MAX_AUTO_SHARDS. On the
  gated fast path the backward runs that count as fewer token shards of column blocks of I
  (``split_columns``).
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


def too_few_rows(x: torch.Tensor) -> bool:
    """Fewer rows than two shards' minimum: ``auto_num_shards`` is 1 whatever the MLP's width (its
    ``rows // min_rows`` is at most 1, min_rows being at least MIN_SHARD_TOKENS), so a short call need not read
    the width."""
    return math.prod(x.shape[:-1]) < 2 * MIN_SHARD_TOKENS


# The gated fast path's backward can also split I: everything between its recomputed GEMMs is elementwise in
# the I columns, so a shard's backward may run in column blocks, holding gate, up and d_hidden for I / blocks
# columns at a time, while the weight-gradient sums are read and written once per token shard, not per block.
# Low-precision weights sum in fp32 over more than two token shards (_grad_sums): the sums hold twice the
# weights, and each token shard after the first costs a pass over them inside its weight-gradient GEMMs
# (3 H I x 8 bytes; 0.31 ms at the Llama-8B MLP on an H200: benchmarks/NOTES.md §17). So an automatic count of
# n shards is run as the split (token shards, column blocks) that is cheapest by ``_split_cost`` among those
# whose backward holds no more than n whole-column shards would (``_held``: one block's three activations and
# the sums): the memory goal of the count itself, met with fewer passes. Never one token shard of blocks:
# that measured 1-3% slower than two token shards (benchmarks/NOTES.md §18).
# The forward accumulates nothing, so its split is free to differ: the fewest token shards (at least two, at
# most n) whose gate, up and activation output hold no more than the backward holds at its peak, the block's
# three and the sums, plus d_x where x needs a gradient (the forward's output and the backward's incoming
# gradient are alike): the forward then adds nothing to the call's peak, with fewer, larger GEMMs (at 32k,
# 3 forward shards took 63.9-64.1 ms where 4 took 64.1-64.4: benchmarks/NOTES.md §19).
# At most four blocks: d_x adds the blocks' two GEMM products each in the gradient's own dtype, and its error
# against float64 grows with their number (bf16, measured on CPU: 0.97x the untiled error at 2 blocks, 1.05x
# at 4, 1.20x at 8, 1.45x at 16; the contract is 1.5x). Each block's GEMMs keep at least MIN_BLOCK_COLUMNS
# columns (the last, narrower one included), and blocks start on multiples of BLOCK_ALIGN columns where I
# allows it, so that every block's leading dimensions stay aligned for the tensor cores.
MIN_BLOCK_COLUMNS = 2048
COLUMN_BLOCKS = (2, 4)
BLOCK_ALIGN = 64
# The cost estimate's rates and the blocks' price, from the H200 (benchmarks/NOTES.md §18, §19): a pass over
# the sums runs at copy bandwidth; column blocks cost a share of the MLP's own GEMM time (narrower GEMMs, and
# d_x's products added block by block): four blocks 3.4% more than two (4 x 4 against 8 x 2 at 64k, 8 x 4
# against 16 x 2 at 128k, 2 x 4 against 2 x 2 at 32k, each pair in one run), two blocks 0.7% more than whole
# columns (16 x 1 against 8 x 2 at 64k and 128k across runs).
COPY_BYTES_PER_S = 4.2e12
GEMM_FLOPS_PER_S = 7.0e14
BLOCK_COST = {1: 0.0, 2: 0.007, 4: 0.041}


class Split(NamedTuple):
    """An automatic count as the gated fast path runs it: token shards of the forward, token shards of the
    backward, and column blocks of I per backward shard."""

    forward: int
    shards: int
    blocks: int


def unsplit(num_shards: int) -> Split:
    return Split(num_shards, num_shards, 1)


def split_columns(
    num_shards: int, x_shape, intermediate: int | None, weight_dtype=torch.bfloat16, summed=3, x_grad=True
) -> Split:
    """How the gated fast path runs an automatic count of ``num_shards`` for x of ``x_shape`` through an MLP
    with ``intermediate`` columns (None: not that path, no blocks), weights of ``weight_dtype`` (x's too),
    ``summed`` trainable projections, and x needing a gradient or not (``x_grad``): see the comment above.
    Shapes only: the same on every rank."""
    batch = math.prod(x_shape[:-2])
    if intermediate is None or num_shards < 2 or min(intermediate, batch, x_shape[-2], x_shape[-1]) <= 0:
        return unsplit(num_shards)  # nothing to split (an empty MLP or input: every layout is exact)
    shape = (x_shape[-2], batch, x_shape[-1], intermediate, weight_dtype, summed)
    return _best_split(num_shards, *shape, bool(x_grad))


def _sums_dtype(shards, dtype) -> torch.dtype:
    return dtype if narrow_sums(shards, dtype) else torch.promote_types(dtype, torch.float32)


def _held(shards, width, seq_len, batch, hidden, intermediate, dtype, summed) -> int:
    """Bytes the blocked (or whole-column) backward holds at its peak beyond d_x: one block's gate, up and
    d_hidden (``width`` columns of a shard's rows), and the weight-gradient sums over ``shards`` token shards.
    A shard of a batch (batch > 1) is no single block of rows: x's and d_out's rows are copied for its GEMMs,
    and d_x's products are added in a copy of its rows, which coexists with two of the three activations
    (the d_hidden buffer is freed by then). The peak may also come after the shards, when the gradients are
    cast from the sums."""
    rows = batch * math.ceil(seq_len / shards)
    block, copy = rows * width * dtype.itemsize, (rows * hidden * dtype.itemsize if batch > 1 else 0)
    sums = summed * hidden * intermediate * _sums_dtype(shards, dtype).itemsize
    # after the shards: one weight's gradient in the parameters' dtype is made while the sums still exist
    last = hidden * intermediate * dtype.itemsize if summed else 0
    return sums + max(3 * block + 2 * copy, 2 * block + 3 * copy, last)


def _forward_held(shards, seq_len, batch, hidden, intermediate, dtype) -> int:
    """Bytes the forward holds at its peak beyond its output: a shard's gate, up and activation output, and
    for a batch the copy of x's rows (later the down projection's product, copied into the output)."""
    rows = batch * math.ceil(seq_len / shards)
    act, copy = rows * intermediate * dtype.itemsize, (rows * hidden * dtype.itemsize if batch > 1 else 0)
    return max(3 * act + copy, act + 2 * copy)


def _fewest(low, high, fits) -> int | None:
    """The least count in [low, high] for which ``fits`` (false below it, true from it on), or None."""
    if low > high or not fits(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _split_cost(shards, blocks, seq_len, batch, hidden, intermediate, dtype, summed) -> float:
    """Seconds a split adds to the backward, estimated: every token shard's GEMMs but the first read and
    write the sums (the first writes them), and the blocks' share of the GEMM time."""
    one_pass = summed * hidden * intermediate * 2 * _sums_dtype(shards, dtype).itemsize / COPY_BYTES_PER_S
    gemms = 18 * batch * seq_len * hidden * intermediate / GEMM_FLOPS_PER_S  # 9 GEMM-units of 2 S H I flops
    return (shards - 0.5) * one_pass + BLOCK_COST[blocks] * gemms


@functools.lru_cache(maxsize=256)
def _best_split(n, seq_len, batch, hidden, intermediate, dtype, summed, x_grad) -> Split:
    shape = (seq_len, batch, hidden, intermediate, dtype, summed)
    budget = _held(n, intermediate, *shape)
    best, best_cost, best_width = (n, 1), _split_cost(n, 1, *shape), intermediate
    for blocks in COLUMN_BLOCKS:
        widths = [width for _, width in column_bounds(intermediate, blocks)] if blocks <= intermediate else [0]
        if min(widths) < MIN_BLOCK_COLUMNS:
            continue
        width = max(widths)

        # Two token shards (whose sums may be narrow), else the fewest of three or more, whose sums are wide
        # and whose held bytes only fall as the count grows.
        def fits(shards, width=width):
            return _held(shards, width, *shape) <= budget

        shards = 2 if fits(2) else _fewest(3, n, fits)
        if shards is None:
            continue
        cost = _split_cost(shards, blocks, *shape)
        if cost < best_cost:
            best, best_cost, best_width = (shards, blocks), cost, width
    # the forward's shards: the fewest whose activations fit in what the backward holds (comment above)
    room = _held(best[0], best_width, *shape) + (batch * seq_len * hidden * dtype.itemsize if x_grad else 0)
    forward = _fewest(2, n, lambda f: _forward_held(f, *shape[:-1]) <= room)
    return Split(n if forward is None else forward, *best)


def column_bounds(columns: int, blocks: int) -> list[tuple]:
    """(start, width) of each column block: equal widths rounded up to BLOCK_ALIGN (the last block takes the
    rest) where that adds at most an eighth to a block; narrower blocks within one of each other."""
    width = math.ceil(columns / blocks)
    aligned = math.ceil(width / BLOCK_ALIGN) * BLOCK_ALIGN
    if width < 8 * BLOCK_ALIGN or aligned * (blocks - 1) >= columns:
        return shard_bounds(columns, blocks)
    return [(start, min(aligned, columns - start)) for start in range(0, columns, aligned)]


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


def has_engine_parameters(mlp_module) -> bool:
    """``engine_managed(structure(mlp_module), its parameters)`` without building the structure: whether a
    parameter of the module or of a module inside it is DeepSpeed ZeRO-3's; True for anything but a module (the
    full checks then run, and raise what they raise)."""
    if not isinstance(mlp_module, nn.Module):
        return True
    # Plain loops and inline reads (``_zero3.is_zero3`` is ``hasattr(p, "ds_id")``): this runs on every short
    # call of a tiled layer. Only modules that hold modules are remembered as seen: a module inside itself or in
    # two places is walked once, and a leaf (the projections, the activation) needs no set entry.
    stack, seen = [mlp_module], {id(mlp_module)}
    while stack:
        module = stack.pop()
        for p in module._parameters.values():
            if p is not None and hasattr(p, "ds_id"):
                return True
        for child in module._modules.values():
            if child is None:
                continue
            if child._modules:
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
                continue
            for p in child._parameters.values():
                if p is not None and hasattr(p, "ds_id"):
                    return True
    return False


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


def hooked(params) -> bool:
    """Whether a gradient hook is registered on one of ``params`` (``p.register_hook``). Hooks on the gradient's
    accumulation (DDP's, DeepSpeed's, FSDP2's, ``register_post_accumulate_grad_hook``) are not these."""
    for p in params:  # (a loop, not any() over a generator: asked on each call that may tile)
        if p._backward_hooks:
            return True
    return False


def tiling_pays(
    tokens: int,
    hidden: int,
    intermediate: int,
    itemsize: int,
    num_shards: int,
    weight_dtype=None,
    summed: int = 3,
    blocks: int = 1,
    forward_shards: int | None = None,
) -> bool:
    """Whether the tiled gated MLP holds less memory at its peak than the fused untiled one, for ``tokens``
    rows of width ``hidden``, ``intermediate`` columns in the MLP and activations of ``itemsize`` bytes;
    ``weight_dtype`` (the projections'; None: bf16 for 2-byte activations, fp32 otherwise) sets the sums';
    ``summed``: how many of the three projections have gradients to sum (the frozen ones have none).

    Untiled, gate, up and the activation's output (the down projection's input) live from forward to
    backward, and backward adds d_hidden: about 4 x tokens x I activations. Tiled, the backward holds gate, up and
    d_hidden (the fused pass writes the gradients over them) for one column block (of ``blocks``) of one
    token shard (of ``num_shards``) at a time, and the
    forward gate, up and the output for one of its ``forward_shards`` (default: ``num_shards``) token shards:
    the larger of the two counts. Low-precision weights add fp32 gradient sums for the three projections (3 x
    H x I x 4 bytes; fp32 weights, and bf16 ones over at most MAX_NARROW_SUM_SHARDS token shards, sum in their
    own dtype: _grad_sums). What both hold alike (x, the output, the weights' gradients) cancels. Shapes only:
    no sync, no collective, the same answer on every rank."""
    forward = num_shards if forward_shards is None else forward_shards
    if forward <= 1:
        return False
    per_activation = tokens * intermediate * itemsize
    held = max(3.0 / forward, 3.0 / (num_shards * blocks))
    saved = per_activation * (4.0 - held)
    if weight_dtype is None:
        weight_dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    wide_sums = weight_dtype.itemsize < 4 and not narrow_sums(num_shards, weight_dtype)
    sums = summed * hidden * intermediate * 4 if wide_sums else 0
    return saved > sums
