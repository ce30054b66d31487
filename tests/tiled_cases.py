"""Modules and comparisons shared by the tiled-MLP tests (single process and distributed)."""

import torch
import torch.nn.functional as F


class GatedMLP(torch.nn.Module):
    """A plain-PyTorch SwiGLU MLP in the form the layers serve: the untiled reference."""

    def __init__(self, hidden, intermediate, out_features=None, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate, out_features or hidden, bias=bias)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DropoutGatedMLP(GatedMLP):
    """Dropout on the hidden activations: for apply_tiled_mlp with a generic fn (the layers refuse this form)."""

    def __init__(self, hidden, intermediate, dropout):
        super().__init__(hidden, intermediate)
        self.dropout = dropout

    def forward(self, x):
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(F.dropout(h, self.dropout, training=True))


def call(module, x):
    return module(x)


def tiled_and_untiled_grads(lk, module, x, num_shards, d_out=None, compute_params=None):
    """(out, grads) of the tiled call and of the plain module; grads: x's (if it requires grad), then every
    parameter's .grad (None where it stays None)."""
    results = []
    for tiled in (True, False):
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(x.requires_grad)
        out = lk.apply_tiled_mlp(call, module, leaf, num_shards, compute_params) if tiled else module(leaf)
        if d_out is None:
            d_out = torch.randn_like(out)
        out.backward(d_out)
        grads = ([leaf.grad] if x.requires_grad else []) + [p.grad for p in module.parameters()]
        results.append((out.detach(), [None if g is None else g.clone() for g in grads]))
    return results


def max_abs_diff(tiled, untiled) -> float:
    (out_t, grads_t), (out_u, grads_u) = tiled, untiled
    worst = (out_t - out_u).abs().max().item() if out_t.numel() else 0.0
    for a, b in zip(grads_t, grads_u):
        assert (a is None) == (b is None), "a gradient is None on one side only"
        if a is not None and a.numel():
            worst = max(worst, (a - b).abs().max().item())
    return worst
