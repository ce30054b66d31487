"""The same checks on CUDA with the compiled Triton kernels, at realistic sizes (skipped without a GPU)."""

import copy

import pytest
import torch

from conftest import FLOAT_DTYPES, backend, rel_err
from gated_cases import OPS, check_op, make_pair
from test_layers import bind, llama_mlp, run

pytestmark = pytest.mark.gpu
ROWS, COLS = 16384, 14336  # Llama-3-8B intermediate width


@pytest.fixture
def auto_backend(lk):
    with backend("auto"):
        assert lk._backend.use_triton(torch.empty(1, device="cuda"))
        yield "auto"


@pytest.mark.parametrize("layout", ["contiguous", "strided", "wide"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_cuda_matches_float64_reference(lk, op, dtype, layout, auto_backend):
    torch.manual_seed(0)
    shape = (4, 70001) if layout == "wide" else (ROWS, COLS)
    a, b, _ = make_pair(shape, dtype, device="cuda", strided=layout == "strided")
    check_op(lk, op, a, b, dtype, auto_backend)
    torch.cuda.empty_cache()


def backward_peak(call, gate, up, d_out):
    out = call(gate, up)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (gate, up), d_out)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, grads


def test_cuda_in_place_backward_allocates_no_gate_or_up_buffers(lk, auto_backend):
    x_a, x_b, _ = make_pair((8192, COLS), torch.bfloat16, device="cuda")
    d_out = torch.randn(8192, COLS, device="cuda", dtype=torch.bfloat16)
    one_buffer = x_a.numel() * x_a.element_size()
    fresh_peak, want = backward_peak(lambda g, u: lk.silu_mul(g, u), x_a * 1.0, x_b * 1.0, d_out)
    in_place_peak, got = backward_peak(lambda g, u: lk.silu_mul(g, u, 1.0, 1.0, True), x_a * 1.0, x_b * 1.0, d_out)
    assert fresh_peak >= 2 * one_buffer
    assert in_place_peak < 0.05 * one_buffer, f"in-place backward peak {in_place_peak} bytes"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_swiglu_layer_parity_with_llama_mlp(lk, dtype, auto_backend):
    torch.manual_seed(0)
    host64 = llama_mlp(hidden=1024, intermediate=2816).double().cuda()
    eager = copy.deepcopy(host64).to(dtype)
    fused = bind(lk.LigerSwiGLUMLP, copy.deepcopy(host64).to(dtype))
    x = torch.randn(2, 2048, host64.hidden_size, dtype=torch.float64, device="cuda")
    d_out = torch.randn_like(x)
    want, got_eager, got_fused = run(host64, x, d_out), run(eager, x.to(dtype), d_out.to(dtype)), run(fused, x.to(dtype), d_out.to(dtype))
    for w, e, f in zip([want[0], *want[1]], [got_eager[0], *got_eager[1]], [got_fused[0], *got_fused[1]]):
        assert rel_err(f, w) <= 1.5 * rel_err(e, w) + 4 * torch.finfo(torch.float32).eps
