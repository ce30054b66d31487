"""The backend seam: who runs what."""

import pytest
import torch

from harness import backend


@pytest.mark.parametrize(
    "device, dtype, expected",
    [("cpu", torch.float32, False), ("cpu", torch.bfloat16, False), ("meta", torch.float32, False)],
)
def test_auto_runs_pytorch_off_gpu(lk, device, dtype, expected):
    with backend("auto"):
        assert lk._backend.use_triton(torch.empty(2, device=device, dtype=dtype)) is expected


def test_float64_never_goes_to_triton(lk):
    with backend("triton"), pytest.raises(RuntimeError, match="dtype torch.float64"):
        lk._backend.use_triton(torch.empty(2, dtype=torch.float64))
    with backend("auto"):
        assert lk._backend.use_triton(torch.empty(2, dtype=torch.float64)) is False


def test_torch_forced(lk):
    with backend("torch"):
        assert lk._backend.use_triton(torch.empty(2)) is False


def test_unknown_backend_is_a_clear_error(lk):
    with backend("cuda"), pytest.raises(ValueError, match="LIGER_KERNELS_BACKEND must be one of"):
        lk.silu_mul(torch.randn(2, 3), torch.randn(2, 3))


def test_forced_triton_on_cpu_follows_the_interpreter(lk, monkeypatch):
    with backend("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert lk._backend.use_triton(torch.empty(2)) is True
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
            lk._backend.use_triton(torch.empty(2))
