"""liger-kernels: fused Triton SwiGLU/GeGLU and layers for ``kernels.kernelize``.

Loaded as ``kernels.get_kernel("kernels-community/liger-kernels", version=3)``; the loader imports this
package under its own name, so everything here is imported relatively.
"""

from . import geglu, layers, swiglu
from .geglu import LigerGELUMulFunction, gelu_mul
from .layers import LigerGEGLUMLP, LigerSwiGLUMLP
from .swiglu import LigerSiLUMulFunction, silu_mul

__all__ = [
    "LigerGELUMulFunction",
    "LigerGEGLUMLP",
    "LigerSiLUMulFunction",
    "LigerSwiGLUMLP",
    "gelu_mul",
    "geglu",
    "layers",
    "silu_mul",
    "swiglu",
]
