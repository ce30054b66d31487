"""The backend seam: who runs what, and what it costs the host per call."""

import os
import sys

import pytest
import torch

from harness import backend, python_calls, rel_err, skip_unless_runnable


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
        for allocator in ("new_tensor", "new_like"):
            inner = getattr(lk._backend, allocator)
            monkeypatch.setattr(
                lk._backend, allocator, lambda *s, inner=inner, **k: allocations.append(s) or inner(*s, **k)
            )
        monkeypatch.setattr("os.environ", CountingEnviron(os.environ))
        CountingEnviron.reads = 0
        out = lk.silu_mul(a * 1.0, b * 1.0, 1.0, 1.0, True)
        forward = len(allocations)
        out.sum().backward()
    assert CountingEnviron.reads == 0
    if name == "triton":
        assert (forward, len(allocations)) == (1, 1)  # in place: backward writes over gate and up


# Host work per eager call on the Triton path, launches stubbed, for forward with grad, forward under no_grad and
# the backward: the Python calls the package makes, and the aten ops it dispatches (counted by a dispatch mode:
# the other half of a call's host cost, ~5-10 us an op on the H200 machine, where the losses spend most of
# theirs). Measured exactly these with torch 2.13, on the CPU, so the losses' target range check (which a GPU
# skips) and the tests' poisoning fills are in the aten figures. A change that adds host work to a call fails
# here (benchmarks/NOTES.md §15, §16 have what the work costs on the H200 machine); lower them when work goes
# away.
BUDGETS = {  # name: ((Python calls), (aten ops)), each (forward, no_grad forward, backward)
    # every backward asks whether PyTorch's legacy vmap batched its incoming gradients (autograd.grad(
    # is_grads_batched=True)): no kernel can read such a tensor (NOTES.md §32); the public Functions' forward too
    # the eager route asks whether PyTorch's legacy vmap batched gate or up (two C calls: no storage a kernel could
    # read); the gated launches' plan key holds id() of the activation's jit function (counted here): on the GPU that
    # function hashes in Python (uncounted here, where the interpreter's hashes by identity; NOTES.md §31)
    "silu_mul": ((25, 22, 23), (1, 1, 2)),
    "gelu_mul": ((25, 22, 23), (1, 1, 2)),
    # its own apply binds the arguments (5 calls counted here) where PyTorch's ran inspect's binding, uncounted
    "LigerSiLUMulFunction": ((31, 31, 23), (1, 1, 2)),
    # the weight's stride, asked before each launch: the kernels read it element after element, and a strided or
    # expanded weight was read as if it were contiguous (NOTES.md §38)
    "rms_norm": ((51, 44, 47), (4, 3, 5)),
    # forward with grad: whether a torch.func transform is active is asked (one call; PyTorch's apply refused the
    # Function under one), then autograd's C++ apply is called directly (NOTES.md §32);
    # no_grad: a decoding-sized call runs the activation and the product as two in-place aten ops instead of the
    # kernel's output allocation and launch (uncounted here, and dearer: benchmarks/NOTES.md §27)
    # the layers read their host's form from a map keyed by id(class): torch.compile's dynamo then guards the class
    # (keyed by the class, a compiled frame served one class another's form; NOTES.md §37), one call more; the
    # activation by its class itself (torch's or transformers' own, from a map keyed by id(class) as the form's) and
    # no forward set on its instance, not by its class name, three more (a same-named class computed another curve
    # without an error; NOTES.md §38); whether a torch-function or dispatch mode is active before the backward may
    # write over gate and up, two more (a mode that kept the projections' outputs found gradients there; §39)
    "LigerSwiGLUMLP": ((64, 40, 25), (7, 7, 7)),
    # the tiled layer's short call: the host is resolved once (in the plain call itself, which refuses what the
    # layer's own check refused), the width is not read below two shards' rows, and the walk for ZeRO-3
    # parameters reads the leaves' parameters inline (NOTES.md §37)
    "LigerTiledSwiGLUMLP, one shard": ((109, 85, 25), (7, 7, 7)),
    "liger_rotary_pos_emb": ((61, 57, 36), (7, 7, 4)),
    # the losses' reductions are two kernels of the package (more Python calls here) instead of five to nine aten
    # ops ("mean"'s divisors and the sums; 10-40 us each on the H200 machine, benchmarks/NOTES.md §23); the loss
    # is the node's own output where z_loss is not handed out, without an aten addition (NOTES.md §32); the eager
    # loss finds "mean"'s divisors in the sums' launch, and cross_entropy's common case skips the checks' and the
    # route's calls, writes the loss alone (not its two parts) where z_loss is not handed out, and its backward
    # divides the incoming gradient in the gradient's launch (NOTES.md §33); on the CPU a target's values are
    # checked in a call of its own (counted here); the losses' kernels launch from plans made once per layout and
    # options, found by one dict lookup (counted here) instead of each argument keyed afresh (uncounted here,
    # 10-30 us of host time per launch on the H200 machine); the fused loss writes the loss alone where z_loss
    # is not handed out (two allocations fewer) and calls autograd's C++ apply directly; without a gradient it
    # asks whether a torch.func transform is active (one call: the composite runs under one) and whether the
    # target is a dead torch.func wrapper (one call: unwrapped before a kernel reads it; NOTES.md §34)
    "cross_entropy": ((52, 52, 22), (11, 11, 1)),
    "liger_fused_linear_cross_entropy": ((165, 134, 31), (20, 15, 0)),
    "LigerFusedLinearCrossEntropyFunction": ((144, 144, 31), (20, 20, 0)),
    # the logits or hidden states checked against the width and the labels before the reshape to rows (a frame and
    # two numel() calls): a misshapen input was a reshape's error, or one blaming the loss's target (NOTES.md §38)
    "LigerForCausalLMLoss": ((69, 69, 22), (15, 15, 2)),
    "LigerForCausalLMLoss, fused": ((185, 154, 31), (24, 19, 1)),
}


def _budget_case(lk, name):
    """(inputs that take gradients, the call of them) of one entry point, at a tiny shape."""
    if name == "liger_rotary_pos_emb":  # q and k as transposed views, as Llama's attention hands them over
        q = torch.randn(1, 8, 4, 64).transpose(1, 2).requires_grad_()
        k = torch.randn(1, 8, 2, 64).transpose(1, 2).requires_grad_()
        cos, sin = torch.randn(1, 8, 64), torch.randn(1, 8, 64)
        return (q, k), lambda q, k: lk.liger_rotary_pos_emb(q, k, cos, sin)
    target = torch.randint(0, 128, (8,))
    if name == "cross_entropy":
        return (torch.randn(8, 128, requires_grad=True),), lambda logits: lk.cross_entropy.cross_entropy(logits, target)
    if name == "LigerForCausalLMLoss":
        labels = torch.randint(0, 128, (1, 8))
        return (torch.randn(1, 8, 128, requires_grad=True),), lambda logits: lk.LigerForCausalLMLoss(
            logits, labels, 128
        )
    if name == "LigerForCausalLMLoss, fused":
        hidden, weight = torch.randn(1, 8, 64, requires_grad=True), torch.randn(128, 64, requires_grad=True)
        labels = torch.randint(0, 128, (1, 8))
        return (hidden, weight), lambda h, w: lk.LigerForCausalLMLoss(
            None, labels, 128, hidden_states=h, lm_head_weight=w
        )
    if name == "liger_fused_linear_cross_entropy":
        hidden, weight = torch.randn(8, 64, requires_grad=True), torch.randn(128, 64, requires_grad=True)
        return (hidden, weight), lambda h, w: lk.liger_fused_linear_cross_entropy(h, w, target)
    if name == "LigerFusedLinearCrossEntropyFunction":
        hidden, weight = torch.randn(8, 64, requires_grad=True), torch.randn(128, 64, requires_grad=True)
        return (hidden, weight), lambda h, w: lk.LigerFusedLinearCrossEntropyFunction.apply(h, w, target)[0]
    x = torch.randn(4, 64, requires_grad=True)
    if name.startswith(("LigerSwiGLUMLP", "LigerTiledSwiGLUMLP")):
        # the kernelized Llama MLP, as a decoding model calls it once per layer and token; tiled, as a training
        # step's short sequence meets it (one automatic shard: the plain call)
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        host = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))
        layer = lk.layers.LigerSwiGLUMLP if name == "LigerSwiGLUMLP" else lk.layers.LigerTiledSwiGLUMLP
        return (x,), lambda x: layer.forward(host, x)
    if name == "rms_norm":
        return (x, torch.randn(64, requires_grad=True)), lambda x, w: lk.rms_norm(x, w, 1e-6)
    op = {"silu_mul": lk.silu_mul, "gelu_mul": lk.gelu_mul, "LigerSiLUMulFunction": lk.LigerSiLUMulFunction.apply}
    return (x, torch.randn(4, 64, requires_grad=True)), op[name]


class _CountingAten(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn) -> int:
    with _CountingAten() as mode:
        fn()
    return mode.count


def _per_call_work(lk, name, monkeypatch, count):
    """``count(fn)`` for one eager call of ``name`` on the Triton path with its launches stubbed: (forward with
    grad, forward under no_grad, backward)."""
    inputs, op = _budget_case(lk, name)

    def call():
        out = op(*inputs)
        return out if isinstance(out, tuple) else (out,)

    with backend("triton"):
        warm = call()  # caches filled (with the gradients' layout too), the environment read once
        torch.autograd.grad(warm, inputs, [torch.ones_like(o) for o in warm])
        with torch.no_grad():  # (its launch plans too: a plan's first call makes it, counted)
            call()
        launches = []
        stub = lambda *args, **meta: launches.append(args[0])  # noqa: E731
        modules = (
            lk._gated,
            lk.cross_entropy,
            lk.fused_linear_cross_entropy,
            sys.modules[f"{lk.__name__}.rms_norm"],
            lk.rotary,
        )
        for module in modules:
            for launcher in ("launch", "launch_prepared"):
                if hasattr(module, launcher):
                    monkeypatch.setattr(module, launcher, stub)
        forward = count(call)
        with torch.no_grad():
            no_grad = count(call)
        # The backward's graph from a forward outside the counter: a dispatch mode (the aten counter) is one the
        # layers' forward answers with fresh gradients (a mode may keep the projections' outputs)
        out = call()
        d_out = [torch.ones_like(o) for o in out]
        backward = count(lambda: torch.autograd.grad(out, inputs, d_out))
    assert launches, "the stubbed launch was not reached"
    return forward, no_grad, backward


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_host_work_per_call_stays_within_its_budget(lk, name, monkeypatch):
    if not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    package = os.path.dirname(lk.__file__)
    counters = {"Python calls": lambda fn: python_calls(fn, package), "aten ops": aten_ops}
    for (what, count), budget in zip(counters.items(), BUDGETS[name], strict=True):
        counts = _per_call_work(lk, name, monkeypatch, count)
        assert all(c <= b for c, b in zip(counts, budget)), (
            f"{name}: {counts} {what} per forward / no_grad forward / backward, budget {budget}"
        )


# ----------------------------------------------------------------------------------------------------------
# torch.compile against torch.export. Before torch 2.14 dynamo folds torch.compiler.is_exporting() to True under
# plain torch.compile too; an op that asked it would take its export form (the PyTorch composite) in every
# compiled model. The tests make is_exporting() say True, as those versions do, and check that compiled calls
# still reach the package's ops while exported programs still hold aten ops only.


OPS_UNDER_TEST = ["rms_norm", "rotary", "silu_mul", "fused_linear_cross_entropy", "cross_entropy"]


def _op_calls(lk, device="cpu"):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    weight = torch.randn(32, device=device, requires_grad=True)
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, device=device, requires_grad=True)
    cos, sin = torch.randn(1, 3, 8, device=device), torch.randn(1, 3, 8, device=device)
    head = torch.randn(40, 32, device=device, requires_grad=True)
    target = torch.randint(0, 40, (6,), device=device)
    return {
        "rms_norm": (lambda x, w: lk.rms_norm(x, w, 1e-6), (x, weight)),
        "rotary": (lambda q, k: lk.liger_rotary_pos_emb(q, k, cos, sin), (q, k)),
        "silu_mul": (lambda a, b: lk.silu_mul(a, b), (x, x * 2)),
        "fused_linear_cross_entropy": (lambda x, w: lk.liger_fused_linear_cross_entropy(x, w, target), (x, head)),
        "cross_entropy": (lambda x, w: lk.cross_entropy.cross_entropy(x @ w.T, target), (x, head)),
        "LigerRMSNormFunction": (lambda x, w: lk.LigerRMSNormFunction.apply(x, w, 1e-6), (x, weight)),
        # every argument given: with inputs that need no gradient (export's), dynamo passes a setup_context-style
        # Function its ctx as the first argument when a call leaves defaults out (README Limits)
        "LigerSiLUMulFunction": (lambda a, b: lk.LigerSiLUMulFunction.apply(a, b, 1.0, 1.0, False), (x, x * 2)),
        "LigerFusedLinearCrossEntropyFunction": (
            lambda x, w: lk.LigerFusedLinearCrossEntropyFunction.apply(x, w, target)[0],
            (x, head),
        ),
    }


PUBLIC_FUNCTIONS = ["LigerRMSNormFunction", "LigerSiLUMulFunction", "LigerFusedLinearCrossEntropyFunction"]


@pytest.fixture
def dynamo_says_exporting(monkeypatch):
    """is_exporting() as torch < 2.14 traces it: True in code dynamo traces, the real flag elsewhere (torch's
    own callers run untraced)."""
    real = torch.compiler.is_exporting

    def folded():
        return True if torch.compiler.is_dynamo_compiling() else real()

    # Dynamo builds its tables of torch functions once per process, from the names as they are then: build
    # them with the real function first, or later tests (transformers asks is_exporting too) would trace it
    # as an unknown torch function and break their graphs.
    torch.compile(lambda t: t + real(), backend="eager", fullgraph=True)(torch.zeros(1))
    monkeypatch.setattr(torch.compiler, "is_exporting", folded)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _package_targets(lk, graph) -> set:
    return {str(n.target) for n in graph.nodes if n.op == "call_function" and lk.__name__ in str(n.target)}


@pytest.mark.parametrize("op", OPS_UNDER_TEST)
def test_compile_reaches_the_ops_where_dynamo_says_exporting(lk, op, dynamo_says_exporting):
    fn, args = _op_calls(lk)[op]
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch.compile(fn, backend=recording, fullgraph=True)(*args)
    assert graphs and _package_targets(lk, graphs[0]), graphs[0] if graphs else "no graph"


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("op", [*OPS_UNDER_TEST, *PUBLIC_FUNCTIONS])
def test_export_holds_aten_ops_only(lk, op, strict):
    fn, args = _op_calls(lk)[op]
    args = tuple(a.detach() for a in args)

    class Module(torch.nn.Module):
        def forward(self, *inputs):
            return fn(*inputs)

    torch._dynamo.reset()
    program = torch.export.export(Module(), args, strict=strict)
    assert not _package_targets(lk, program.graph)
    for got, want in zip(
        torch.utils._pytree.tree_leaves(program.module()(*args)), torch.utils._pytree.tree_leaves(fn(*args))
    ):
        if isinstance(want, torch.Tensor) and want.is_floating_point():
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["auto", "triton"])
@pytest.mark.parametrize("op", [*OPS_UNDER_TEST, *PUBLIC_FUNCTIONS])
def test_meta_tensors_give_the_shapes_of_a_real_call(lk, op, name):
    """Meta tensors (shape inference, models built on the meta device): every op, forward and backward, gives
    what a real call's shapes and dtypes would be, or fails loudly; it never touches data. Also with the Triton
    backend forced: a meta tensor has no data for a kernel (the interpreter failed inside Triton on one)."""
    fn, args = _op_calls(lk)[op]
    real = torch.utils._pytree.tree_leaves(fn(*args))
    fn, meta_args = _op_calls(lk, "meta")[op]
    with backend(name):
        meta = torch.utils._pytree.tree_leaves(fn(*meta_args))
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in real]
    assert all(t.device.type == "meta" for t in meta)
    inputs = [a for a in meta_args if a.requires_grad]
    with backend(name):
        grads = torch.autograd.grad(sum(t.sum() for t in meta if t.requires_grad), inputs)
    assert [g.shape for g in grads] == [a.shape for a in inputs]
    assert all(g.device.type == "meta" for g in grads)


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("op", ["LigerSiLUMulFunction", "LigerRMSNormFunction"])
def test_export_of_a_public_function_with_a_parameter(lk, op, strict, name):
    """A module holding a Parameter: export traces the Function's backward too, which must take the composite
    as its forward does (a kernel launch inside dynamo's trace fails)."""
    skip_unless_runnable(name)
    fn, args = _op_calls(lk)[op]
    args = tuple(a.detach() for a in args)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.param = torch.nn.Parameter(args[1].clone())

        def forward(self, x):
            return fn(x, self.param)

    module = Module()
    with backend(name):
        torch._dynamo.reset()
        program = torch.export.export(module, args[:1], strict=strict)
        assert not _package_targets(lk, program.graph)
        assert torch.allclose(program.module()(args[0]), fn(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op", [*OPS_UNDER_TEST, *PUBLIC_FUNCTIONS])
def test_jit_trace_records_the_computation(lk, op, name):
    """torch.jit.trace records aten ops only: a kernel launch would leave the traced program returning the output
    it allocated, unwritten. Every op takes its aten form while tracing, so the program computes the op on
    inputs other than those it was traced with."""
    skip_unless_runnable(name)
    fn, args = _op_calls(lk)[op]
    args = tuple(a.detach() for a in args)
    with backend(name):
        traced = torch.jit.trace(fn, args, check_trace=False)
        fresh = tuple(torch.randn_like(a) for a in args)
        leaves = torch.utils._pytree.tree_leaves
        for got, want in zip(leaves(traced(*fresh)), leaves(fn(*fresh))):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_tiled_mlp_tiles_where_dynamo_says_exporting(lk, dynamo_says_exporting):
    shards = []

    def fn(module, x):
        shards.append(x.shape[-2])
        return module(x)

    mlp = torch.nn.Linear(8, 8)
    x = torch.randn(1, 12, 8)
    torch.compile(lambda x: lk.apply_tiled_mlp(fn, mlp, x, num_shards=3))(x)
    assert shards == [4, 4, 4]


# ----------------------------------------------------------------------------------------------------------
# Forward-mode AD. The kernels have no JVP: inside a dual level every op runs its differentiable PyTorch form,
# so a dual tensor's tangent comes out right on either backend, with or without grad mode (a shortcut that
# skips autograd for inputs that do not require grad must not skip the tangent too).


@pytest.mark.parametrize(
    ("grad_mode", "compiled"), [(True, False), (False, False), (True, True)], ids=["grad", "no_grad", "compiled"]
)
@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op", [*OPS_UNDER_TEST, "gelu_mul"])
def test_forward_ad_tangents_survive_every_op(lk, op, name, grad_mode, compiled):
    """Compiled too (aot_eager, as far as dynamo goes with dual tensors): the torch.library ops the compiled
    path calls have no forward-AD rule, so a dual level must be checked before them."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    if compiled and name == "torch":
        pytest.skip("the branch under test is the same on both backends: compiled once, on the Triton path")
    torch.manual_seed(0)
    calls = _op_calls(lk)
    calls["gelu_mul"] = (lambda a, b: lk.gelu_mul(a, b), calls["silu_mul"][1])
    fn, inputs = calls[op]
    primals = [t.detach() for t in inputs]
    tangents = [torch.randn_like(t) for t in primals]

    def first(out):
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    # The float64 reference: the op's PyTorch form, differentiated by torch.func.jvp.
    with backend("torch"):
        _, want = torch.func.jvp(
            lambda *p: first(fn(*p)), tuple(p.double() for p in primals), tuple(t.double() for t in tangents)
        )
    run = torch.compile(fn, backend="aot_eager", fullgraph=False) if compiled else fn
    with backend(name), torch.set_grad_enabled(grad_mode), torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)]
        got = torch.autograd.forward_ad.unpack_dual(first(run(*duals))).tangent
    assert got is not None, f"{op}: the tangent was dropped"
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_forward_ad_through_the_public_functions_raises_pytorchs_error(lk, name):
    """The autograd Functions have no jvp: forward-mode AD through them raises PyTorch's own error (never a
    dropped tangent)."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    a, b, weight = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    calls = {
        "LigerSiLUMulFunction": lambda a, b: lk.LigerSiLUMulFunction.apply(a, b),
        "LigerGELUMulFunction": lambda a, b: lk.LigerGELUMulFunction.apply(a, b),
        "LigerRMSNormFunction": lambda a, b: lk.LigerRMSNormFunction.apply(a, weight),
    }
    with backend(name), torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(a, torch.randn_like(a))
        for function, call in calls.items():
            with pytest.raises((NotImplementedError, RuntimeError), match="jvp"):
                call(dual, b)
                pytest.fail(f"{function} returned under forward-mode AD")


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_gated_backward_inside_torch_func_grad_is_exact(lk, name):
    """A public Function applied inside ``torch.func.grad`` saves torch.func's wrappers as gate and up (no storage
    for a kernel): an ``autograd.grad`` through it inside the transform, with a plain incoming gradient, takes the
    composite backward."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    torch.manual_seed(0)
    a, b, d_out = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)

    def f(x):
        out = lk.LigerSiLUMulFunction.apply(x, b)
        (inner,) = torch.autograd.grad(out, x, d_out, retain_graph=True)
        return out.sum(), inner

    with backend(name):
        outer, inner = torch.func.grad(f, has_aux=True)(a)
    wide = a.double().requires_grad_()
    out64 = torch.nn.functional.silu(wide) * b.double()
    (want_inner,) = torch.autograd.grad(out64, wide, d_out.double(), retain_graph=True)
    (want_outer,) = torch.autograd.grad(out64.sum(), wide)
    assert rel_err(inner, want_inner) < 1e-5 and rel_err(outer, want_outer) < 1e-5


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op, in_place", [("silu_mul", False), ("gelu_mul", False), ("silu_mul", True)])
def test_torch_func_vmap_over_a_recorded_gated_backward_is_exact(lk, op, name, in_place):
    """``torch.func.vmap`` over ``autograd.grad`` of a graph recorded outside it hands the gated node incoming
    gradients that are torch.func's wrappers, with no storage for a kernel: the backward takes its composite."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    torch.manual_seed(0)
    gated = lk.silu_mul if op == "silu_mul" else lk.gelu_mul
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with backend(name):
        out = gated(a * 1, b * 1, in_place_backward=True) if in_place else gated(a, b)
        rows = torch.randn(3, 4, 8)
        got = torch.func.vmap(lambda row: torch.autograd.grad(out, (a, b), row, retain_graph=True))(rows)
    with backend("torch"):  # the reference: one float64 backward per row
        wide = [t.detach().double().requires_grad_() for t in (a, b)]
        out64 = gated(*wide)
        for row in range(3):
            want = torch.autograd.grad(out64, wide, rows[row].double(), retain_graph=True)
            for g, w in zip(got, want):
                assert rel_err(g[row], w) < 1e-5


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize(
    "op, in_place", [*((op, False) for op in [*OPS_UNDER_TEST, "gelu_mul"]), ("silu_mul", True), ("gelu_mul", True)]
)
def test_batched_gradients_are_exact_or_a_clear_error(lk, op, name, in_place):
    """``autograd.grad(is_grads_batched=True)`` (and ``jacobian(vectorize=True)``) batch the incoming gradients
    with PyTorch's legacy vmap, whose tensors have no storage for a kernel and are not torch.func's wrappers:
    the elementwise ops and rotary take their composite backward (exact, also with the in-place backward), the
    losses raise a RuntimeError that says so."""
    if name == "triton" and not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    torch.manual_seed(0)
    calls = _op_calls(lk)
    calls["gelu_mul"] = (lambda a, b: lk.gelu_mul(a, b), calls["silu_mul"][1])
    if in_place:  # the gated ops' in-place backward, on gate and up made by autograd ops
        gated = lk.silu_mul if op == "silu_mul" else lk.gelu_mul
        calls[op] = (lambda a, b: gated(a * 1, b * 1, in_place_backward=True), calls[op][1])
    fn, inputs = calls[op]
    leaves = [t.detach().requires_grad_() for t in inputs]

    def outputs(*args):
        out = fn(*args)
        return out if isinstance(out, tuple) else (getattr(out, "loss", out),)

    with backend(name):
        outs = outputs(*leaves)
        batched = [torch.randn(3, *o.shape) for o in outs]
        if op in ("cross_entropy", "fused_linear_cross_entropy"):
            with pytest.raises(RuntimeError, match="batched gradients"):
                torch.autograd.grad(outs, leaves, batched, is_grads_batched=True)
            return
        got = torch.autograd.grad(outs, leaves, batched, is_grads_batched=True)
    with backend("torch"):  # the reference: one float64 backward per row of the batch
        wide = [t.detach().double().requires_grad_() for t in leaves]
        outs64 = outputs(*wide)
        for row in range(3):
            want = torch.autograd.grad(outs64, wide, [b[row].double() for b in batched], retain_graph=True)
            for g, w in zip(got, want):
                assert rel_err(g[row], w) < 1e-5
