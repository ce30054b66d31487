"""The same checks on CUDA with the compiled Triton kernels, at realistic sizes (skipped without a GPU)."""

import copy

import pytest
import torch

from harness import FLOAT_DTYPES, OPS, backend, check_op, make_pair, rel_err
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
    want, got_eager, got_fused = (
        run(host64, x, d_out),
        run(eager, x.to(dtype), d_out.to(dtype)),
        run(fused, x.to(dtype), d_out.to(dtype)),
    )
    for w, e, f in zip([want[0], *want[1]], [got_eager[0], *got_eager[1]], [got_fused[0], *got_fused[1]]):
        assert rel_err(f, w) <= 1.5 * rel_err(e, w) + 4 * torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------------------------------------
# The tiled MLP on CUDA


def _llama_pair(dtype, hidden=1024, intermediate=2816):
    torch.manual_seed(0)
    host64 = llama_mlp(hidden=hidden, intermediate=intermediate).double().cuda()
    return host64, copy.deepcopy(host64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_tiled_swiglu_layer_against_float64(lk, dtype, auto_backend):
    """LigerTiledSwiGLUMLP at S = 8192 (8 automatic shards): output, input and weight gradients no worse
    than the eager untiled MLP in the same dtype (1.5x), against float64."""
    host64, eager = _llama_pair(dtype)
    tiled = bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(eager))
    x = torch.randn(1, 8192, 1024, dtype=torch.float64, device="cuda")
    d_out = torch.randn_like(x)
    want, got_eager, got_tiled = (
        run(host64, x, d_out),
        run(eager, x.to(dtype), d_out.to(dtype)),
        run(tiled, x.to(dtype), d_out.to(dtype)),
    )
    for w, e, t in zip([want[0], *want[1]], [got_eager[0], *got_eager[1]], [got_tiled[0], *got_tiled[1]]):
        assert t.dtype == dtype
        assert rel_err(t, w) <= 1.5 * rel_err(e, w) + 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize(
    "sum_dtype, dtype",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_cuda_transposed_sum_cast_equals_pytorch(lk, sum_dtype, dtype, auto_backend):
    """The compiled cast of a transposed sum (the down projection's, under column blocks): bit for bit what
    PyTorch's copy of the transposed view gives (one round-to-nearest), tiles cut by both edges."""
    total = torch.randn(2900, 1037, device="cuda").to(sum_dtype)
    got = lk._grad_sums.cast_transposed(total, dtype)
    assert got.is_contiguous() and torch.equal(got, total.t().to(dtype))


def test_cuda_tiled_accumulates_once_and_saves_memory(lk, auto_backend):
    _, module = _llama_pair(torch.bfloat16, 4096, 14336)
    fired = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.__setitem__(name, fired[name] + 1))
    tiled = bind(lk.LigerTiledSwiGLUMLP, module)
    x = torch.randn(1, 32768, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def peak(forward):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    tiled_peak = peak(tiled)
    assert set(fired.values()) == {1}
    untiled_peak = peak(lambda h: lk.layers.swiglu_mlp(tiled, h))
    print(
        f"S=32768 Llama-8B MLP bf16 extra peak: tiled {tiled_peak / 2**30:.2f} GiB, "
        f"untiled fused {untiled_peak / 2**30:.2f} GiB"
    )
    assert tiled_peak < 0.6 * untiled_peak


def test_cuda_tiled_replays_dropout(lk, auto_backend):
    """The recompute draws the forward's dropout masks from the CUDA generator: gradients equal those of the
    same shards run with autograd."""
    from harness import DropoutGatedMLP, call

    module = DropoutGatedMLP(512, 1376, dropout=0.3).cuda()
    x = torch.randn(2, 2048, 512, device="cuda", requires_grad=True)
    d_out = torch.randn(2, 2048, 512, device="cuda")
    torch.manual_seed(7)
    ref = torch.cat([module(s) for s in torch.tensor_split(x, 4, dim=-2)], dim=-2)
    want = torch.autograd.grad(ref, [x, *module.parameters()], d_out)
    torch.manual_seed(7)
    out = lk.apply_tiled_mlp(call, module, x, 4)
    got = torch.autograd.grad(out, [x, *module.parameters()], d_out)
    assert torch.equal(out, ref)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("leaf", [True, False], ids=["x leaf", "x activation"])
def test_cuda_tiled_replays_autocast(lk, leaf, auto_backend):
    from harness import GatedMLP
    from test_tiled_mlp import autocast_grads

    torch.manual_seed(0)
    module = GatedMLP(1024, 2816).cuda()
    base = torch.randn(2, 4096, 1024, device="cuda", requires_grad=True)
    d_out = torch.randn(2, 4096, 1024, device="cuda")
    tiled = autocast_grads(lk, module, base, d_out, True, leaf)
    untiled = autocast_grads(lk, module, base, d_out, False, leaf)
    fp32 = autocast_grads(lk, module, base, d_out, False, leaf, enabled=False)
    assert tiled[0].dtype == torch.bfloat16
    for t, u, f in zip(tiled[:2], untiled[:2], fp32[:2]):  # row-wise: equal up to GEMM tiling by shard size
        assert rel_err(t, u) < 0.1 * rel_err(u, f)
    for t, u, f in zip(tiled[2:], untiled[2:], fp32[2:]):
        assert rel_err(t, u) < 0.6 * rel_err(u, f)


# ----------------------------------------------------------------------------------------------------------
# What users combine with the ops and layers, on CUDA with the compiled kernels (the CPU suite runs the same
# cases through the interpreter).


@pytest.mark.parametrize("op", sorted(OPS))
def test_cuda_second_order_and_torch_func(lk, op, auto_backend):
    from test_gated import _hvp

    apply, reference = OPS[op]
    a, b, _ = make_pair((64, 512), torch.float32, device="cuda")
    v = torch.randn_like(a)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    for got, want in zip(_hvp(lambda p, q: apply(lk, p, q), a, b, v), _hvp(reference, a64, b64, v.double())):
        assert rel_err(got, want) < 1e-5
    a, b = a.detach(), b.detach()
    assert rel_err(torch.func.vmap(lambda p, q: apply(lk, p, q))(a, b), reference(a.double(), b.double())) < 1e-6
    got = torch.func.grad(lambda p: apply(lk, p, b).sum())(a)
    assert rel_err(got, torch.func.grad(lambda p: reference(p, b.double()).sum())(a.double())) < 1e-6


def test_cuda_in_place_backward_with_a_retained_graph_and_aliases(lk, auto_backend):
    a, b, _ = make_pair((256, 1024), torch.float32, device="cuda")
    out = lk.silu_mul(a * 1.0, b * 1.0, 1.0, 1.0, True)
    first = torch.autograd.grad(out.sum(), (a, b), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (a, b))
    for g, w in zip(first, second):
        assert torch.equal(g, w)
    y = a * 1.0
    (d_a,) = torch.autograd.grad(lk.silu_mul(y, y, 1.0, 1.0, True).sum(), a)
    ref = a.detach().double().requires_grad_()
    (want,) = torch.autograd.grad((torch.nn.functional.silu(ref) * ref).sum(), ref)
    assert rel_err(d_a, want) < 1e-6


@pytest.mark.parametrize("case", ["parametrize", "functional_call", "backward_hook", "peft"])
def test_cuda_tiled_layer_with_pytorch_features(lk, case, auto_backend):
    from test_tiled_mlp_features import LowRank, grads_of

    torch.manual_seed(0)
    host = llama_mlp(hidden=256, intermediate=688).cuda()  # fp32: the Triton kernels run
    if case == "parametrize":
        from torch.nn.utils import parametrize

        parametrize.register_parametrization(host.gate_proj, "weight", LowRank(688, 256).float().cuda())
    if case == "peft":
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
        holder = torch.nn.Module()
        holder.mlp = host
        host = inject_adapter_in_model(config, holder).cuda().mlp
    tiled, plain = bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(host)), copy.deepcopy(host)
    tiled.num_shards = 4
    x = torch.randn(2, 1024, 256, device="cuda")
    d_out = torch.randn_like(x)
    if case == "backward_hook":
        for module in (tiled, plain):
            module.gate_proj.register_full_backward_hook(lambda m, gi, go: tuple(g * 0.5 for g in gi))
    if case == "functional_call":
        results = []
        for module in (tiled, plain):
            base = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
            out = torch.func.functional_call(module, {n: p * 0.5 for n, p in base.items()}, (x,))
            results.append([out, *torch.autograd.grad(out, list(base.values()), d_out)])
    else:
        results = [grads_of(tiled, x, d_out), grads_of(plain, x, d_out)]
    for got, want in zip(*results):
        assert rel_err(got, want) < 1e-5
