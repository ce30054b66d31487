"""The gated activations: ``out = act(gate_multiplier * gate) * up * down_multiplier``, one registry entry each.

An entry carries everything the rest of the package, its tests, benchmarks and docs need to know about an
activation: its math twice (``@triton.jit`` functions for the kernels in _gated.py, PyTorch functions for
the PyTorch backend), a float64 reference, and the names by which transformers hosts announce it. Every
list of activations (the ops the tests check, the benchmark rows, host recognition, the README table) is
read from ``REGISTRY``; CONTRIBUTING.md says how to add one.

Names are one vocabulary: "silu", "gelu_tanh" (tanh-approximated GELU) and "gelu" (exact, erf GELU).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._backend import constexpr, jit, tl


class GatedActivation(NamedTuple):
    name: str  # the registry key, also the torch.library ops' activation argument
    description: str  # for messages and docs
    triton_value: Callable  # @jit (z) -> act(z), fp32
    triton_value_and_grad: Callable  # @jit (z) -> (act(z), act'(z)), fp32
    torch_value: Callable  # (z) -> act(z), z in fp32 or fp64
    torch_value_and_grad: Callable  # (z) -> (act(z), act'(z))
    reference: Callable  # (z float64) -> act(z), independent of the above: what tests compare against
    host_classes: tuple[str, ...]  # names of torch's or transformers' own activation classes computing it
    config_names: tuple[str, ...]  # hidden_act / hidden_activation strings naming it
    # (z) -> act(z) written over z, in z's dtype: PyTorch's own op (what nn.SiLU, GELUTanh or GELUActivation
    # call in their default form). The layers' small inference calls use it (gated_mlp.py), where a launch would
    # cost the host more than the op.
    torch_in_place: Callable


REGISTRY = {}


def register(activation: GatedActivation) -> GatedActivation:
    REGISTRY[activation.name] = activation
    return activation


# ----------------------------------------------------------------------------------------------------------
# SiLU: silu(z) = z * sigmoid(z)


@jit
def _silu(z):
    return z * tl.sigmoid(z)


@jit
def _silu_and_grad(z):
    # silu(z) = z * s with s = sigmoid(z);  silu'(z) = s + z * s * (1 - s) = s * (1 + z * (1 - s))
    s = tl.sigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s))


def _silu_torch(z):
    return z * torch.sigmoid(z)


def _silu_and_grad_torch(z):
    s = torch.sigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s))


SILU = register(
    GatedActivation(
        "silu",
        "SiLU",
        _silu,
        _silu_and_grad,
        _silu_torch,
        _silu_and_grad_torch,
        torch.nn.functional.silu,
        host_classes=("SiLU", "SiLUActivation"),
        config_names=("silu", "swish"),
        torch_in_place=lambda z: torch.nn.functional.silu(z, inplace=True),
    )
)


# ----------------------------------------------------------------------------------------------------------
# GELU, tanh form: gelu(z) = 0.5 z (1 + tanh(k (z + 0.044715 z^3))), k = sqrt(2 / pi)

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
_K = constexpr(SQRT_2_OVER_PI)
_C = constexpr(TANH_CUBIC)


@jit
def _gelu_tanh(z):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): one exp, no tanh.
    u = _K * (z + _C * z * z * z)
    return z * tl.sigmoid(2.0 * u)


@jit
def _gelu_tanh_and_grad(z):
    # g = z * s with s = sigmoid(2u), u = k (z + c z^3):  g' = s + z * s (1 - s) * 2 k (1 + 3 c z^2)
    z2 = z * z
    s = tl.sigmoid(2.0 * _K * (z + _C * z2 * z))
    du = 2.0 * _K * (1.0 + 3.0 * _C * z2)
    return z * s, s + z * s * (1.0 - s) * du


def _gelu_tanh_torch(z):
    return z * torch.sigmoid(2.0 * SQRT_2_OVER_PI * (z + TANH_CUBIC * z * z * z))


def _gelu_tanh_and_grad_torch(z):
    z2 = z * z
    s = torch.sigmoid(2.0 * SQRT_2_OVER_PI * (z + TANH_CUBIC * z2 * z))
    du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * z2)
    return z * s, s + z * s * (1.0 - s) * du


GELU_TANH = register(
    GatedActivation(
        "gelu_tanh",
        "tanh-approximated GELU",
        _gelu_tanh,
        _gelu_tanh_and_grad,
        _gelu_tanh_torch,
        _gelu_tanh_and_grad_torch,
        lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
        host_classes=(
            "GELUTanh",
            "PytorchGELUTanh",
            "NewGELUActivation",
            "FastGELUActivation",
            "AccurateGELUActivation",
        ),
        config_names=("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast", "gelu_accurate"),
        torch_in_place=lambda z: torch._C._nn.gelu_(z, approximate="tanh"),
    )
)


# ----------------------------------------------------------------------------------------------------------
# GELU, exact form: gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt(2)))
#
# The normal CDF without erf: libdevice's erf made the forward compute-bound. With x = z / sqrt(2), a = |x|
# and t = 1 / (1 + p a):  erfc(a) = t R(t) exp(-a^2), one polynomial R for every a (no branches), and
# Phi(z) = 0.5 erfc(-x) is formed without the cancellation of 0.5 (1 + erf(x)) in the left tail. Relative
# error <= 1.3e-6 for z >= -3 (float32 0.5 (1 + erf) reaches 1.1e-5 there, and 100% by z = -6). The
# coefficients come from scripts/fit_normal_cdf.py.

INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_R2 = constexpr(INV_SQRT_2)
_R2PI = constexpr(INV_SQRT_2PI)
_P = constexpr(0.4)
_T0, _T1, _T2, _T3 = (
    constexpr(0.2256758641716087),
    constexpr(0.2256695868425358),
    constexpr(0.20784146524705283),
    constexpr(0.16855848372788834),
)
_T4, _T5, _T6 = constexpr(0.14134778591829064), constexpr(-0.005396922021842962), constexpr(0.16880437951721464)
_T7, _T8 = constexpr(-0.1827112770669006), constexpr(0.05021075399384668)
_LOG2E = constexpr(math.log2(math.e))


@jit
def _normal_cdf_and_gauss(z):
    """(Phi(z), exp(-z^2 / 2)); the second is the normal density up to 1 / sqrt(2 pi)."""
    a = tl.abs(z * _R2)
    t = 1.0 / (1.0 + _P * a)
    r = _T0 + t * (_T1 + t * (_T2 + t * (_T3 + t * (_T4 + t * (_T5 + t * (_T6 + t * (_T7 + t * _T8)))))))
    gauss = tl.math.exp2(-(a * a) * _LOG2E)  # exp(-a^2) = exp(-z^2 / 2)
    half_erfc = 0.5 * t * r * gauss  # Phi(-|z|)
    return tl.where(z < 0, half_erfc, 1.0 - half_erfc), gauss


@jit
def _gelu(z):
    cdf, _ = _normal_cdf_and_gauss(z)
    return z * cdf


@jit
def _gelu_and_grad(z):
    # g = z * Phi(z):  g' = Phi(z) + z * phi(z), phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
    cdf, gauss = _normal_cdf_and_gauss(z)
    return z * cdf, cdf + z * _R2PI * gauss


def _gelu_torch(z):
    return 0.5 * z * (1.0 + torch.erf(z * INV_SQRT_2))


def _gelu_and_grad_torch(z):
    cdf = 0.5 * (1.0 + torch.erf(z * INV_SQRT_2))
    return z * cdf, cdf + z * INV_SQRT_2PI * torch.exp(-0.5 * z * z)


GELU = register(
    GatedActivation(
        "gelu",
        "exact GELU",
        _gelu,
        _gelu_and_grad,
        _gelu_torch,
        _gelu_and_grad_torch,
        torch.nn.functional.gelu,
        host_classes=("GELUActivation",),
        config_names=("gelu", "gelu_python"),
        torch_in_place=torch._C._nn.gelu_,
    )
)
