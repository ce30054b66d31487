"""GeGLU: ``c = gelu(a) * b``, fused forward and backward, in both forms of GELU:

* ``approximate="tanh"`` (the default, as in the Hub package): ``activations.GELU_TANH``;
* ``approximate="none"``: the exact ``gelu(a) = a * Phi(a)``, ``activations.GELU``.

Math runs in fp32 (fp64 for fp64 inputs on the PyTorch backend) with one rounding to the input dtype;
backward recomputes the activation from the saved ``a`` and ``b``.
"""

import torch

from . import _gated
from .activations import GELU, GELU_TANH

OP = "LigerGELUMulFunction"
BY_APPROXIMATE = {"tanh": GELU_TANH, "none": GELU}  # F.gelu's `approximate` -> the registry's activation
APPROXIMATIONS = tuple(BY_APPROXIMATE)


def check_approximate(approximate, op: str = OP) -> str:
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: `approximate` must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate


def _checked(a, b, approximate, in_place_backward):
    _gated.check_pair(a, b, OP)
    activation = BY_APPROXIMATE[check_approximate(approximate)]
    return activation, _gated.check_flag(in_place_backward, "in_place_backward", OP)


@_gated.bind_cheaply
class LigerGELUMulFunction(torch.autograd.Function):
    """``LigerGELUMulFunction.apply(a, b, approximate="tanh", in_place_backward=False)``.

    ``in_place_backward=True`` writes the gradients into ``a``'s and ``b``'s buffers where that is provably
    harmless (see _gated's autograd contract); otherwise, and by default, fresh tensors are written.
    """

    generate_vmap_rule = True  # elementwise: torch.func.vmap runs forward on the batched tensors

    @staticmethod
    def forward(a, b, approximate="tanh", in_place_backward=False):
        activation, _ = _checked(a, b, approximate, in_place_backward)
        return _gated.function_forward(a, b, activation, 1.0, 1.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, approximate, in_place_backward = _gated.with_defaults(inputs, ("tanh", False))
        _gated.save_for_backward(ctx, a, b, BY_APPROXIMATE[approximate], 1.0, 1.0, in_place_backward)

    @staticmethod
    def backward(ctx, d_out):
        d_a, d_b = _gated.backward_from_ctx(ctx, d_out)
        return d_a, d_b, None, None


def gelu_mul(a, b, approximate="tanh", in_place_backward=False):
    """:class:`LigerGELUMulFunction`'s math and checks, as cheap per call; under torch.compile a
    torch.library op, traced without a graph break."""
    if type(approximate) is str and approximate in BY_APPROXIMATE:
        out = _gated.eager_call(a, b, BY_APPROXIMATE[approximate], 1.0, 1.0, in_place_backward)
        if out is not None:
            return out
    activation, in_place = _checked(a, b, approximate, in_place_backward)
    return _gated.gated_apply(a, b, activation, 1.0, 1.0, in_place)
