"""The backend seam: who runs what, and what it costs the host per call."""

import os

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
    with pytest.raises(ValueError, match="LIGER_KERNELS_BACKEND must be one of"):
        lk._backend.set_backend("cuda")


def test_forced_triton_on_cpu_follows_the_interpreter(lk, monkeypatch):
    with backend("triton"):
        monkeypatch.setattr(lk._backend, "_INTERPRETED", True)
        assert lk._backend.use_triton(torch.empty(2)) is True
        monkeypatch.setattr(lk._backend, "_INTERPRETED", False)
        with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
            lk._backend.use_triton(torch.empty(2))


class CountingEnviron(dict):
    """os.environ stand-in that counts reads."""

    reads = 0

    def __getitem__(self, key):
        CountingEnviron.reads += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        CountingEnviron.reads += 1
        return super().get(key, default)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_an_eager_call_reads_no_environment_and_allocates_only_its_outputs(lk, name, monkeypatch):
    """Host work per call, counted rather than timed: no environment lookups, and the Triton path allocates
    exactly its outputs (one in forward; two gradients in backward, none when it may write in place)."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    a = torch.randn(4, 64, requires_grad=True)
    b = torch.randn(4, 64, requires_grad=True)
    with backend(name):
        lk.silu_mul(a, b).sum().backward()  # warm: the first call may read the environment once
        allocations = []
        inner = lk._backend.new_tensor
        monkeypatch.setattr(lk._backend, "new_tensor", lambda *s, **k: allocations.append(s) or inner(*s, **k))
        monkeypatch.setattr("os.environ", CountingEnviron(os.environ))
        CountingEnviron.reads = 0
        out = lk.silu_mul(a * 1.0, b * 1.0, 1.0, 1.0, True)
        forward = len(allocations)
        out.sum().backward()
    assert CountingEnviron.reads == 0
    if name == "triton":
        assert (forward, len(allocations)) == (1, 1)  # in place: backward writes over gate and up
