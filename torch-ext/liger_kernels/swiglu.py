"""SwiGLU: ``c = silu(gate_multiplier * a) * b * down_multiplier``, fused forward and backward.

``a`` is the gate projection's output, ``b`` the up projection's. Math runs in fp32 (fp64 for fp64 inputs on
the PyTorch backend) with one rounding to the input dtype; backward recomputes the activation from the saved
``a`` and ``b`` instead of keeping it. The math is ``activations.SILU``; the kernels are _gated.py's.
"""

import torch

from . import _gated
from .activations import SILU

OP = "LigerSiLUMulFunction"


def _checked(a, b, gate_multiplier, down_multiplier, in_place_backward):
    _gated.check_pair(a, b, OP)
    if type(gate_multiplier) is not float:  # (the checks' own fast case, without their calls)
        gate_multiplier = _gated.check_multiplier(gate_multiplier, "gate_multiplier", OP)
    if type(down_multiplier) is not float:
        down_multiplier = _gated.check_multiplier(down_multiplier, "down_multiplier", OP)
    if type(in_place_backward) is not bool:
        _gated.check_flag(in_place_backward, "in_place_backward", OP)
    return gate_multiplier, down_multiplier, in_place_backward


@_gated.bind_cheaply
class LigerSiLUMulFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction.apply(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False)``.

    ``in_place_backward=True`` writes the gradients into ``a``'s and ``b``'s buffers, saving two
    activation-sized allocations, where that is provably harmless (see _gated's autograd contract);
    otherwise, and by default, fresh tensors are written.
    """

    generate_vmap_rule = True  # elementwise: torch.func.vmap runs forward on the batched tensors

    @staticmethod
    def forward(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False):
        gate_multiplier, down_multiplier, _ = _checked(a, b, gate_multiplier, down_multiplier, in_place_backward)
        return _gated.function_forward(a, b, SILU, gate_multiplier, down_multiplier)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, gate_multiplier, down_multiplier, in_place_backward = _gated.with_defaults(inputs, (1.0, 1.0, False))
        _gated.save_for_backward(ctx, a, b, SILU, float(gate_multiplier), float(down_multiplier), in_place_backward)

    @staticmethod
    def backward(ctx, d_out):
        d_a, d_b = _gated.backward_from_ctx(ctx, d_out)
        return d_a, d_b, None, None, None


def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False):
    """:class:`LigerSiLUMulFunction`'s math and checks, as cheap per call; under torch.compile a
    torch.library op, traced without a graph break."""
    out = _gated.eager_call(a, b, SILU, gate_multiplier, down_multiplier, in_place_backward)
    if out is not None:
        return out
    gate_multiplier, down_multiplier, in_place = _checked(a, b, gate_multiplier, down_multiplier, in_place_backward)
    return _gated.gated_apply(a, b, SILU, gate_multiplier, down_multiplier, in_place)
