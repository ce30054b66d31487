"""The tiled MLP: run an MLP over sequence shards and recompute each shard in backward, so a long sequence
needs the MLP intermediates (the S x I gate/up activations) of one shard at a time.

Forward runs ``fn(mlp_module, shard)`` for each shard of ``x`` along the sequence dimension (``x.shape[-2]``)
under ``no_grad`` and concatenates. Backward recomputes each shard with grad and takes its gradients with
``torch.autograd.grad``.

How gradients reach the parameters must not change with tiling. The trainable parameters are inputs of the
autograd Function and their gradients are *returned* from its backward, summed over shards in fp32 and cast
once, so autograd accumulates each one exactly once per backward and no AccumulateGrad node (where DDP and
FSDP hang their per-parameter hooks) fires inside the shard loop.

DeepSpeed ZeRO-3 is the exception: its partitioned parameters (marked by ``ds_id``) are 0-sized outside their
module's forward, so they cannot be Function inputs. They keep a per-shard path: each shard's backward
accumulates into ``.grad`` through DeepSpeed's own hooks, with ``ds_grad_is_ready`` False on every shard but
the last, which defers DeepSpeed's reduction to the last shard.
"""

import contextlib
import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._gated import gated_forward, gated_recompute_backward

OP = "apply_tiled_mlp"


# ----------------------------------------------------------------------------------------------------------
# Shards


def check_num_shards(num_shards) -> Optional[int]:
    if num_shards is None:
        return None
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{OP}: `num_shards` must be None (automatic) or an int >= 1, got {num_shards!r}")
    return num_shards


def auto_num_shards(x: torch.Tensor) -> int:
    """ceil(S / H): shards of about H tokens, so each shard's S x I intermediates are about I x H, the size of
    one weight matrix."""
    seq_len, hidden = x.shape[-2], x.shape[-1]
    return max(1, math.ceil(seq_len / max(hidden, 1)))


def harmonize_num_shards(num_shards: int, x: torch.Tensor) -> int:
    """Under torch.distributed every rank must run the same number of shards: ZeRO-3 and FSDP gather
    parameters inside each shard's forward, and a rank that ran fewer shards would leave the others waiting
    in a collective forever. Take the maximum over ranks (extra shards are just empty)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return num_shards
    count = torch.tensor([num_shards], dtype=torch.int64, device=_collective_device(x))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _collective_device(x: torch.Tensor) -> torch.device:
    if dist.get_backend() == "gloo" or x.device.type == "meta":
        return torch.device("cpu")
    return x.device


def shard_bounds(seq_len: int, num_shards: int) -> List[tuple]:
    """(start, length) of each shard; sizes differ by at most one, trailing shards may be empty."""
    base, extra = divmod(seq_len, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        length = base + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


# ----------------------------------------------------------------------------------------------------------
# What the recompute must see again: autocast and random state.


def _autocast_state(device_type: str):
    kinds = {device_type, "cpu"}
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in sorted(kinds)], (
        torch.is_autocast_cache_enabled()
    )


@contextlib.contextmanager
def _replay_autocast(state):
    kinds, cache_enabled = state
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in kinds:
            stack.enter_context(torch.autocast(device_type=kind, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled))
        yield


def _rng_devices(device: torch.device):
    if device.type in ("cpu", "meta"):
        return None, []
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None, []
    index = device.index if device.index is not None else module.current_device()
    return module, [index]


def _capture_rng(device: torch.device):
    module, indices = _rng_devices(device)
    device_state = module.get_rng_state(indices[0]) if module is not None else None
    return torch.get_rng_state(), device_state


@contextlib.contextmanager
def _replay_rng(device: torch.device, state):
    """Restore the forward's random state for the recompute, and the caller's afterwards."""
    module, indices = _rng_devices(device)
    with torch.random.fork_rng(devices=indices, device_type=device.type if module is not None else "cuda"):
        cpu_state, device_state = state
        torch.set_rng_state(cpu_state)
        if module is not None:
            module.set_rng_state(device_state, indices[0])
        yield


# ----------------------------------------------------------------------------------------------------------
# Parameters


def is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def trainable_params(mlp_module, compute_params) -> List[torch.Tensor]:
    """The parameters whose gradients the tiled call must deliver: ``compute_params`` if given, else the
    module's, resolved now (not captured earlier: FSDP2 and ZeRO-3 replace or re-register parameters)."""
    if compute_params is None:
        if not isinstance(mlp_module, torch.nn.Module):
            raise TypeError(f"{OP}: `mlp_module` must be an nn.Module when `compute_params` is None")
        candidates = list(mlp_module.parameters())
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


def _leaves_reached(output: torch.Tensor) -> List[torch.Tensor]:
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
                f"{OP}: `fn` uses a tensor that requires grad (shape {shape}) which is not among the parameters "
                "the tiled call delivers gradients to, so its gradient would be lost. Pass compute_params=None to "
                "use the module's current parameters, or list every trainable tensor fn uses (after any wrapping "
                "such as fully_shard, which replaces the module's parameters)."
            )


# ----------------------------------------------------------------------------------------------------------
# The autograd Function


class LigerTiledMLPFunction(torch.autograd.Function):
    """``LigerTiledMLPFunction.apply(fn, mlp_module, x, num_shards, zero3_params, anchor, *params)``.

    ``params`` are the trainable parameters whose gradients this Function returns, summed over shards.
    ``zero3_params`` (a list, not inputs) are DeepSpeed ZeRO-3 parameters, accumulated per shard; ``anchor``
    is None or an empty tensor requiring grad that keeps the output differentiable when nothing else would.
    :func:`apply_tiled_mlp` resolves all of these and the shard count.
    """

    @staticmethod
    def forward(ctx, fn, mlp_module, x, num_shards, zero3_params, anchor, *params):
        ctx.fn, ctx.mlp_module = fn, mlp_module
        ctx.zero3_params, ctx.params = list(zero3_params), list(params)
        ctx.bounds = shard_bounds(x.shape[-2], num_shards)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = _capture_rng(x.device)
        # Autocast caches its casts of leaf tensors that require grad; the recompute feeds fn a shard of the
        # same kind (leaf or not) as x, so that it makes the same casts and the same gradient sums as untiled.
        ctx.x_is_grad_leaf = x.is_leaf and x.requires_grad
        ctx.gated = _gated_plan(fn, mlp_module, x, ctx.params, ctx.zero3_params)
        ctx.save_for_backward(x)
        if ctx.gated is not None:
            with torch.no_grad():
                return _gated_mlp_forward(ctx, x)
        out = None
        with torch.no_grad():
            for start, length in ctx.bounds:
                shard_out = fn(mlp_module, x.narrow(-2, start, length))
                if shard_out.dim() != x.dim() or shard_out.shape[-2] != length:
                    raise ValueError(
                        f"{OP}: `fn` must map a shard [..., {length}, H] to [..., {length}, H_out], got "
                        f"{tuple(shard_out.shape)}"
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
                "LigerTiledMLPFunction does not support double backward (create_graph=True): it recomputes "
                "each shard and returns first-order gradients only"
            )
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        if ctx.gated is not None:
            return _gated_mlp_backward(ctx, x, d_out, want_x)
        d_x = torch.empty_like(x) if want_x else None
        sums = [None] * len(ctx.params)
        with _replay_rng(x.device, ctx.rng):
            for i, (start, length) in enumerate(ctx.bounds):
                shard_x = x.narrow(-2, start, length).detach().requires_grad_(want_x)
                with torch.enable_grad(), _replay_autocast(ctx.autocast):
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
                sums = [_accumulate(total, g) for total, g in zip(sums, grads)]
        return (None, None, d_x, None, None, None, *_cast_each(sums, ctx.params))


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


# ----------------------------------------------------------------------------------------------------------
# The gated-MLP backward. For fn = down_proj(act(gate_proj(x)) * up_proj(x)) (the package's own tiled layers
# mark their fn with ``gated_activation``), the recompute needs only gate and up: the down projection's
# forward is never needed in backward (11 GEMM-units per step against 9 untiled, not the generic 12). The
# activation's output and both gradients come from one fused pass, and the weight gradients are accumulated
# in fp32 by the GEMMs themselves where the device supports it.

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_plain_linear(module) -> bool:
    """An nn.Linear whose call is exactly F.linear: no overridden forward, no forward hooks."""
    return (
        isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not torch.nn.modules.module._global_forward_hooks
        and not torch.nn.modules.module._global_forward_pre_hooks
    )


def _gated_plan(fn, mlp_module, x, params, zero3_params):
    """The activation for the gated-MLP backward, or None where only the generic recompute is exact."""
    describe = getattr(fn, "gated_activation", None)
    if describe is None or zero3_params or torch.is_autocast_enabled(x.device.type):
        return None
    projections = [getattr(mlp_module, name, None) for name in _PROJECTIONS]
    if not all(is_plain_linear(p) for p in projections):
        return None
    tensors = [t for p in projections for t in (p.weight, p.bias) if t is not None]
    if any(t.dtype != x.dtype for t in tensors):
        return None
    delivered = {id(p) for p in params}
    if any(t.requires_grad and id(t) not in delivered for t in tensors):
        return None  # the generic path raises for a gradient that would be lost
    return describe(mlp_module)


def _mm_into(target, a, weight, bias):
    """target[..., :] = a @ weight^T (+ bias), the GEMM writing into target directly where its rows are
    contiguous."""
    rows = target.view(-1, target.shape[-1]) if target.is_contiguous() else None
    if bias is None:
        rows = torch.mm(a, weight.t(), out=rows)
    else:
        rows = torch.addmm(bias, a, weight.t(), out=rows)
    if rows.data_ptr() != target.data_ptr() or target.numel() == 0:
        target.copy_(rows.view(target.shape))


def _gated_mlp_forward(ctx, x):
    """fn's math per shard, with each shard's down projection written straight into the output."""
    gate_proj, up_proj, down_proj = (getattr(ctx.mlp_module, name) for name in _PROJECTIONS)
    out = x.new_empty(*x.shape[:-1], down_proj.out_features)
    for start, length in ctx.bounds:
        rows = x.narrow(-2, start, length).reshape(-1, x.shape[-1])
        hidden = gated_forward(
            F.linear(rows, gate_proj.weight, gate_proj.bias), F.linear(rows, up_proj.weight, up_proj.bias), ctx.gated
        )
        _mm_into(out.narrow(-2, start, length), hidden, down_proj.weight, down_proj.bias)
        del hidden
    return out


def _gated_mlp_backward(ctx, x, d_out, want_x):
    """Per shard: gate = x W_g^T, up = x W_u^T; d_hidden = d_out W_down; one fused pass writes d_gate, d_up
    over gate, up and hidden over d_hidden; then dW_down += d_out^T hidden, dW_g += d_gate^T x,
    dW_u += d_up^T x, d_x = d_gate W_g + d_up W_u. Weight gradients are summed in fp32. (Gate and up as one
    GEMM against a concatenated weight measured 1% faster and 0.08 GiB heavier at S = 32768: not kept.)"""
    gate_proj, up_proj, down_proj = (getattr(ctx.mlp_module, name) for name in _PROJECTIONS)
    index = {id(p): i for i, p in enumerate(ctx.params)}
    sums = [None] * len(ctx.params)

    def slot(param):
        """Where ``param``'s gradient sum goes, or None for a parameter that gets no gradient."""
        return None if param is None else index.get(id(param))

    d_x = torch.empty_like(x) if want_x else None
    for start, length in ctx.bounds:
        rows = x.narrow(-2, start, length).reshape(-1, x.shape[-1])
        d_rows = d_out.narrow(-2, start, length).reshape(-1, d_out.shape[-1])
        d_gate = F.linear(rows, gate_proj.weight, gate_proj.bias)  # gate, until the fused pass
        d_up = F.linear(rows, up_proj.weight, up_proj.bias)  # up, likewise
        hidden = gated_recompute_backward(d_rows @ down_proj.weight, d_gate, d_up, ctx.gated)
        if (i := slot(down_proj.weight)) is not None:
            sums[i] = _add_matmul(sums[i], d_rows.t(), hidden)
        if (i := slot(down_proj.bias)) is not None:
            sums[i] = _accumulate(sums[i], d_rows.sum(0))
        del hidden
        for proj, d_proj in ((gate_proj, d_gate), (up_proj, d_up)):
            if (i := slot(proj.weight)) is not None:
                sums[i] = _add_matmul(sums[i], d_proj.t(), rows)
            if (i := slot(proj.bias)) is not None:
                sums[i] = _accumulate(sums[i], d_proj.sum(0))
        if want_x:
            target = d_x.narrow(-2, start, length)
            d_x_rows = target.view(-1, x.shape[-1]) if target.is_contiguous() else None
            d_x_rows = torch.mm(d_gate, gate_proj.weight, out=d_x_rows)
            d_x_rows.addmm_(d_up, up_proj.weight)
            if d_x_rows.data_ptr() != target.data_ptr() or target.numel() == 0:
                target.copy_(d_x_rows.view(target.shape))
            del d_x_rows
        del d_gate, d_up  # before the next shard allocates its own: one shard's buffers at a time
    return (None, None, d_x, None, None, None, *_cast_each(sums, ctx.params))


def _cast_each(sums, params):
    """The fp32 sums cast to their parameters' dtypes, each sum freed as soon as it is cast, so that the fp32
    and the low-precision copies of all weights never coexist."""
    grads = []
    for i, p in enumerate(params):
        grads.append(None if sums[i] is None else sums[i].to(p.dtype))
        sums[i] = None
    return grads


_OUT_DTYPE_MM = {}  # device type -> whether addmm(..., out_dtype=) accumulates low-precision GEMMs in fp32


def _add_matmul(total, a, b):
    """total + a @ b, total in fp32 (fp64 for fp64) however low a and b are."""
    wide = torch.promote_types(a.dtype, torch.float32)
    if a.dtype == wide:
        return a @ b if total is None else total.addmm_(a, b)
    device = a.device.type
    if _OUT_DTYPE_MM.get(device, True):
        try:  # the GEMM itself writes (or adds into) the fp32 sum: no low-precision product, no extra pass
            if total is None:
                return torch.mm(a, b, out_dtype=wide)
            return torch.addmm(total, a, b, out_dtype=wide, out=total)
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[device] = False
    return (a @ b).to(wide) if total is None else total.add_(a @ b)


def _accumulate(total, grad):
    """Sum shard gradients in fp32 (fp64 for fp64), never in the parameter's low precision."""
    if grad is None:
        return total
    if total is None:
        wide = torch.promote_types(grad.dtype, torch.float32)
        # A tensor of our own to add into: autograd may hand back a gradient that aliases another one.
        return grad.to(wide) if grad.dtype != wide else grad.clone()
    return total.add_(grad)


def apply_tiled_mlp(
    fn: Callable, mlp_module, x: torch.Tensor, num_shards: Optional[int] = None, compute_params=None
) -> torch.Tensor:
    """``fn(mlp_module, x)`` computed shard by shard along the sequence dimension, recomputed in backward.

    x: [B, S, H] or [S, H] (MoE experts); the shards split S (``x.shape[-2]``). num_shards: None for
    ceil(S / H), or an int >= 1 (more shards than tokens is fine). compute_params: the trainable tensors fn
    uses, if not the module's own parameters.
    """
    if not callable(fn):
        raise TypeError(f"{OP}: `fn` must be callable as fn(mlp_module, shard), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{OP}: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{OP}: `x` must be [B, S, H] or [S, H], got shape {tuple(x.shape)}")
    requested = check_num_shards(num_shards)
    params = trainable_params(mlp_module, compute_params)
    if requested is None:
        num_shards = harmonize_num_shards(auto_num_shards(x), x)
    else:
        num_shards = requested
    zero3 = [p for p in params if is_zero3(p)]
    explicit = [] if zero3 else params
    # ZeRO-3 weights are not Function inputs; when x needs no grad either, an anchor input makes the output
    # require grad so that backward (and with it the weights' per-shard accumulation) runs at all.
    anchor = torch.empty(0, device=x.device, requires_grad=True) if zero3 and not x.requires_grad else None
    return LigerTiledMLPFunction.apply(fn, mlp_module, x, num_shards, zero3, anchor, *explicit)
