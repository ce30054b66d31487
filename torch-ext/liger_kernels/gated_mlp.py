"""The gated MLPs the layers compute: ``down_proj(act(gate_proj(x)) * up_proj(x))`` with the fused activation.

A :class:`GatedMLP` is the math of one layer family (SwiGLU, GeGLU). Called as ``mlp(module, x)`` it runs the
host's projections and the fused activation, untiled; it is also the ``fn`` the tiled layers hand to
:func:`tiled_mlp.apply_tiled_mlp`. Its :meth:`GatedMLP.tiled_fast_path` is the declaration the tiled machinery
asks for: where it returns an activation, the tiled MLP may run this same math itself, shard by shard, and
recompute only gate and up in backward; where it returns None, the tiled MLP calls ``mlp(module, shard)``.
Keep the two together: a change to the math here must be matched by the fast path it declares.
"""

import torch
from torch import nn

from . import _gated, _hosts
from .activations import REGISTRY, GatedActivation


class GatedMLP:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` for the hosts a layer serves.

    layer: the layer's name, for messages. activations: the registry names of the activations it computes.
    default: the activation for a host that does not say which it uses (None: refuse such a host).
    """

    def __init__(self, layer: str, activations, default: str | None):
        self.layer = layer
        self.activations = tuple(activations)
        self.default = default

    def check(self, module: nn.Module):
        """(activation, form) for ``module``, or a ValueError naming what the layer would not reproduce."""
        shape = _hosts.gated_form(type(module))
        found = _hosts.host_activation(module, (shape.act_attribute,)) if shape.act_attribute else None
        if found is None:
            found = _hosts.host_activation(module)
        if found is None:
            found = self.default
        if shape.problem is not None or found not in self.activations:
            wanted = " or ".join(_hosts.describe(a) for a in self.activations)
            why = shape.problem or f"it uses {_hosts.describe(found)}"
            raise ValueError(
                f"liger-kernels {self.layer} computes down_proj(act(gate_proj(x)) * up_proj(x)) with act = {wanted}, "
                f"but the host {type(module).__name__} cannot be served: {why}. Map this module to a layer that "
                "reproduces its forward, or leave it unmapped."
            )
        form = shape.form or (_hosts.FUSED if hasattr(module, "gate_up_proj") else _hosts.SEPARATE)
        return REGISTRY[found], form

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        activation, form = self.check(module)
        if _activation_is_hooked(module):
            # Hooks on the activation module (reading, ablating or steering neurons) must see it called: the
            # host's own forward is what they hook into.
            return type(module).forward(module, x)
        if form == _hosts.FUSED:
            # The halves share one buffer: backward writes fresh gradients (never over an aliased pair).
            gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
            in_place = False
        else:
            gate, up = module.gate_proj(x), module.up_proj(x)
            # Outputs of plain nn.Linear calls are fresh tensors nobody else keeps: backward may write over them.
            in_place = _hosts.is_plain_linear(module.gate_proj) and _hosts.is_plain_linear(module.up_proj)
        return module.down_proj(_gated.gated_apply(gate, up, activation, 1.0, 1.0, in_place))

    def tiled_fast_path(self, module: nn.Module) -> GatedActivation | None:
        """The activation, when the tiled MLP may compute this math from the projections' weights directly:
        separate projections, each a plain nn.Linear (see ``_hosts.is_plain_linear``; the tiled MLP gathers
        DeepSpeed ZeRO-3 weights itself, so ZeRO-3's own hooks on them do not count). None otherwise."""
        activation, form = self.check(module)
        if form != _hosts.SEPARATE or _activation_is_hooked(module):
            return None
        projections = [getattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(_hosts.is_plain_linear(p, engine_gathers=True) for p in projections):
            return None
        return activation


def _activation_is_hooked(module: nn.Module) -> bool:
    shape = _hosts.gated_form(type(module))
    act = getattr(module, shape.act_attribute or "act_fn", None)
    return isinstance(act, nn.Module) and _hosts.has_hooks(act)


swiglu_mlp = GatedMLP("LigerSwiGLUMLP", ["silu"], default="silu")
geglu_mlp = GatedMLP("LigerGEGLUMLP", ["gelu_tanh", "gelu"], default="gelu_tanh")
