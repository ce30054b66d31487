"""Layers for ``kernels.kernelize``: the fused MLPs, their tiled forms, and a tiled Linear.

``kernelize`` binds a layer's ``forward`` to the host module (a ``LlamaMLP``, a ``GemmaMLP``, ...), so
``self`` is the host: the layers read its ``gate_proj``, ``up_proj`` and ``down_proj`` and hold no state of
their own. ``kernels`` rejects a layer with a constructor or members other than ``forward``,
``can_torch_compile`` and ``has_backward``, so the math lives in the module-level functions below.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import geglu as _geglu
from . import loss as _loss
from . import swiglu as _swiglu
from .tiled_mlp import apply_tiled_mlp, is_plain_linear

# How a host's activation is recognized: its ``act_fn`` (module or function) first, since that is what the
# host computes, else its config's ``hidden_act`` / ``hidden_activation``.
_SILU = "silu"
_GELU_TANH = "tanh"
_GELU_EXACT = "none"
_ACTIVATION_CLASSES = {
    "SiLU": _SILU,
    "SiLUActivation": _SILU,
    "GELUActivation": _GELU_EXACT,  # erf form (also with use_gelu_python)
    "GELUTanh": _GELU_TANH,
    "PytorchGELUTanh": _GELU_TANH,
    "NewGELUActivation": _GELU_TANH,
    "FastGELUActivation": _GELU_TANH,
    "AccurateGELUActivation": _GELU_TANH,
}
_ACTIVATION_NAMES = {
    "silu": _SILU,
    "swish": _SILU,
    "gelu": _GELU_EXACT,
    "gelu_python": _GELU_EXACT,
    "gelu_pytorch_tanh": _GELU_TANH,
    "gelu_python_tanh": _GELU_TANH,
    "gelu_new": _GELU_TANH,
    "gelu_fast": _GELU_TANH,
    "gelu_accurate": _GELU_TANH,
}


def host_activation(module: nn.Module):
    """The gated activation ``module`` computes: "silu", "tanh" (tanh-approximated GELU), "none" (exact
    GELU), None when the module does not say, or a string describing an activation this package lacks."""
    act_fn = getattr(module, "act_fn", None)
    if act_fn is not None:
        if isinstance(act_fn, nn.GELU):
            return _GELU_TANH if act_fn.approximate == "tanh" else _GELU_EXACT
        if act_fn is torch.nn.functional.silu:
            return _SILU
        if act_fn is torch.nn.functional.gelu:
            return _GELU_EXACT
        name = type(act_fn).__name__
        return _ACTIVATION_CLASSES.get(name, f"act_fn {name}")
    config = getattr(module, "config", None)
    for key in ("hidden_act", "hidden_activation"):
        name = getattr(config, key, None)
        if isinstance(name, str):
            return _ACTIVATION_NAMES.get(name, f"config.{key}={name!r}")
    return None


def _check_silu_host(module: nn.Module, layer: str) -> None:
    found = host_activation(module)
    if found not in (None, _SILU):
        raise ValueError(
            f"{layer} computes silu(gate_proj(x)) * up_proj(x), but the host {type(module).__name__} uses "
            f"{_describe(found)}; map this module to a layer with its own activation instead"
        )


def _gelu_form(module: nn.Module, layer: str) -> str:
    found = host_activation(module)
    if found is None:
        return _GELU_TANH
    if found not in (_GELU_TANH, _GELU_EXACT):
        raise ValueError(
            f"{layer} computes gelu(gate_proj(x)) * up_proj(x) (tanh or exact GELU), but the host "
            f"{type(module).__name__} uses {_describe(found)}"
        )
    return found


def _describe(found: str) -> str:
    return {_SILU: "SiLU", _GELU_TANH: "tanh-approximated GELU", _GELU_EXACT: "exact GELU"}.get(found, found)


def _in_place_ok(module: nn.Module) -> bool:
    """True when gate_proj(x) and up_proj(x) return fresh tensors nobody else keeps (plain nn.Linear calls
    without hooks): only then may backward write gradients over them."""
    return is_plain_linear(module.gate_proj) and is_plain_linear(module.up_proj)


def swiglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused SwiGLU."""
    _check_silu_host(module, "LigerSwiGLUMLP")
    gate, up = module.gate_proj(x), module.up_proj(x)
    return module.down_proj(_swiglu.silu_mul(gate, up, 1.0, 1.0, _in_place_ok(module)))


def geglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` with the fused GeGLU, in the host's GELU form."""
    approximate = _gelu_form(module, "LigerGEGLUMLP")
    gate, up = module.gate_proj(x), module.up_proj(x)
    return module.down_proj(_geglu.gelu_mul(gate, up, approximate, _in_place_ok(module)))


class LigerSwiGLUMLP(nn.Module):
    """SwiGLU MLP (Llama, Mistral, Qwen): ``down_proj(silu(gate_proj(x)) * up_proj(x))``, fused activation."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(self, x)


class LigerGEGLUMLP(nn.Module):
    """GeGLU MLP (Gemma): ``down_proj(gelu(gate_proj(x)) * up_proj(x))``, tanh or exact GELU as the host."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu_mlp(self, x)


# The tiled layers' fns say which gated activation they compute (checking the host as fn itself would), so
# the tiled MLP can run the math directly and recompute only gate and up (see tiled_mlp._gated_plan).
def _swiglu_activation(module: nn.Module):
    _check_silu_host(module, "LigerSwiGLUMLP")
    return _swiglu.SILU


swiglu_mlp.gated_activation = _swiglu_activation
geglu_mlp.gated_activation = lambda module: _geglu.ACTIVATIONS[_gelu_form(module, "LigerGEGLUMLP")]


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def tiled(fn, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``fn(module, x)`` through the tiled MLP; a host attribute ``num_shards`` overrides ceil(S / H)."""
    return apply_tiled_mlp(fn, module, x, num_shards=getattr(module, "num_shards", None))


class LigerTiledSwiGLUMLP(nn.Module):
    """:class:`LigerSwiGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(swiglu_mlp, self, x)


class LigerTiledGEGLUMLP(nn.Module):
    """:class:`LigerGEGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(geglu_mlp, self, x)


class LigerLinear(nn.Module):
    """A host ``nn.Linear`` run over sequence shards and recomputed in backward; 1-D input runs untiled."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(self, input) if input.dim() < 2 else tiled(linear, self, input)


# ----------------------------------------------------------------------------------------------------------
# The causal-LM loss. transformers maps "ForCausalLMLoss" (its loss function, made a layer by
# ``use_kernel_forward_from_hub``) to this layer; kernels checks that the forward has the function's
# parameters, so the fused path's hidden_states / lm_head_weight / lm_head_bias arrive through ``kwargs``.


class LigerForCausalLMLossLayer(nn.Module):
    """transformers' ``ForCausalLMLoss``, computed by :func:`~liger_kernels.loss.LigerForCausalLMLoss`: from the
    logits, or fused with the LM head when ``hidden_states`` and ``lm_head_weight`` are passed."""

    can_torch_compile = True
    has_backward = True

    def forward(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                **kwargs):  # fmt: skip
        return _loss.LigerForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                                          shift_labels, **kwargs)  # fmt: skip
