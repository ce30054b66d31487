"""The gated MLPs the layers compute: ``down_proj(act(gate_proj(x)) * up_proj(x))`` with the fused activation.

A :class:`GatedMLP` is the math of one layer family (SwiGLU, GeGLU). Called as ``mlp(module, x)`` it runs the
host's projections and the fused activation, untiled; it is also the ``fn`` the tiled layers hand to
:func:`tiled_mlp.apply_tiled_mlp`. Its :meth:`GatedMLP.tiled_fast_path` is the declaration the tiled machinery
asks for: where it returns an activation, the tiled MLP may run this same math itself, shard by shard, and
recompute only gate and up in backward; where it returns None, the tiled MLP calls ``mlp(module, shard)``.
Keep the two together: a change to the math here must be matched by the fast path it declares. Its
:meth:`GatedMLP.tiled_check`, asked by the tiled machinery before anything else, refuses a host the math would not
reproduce.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import _backend, _gated, _hosts
from .activations import REGISTRY, GatedActivation

# Inference calls up to this many activation elements (73 tokens at Llama-3-8B's 14336; decoding) compute it as
# the host module does, with PyTorch's activation and product written over the layer's own gate buffer: two
# aten launches cost the host less than one Triton launch and its output (benchmarks/NOTES.md §27), and the
# GPU time both take is far below the host's at these sizes.
SMALL_CALL_ELEMENTS = 1 << 20


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
        activation, form, _ = self._resolve(module)
        return activation, form

    def _resolve(self, module: nn.Module):
        """``check``'s answer and the activation the host's forward calls (its ``act_fn`` / ``activation_fn``),
        read once: every attribute of a module is a lookup through ``nn.Module.__getattr__``, and a decoding
        model calls this once per layer and token."""
        shape = _hosts.gated_form(type(module))
        act_fn = getattr(module, shape.act_attribute or "act_fn", None)
        if act_fn is not None:
            found = _hosts.activation_of(act_fn, shape.act_attribute or "act_fn")
        elif shape.act_attribute:  # the attribute the forward calls is missing: its config first, then any
            found = _hosts.host_activation(module, (shape.act_attribute,)) or _hosts.host_activation(module)
        else:
            found = _hosts.host_activation(module)
        found = found or self.default
        if shape.problem is not None or found not in self.activations:
            wanted = " or ".join(_hosts.describe(a) for a in self.activations)
            why = shape.problem or f"it uses {_hosts.describe(found)}"
            raise ValueError(
                f"liger-kernels {self.layer} computes down_proj(act(gate_proj(x)) * up_proj(x)) with act = {wanted}, "
                f"but the host {type(module).__name__} cannot be served: {why}. Map this module to a layer that "
                "reproduces its forward, or leave it unmapped."
            )
        form = shape.form or (_hosts.FUSED if hasattr(module, "gate_up_proj") else _hosts.SEPARATE)
        return REGISTRY[found], form, act_fn

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        activation, form, act_fn = self._resolve(module)
        hooked_globally = _hosts.global_hooks()  # global module hooks fire on every module of the host's forward
        if isinstance(act_fn, nn.Module) and (hooked_globally or _hosts.has_hooks(act_fn)):
            # Hooks on the activation module (reading, ablating or steering neurons) must see it called: the
            # host's own forward is what they hook into.
            return type(module).forward(module, x)
        if form == _hosts.FUSED:
            # The halves share one buffer: backward writes fresh gradients (never over an aliased pair).
            gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
            return module.down_proj(_gated.gated_apply(gate, up, activation, 1.0, 1.0, False, own_buffers=True))
        gate_proj, up_proj, down_proj = module.gate_proj, module.up_proj, module.down_proj
        # Where each projection's call is exactly F.linear with its parameters (an eager call, no hook, nn.Linear
        # itself: _hosts.linear_operands), F.linear runs directly: the same ops without three module calls'
        # host work (a decoding model makes them once per layer and token). Traced and compiled calls keep the
        # module calls, which record the modules.
        direct = not (hooked_globally or torch.compiler.is_compiling() or _backend.exporting())
        gate_operands = direct and _hosts.linear_operands(gate_proj)
        up_operands = gate_operands and _hosts.linear_operands(up_proj)
        down_operands = up_operands and _hosts.linear_operands(down_proj)
        if down_operands:
            gate, up = F.linear(x, *gate_operands), F.linear(x, *up_operands)
            grad_mode = torch.is_grad_enabled()
            if not grad_mode and _small_call(gate, up):
                # act(gate) * up in the inputs' dtype, rounded after each op: the host module's own arithmetic
                # (bit for bit where its activation is PyTorch's op), over the gate buffer
                return F.linear(activation.torch_in_place(gate).mul_(up), *down_operands)
            # Outputs of F.linear are fresh tensors nobody else keeps (a torch-function or dispatch mode may: one
            # that records the projections' outputs would find the gradients there), so backward may write over
            # them. Asked only where a backward will run (decoding records nothing).
            in_place = (
                grad_mode
                and (gate.requires_grad or up.requires_grad)
                and not (gate_operands[0].is_meta or up_operands[0].is_meta)
                and not ((_function_modes() or _dispatch_modes()) and _modes_may_keep())
            )
            hidden = _gated.gated_apply_eager(gate, up, activation, 1.0, 1.0, in_place, own_buffers=True)
            return F.linear(hidden, *down_operands)
        gate, up = gate_proj(x), up_proj(x)
        # Outputs of plain nn.Linear calls are fresh tensors nobody else keeps, as above.
        in_place = (
            (gate.requires_grad or up.requires_grad)
            and torch.is_grad_enabled()
            and _hosts.is_plain_linear(gate_proj)
            and _hosts.is_plain_linear(up_proj)
            # (a compiled call never writes over them: the question is not traced)
            and (torch.compiler.is_compiling() or not ((_function_modes() or _dispatch_modes()) and _modes_may_keep()))
        )
        return down_proj(_gated.gated_apply(gate, up, activation, 1.0, 1.0, in_place, own_buffers=True))

    def tiled_check(self, module: nn.Module) -> None:
        """What the tiled MLP asks before it walks, gathers or tiles: ``check``'s ValueError for a host this math
        would not reproduce (the tiled layers' refusal before any shard runs; their plain call refuses in its own
        first step). Reads no parameter: inside DeepSpeed's forward, reading a partitioned ZeRO-3 weight gathers
        it."""
        self._resolve(module)

    def tiled_fast_path(self, module: nn.Module) -> GatedActivation | None:
        """The activation, when the tiled MLP may compute this math from the projections' weights directly:
        separate projections, each a plain nn.Linear (see ``_hosts.is_plain_linear``; the tiled MLP gathers
        DeepSpeed ZeRO-3 weights itself, so ZeRO-3's own hooks on them do not count). None otherwise."""
        activation, form, act_fn = self._resolve(module)
        if form != _hosts.SEPARATE or _is_hooked(act_fn):
            return None
        projections = [getattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(_hosts.is_plain_linear(p, engine_gathers=True) for p in projections):
            return None
        return activation


def _small_call(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether an inference call (grad mode off: a call under grad mode may sit in a checkpoint whose saved
    tensors, the gate buffer among them, must stay as they are) takes the host's arithmetic over its gate
    buffer: at most SMALL_CALL_ELEMENTS elements, plain tensors of one shape (a subclass or a torch-function or
    dispatch mode may keep the projection's output; a broadcasting product has no in-place form), no
    forward-mode AD or torch.func transform."""
    return (
        gate.numel() <= SMALL_CALL_ELEMENTS
        and type(gate) is torch.Tensor
        and type(up) is torch.Tensor
        and gate.shape == up.shape
        and not ((_function_modes() or _dispatch_modes()) and _modes_may_keep())
        and not (_backend.forward_ad_active() or torch._C._are_functorch_transforms_active())
    )


# How many torch-function and dispatch modes are active: a mode may keep the projections' outputs (to log them,
# say), which the layer would otherwise write over.
_function_modes, _dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def _modes_may_keep() -> bool:
    """Asked where a mode is active: whether one may keep what it sees. ``torch.device(...)`` as a context and
    ``torch.set_default_device`` push a mode that only sets the device of new tensors (a training loop may run
    under it whole): that one keeps nothing."""
    from torch.utils._device import DeviceContext

    if _dispatch_modes():
        return True
    return any(type(torch._C._get_function_stack_at(i)) is not DeviceContext for i in range(_function_modes()))


def _is_hooked(act_fn) -> bool:
    """Hooks that must see the activation module called: its own, or global module hooks (which fire on it in
    the host's forward)."""
    return isinstance(act_fn, nn.Module) and (_hosts.has_hooks(act_fn) or _hosts.global_hooks())


swiglu_mlp = GatedMLP("LigerSwiGLUMLP", ["silu"], default="silu")
geglu_mlp = GatedMLP("LigerGEGLUMLP", ["gelu_tanh", "gelu"], default="gelu_tanh")
