"""Layers for ``kernels.kernelize``: the fused MLPs, their tiled forms, a tiled Linear, and RMSNorm.

``kernelize`` binds a layer's ``forward`` to the host module (a ``LlamaMLP``, a ``GemmaMLP``, ...), so
``self`` is the host: the layers read its projections and hold no state of their own. ``kernels`` rejects a
layer with a constructor or members other than ``forward``, ``can_torch_compile`` and ``has_backward``, so
the math lives in module-level functions (gated_mlp.py for the MLPs). Each layer refuses, with a message, a
host whose forward it would not reproduce (``_hosts``), before it runs anything of the host's (the tiled layers
after the tiled call's checks of its input and the host's settings).
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import _hosts
from . import loss as _loss
from . import rms_norm as _rms_norm
from ._hosts import declare_rms_norm_host, rms_norm_host  # noqa: F401  (declare: public, here as published)
from .cross_entropy import CrossEntropyOutput  # noqa: F401  (here too, as in the published package)
from .fused_linear_cross_entropy import liger_fused_linear_cross_entropy  # noqa: F401  (likewise)
from .gated_mlp import geglu_mlp, swiglu_mlp
from .loss import LigerForCausalLMLoss  # noqa: F401  (likewise)
from .rotary import liger_rotary_pos_emb  # also here, as in the published package
from .tiled_mlp import apply_tiled_mlp


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _check_linear_host(module: nn.Module) -> None:
    if type(module).forward is not nn.Linear.forward:
        raise ValueError(
            f"liger-kernels LigerLinear computes F.linear(x, weight, bias), but the host {type(module).__name__} "
            "defines its own forward, which the layer would not reproduce; leave it unmapped."
        )


def tiled(fn, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``fn(module, x)`` through the tiled MLP; host attributes override the automatic choices: ``num_shards``
    (the shard count) and ``tile`` (True: always tile; False: never). A host that ``fn`` (a ``GatedMLP``) refuses
    fails with its ValueError before any shard runs: in ``fn``'s own call where the call runs untiled, and in
    its ``tiled_check``, asked first, where it tiles."""
    tile, num_shards = _host_setting(module, "tile"), _host_setting(module, "num_shards")
    return apply_tiled_mlp(fn, module, x, num_shards=num_shards, tile=tile)


def tiled_swiglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tiled(swiglu_mlp, module, x)


def tiled_geglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return tiled(geglu_mlp, module, x)


def tiled_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A host ``nn.Linear`` tiled; 1-D input untiled."""
    _check_linear_host(module)
    return linear(module, x) if x.dim() < 2 else tiled(linear, module, x)


def _host_setting(module: nn.Module, name: str):
    """``getattr(module, name, None)``, without raising and catching ``nn.Module.__getattr__``'s AttributeError
    where the name is nowhere (the common case, on every call of a tiled layer): an instance attribute is read
    directly; a class attribute, a registered tensor or module, or a class's own attribute lookup through
    getattr."""
    cls = type(module)
    if cls.__getattribute__ is not object.__getattribute__ or cls.__getattr__ is not nn.Module.__getattr__:
        return getattr(module, name, None)
    if hasattr(cls, name):  # (a data descriptor would come before the instance's dict)
        return getattr(module, name, None)
    instance = module.__dict__
    if name in instance:
        return instance[name]
    if name in module._parameters or name in module._buffers or name in module._modules:
        return getattr(module, name, None)
    return None


class LigerSwiGLUMLP(nn.Module):
    """SwiGLU MLP (Llama, Mistral, Qwen, Phi-3's fused gate_up): ``down_proj(silu(gate) * up)``, fused activation."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerSwiGLUMLP.forward):
            return _hosts.run_hook(self, swiglu_mlp, x)
        return swiglu_mlp(self, x)


class LigerGEGLUMLP(nn.Module):
    """GeGLU MLP (Gemma): ``down_proj(gelu(gate_proj(x)) * up_proj(x))``, tanh or exact GELU as the host."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerGEGLUMLP.forward):
            return _hosts.run_hook(self, geglu_mlp, x)
        return geglu_mlp(self, x)


class LigerTiledSwiGLUMLP(nn.Module):
    """:class:`LigerSwiGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerTiledSwiGLUMLP.forward):
            return _hosts.run_hook(self, tiled_swiglu_mlp, x)
        return tiled(swiglu_mlp, self, x)


class LigerTiledGEGLUMLP(nn.Module):
    """:class:`LigerGEGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerTiledGEGLUMLP.forward):
            return _hosts.run_hook(self, tiled_geglu_mlp, x)
        return tiled(geglu_mlp, self, x)


class LigerLinear(nn.Module):
    """A host ``nn.Linear`` run over sequence shards and recomputed in backward; 1-D input runs untiled."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerLinear.forward):
            return _hosts.run_hook(self, tiled_linear, input)
        return tiled_linear(self, input)


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding. transformers tags ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` with
# ``use_kernel_forward_from_hub("rotary_pos_emb")``, which turns the function into a module whose forward
# takes those arguments; kernelize binds this layer's forward to it (``self`` is that module, unused).
# The lower-case name is the one the published package gives the layer.


class liger_rotary_pos_emb_layer(nn.Module):
    """:func:`liger_rotary_pos_emb` as a kernelize layer for transformers' "rotary_pos_emb": the function it is
    bound to is read first (``_hosts.rotary_host``). Llama's form and gpt-oss's give the promoted dtype, OLMo's,
    ESM's, ModernBERT's and HunYuan-VL's cast the result back as theirs do, NanoChat's rotates by -sin; any other
    (interleaved pairs) is refused with a ValueError. Called on its own (not bound), it is Llama's."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
        return rotary_layer(self, q, k, cos, sin, unsqueeze_dim)


def rotary_layer(module, q, k, cos, sin, unsqueeze_dim=1):
    """The rotary function ``module`` (kernels' module of a tagged function) computes, by its form."""
    if type(module) is liger_rotary_pos_emb_layer:
        return liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    dtype, sign, refusal = _hosts.rotary_host(type(module))
    if refusal:
        raise ValueError(refusal)
    q_embed, k_embed = liger_rotary_pos_emb(q, k, cos, sin if sign > 0 else -sin, unsqueeze_dim)
    if dtype == _hosts.ROTARY_PROMOTED:
        return q_embed, k_embed
    return q_embed.to(q.dtype), k_embed.to(k.dtype if dtype == _hosts.ROTARY_Q_K_DTYPES else q.dtype)


# ----------------------------------------------------------------------------------------------------------
# The causal-LM loss. transformers maps "ForCausalLMLoss" (its loss function, made a layer by
# ``use_kernel_forward_from_hub``) to this layer; kernels checks that the forward has the function's
# parameters, so the fused path's hidden_states / lm_head_weight / lm_head_bias arrive through ``kwargs``.


class LigerForCausalLMLossLayer(nn.Module):
    """transformers' ``ForCausalLMLoss``, computed by :func:`loss.LigerForCausalLMLoss`: from the logits, or
    fused with the LM head when ``hidden_states`` and ``lm_head_weight`` are passed."""

    can_torch_compile = True
    has_backward = True

    def forward(
        self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        return _loss.LigerForCausalLMLoss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )


# ----------------------------------------------------------------------------------------------------------
# RMSNorm: the host's form is read in _hosts (rms_norm_host); a refused host raises before any launch.


def rms_norm_layer(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The host's RMSNorm of ``hidden_states`` with its ``weight`` and epsilon, after checking its form."""
    casting, offset, eps_attribute, refusal = rms_norm_host(type(module))
    if refusal:
        raise ValueError(refusal)
    return _rms_norm.rms_norm(hidden_states, module.weight, getattr(module, eps_attribute), offset, casting)


class LigerRMSNorm(nn.Module):
    """RMSNorm for hosts of the ``LlamaRMSNorm`` form (``weight * x_normed.to(x.dtype)``) and of the fp32-product
    form (``(weight * x_normed).to(x.dtype)``), reading the host's ``weight`` and ``variance_epsilon`` (or
    ``eps``); other hosts are refused with a ValueError (see :func:`declare_rms_norm_host`)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if "_hf_hook" in self.__dict__ and _hosts.hook_bypassed(self, LigerRMSNorm.forward):
            return _hosts.run_hook(self, rms_norm_layer, hidden_states)
        return rms_norm_layer(self, hidden_states)
