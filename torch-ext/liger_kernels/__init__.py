"""liger-kernels: fused Triton SwiGLU/GeGLU, RMSNorm, the tiled MLP, and layers for ``kernels.kernelize``.

Loaded as ``kernels.get_kernel("kernels-community/liger-kernels", version=3)``; the loader imports this
package under its own name, so everything here is imported relatively.
"""

from . import geglu, layers, mapping, swiglu, tiled_mlp
from .geglu import LigerGELUMulFunction, gelu_mul
from .mapping import kernel_mapping, register_kernel_mapping
from .layers import LigerGEGLUMLP, LigerLinear, LigerSwiGLUMLP, LigerTiledGEGLUMLP, LigerTiledSwiGLUMLP
from .swiglu import LigerSiLUMulFunction, silu_mul
from .layers import LigerRMSNorm

# The function, not its module, is the package's `rms_norm` (the module: sys.modules[__name__ + ".rms_norm"]).
from .rms_norm import LigerRMSNormFunction, rms_norm
from .tiled_mlp import LigerTiledMLPFunction, apply_tiled_mlp

__all__ = [
    "LigerGELUMulFunction",
    "LigerGEGLUMLP",
    "LigerLinear",
    "LigerRMSNorm",
    "LigerRMSNormFunction",
    "LigerSiLUMulFunction",
    "LigerSwiGLUMLP",
    "LigerTiledGEGLUMLP",
    "LigerTiledMLPFunction",
    "LigerTiledSwiGLUMLP",
    "apply_tiled_mlp",
    "gelu_mul",
    "kernel_mapping",
    "mapping",
    "register_kernel_mapping",
    "rms_norm",
    "geglu",
    "layers",
    "silu_mul",
    "swiglu",
    "tiled_mlp",
]
