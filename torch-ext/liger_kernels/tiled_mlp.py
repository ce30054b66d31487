"""The tiled MLP: run an MLP over sequence shards and recompute each shard in backward, so a long sequence
needs the MLP intermediates (the S x I gate/up activations) of one shard at a time.

Forward runs ``fn(mlp_module, shard)`` for each shard of ``x`` along the sequence dimension (``x.shape[-2]``)
under ``no_grad``. Backward recomputes each shard with grad and takes its gradients with
``torch.autograd.grad``. The pieces live beside this module: ``_tiling`` (whether and how to shard),
``_replay`` (what the recompute must see again), ``_tiled_gated`` (the fast path for gated MLPs, declared by
their owner in gated_mlp.py), ``_grad_sums`` (the gradient sums: fp32, or bf16 over two shards).

How gradients reach the parameters must not change with tiling. The trainable parameters are inputs of the
autograd Function and their gradients are *returned* from its backward, summed over shards (``_grad_sums``)
and cast once, so autograd accumulates each one exactly once per backward and no AccumulateGrad node (where DDP and
FSDP hang their per-parameter hooks) fires inside the shard loop.

DeepSpeed ZeRO-3 parameters are gathered once per call, not once per shard (``_zero3``): where DeepSpeed
gathers them around the whole call (the MLP is a ZeRO-3 leaf) they are ordinary inputs; where the gated
fast path runs, the call gathers them itself and delivers each summed gradient to DeepSpeed once. Only a
user's ``fn`` that calls hooked projections keeps DeepSpeed's per-shard path: those parameters are 0-sized
outside their module's forward, so they cannot be Function inputs; each shard's backward accumulates into
``.grad`` through DeepSpeed's own hooks, with ``ds_grad_is_ready`` False on every shard but the last, which
defers DeepSpeed's reduction to the last shard.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from . import _backend, _replay, _tiling, _zero3
from ._grad_sums import accumulate, cast_each, narrow_sums
from ._tiled_gated import gated_mlp_backward, gated_mlp_forward, gated_plan, splits_columns, summed_weights

OP = _tiling.OP


def apply_tiled_mlp(
    fn: Callable,
    mlp_module,
    x: torch.Tensor,
    num_shards: int | None = None,
    compute_params=None,
    tile: bool | None = None,
) -> torch.Tensor:
    """``fn(mlp_module, x)`` computed shard by shard along the sequence dimension, recomputed in backward.

    x: [B, S, H] or [S, H] (MoE experts); the shards split S (``x.shape[-2]``). num_shards: None for
    automatic (``_tiling.auto_num_shards``), or an int >= 1 (more shards than tokens is fine). compute_params:
    the trainable tensors fn uses, if not the module's own parameters.

    Runs untiled, as the plain ``fn(mlp_module, x)``, where only that is exact (``_tiling.untiled_reason``)
    and under torch.export (an exported program is a forward graph; tiling is a training-memory device).
    An ``fn`` with a ``tiled_check(mlp_module)`` (the package's gated MLPs) is asked it first wherever the call is
    not the short plain one (one automatic shard, no engine's parameters): a host it refuses raises there, before
    the module is walked and before any gather or shard (the short call's ``fn`` refuses it itself).

    tile: None (automatic) tiles a gated MLP whose owner declares the fast path (the package's layers) only
    where it lowers the peak (``_tiling.tiling_pays``; an explicit ``num_shards`` counts as asking to tile),
    and any other ``fn`` wherever the automatic count gives more than one shard (one shard would only add the
    recompute and the host's cost of the tiled call); True always tiles; False runs ``fn(mlp_module, x)``.
    """
    if not callable(fn):
        raise TypeError(f"{OP}: `fn` must be callable as fn(mlp_module, shard), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{OP}: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{OP}: `x` must be [B, S, H] or [S, H], got shape {tuple(x.shape)}")
    requested = _tiling.check_num_shards(num_shards)
    if tile is not None and not isinstance(tile, bool):
        raise TypeError(f"{OP}: `tile` must be None (automatic), True or False (a Python bool), got {tile!r}")
    if tile is False or _backend.exporting():
        return fn(mlp_module, x)
    if not torch.compiler.is_compiling():
        # In eager mode a short call skips the compiler boundary below (its wrapper costs the host more than
        # the check) and makes the plain call, exactly as _apply_tiled would.
        one_shard = _one_shard(x, mlp_module, requested, tile)
        if one_shard and _needs_no_checks(mlp_module, compute_params):
            return fn(mlp_module, x)
        return _apply_tiled(fn, mlp_module, x, requested, compute_params, tile, asked=True)
    return _apply_tiled(fn, mlp_module, x, requested, compute_params, tile)


def _one_shard(x, mlp_module, requested, tile) -> bool:
    """The automatic shard count is 1."""
    return (
        tile is None
        and requested is None
        and (_tiling.too_few_rows(x) or _tiling.auto_num_shards(x, intermediate_size(mlp_module)) <= 1)
    )


def _needs_no_checks(mlp_module, compute_params) -> bool:
    """With one automatic shard, whether every branch of _apply_tiled would make the plain call: no engine
    gathers the parameters (its layouts may tile, or agree on a count across ranks). For a module's own
    parameters this is asked before the module's structure is walked (the short sequences of a training step
    meet it on every layer)."""
    return compute_params is None and not _tiling.has_engine_parameters(mlp_module)


# torch.compile must not trace the tiled call: a compiled forward would draw dropout masks from the
# compiler's random stream while the eager recompute replays the ordinary generator, and the gradients would
# belong to other masks. The call is a graph break; what runs inside is the eager code, exact.
@torch.compiler.disable
def _apply_tiled(fn, mlp_module, x, requested, compute_params, tile, asked=False):
    """``asked``: the eager caller has found that the plain call's shortcut does not apply."""
    one_shard = _one_shard(x, mlp_module, requested, tile)
    if not asked and one_shard and _needs_no_checks(mlp_module, compute_params):
        return fn(mlp_module, x)
    refuse = getattr(fn, "tiled_check", None)
    if refuse is not None:
        # The owner's refusal of a host its math would not reproduce (the ValueError fn's own call would raise),
        # before the module is walked and before any gather, count or shard. It reads no parameter: inside
        # DeepSpeed's forward, reading a partitioned ZeRO-3 weight gathers it. The plain call above needs no such
        # question: fn's call raises the same first thing.
        refuse(mlp_module)
    intermediate = intermediate_size(mlp_module)
    found = _tiling.structure(mlp_module)
    params = trainable_params(mlp_module, compute_params, found)
    if one_shard and not _tiling.engine_managed(found, params):
        return fn(mlp_module, x)
    if _tiling.untiled_reason(mlp_module, x, params, found) is not None:
        return fn(mlp_module, x)
    if _tiling.hooked(params) and gated_plan(fn, mlp_module, x, params) is None:
        # The generic recompute's per-shard autograd.grad runs a parameter's gradient hooks too: once per shard,
        # then again on the summed gradient (a hook that scales it applied twice). The gated path writes the
        # gradients itself, and they run once.
        return fn(mlp_module, x)
    layout = _layout(fn, mlp_module, x, params, found)
    num_shards = _tiling.num_shards_for(requested, x, layout.agree, intermediate)
    shards = _tiling.unsplit(num_shards)
    plan = gated_plan(fn, mlp_module, x, params) if requested is None else None
    if plan is not None:
        shards = _gated_split(plan, params, num_shards, x, intermediate)
    if (
        tile is None
        and requested is None
        and not layout.always_tile
        and (num_shards <= 1 or not _pays(fn, mlp_module, x, shards))
    ):
        return fn(mlp_module, x)
    zero3 = layout.zero3
    explicit = [p for p in params if not any(p is z for z in zero3)]
    # Per-call ZeRO-3 weights are not Function inputs; when nothing else needs a gradient, an anchor input
    # makes the output require grad so that backward (and with it the weights' gradients) runs at all.
    anchor = None
    if zero3 and not x.requires_grad and not explicit:
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    if torch.is_grad_enabled() and (x.requires_grad or explicit):
        # The module's frozen parameters are saved too: the recompute reads them as they are in backward, so one
        # changed in place since forward must raise, as the plain module's saved weights do (LoRA's base weights).
        frozen = _frozen(found)
        x = _SavedForRecompute.apply(x.is_leaf and x.requires_grad, x, len(frozen), *explicit, *frozen)
    return LigerTiledMLPFunction.apply(fn, mlp_module, x, shards, zero3, anchor, *explicit)


def _frozen(found: _tiling.Structure) -> list:
    """The module's frozen parameters the recompute reads, saved for autograd's version check beside the trainable
    ones (not ZeRO-3's, whose data DeepSpeed swaps between calls)."""
    return [p for p in found.params if not p.requires_grad and not _zero3.is_zero3(p)]


class _Layout(NamedTuple):
    zero3: list  # trainable ZeRO-3 parameters whose gradients the call hands to DeepSpeed (not inputs)
    gather: list  # ZeRO-3 parameters the call gathers itself, once in forward and once in backward
    agree: bool  # parameters are gathered per shard: ranks must run the same shard count
    # ZeRO-3's hooks would gather in the plain call and not in the tiled one (or the other way round): every
    # rank must take the same branch, and the choice reads this rank's tokens, so such calls always tile.
    always_tile: bool = False


def _layout(fn, mlp_module, x, params, found=None, fast=None) -> _Layout:
    """How this call meets the engines that gather parameters (see ``_zero3``): shapes and module structure
    only, the same on every rank. ``found``: the module's structure if already walked; ``fast``: whether the
    gated fast path runs, if already known."""
    found = _tiling.structure(mlp_module) if found is None else found
    engine = [p for p in found.params if _zero3.is_zero3(p)]
    zero3 = [p for p in params if _zero3.is_zero3(p)]
    if not (engine or zero3):
        return _NO_ENGINE
    if _zero3.gathered_around_call(mlp_module, engine):  # whole for the call: ordinary inputs
        owned = {id(p) for p in engine}
        zero3 = [p for p in zero3 if id(p) not in owned]  # ZeRO-3 tensors from elsewhere (compute_params)
        return _Layout(zero3, [], bool(zero3), bool(zero3))
    if fast is None:
        fast = gated_plan(fn, mlp_module, x, params) is not None
    if fast:
        # The fast path never calls the projections, so nothing releases their weights during the call.
        # Inside DeepSpeed's forward, reading them (gated_plan just did) gathers them and makes them external
        # parameters of the running module, which DeepSpeed gathers again around its backward: whole, they
        # are ordinary inputs, and autograd sums a weight's uses (one MLP called twice, tied weights) into
        # one accumulation per backward, which DeepSpeed's gradient hook expects.
        if all(_zero3.is_whole(p) for p in engine + zero3):
            return _Layout([], [], False, True)
        return _Layout(zero3, engine, False, True)
    return _Layout(zero3, [], True, True)


_NO_ENGINE = _Layout([], [], False)


def intermediate_size(mlp_module) -> int | None:
    """I of a gated MLP with ``gate_proj`` (or Phi-3's fused ``gate_up_proj``) Linears, else None."""
    gate = getattr(mlp_module, "gate_proj", None)
    if isinstance(getattr(gate, "out_features", None), int):
        return gate.out_features
    fused = getattr(getattr(mlp_module, "gate_up_proj", None), "out_features", None)
    return fused // 2 if isinstance(fused, int) else None


def _gated_split(plan, params, num_shards, x, intermediate) -> _tiling.Split:
    """How the fast path runs an automatic count (column blocks only where no projections are tied), as both
    callers ask it: x's shape and gradient, the weights' dtype, the projections ``params`` make trainable."""
    if not splits_columns(plan):
        return _tiling.unsplit(num_shards)
    summed = summed_weights(plan, params)
    return _tiling.split_columns(num_shards, x.shape, intermediate, plan.gate[0].dtype, summed, x.requires_grad)


def _pays(fn, mlp_module, x, num_shards) -> bool:
    """Tiling lowers the peak, for a gated MLP whose owner declares the fast path; any other fn is tiled.
    ``num_shards``: an int, or a ``_tiling.Split`` (how the fast path runs the count)."""
    if getattr(fn, "tiled_fast_path", None) is None:
        return True
    gate = getattr(mlp_module, "gate_proj", None)
    intermediate = intermediate_size(mlp_module)
    if intermediate is None:
        return True
    split = num_shards if isinstance(num_shards, _tiling.Split) else _tiling.unsplit(num_shards)
    hidden = x.shape[-1]
    weight = getattr(gate, "weight", None)
    weight_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    # Only trainable projections have gradients to sum (LoRA on attention alone leaves the MLP frozen).
    projections = [getattr(mlp_module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    weights = [getattr(p, "weight", None) for p in projections]
    summed = sum(1 for w in weights if not isinstance(w, torch.Tensor) or w.requires_grad)
    tokens = x.numel() // max(hidden, 1)
    return _tiling.tiling_pays(
        tokens, hidden, intermediate, x.element_size(), split.shards, weight_dtype, summed, split.blocks, split.forward
    )


# ----------------------------------------------------------------------------------------------------------
# Parameters


def trainable_params(mlp_module, compute_params, found=None) -> list[torch.Tensor]:
    """The parameters whose gradients the tiled call must deliver: ``compute_params`` if given, else the
    module's, resolved now (not captured earlier: FSDP2 and ZeRO-3 replace or re-register parameters)."""
    if compute_params is None:
        if not isinstance(mlp_module, torch.nn.Module):
            raise TypeError(f"{OP}: `mlp_module` must be an nn.Module when `compute_params` is None")
        candidates = found.params if found is not None else list(mlp_module.parameters())
    else:
        candidates = list(compute_params)
        for p in candidates:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{OP}: `compute_params` must hold tensors, got {type(p).__name__}")
    seen, params = set(), []
    for p in candidates:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def _leaves_reached(output: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad whose AccumulateGrad nodes ``output``'s graph reaches."""
    leaves, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _check_no_gradient_is_lost(output, delivered: Sequence[torch.Tensor], shard_x) -> None:
    known = {id(t) for t in delivered} | {id(shard_x)}
    for leaf in _leaves_reached(output):
        if id(leaf) not in known:
            shape = tuple(leaf.shape)
            raise RuntimeError(
                f"liger-kernels {OP}: `fn` uses a tensor that requires grad (shape {shape}) which is not among the "
                "parameters the tiled call delivers gradients to, so its gradient would be lost. Pass "
                "compute_params=None to use the module's current parameters, or list every trainable tensor fn uses "
                "(after any wrapping "
                "such as fully_shard, which replaces the module's parameters). Offloading hooks that swap weights in "
                "per call (accelerate's cpu_offload) lose such gradients: train with the weights frozen there."
            )


# ----------------------------------------------------------------------------------------------------------
# The autograd Functions


class _SavedForRecompute(torch.autograd.Function):
    """Saves what the tiled backward reads (x and the parameters) in a node of its own, before the
    tiled forward runs, and passes x on as a view.

    Non-reentrant activation checkpointing (transformers' gradient checkpointing) recomputes a region in
    backward only until every tensor the region saved has been saved again (``early_stop``, on by default).
    In a decoder layer the MLP is the last thing that saves anything (the residual add after it saves
    nothing), so the recompute stops here and never runs the tiled forward again: its output is read by
    nothing there, and its backward recomputes each shard anyway. The layer's step then costs 11 GEMM-units
    of MLP work against 12 for the untiled MLP (which the checkpoint recomputes), where it cost 14. Where
    something after the MLP saves tensors, the recompute runs on through the tiled forward, as before."""

    @staticmethod
    def forward(ctx, x_is_grad_leaf, x, num_frozen, *params):
        # params: the trainable parameters, then num_frozen frozen ones (saved for the version check, no gradient)
        ctx.x_is_grad_leaf, ctx.num_params, ctx.num_frozen = x_is_grad_leaf, len(params) - num_frozen, num_frozen
        ctx.set_materialize_grads(False)  # x that needs no gradient gets None, not an x-sized zero tensor
        ctx.save_for_backward(x, *params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, d_x):
        # The tiled backward returns d_x only where x itself needs it (needs_input_grad[1]).
        return (None, d_x, None, *([None] * (ctx.num_params + ctx.num_frozen)))


def _saved_for_recompute(x, params):
    """The node that saved x and ``params`` for the tiled call whose input is ``x``, if it did."""
    node = x.grad_fn
    if isinstance(node, _SavedForRecompute._backward_cls) and node.num_params == len(params):
        return node
    return None


class LigerTiledMLPFunction(torch.autograd.Function):
    """``LigerTiledMLPFunction.apply(fn, mlp_module, x, num_shards, zero3_params, anchor, *params)``.

    ``params`` are the trainable parameters whose gradients this Function returns, summed over shards.
    ``num_shards`` is an int >= 1 or None (automatic). ``zero3_params`` (a list, not inputs) are DeepSpeed
    ZeRO-3 parameters that are partitioned outside the call: on the fast path the call gathers them and
    accumulates each summed gradient once, otherwise each shard accumulates through DeepSpeed's hooks (see
    ``_zero3``); ``anchor`` is None or an empty tensor requiring grad that keeps
    the output differentiable when nothing else would. :func:`apply_tiled_mlp` resolves all of these.
    """

    @staticmethod
    def forward(ctx, fn, mlp_module, x, num_shards, zero3_params, anchor, *params):
        # apply_tiled_mlp hands over its automatic count as the _tiling.Split the fast path runs
        if isinstance(num_shards, _tiling.Split):
            split = num_shards
        else:
            requested = _tiling.check_num_shards(num_shards)
            split = None if requested is None else _tiling.unsplit(requested)
        ctx.fn, ctx.mlp_module = fn, mlp_module
        ctx.zero3_params, ctx.params = list(zero3_params), list(params)
        ctx.gated = gated_plan(fn, mlp_module, x, ctx.params + ctx.zero3_params)
        layout = _layout(fn, mlp_module, x, ctx.params + ctx.zero3_params, fast=ctx.gated is not None)
        if split is None:  # automatic, as apply_tiled_mlp splits it
            intermediate = intermediate_size(mlp_module)
            split = _tiling.unsplit(_tiling.num_shards_for(None, x, layout.agree, intermediate))
            if ctx.gated is not None:
                split = _gated_split(ctx.gated, ctx.params + ctx.zero3_params, split.forward, x, intermediate)
        if ctx.gated is None:  # column blocks and a backward split of their own: the fast path's only
            split = _tiling.unsplit(split.forward)
        ctx.blocks = split.blocks
        ctx.forward_bounds = _tiling.shard_bounds(x.shape[-2], split.forward)
        ctx.bounds = _tiling.shard_bounds(x.shape[-2], split.shards)  # the backward's
        ctx.autocast = _replay.autocast_state(x.device.type)
        ctx.rng = _replay.capture_rng(x.device)
        ctx.tensors = _replay.capture_tensors(mlp_module)
        ctx.gather = layout.gather
        # The parameters, trainable and frozen, are saved as well as x: a weight changed in place before backward
        # (an optimizer or EMA step) then raises autograd's own error, as the plain module's saved weights do,
        # instead of the recompute silently using the new values. apply_tiled_mlp has saved them already, in a node of
        # their own (``_SavedForRecompute``); a direct call of this Function saves them here.
        ctx.saved_by = _saved_for_recompute(x, params)
        # Autocast caches its casts of leaf tensors that require grad; the recompute feeds fn a shard of the
        # same kind (leaf or not) as x, so that it makes the same casts and the same gradient sums as untiled.
        if ctx.saved_by is not None:
            ctx.x_is_grad_leaf = ctx.saved_by.x_is_grad_leaf
        else:
            ctx.x_is_grad_leaf = x.is_leaf and x.requires_grad
            ctx.save_for_backward(x, *params, *_frozen(_tiling.structure(mlp_module)))
        if ctx.gated is not None:
            with _zero3.gathered(ctx.gather):
                return gated_mlp_forward(ctx.gated, x, ctx.forward_bounds)
        out = None
        for start, length in ctx.forward_bounds:
            shard_out = fn(mlp_module, x.narrow(-2, start, length))
            if not isinstance(shard_out, torch.Tensor) or shard_out.dim() != x.dim() or shard_out.shape[-2] != length:
                raise ValueError(
                    f"{OP}: `fn` must map a shard [..., {length}, H] to a tensor [..., {length}, H_out], got "
                    f"{tuple(shard_out.shape) if isinstance(shard_out, torch.Tensor) else type(shard_out).__name__}"
                )
            if out is None:  # written shard by shard: no second full-size copy, as torch.cat would make
                out = shard_out.new_empty(*shard_out.shape[:-2], x.shape[-2], shard_out.shape[-1])
            out.narrow(-2, start, length).copy_(shard_out)
            del shard_out
        return out

    @staticmethod
    def backward(ctx, d_out):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "liger-kernels LigerTiledMLPFunction does not support double backward (create_graph=True): it "
                "recomputes each shard and returns first-order gradients only. Use the untiled layer "
                "(LigerSwiGLUMLP / LigerGEGLUMLP) for higher-order gradients."
            )
        # (its shards' gradients are written into one buffer, in place)
        _backend.refuse_batched_gradients(
            "liger-kernels LigerTiledMLPFunction",
            d_out,
            instead="compute one gradient per call, or run the layer untiled (tile=False)",
        )
        saved_by = ctx.saved_by
        # One unpack per backward: a checkpoint hands each saved tensor out once per backward.
        x = (saved_by.saved_tensors if saved_by is not None else ctx.saved_tensors)[0]
        want_x = ctx.needs_input_grad[2] and (saved_by is None or saved_by.needs_input_grad[1])
        if ctx.gated is not None:
            explicit = len(ctx.params)
            with _zero3.gathered(ctx.gather):
                d_x, grads = gated_mlp_backward(
                    ctx.gated, ctx.params + ctx.zero3_params, ctx.bounds, x, d_out, want_x, ctx.blocks
                )
                _zero3.deliver(ctx.zero3_params, grads[explicit:])
            return (None, None, d_x, None, None, None, *grads[:explicit])
        d_x = torch.empty_like(x) if want_x else None
        sums = [None] * len(ctx.params)
        narrow = [narrow_sums(len(ctx.bounds), p.dtype) for p in ctx.params]
        with _replay.replay_rng(x.device, ctx.rng), _replay.forward_tensors(ctx.tensors):
            for i, (start, length) in enumerate(ctx.bounds):
                shard_x = x.narrow(-2, start, length).detach().requires_grad_(want_x)
                with torch.enable_grad(), _replay.replay_autocast(ctx.autocast):
                    out = ctx.fn(ctx.mlp_module, shard_x if ctx.x_is_grad_leaf else shard_x.view_as(shard_x))
                if not out.requires_grad:  # nothing in this shard needs a gradient
                    grads = [None] * (want_x + len(ctx.params))
                else:
                    if i == 0:
                        _check_no_gradient_is_lost(out, ctx.params + ctx.zero3_params, shard_x)
                    grads = _shard_grads(ctx, out, d_out.narrow(-2, start, length), shard_x, i)
                if want_x:
                    d_x_shard, grads = grads[0], grads[1:]
                    target = d_x.narrow(-2, start, length)
                    if d_x_shard is None:  # fn ignored its input
                        target.zero_()
                    else:
                        target.copy_(d_x_shard)
                sums = [accumulate(total, g, n) for total, g, n in zip(sums, grads, narrow)]
                # before the next shard runs: its output and gradients (the weights' size) are added in
                out = grads = d_x_shard = None
        return (None, None, d_x, None, None, None, *cast_each(sums, ctx.params))


def _shard_grads(ctx, out, d_out_shard, shard_x, index):
    """This shard's gradients for [shard_x if needed, *ctx.params]."""
    inputs = ([shard_x] if shard_x.requires_grad else []) + ctx.params
    if not ctx.zero3_params:
        # No AccumulateGrad fires here: the gradients come back to be summed and returned once.
        return torch.autograd.grad(out, inputs, d_out_shard, allow_unused=True)
    for p in ctx.zero3_params:
        p.ds_grad_is_ready = index == len(ctx.bounds) - 1
    torch.autograd.backward(out, d_out_shard, inputs=inputs + ctx.zero3_params)
    grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    return grads
