"""torch.compile of kernelized models: the fused layers trace as one graph (the activation a single op with
float scalars), the tiled ones may break the graph but keep their gradients; compiled equals eager."""

import copy
import types

import pytest
import torch
from kernels import Mode, kernelize, use_kernel_mapping

from harness import make_inputs, rel_err
from test_kernelize import MLP_LAYERS, MODELS, loss_and_grads, mlp_layers
from test_layers import gemma_mlp, llama_mlp


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("layer, make_host", [("LigerSwiGLUMLP", llama_mlp), ("LigerGEGLUMLP", gemma_mlp)])
def test_untiled_layer_compiles_without_graph_break(lk, layer, make_host):
    host = make_host()
    host.forward = types.MethodType(getattr(lk, layer).forward, host)
    x = torch.randn(2, 33, host.hidden_size, requires_grad=True)
    explained = torch._dynamo.explain(host)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert any(f"{lk.__name__}.gated_forward" in op for op in ops), ops
    float_args = [
        node.args[3:5]
        for graph in explained.graphs
        for node in graph.graph.nodes
        if "gated_forward" in str(node.target)
    ]
    assert all(isinstance(v, float) for args in float_args for v in args)


def compiled_vs_eager(lk, variant_root, name, mode, device="cpu"):
    make, mlp_cls, kind = MODELS[name]
    torch.manual_seed(0)
    eager = make().to(device)
    ids = torch.randint(0, 97, (2, 3 * 64 + 5), device=device)
    with use_kernel_mapping(lk.kernel_mapping(variant_root, layers=MLP_LAYERS), inherit_mapping=False):
        kernelize(eager.train(), mode=mode, device=device if device != "cuda" else "cuda")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    want = loss_and_grads(eager, ids)
    compiled_model.zero_grad(set_to_none=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    got = (loss.detach(), [p.grad for p in compiled_model.parameters()])
    return eager, mlp_cls, kind, want, got


PUBLIC_FUNCTION_CALLS = {
    "LigerSiLUMulFunction(a, b)": (lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b), "silu"),
    "LigerSiLUMulFunction(a, b, 0.5)": (lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b, 0.5), "silu_half"),
    "LigerGELUMulFunction(a, b)": (lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b), "gelu_tanh"),
    "LigerGELUMulFunction(a, b, 'none')": (lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b, "none"), "gelu"),
}
REFERENCES = {
    "silu": lambda a, b: torch.nn.functional.silu(a) * b,
    "silu_half": lambda a, b: torch.nn.functional.silu(0.5 * a) * b,
    "gelu_tanh": lambda a, b: torch.nn.functional.gelu(a, approximate="tanh") * b,
    "gelu": lambda a, b: torch.nn.functional.gelu(a) * b,
}


def test_compiled_public_function_keyword_that_skips_an_optional_argument_is_refused_by_name(lk):
    """README Limits: dynamo maps apply's keywords to positions without the defaults, so a keyword that skips an
    optional argument fails there, naming the argument; the forms the README gives instead compile and agree."""
    a = torch.randn(4, 40, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 40, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    skipping = torch.compile(lambda a, b: lk.LigerSiLUMulFunction.apply(a, b, down_multiplier=2.0), backend="aot_eager")
    with pytest.raises(Exception, match="gate_multiplier"):
        skipping(a, b)
    want = lk.LigerSiLUMulFunction.apply(a, b, down_multiplier=2.0)  # eager binds the defaults
    for form in (
        lambda a, b: lk.LigerSiLUMulFunction.apply(a, b, 1.0, 2.0),
        lambda a, b: lk.silu_mul(a, b, down_multiplier=2.0),
    ):
        torch._dynamo.reset()
        assert torch.allclose(torch.compile(form, backend="aot_eager", fullgraph=True)(a, b), want, rtol=1e-12, atol=0)


def test_compiled_public_function_without_grad_is_exact_and_one_graph_with_every_argument(lk):
    """README Limits: on inputs that need no gradient, dynamo hands a setup_context-style Function its ctx as the
    first argument when the call leaves defaults out (a graph break, results exact); every argument given, the
    call is one graph."""
    a, b = torch.randn(4, 40, dtype=torch.float64), torch.randn(4, 40, dtype=torch.float64)
    want = lk.silu_mul(a, b)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda a, b: lk.LigerSiLUMulFunction.apply(a, b), backend="aot_eager")(a, b), want)
    torch._dynamo.reset()
    every = torch.compile(
        lambda a, b: lk.LigerSiLUMulFunction.apply(a, b, 1.0, 1.0, False), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(every(a, b), want)


@pytest.mark.parametrize("call", sorted(PUBLIC_FUNCTION_CALLS))
def test_public_functions_compile_in_one_graph_with_their_defaults(lk, call):
    """torch.compile hands setup_context only the arguments the call gave (eager apply binds the defaults):
    the Functions fill in the rest, so a call that leaves them out traces in one graph, equal to eager."""
    fn, reference = PUBLIC_FUNCTION_CALLS[call]
    # (seeded, and compared by relative error: element by element with atol=0, an output near 0 of the inputs the
    # previous tests' draws left failed a 1e-12 bound on a difference of 4e-16)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(4, 40, dtype=torch.float64, generator=generator, requires_grad=True)
    b = torch.randn(4, 40, dtype=torch.float64, generator=generator, requires_grad=True)
    compiled = torch.compile(lambda a, b: fn(lk, a, b), backend="aot_eager", fullgraph=True)
    out = compiled(a, b)
    want = REFERENCES[reference](a, b)
    d_out = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    got_grads = torch.autograd.grad(out, (a, b), d_out)
    want_grads = torch.autograd.grad(want, (a, b), d_out)
    assert rel_err(out, want) < 1e-14
    for got, expected in zip(got_grads, want_grads):
        assert rel_err(got, expected) < 1e-14


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_compiled_kernelized_llama_equals_eager(lk, variant_root, tagged, mode):
    mode_flag = getattr(Mode, mode) | Mode.TORCH_COMPILE
    eager, mlp_cls, kind, want, got = compiled_vs_eager(lk, variant_root, "llama", mode_flag)
    assert mlp_layers(eager, mlp_cls) == {f"Liger{'Tiled' if mode == 'TRAINING' else ''}{kind}MLP"}
    assert abs(got[0].item() - want[0].item()) < 1e-5
    for g, w in zip(got[1], want[1]):
        assert ((g - w).norm() / w.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_cuda_compiled_kernelized_llama_equals_eager(lk, variant_root, tagged, mode):
    with_triton = lk._backend.use_triton(torch.empty(1, device="cuda"))
    assert with_triton
    mode_flag = getattr(Mode, mode) | Mode.TORCH_COMPILE
    _, _, _, want, got = compiled_vs_eager(lk, variant_root, "llama", mode_flag, device="cuda")
    assert abs(got[0].item() - want[0].item()) < 1e-4
    for g, w in zip(got[1], want[1]):
        assert ((g - w).norm() / w.norm()).item() < 1e-4


def _attribute_float_calls(lk):
    """Ops called with floats read from module attributes, which torch.compile(dynamic=True) makes symbolic."""
    target = torch.randint(0, 40, (6,))

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32))
            self.variance_epsilon, self.offset = 1e-6, 0.5

        def forward(self, x):
            return lk.rms_norm(x, self.weight, self.variance_epsilon, self.offset, "gemma")

    class Loss(torch.nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.head = torch.nn.Parameter(torch.randn(40, 32))
            self.smoothing, self.z_scale, self.fused = 0.1, 1e-4, fused

        def forward(self, x):
            options = dict(label_smoothing=self.smoothing, lse_square_scale=self.z_scale)
            if self.fused:
                return lk.liger_fused_linear_cross_entropy(x, self.head, target, **options)
            return lk.cross_entropy.cross_entropy(x @ self.head.T, target, **options)

    return {"rms_norm": Norm(), "fused_linear_cross_entropy": Loss(True), "cross_entropy": Loss(False)}


@pytest.mark.parametrize("op", ["rms_norm", "fused_linear_cross_entropy", "cross_entropy"])
def test_dynamic_compile_with_float_attributes(lk, op):
    """Float attributes become symbolic under dynamic=True: the checks trace them (no graph break) and the
    result and gradients equal eager."""
    module = _attribute_float_calls(lk)[op]
    x = torch.randn(6, 32, requires_grad=True)
    want = module(x)
    want_grads = torch.autograd.grad(want.sum(), (x, *module.parameters()))
    got = torch.compile(module, dynamic=True, fullgraph=True)(x)
    got_grads = torch.autograd.grad(got.sum(), (x, *module.parameters()))
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_public_fused_linear_cross_entropy_function_compiles_in_one_graph(lk, reduction):
    """LigerFusedLinearCrossEntropyFunction under torch.compile runs the package's op (the chunked loop's
    buffer reuse and in-place scaling were a graph break, an error with fullgraph=True): equal to eager,
    gradients included."""
    x, weight, bias, target, _, _ = make_inputs(6, 16, 24, torch.float64, case="bias", seed=5)

    def loss_of(x, weight, bias):
        function = lk.LigerFusedLinearCrossEntropyFunction
        return function.apply(x, weight, target, bias, None, -100, 1e-3, 0.1, reduction, None, True)

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(loss_of, backend=recording, fullgraph=True)(x, weight, bias)
    want = loss_of(x, weight, bias)
    modules = [m for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)]  # the Function's
    assert any(lk.__name__ in str(n.target) for m in modules for n in m.graph.nodes)  # forward is a subgraph
    d_loss = torch.linspace(0.5, 1.5, want[0].numel(), dtype=torch.float64).reshape(want[0].shape)
    for g, w in zip(
        torch.autograd.grad(got[0], (x, weight, bias), d_loss), torch.autograd.grad(want[0], (x, weight, bias), d_loss)
    ):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-14)
    assert torch.allclose(got[0], want[0], rtol=1e-12, atol=0) and torch.allclose(got[1], want[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("form", ["function", "functional"])
def test_double_backward_through_the_fused_loss_is_refused_eagerly_and_unused_compiled(lk, form):
    """README Limits: the fused losses compute their gradients in forward. Eager refuses create_graph=True; a
    compiled backward cannot, and its gradient is not connected to the inputs (autograd says so when asked)."""
    x, weight, _, target, _, _ = make_inputs(6, 16, 24, torch.float64, seed=6)
    if form == "function":

        def loss_of(x, weight):
            return lk.LigerFusedLinearCrossEntropyFunction.apply(x, weight, target)[0]
    else:

        def loss_of(x, weight):
            return lk.liger_fused_linear_cross_entropy(x, weight, target)

    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss_of(x, weight), x, create_graph=True)
    torch._dynamo.reset()
    (d_x,) = torch.autograd.grad(torch.compile(loss_of, backend="aot_eager")(x, weight), x, create_graph=True)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(d_x.square().sum(), x)
