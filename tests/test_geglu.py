"""GeGLU specifics: tanh is the default, "none" selects exact GELU, gradcheck on the PyTorch path."""

import pytest
import torch
import torch.nn.functional as F

from harness import backend, rel_err


def test_default_is_tanh(lk, backend_name):
    a = torch.randn(6, 50, requires_grad=True)
    b = torch.randn(6, 50)
    out = lk.LigerGELUMulFunction.apply(a, b)
    tanh = F.gelu(a.double(), approximate="tanh") * b.double()
    exact = F.gelu(a.double()) * b.double()
    assert rel_err(out, tanh) < 1e-6
    assert rel_err(out, exact) > 1e-5  # the two forms differ by more than fp32 noise: the check can tell
    assert torch.equal(out, lk.gelu_mul(a, b)) and torch.equal(out, lk.LigerGELUMulFunction.apply(a, b, "tanh"))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gradcheck_float64_pytorch_path(lk, approximate):
    a = torch.randn(3, 7, dtype=torch.float64, requires_grad=True) * 2
    b = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    with backend("auto"):
        assert torch.autograd.gradcheck(
            lambda x, y: lk.LigerGELUMulFunction.apply(x, y, approximate), (a.detach().requires_grad_(), b)
        )


@pytest.mark.parametrize("approximate", ["exact", "TANH", None, 1])
def test_unknown_approximate(lk, approximate):
    a = torch.randn(2, 4)
    with pytest.raises(ValueError, match="`approximate` must be one of"):
        lk.LigerGELUMulFunction.apply(a, a, approximate)


def test_exact_gelu_is_accurate_per_element_into_the_left_tail(lk):
    """The Triton path forms Phi(z) = 0.5 erfc(-z / sqrt 2) without 0.5 (1 + erf) cancelling: every element of
    value and gradient, down to z = -12, within 2e-5 relative of float64 (float32's 0.5 (1 + erf) is off by
    100% there, and by more than 1e-5 already at z = -3)."""
    z = torch.cat([torch.linspace(-12.0, 6.0, 4001), torch.randn(999) * 3])
    b = torch.rand(z.shape) + 0.5  # positive: the product keeps z's relative error
    a = z.clone().requires_grad_()
    with backend("triton"):
        out = lk.LigerGELUMulFunction.apply(a, b, "none")
        d_out = torch.rand(z.shape) + 0.5
        (d_a,) = torch.autograd.grad(out, a, d_out)
    # float64 reference from erfc: F.gelu's 0.5 (1 + erf) cancels in float64 too, below z = -8
    z64 = z.double()
    cdf = 0.5 * torch.special.erfc(-z64 / 2**0.5)
    ref = z64 * cdf * b.double()
    density = torch.exp(-0.5 * z64**2) / (2 * torch.pi) ** 0.5
    ref_grad = (cdf + z64 * density) * b.double() * d_out.double()
    # g' = Phi + z phi crosses zero near z = -0.75: measure the gradient against the size of its two terms
    grad_scale = (cdf + (z64 * density).abs()) * b.double() * d_out.double()
    keep = ref.abs() > 1e-36  # float32's normal range
    assert ((out.double() - ref).abs() / ref.abs())[keep].max() < 2e-5
    keep = grad_scale > 1e-36
    assert ((d_a.double() - ref_grad).abs() / grad_scale)[keep].max() < 2e-5
    naive = 0.5 * z * (1 + torch.erf(z / 2**0.5)) * b  # float32 eager: the check can tell the two apart
    assert ((naive.double() - ref).abs() / ref.abs())[ref.abs() > 1e-36].max() > 0.5
