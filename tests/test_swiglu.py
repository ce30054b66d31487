"""SwiGLU specifics: the Hub signature, the multipliers, gradcheck on the PyTorch path."""

import pytest
import torch
import torch.nn.functional as F

from harness import backend


def test_hub_signature_defaults(lk, backend_name):
    a = torch.randn(6, 40, requires_grad=True)
    b = torch.randn(6, 40, requires_grad=True)
    ref = F.silu(a.double()) * b.double()
    for out in (lk.LigerSiLUMulFunction.apply(a, b), lk.LigerSiLUMulFunction.apply(a, b, 1.0, 1.0), lk.silu_mul(a, b)):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_multipliers_reach_both_gradients(lk, backend_name):
    a = torch.randn(5, 33, dtype=torch.float64 if backend_name == "torch" else torch.float32, requires_grad=True)
    b = torch.randn(5, 33, dtype=a.dtype, requires_grad=True)
    out = lk.LigerSiLUMulFunction.apply(a, b, gate_multiplier=-1.25, down_multiplier=0.5)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = F.silu(-1.25 * a64) * b64 * 0.5
    d_out = torch.randn(5, 33, dtype=torch.float64)
    got = torch.autograd.grad(out, (a, b), d_out.to(a.dtype))
    want = torch.autograd.grad(ref, (a64, b64), d_out)
    for g, w in zip(got, want):
        assert ((g.double() - w).norm() / w.norm()).item() < 1e-6


def test_gradcheck_float64_pytorch_path(lk):
    a = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    with backend("auto"):  # float64 on CPU: the PyTorch path by the seam's own choice
        assert torch.autograd.gradcheck(lambda x, y: lk.LigerSiLUMulFunction.apply(x, y, 0.8, 1.3), (a, b))


@pytest.mark.parametrize(
    "arg, value", [("gate_multiplier", "2"), ("down_multiplier", torch.tensor(1.0)), ("gate_multiplier", True)]
)
def test_bad_multiplier(lk, arg, value):
    a = torch.randn(2, 4)
    with pytest.raises(TypeError, match=f"`{arg}` must be a real number"):
        lk.silu_mul(a, a, **{arg: value})


def test_bad_in_place_flag(lk):
    a = torch.randn(2, 4)
    with pytest.raises(TypeError, match="`in_place_backward` must be a bool"):
        lk.silu_mul(a, a, 1.0, 1.0, "yes")
