"""The gated ops under test, each with its float64 reference, and the check they all share."""

import torch
import torch.nn.functional as F

from conftest import assert_close_to_rounding, assert_faithful, truncates_bf16

# name -> (call the package's op, float64 reference). Both take (lk, a, b) / (a, b).
OPS = {
    "swiglu": (
        lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b),
        lambda a, b: F.silu(a) * b,
    ),
    "swiglu_multipliers": (
        lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b, 0.75, 1.5),
        lambda a, b: F.silu(0.75 * a) * b * 1.5,
    ),
    "geglu_tanh": (
        lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b, "tanh"),
        lambda a, b: F.gelu(a, approximate="tanh") * b,
    ),
    "geglu_exact": (
        lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b, "none"),
        lambda a, b: F.gelu(a) * b,
    ),
    # the functional forms, which the layers call: an autograd.Function of their own in eager
    "silu_mul": (
        lambda lk, a, b: lk.silu_mul(a, b, 0.75, 1.5),
        lambda a, b: F.silu(0.75 * a) * b * 1.5,
    ),
    "gelu_mul_exact": (
        lambda lk, a, b: lk.gelu_mul(a, b, "none"),
        lambda a, b: F.gelu(a) * b,
    ),
}


def make_pair(shape, dtype, device="cpu", strided=False, scale=2.0):
    """Fresh random a, b (leaves when not strided). Strided: the two halves of one fused gate_up tensor,
    rows strided, last dim contiguous, as `.chunk(2, -1)` gives them. Returns (a, b, leaves)."""
    if strided:
        fused = (torch.randn(*shape[:-1], 2 * shape[-1], device=device) * scale).to(dtype).requires_grad_()
        a, b = fused.chunk(2, dim=-1)
        return a, b, (fused,)
    a = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()
    b = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()
    return a, b, (a, b)


def check_op(lk, op, a, b, dtype, backend_name, bound="rounding"):
    """Forward and both gradients against the float64 reference."""
    apply, reference = OPS[op]
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = apply(lk, a, b)
    ref = reference(a64, b64)
    assert out.dtype == dtype and out.shape == a.shape and out.device == a.device
    d_out = torch.randn(out.shape, device=out.device).to(dtype)
    d_a, d_b = torch.autograd.grad(out, (a, b), d_out)
    ref_d_a, ref_d_b = torch.autograd.grad(ref, (a64, b64), d_out.double())
    truncate = truncates_bf16(backend_name, a.device.type)
    for what, got, want in (("out", out, ref), ("d_a", d_a, ref_d_a), ("d_b", d_b, ref_d_b)):
        assert got.dtype == dtype
        if bound == "rounding":
            assert_close_to_rounding(got, want, dtype, truncate, what=f"{op} {what}")
        else:
            assert_faithful(got, want, dtype, what=f"{op} {what}")
