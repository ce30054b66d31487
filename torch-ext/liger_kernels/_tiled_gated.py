"""The tiled MLP's fast path for gated MLPs: ``down(act(gate(x)) * up(x))`` computed from the weights.

Taken only where the code that owns the MLP's math declares it equivalent (``fn.tiled_fast_path(module)``,
see gated_mlp.py) and this call adds nothing the plain math would miss: no autocast, weights of x's dtype
and device, and every weight that requires grad among the parameters the tiled call delivers gradients to.
DeepSpeed ZeRO-3 weights are whole around the fast path, gathered by DeepSpeed or by the tiled call (see
_zero3). The weights are captured in forward and used again in backward, never re-read from the module
(torch.func.functional_call puts other tensors back in between).

Backward recomputes only gate and up (11 GEMM-units per step, against 9 untiled and 12 for the generic
recompute): the down projection's forward is never needed again. One fused pass writes the activation's
output and both gradients, and the weight gradients are summed in fp32 by the GEMMs themselves where the
device supports it.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _replay
from ._gated import GatedActivation, gated_forward, gated_recompute_backward
from ._grad_sums import accumulate, add_matmul, cast_each, cast_transposed, matmul_into, narrow_sums, row_sum
from ._tiling import column_bounds

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GatedPlan(NamedTuple):
    activation: GatedActivation
    gate: tuple  # (weight, bias or None), as the forward used them
    up: tuple
    down: tuple


def gated_plan(fn, mlp_module, x, params) -> GatedPlan | None:
    """The plan for the fast path, or None where only the generic recompute (which calls fn) is exact.
    ``params``: every tensor whose gradient the tiled call delivers."""
    declare = getattr(fn, "tiled_fast_path", None)
    if declare is None or _replay.autocast_enabled(x.device.type):
        return None
    activation = declare(mlp_module)
    if activation is None:
        return None
    projections = [getattr(mlp_module, name, None) for name in _PROJECTIONS]
    if not all(isinstance(getattr(p, "weight", None), torch.Tensor) for p in projections):
        return None  # a declaration for a module without the three projections: the generic path calls fn
    weights = [(p.weight, getattr(p, "bias", None)) for p in projections]
    tensors = [t for pair in weights for t in pair if t is not None]
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return None
    delivered = {id(p) for p in params}
    if any(t.requires_grad and id(t) not in delivered for t in tensors):
        return None  # the generic path raises for a gradient that would be lost
    return GatedPlan(activation, *weights)


def splits_columns(plan: GatedPlan) -> bool:
    """Whether the backward may run in column blocks of I: not where two of the projections' weights and biases
    are one tensor (tied), whose gradient the blocks would write into two separate sums."""
    tensors = [t for pair in (plan.gate, plan.up, plan.down) for t in pair if t is not None]
    return len({id(t) for t in tensors}) == len(tensors)


def summed_weights(plan: GatedPlan, params) -> int:
    """How many of the three projections' weights have gradients summed over the shards (among ``params``,
    the tensors the call delivers gradients to; frozen ones have none)."""
    delivered = {id(p) for p in params}
    return sum(id(weight) in delivered for weight, _ in (plan.gate, plan.up, plan.down))


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


def gated_mlp_forward(plan: GatedPlan, x, bounds):
    """fn's math per shard, with each shard's down projection written straight into the output."""
    (w_gate, b_gate), (w_up, b_up), (w_down, b_down) = plan.gate, plan.up, plan.down
    out = x.new_empty(*x.shape[:-1], w_down.shape[0])
    for start, length in bounds:
        rows = x.narrow(-2, start, length).reshape(-1, x.shape[-1])
        hidden = gated_forward(F.linear(rows, w_gate, b_gate), F.linear(rows, w_up, b_up), plan.activation)
        _mm_into(out.narrow(-2, start, length), hidden, w_down, b_down)
        del hidden
    return out


def gated_mlp_backward(plan: GatedPlan, params, bounds, x, d_out, want_x, blocks: int = 1):
    """Per shard: gate = x W_g^T, up = x W_u^T; d_hidden = d_out W_down; one fused pass writes d_gate, d_up
    over gate, up and hidden over d_hidden; then dW_down += d_out^T hidden, dW_g += d_gate^T x,
    dW_u += d_up^T x, d_x = d_gate W_g + d_up W_u. Returns (d_x, gradients of ``params``).

    ``blocks`` > 1 runs each shard in that many column blocks of I (``_tiling.split_columns``): every step
    above but d_x is elementwise in the I columns or writes its own rows of the I-indexed sums, and d_x adds
    the blocks' products. The sums then exist from the start (the first shard's GEMMs write them), and the
    down projection's is kept transposed ([I, H_out]), so that each block adds into contiguous rows. Not for
    tied projections (``splits_columns``)."""
    if blocks > 1 and splits_columns(plan):
        return _blocked_backward(plan, params, bounds, x, d_out, want_x, blocks)
    (w_gate, b_gate), (w_up, b_up), (w_down, b_down) = plan.gate, plan.up, plan.down
    index = {id(p): i for i, p in enumerate(params)}
    sums = [None] * len(params)
    narrow = [narrow_sums(len(bounds), p.dtype) for p in params]

    def slot(tensor):
        """Where ``tensor``'s gradient sum goes, or None for one that gets no gradient."""
        return None if tensor is None else index.get(id(tensor))

    d_x = torch.empty_like(x) if want_x else None
    for start, length in bounds:
        rows = x.narrow(-2, start, length).reshape(-1, x.shape[-1])
        d_rows = d_out.narrow(-2, start, length).reshape(-1, d_out.shape[-1])
        d_gate = F.linear(rows, w_gate, b_gate)  # gate, until the fused pass
        d_up = F.linear(rows, w_up, b_up)  # up, likewise
        hidden = gated_recompute_backward(d_rows @ w_down, d_gate, d_up, plan.activation)
        if (i := slot(w_down)) is not None:
            sums[i] = add_matmul(sums[i], d_rows.t(), hidden, narrow[i])
        if (i := slot(b_down)) is not None:
            sums[i] = accumulate(sums[i], row_sum(d_rows, narrow[i]), narrow[i])
        del hidden
        for (weight, bias), d_proj in (((w_gate, b_gate), d_gate), ((w_up, b_up), d_up)):
            if (i := slot(weight)) is not None:
                sums[i] = add_matmul(sums[i], d_proj.t(), rows, narrow[i])
            if (i := slot(bias)) is not None:
                sums[i] = accumulate(sums[i], row_sum(d_proj, narrow[i]), narrow[i])
        if want_x:
            _d_x_into(d_x.narrow(-2, start, length), ((d_gate, w_gate), (d_up, w_up)), first=True)
        # before the next shard allocates its own: one shard's buffers at a time (d_proj, the loop's name,
        # would otherwise keep d_up alive into the next shard; rows and d_rows are copies in a batch)
        del d_gate, d_up, d_proj, rows, d_rows
    return d_x, cast_each(sums, params)


def _d_x_into(target, products, first):
    """target (+)= sum of d_proj @ weight over ``products``, the GEMMs writing into target's rows directly
    where they are contiguous; ``first``: target holds nothing yet."""
    if target.is_contiguous():
        rows = target.view(-1, target.shape[-1])
    else:  # a shard of a batch: its rows are not one block; work on a copy (or a view, where one exists)
        rows = None if first else target.reshape(-1, target.shape[-1])
    for d_proj, weight in products:
        if first:
            rows = torch.mm(d_proj, weight, out=rows)
            first = False
        else:
            rows.addmm_(d_proj, weight)
    if rows.data_ptr() != target.data_ptr() or target.numel() == 0:
        target.copy_(rows.view(target.shape))


def _blocked_backward(plan: GatedPlan, params, bounds, x, d_out, want_x, blocks):
    (w_gate, b_gate), (w_up, b_up), (w_down, b_down) = plan.gate, plan.up, plan.down
    index = {id(p): i for i, p in enumerate(params)}
    narrow = [narrow_sums(len(bounds), p.dtype) for p in params]

    def slot(tensor):
        return None if tensor is None else index.get(id(tensor))

    def sum_for(tensor, transposed=False):
        """The sum for ``tensor``'s gradient, unwritten: the first shard's products write every element."""
        i = slot(tensor)
        if i is None:
            return None
        shape = tuple(reversed(tensor.shape)) if transposed else tensor.shape
        wide = tensor.dtype if narrow[i] else torch.promote_types(tensor.dtype, torch.float32)
        return torch.empty(shape, dtype=wide, device=tensor.device)

    def add_into(total, value, first):
        return total.copy_(value) if first else total.add_(value)

    sum_gate, sum_up, sum_down_t = sum_for(w_gate), sum_for(w_up), sum_for(w_down, transposed=True)
    sum_b_gate, sum_b_up, sum_b_down = sum_for(b_gate), sum_for(b_up), sum_for(b_down)
    columns = column_bounds(w_gate.shape[0], blocks)
    d_x = torch.empty_like(x) if want_x else None
    for shard, (start, length) in enumerate(bounds):
        first = shard == 0
        rows = x.narrow(-2, start, length).reshape(-1, x.shape[-1])
        d_rows = d_out.narrow(-2, start, length).reshape(-1, d_out.shape[-1])
        if sum_b_down is not None:
            add_into(sum_b_down, row_sum(d_rows, sum_b_down.dtype == d_rows.dtype), first)
        for k, (c0, cn) in enumerate(columns):
            w_g, w_u = w_gate.narrow(0, c0, cn), w_up.narrow(0, c0, cn)
            d_gate = F.linear(rows, w_g, None if b_gate is None else b_gate.narrow(0, c0, cn))
            d_up = F.linear(rows, w_u, None if b_up is None else b_up.narrow(0, c0, cn))
            hidden = gated_recompute_backward(d_rows @ w_down.narrow(1, c0, cn), d_gate, d_up, plan.activation)
            if sum_down_t is not None:  # rows c0.. of dW_down^T += hidden^T d_out
                matmul_into(sum_down_t.narrow(0, c0, cn), hidden.t(), d_rows, narrow[slot(w_down)], first)
            del hidden
            for total, bias_total, d_proj, weight in (
                (sum_gate, sum_b_gate, d_gate, w_gate),
                (sum_up, sum_b_up, d_up, w_up),
            ):
                if total is not None:
                    matmul_into(total.narrow(0, c0, cn), d_proj.t(), rows, narrow[slot(weight)], first)
                if bias_total is not None:
                    add_into(bias_total.narrow(0, c0, cn), row_sum(d_proj, bias_total.dtype == d_proj.dtype), first)
            if want_x:
                _d_x_into(d_x.narrow(-2, start, length), ((d_gate, w_g), (d_up, w_u)), first=k == 0)
            del d_gate, d_up, d_proj  # one block's buffers at a time, as above
        del rows, d_rows
    sums = [None] * len(params)
    for tensor, total in ((w_gate, sum_gate), (w_up, sum_up), (b_gate, sum_b_gate), (b_up, sum_b_up),
                          (b_down, sum_b_down)):  # fmt: skip
        if total is not None:
            sums[slot(tensor)] = total
    del sum_gate, sum_up, sum_b_gate, sum_b_up, sum_b_down
    grads = cast_each(sums, params)
    if sum_down_t is not None:  # cast and transposed in one pass, after the others are cast and freed
        i = slot(w_down)
        grads[i] = cast_transposed(sum_down_t, params[i].dtype)
    return d_x, grads
