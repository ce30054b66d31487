"""liger-kernels: fused Triton SwiGLU/GeGLU, the tiled MLP, and layers for ``kernels.kernelize``.

Loaded as ``kernels.get_kernel("kernels-community/liger-kernels", version=3)``; the loader imports this
package under its own name, so everything here is imported relatively.
"""

from . import activations, geglu, layers, mapping, rotary, swiglu, tiled_mlp
from ._gated import gated_mul
from .geglu import LigerGELUMulFunction, gelu_mul
from .mapping import kernel_mapping, register_kernel_mapping
from .layers import LigerGEGLUMLP, LigerLinear, LigerSwiGLUMLP, LigerTiledGEGLUMLP, LigerTiledSwiGLUMLP
from .swiglu import LigerSiLUMulFunction, silu_mul
from .tiled_mlp import LigerTiledMLPFunction, apply_tiled_mlp
from .rotary import liger_rotary_pos_emb
from .layers import liger_rotary_pos_emb_layer

__all__ = [
    "LigerGELUMulFunction",
    "LigerGEGLUMLP",
    "LigerLinear",
    "LigerSiLUMulFunction",
    "LigerSwiGLUMLP",
    "LigerTiledGEGLUMLP",
    "LigerTiledMLPFunction",
    "LigerTiledSwiGLUMLP",
    "activations",
    "apply_tiled_mlp",
    "gated_mul",
    "gelu_mul",
    "kernel_mapping",
    "mapping",
    "register_kernel_mapping",
    "geglu",
    "layers",
    "silu_mul",
    "swiglu",
    "tiled_mlp",
    "liger_rotary_pos_emb",
    "liger_rotary_pos_emb_layer",
    "rotary",
]
