"""liger-kernels: fused Triton SwiGLU/GeGLU, the tiled MLP, and layers for ``kernels.kernelize``.

Loaded as ``kernels.get_kernel("kernels-community/liger-kernels", version=3)``; the loader imports this
package under its own name, so everything here is imported relatively.
"""

from . import cross_entropy, fused_linear_cross_entropy, geglu, layers, loss, mapping, swiglu, tiled_mlp
from .cross_entropy import CrossEntropyOutput
from .fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction, liger_fused_linear_cross_entropy
from .geglu import LigerGELUMulFunction, gelu_mul
from .layers import (
    LigerForCausalLMLossLayer,
    LigerGEGLUMLP,
    LigerLinear,
    LigerSwiGLUMLP,
    LigerTiledGEGLUMLP,
    LigerTiledSwiGLUMLP,
)
from .loss import CausalLMWithFusedLoss, LigerForCausalLMLoss, causal_lm_loss
from .mapping import kernel_mapping, register_kernel_mapping
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
    "LigerSiLUMulFunction",
    "LigerSwiGLUMLP",
    "LigerTiledGEGLUMLP",
    "LigerTiledMLPFunction",
    "LigerTiledSwiGLUMLP",
    "apply_tiled_mlp",
    "causal_lm_loss",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "geglu",
    "gelu_mul",
    "kernel_mapping",
    "layers",
    "liger_fused_linear_cross_entropy",
    "loss",
    "mapping",
    "register_kernel_mapping",
    "silu_mul",
    "swiglu",
    "tiled_mlp",
]
