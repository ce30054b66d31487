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
from ._grad_sums import accumulate, add_matmul, cast_each, narrow_sums

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
    projections = [getattr(mlp_module, name) for name in _PROJECTIONS]
    weights = [(p.weight, p.bias) for p in projections]
    tensors = [t for pair in weights for t in pair if t is not None]
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return None
    delivered = {id(p) for p in params}
    if any(t.requires_grad and id(t) not in delivered for t in tensors):
        return None  # the generic path raises for a gradient that would be lost
    return GatedPlan(activation, *weights)


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


def gated_mlp_backward(plan: GatedPlan, params, bounds, x, d_out, want_x):
    """Per shard: gate = x W_g^T, up = x W_u^T; d_hidden = d_out W_down; one fused pass writes d_gate, d_up
    over gate, up and hidden over d_hidden; then dW_down += d_out^T hidden, dW_g += d_gate^T x,
    dW_u += d_up^T x, d_x = d_gate W_g + d_up W_u. Returns (d_x, gradients of ``params``)."""
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
            sums[i] = accumulate(sums[i], d_rows.sum(0), narrow[i])
        del hidden
        for (weight, bias), d_proj in (((w_gate, b_gate), d_gate), ((w_up, b_up), d_up)):
            if (i := slot(weight)) is not None:
                sums[i] = add_matmul(sums[i], d_proj.t(), rows, narrow[i])
            if (i := slot(bias)) is not None:
                sums[i] = accumulate(sums[i], d_proj.sum(0), narrow[i])
        if want_x:
            target = d_x.narrow(-2, start, length)
            d_x_rows = target.view(-1, x.shape[-1]) if target.is_contiguous() else None
            d_x_rows = torch.mm(d_gate, w_gate, out=d_x_rows)
            d_x_rows.addmm_(d_up, w_up)
            if d_x_rows.data_ptr() != target.data_ptr() or target.numel() == 0:
                target.copy_(d_x_rows.view(target.shape))
            del d_x_rows
        del d_gate, d_up  # before the next shard allocates its own: one shard's buffers at a time
    return d_x, cast_each(sums, params)
