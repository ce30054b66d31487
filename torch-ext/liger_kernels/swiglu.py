"""SwiGLU: ``c = silu(gate_multiplier * a) * b * down_multiplier``, fused forward and backward.

``a`` is the gate projection's output, ``b`` the up projection's. Math runs in fp32 (fp64 for fp64 inputs on
the PyTorch backend) with one rounding to the input dtype; backward recomputes the activation from the saved
``a`` and ``b`` instead of keeping it.
"""

import torch
from torch.autograd.function import once_differentiable

from . import _gated
from ._backend import jit, tl

OP = "LigerSiLUMulFunction"


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


SILU = _gated.register_activation(
    _gated.GatedActivation("silu", _silu, _silu_and_grad, _silu_torch, _silu_and_grad_torch)
)


def _checked(a, b, gate_multiplier, down_multiplier, in_place_backward):
    _gated.check_pair(a, b, OP)
    gate_multiplier = _gated.check_multiplier(gate_multiplier, "gate_multiplier", OP)
    down_multiplier = _gated.check_multiplier(down_multiplier, "down_multiplier", OP)
    return gate_multiplier, down_multiplier, _gated.check_flag(in_place_backward, "in_place_backward", OP)


class LigerSiLUMulFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction.apply(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False)``.

    ``in_place_backward=True`` writes the gradients into ``a``'s and ``b``'s buffers, saving two
    activation-sized allocations. Use it only for ``a``/``b`` that nothing else reads (the package's layers
    pass it for the projections they computed themselves); by default fresh tensors are written.
    """

    @staticmethod
    def forward(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False):
        gate_multiplier, down_multiplier, _ = _checked(a, b, gate_multiplier, down_multiplier, in_place_backward)
        return _gated.gated_forward(a, b, SILU, gate_multiplier, down_multiplier)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, gate_multiplier, down_multiplier, in_place_backward = inputs
        _gated.save_for_backward(ctx, a, b, SILU, float(gate_multiplier), float(down_multiplier), in_place_backward)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        d_a, d_b = _gated.backward_from_ctx(ctx, d_out)
        return d_a, d_b, None, None, None


def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False):
    """:class:`LigerSiLUMulFunction`'s math and checks with less host cost per call; under torch.compile a
    torch.library op, traced without a graph break."""
    gate_multiplier, down_multiplier, in_place = _checked(a, b, gate_multiplier, down_multiplier, in_place_backward)
    return _gated.gated_apply(a, b, SILU, gate_multiplier, down_multiplier, in_place)
