"""liger-kernels: fused Triton kernels for long-sequence LLM training, and layers for ``kernels.kernelize``.

Loaded as ``kernels.get_kernel("kernels-community/liger-kernels", version=3)``; the loader imports this
package under its own name, so everything here is imported relatively.

Reading order for a newcomer:
  _backend.py            the one place that decides Triton or PyTorch for a tensor
  _launch.py             how every Triton kernel is launched (the compiled kernel, called directly)
  activations.py         the gated activations' registry (math for Triton and PyTorch, references, host names)
  _gated.py              the gated kernels, their PyTorch path and autograd contract; swiglu.py, geglu.py
                         are its public faces
  rms_norm.py, rotary.py, cross_entropy.py, fused_linear_cross_entropy.py, loss.py: the other kernels
                         (_causal_lm.py: what a CausalLM's forward computes, read before causal_lm_loss runs)
  _hosts.py, gated_mlp.py   what a host module computes, and the gated MLP math the layers run
  tiled_mlp.py           the tiled MLP (with _tiling, _replay, _tiled_gated, _grad_sums, _zero3 beside it)
  layers.py, mapping.py  the kernelize layers and the mapping that names them
  attention.py           transformers' sdpa attention, its long causal backward split by KV heads, and its
                         forward kept for the checkpoint's recompute (keep_attention_context)
  decoder_layer.py       a Llama-form decoder layer run over chunks of the sequence (tile_decoder_layers)
"""

from . import (
    activations,
    attention,
    cross_entropy,
    decoder_layer,
    fused_linear_cross_entropy,
    geglu,
    layers,
    loss,
    mapping,
    rotary,
    swiglu,
    tiled_mlp,
)
from ._gated import gated_mul
from .attention import keep_attention_context, register_sdpa_attention, sdpa_attention_forward
from .cross_entropy import CrossEntropyOutput
from .decoder_layer import tile_decoder_layers, untile_decoder_layers
from .fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction, liger_fused_linear_cross_entropy
from .geglu import LigerGELUMulFunction, gelu_mul
from .layers import (
    LigerForCausalLMLossLayer,
    LigerGEGLUMLP,
    LigerLinear,
    LigerRMSNorm,
    LigerSwiGLUMLP,
    LigerTiledGEGLUMLP,
    LigerTiledSwiGLUMLP,
    liger_rotary_pos_emb_layer,
)
from .loss import CausalLMWithFusedLoss, LigerForCausalLMLoss, causal_lm_loss
from .mapping import kernel_mapping, register_kernel_mapping

# The function, not its module, is the package's `rms_norm` (the module: sys.modules[__name__ + ".rms_norm"]).
from .rms_norm import LigerRMSNormFunction, rms_norm
from .rotary import liger_rotary_pos_emb
from .swiglu import LigerSiLUMulFunction, silu_mul
from .tiled_mlp import LigerTiledMLPFunction, apply_tiled_mlp

__all__ = [
    "CausalLMWithFusedLoss",
    "CrossEntropyOutput",
    "LigerForCausalLMLoss",
    "LigerForCausalLMLossLayer",
    "LigerFusedLinearCrossEntropyFunction",
    "LigerGEGLUMLP",
    "LigerGELUMulFunction",
    "LigerLinear",
    "LigerRMSNorm",
    "LigerRMSNormFunction",
    "LigerSiLUMulFunction",
    "LigerSwiGLUMLP",
    "LigerTiledGEGLUMLP",
    "LigerTiledMLPFunction",
    "LigerTiledSwiGLUMLP",
    "activations",
    "apply_tiled_mlp",
    "attention",
    "causal_lm_loss",
    "cross_entropy",
    "decoder_layer",
    "fused_linear_cross_entropy",
    "gated_mul",
    "geglu",
    "gelu_mul",
    "keep_attention_context",
    "kernel_mapping",
    "layers",
    "liger_fused_linear_cross_entropy",
    "liger_rotary_pos_emb",
    "liger_rotary_pos_emb_layer",
    "loss",
    "mapping",
    "register_kernel_mapping",
    "register_sdpa_attention",
    "rms_norm",
    "rotary",
    "sdpa_attention_forward",
    "silu_mul",
    "swiglu",
    "tile_decoder_layers",
    "tiled_mlp",
    "untile_decoder_layers",
]
