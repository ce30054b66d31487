"""GeGLU: ``c = gelu(a) * b``, fused forward and backward, in both forms of GELU:

* ``approximate="tanh"`` (the default, as in the Hub package): ``gelu(a) = 0.5 a (1 + tanh(k (a + 0.044715 a^3)))``
  with ``k = sqrt(2 / pi)``;
* ``approximate="none"``: the exact ``gelu(a) = a * Phi(a) = 0.5 a (1 + erf(a / sqrt(2)))``.

Math runs in fp32 (fp64 for fp64 inputs on the PyTorch backend) with one rounding to the input dtype;
backward recomputes the activation from the saved ``a`` and ``b``.
"""

import math

import torch
from torch.autograd.function import once_differentiable

from . import _gated
from ._backend import constexpr, jit, tl

OP = "LigerGELUMulFunction"
APPROXIMATIONS = ("tanh", "none")

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# The same constants as seen from inside @jit functions.
_K = constexpr(SQRT_2_OVER_PI)
_C = constexpr(TANH_CUBIC)
_R2 = constexpr(INV_SQRT_2)
_R2PI = constexpr(INV_SQRT_2PI)


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


# The exact GELU's normal CDF without erf: libdevice's erf made the forward compute-bound. With x = z / sqrt(2),
# a = |x| and t = 1 / (1 + p a):  erfc(a) = t R(t) exp(-a^2), one polynomial R for every a (no branches), and
# Phi(z) = 0.5 erfc(-x) is formed without the cancellation of 0.5 (1 + erf(x)) in the left tail. Relative
# error <= 1.3e-6 for z >= -3 (float32 0.5 (1 + erf) reaches 1.1e-5 there, and 100% by z = -6). The
# coefficients come from scripts/fit_normal_cdf.py.
_P = constexpr(0.4)
_T0, _T1, _T2, _T3 = constexpr(0.2256758641716087), constexpr(0.2256695868425358), constexpr(0.20784146524705283), constexpr(0.16855848372788834)  # fmt: skip
_T4, _T5, _T6 = constexpr(0.14134778591829064), constexpr(-0.005396922021842962), constexpr(0.16880437951721464)  # fmt: skip
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
def _gelu_erf(z):
    cdf, _ = _normal_cdf_and_gauss(z)
    return z * cdf


@jit
def _gelu_erf_and_grad(z):
    # g = z * Phi(z):  g' = Phi(z) + z * phi(z), phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
    cdf, gauss = _normal_cdf_and_gauss(z)
    return z * cdf, cdf + z * _R2PI * gauss


def _gelu_tanh_torch(z):
    return z * torch.sigmoid(2.0 * SQRT_2_OVER_PI * (z + TANH_CUBIC * z * z * z))


def _gelu_tanh_and_grad_torch(z):
    z2 = z * z
    s = torch.sigmoid(2.0 * SQRT_2_OVER_PI * (z + TANH_CUBIC * z2 * z))
    du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * z2)
    return z * s, s + z * s * (1.0 - s) * du


def _gelu_erf_torch(z):
    return 0.5 * z * (1.0 + torch.erf(z * INV_SQRT_2))


def _gelu_erf_and_grad_torch(z):
    cdf = 0.5 * (1.0 + torch.erf(z * INV_SQRT_2))
    return z * cdf, cdf + z * INV_SQRT_2PI * torch.exp(-0.5 * z * z)


GELU_TANH = _gated.register_activation(
    _gated.GatedActivation("gelu_tanh", _gelu_tanh, _gelu_tanh_and_grad, _gelu_tanh_torch, _gelu_tanh_and_grad_torch)
)
GELU_ERF = _gated.register_activation(
    _gated.GatedActivation("gelu", _gelu_erf, _gelu_erf_and_grad, _gelu_erf_torch, _gelu_erf_and_grad_torch)
)
ACTIVATIONS = {"tanh": GELU_TANH, "none": GELU_ERF}


def check_approximate(approximate, op: str = OP) -> str:
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: `approximate` must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate


def _checked(a, b, approximate, in_place_backward):
    _gated.check_pair(a, b, OP)
    activation = ACTIVATIONS[check_approximate(approximate)]
    return activation, _gated.check_flag(in_place_backward, "in_place_backward", OP)


class LigerGELUMulFunction(torch.autograd.Function):
    """``LigerGELUMulFunction.apply(a, b, approximate="tanh", in_place_backward=False)``.

    ``in_place_backward=True`` writes the gradients into ``a``'s and ``b``'s buffers; use it only for
    ``a``/``b`` that nothing else reads. By default fresh tensors are written.
    """

    @staticmethod
    def forward(a, b, approximate="tanh", in_place_backward=False):
        activation, _ = _checked(a, b, approximate, in_place_backward)
        return _gated.gated_forward(a, b, activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, approximate, in_place_backward = inputs
        _gated.save_for_backward(ctx, a, b, ACTIVATIONS[approximate], 1.0, 1.0, in_place_backward)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        d_a, d_b = _gated.backward_from_ctx(ctx, d_out)
        return d_a, d_b, None, None


def gelu_mul(a, b, approximate="tanh", in_place_backward=False):
    """:class:`LigerGELUMulFunction`'s math and checks with less host cost per call; under torch.compile a
    torch.library op, traced without a graph break."""
    activation, in_place = _checked(a, b, approximate, in_place_backward)
    return _gated.gated_apply(a, b, activation, 1.0, 1.0, in_place)
