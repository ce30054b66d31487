"""GeGLU specifics: tanh is the default, "none" selects exact GELU, gradcheck on the PyTorch path."""

import pytest
import torch
import torch.nn.functional as F

from conftest import backend, rel_err


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
        assert torch.autograd.gradcheck(lambda x, y: lk.LigerGELUMulFunction.apply(x, y, approximate), (a.detach().requires_grad_(), b))


@pytest.mark.parametrize("approximate", ["exact", "TANH", None, 1])
def test_unknown_approximate(lk, approximate):
    a = torch.randn(2, 4)
    with pytest.raises(ValueError, match="`approximate` must be one of"):
        lk.LigerGELUMulFunction.apply(a, a, approximate)
