"""What SwiGLU and GeGLU share (the machinery in _gated.py): dtypes, layouts, widths, empty inputs, bad
input, and who may have their buffers overwritten by backward. Every case runs on both backends."""

import contextlib
import inspect
import operator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import (
    FLOAT_DTYPES,
    INTERPRETED,
    OPS,
    assert_faithful,
    backend,
    check_op,
    make_pair,
    poisoned_outputs,
    rel_err,
)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_float64_reference(lk, op, dtype, backend_name):
    a, b, _ = make_pair((4, 37, 1000), dtype)
    check_op(lk, op, a, b, dtype, backend_name)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_strided_rows(lk, op, dtype, backend_name):
    a, b, _ = make_pair((3, 50, 700), dtype, strided=True)
    assert not a.is_contiguous() and a.stride(-1) == 1
    check_op(lk, op, a, b, dtype, backend_name)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_wider_than_65536(lk, dtype, strided, backend_name):
    a, b, _ = make_pair((2, 70001), dtype, strided=strided)
    check_op(lk, "swiglu", a, b, dtype, backend_name)
    check_op(lk, "geglu_exact", a, b, dtype, backend_name)


def test_strided_rows_are_read_in_place(lk):
    """The halves of a fused gate_up output reach the kernel as views of the same memory, not copies."""
    fused = torch.randn(6, 5, 2 * 96)
    gate, up = fused.chunk(2, dim=-1)
    out = torch.empty(gate.shape)
    (gate_rows, up_rows, out_rows), n_rows, n_cols, strides = lk._gated._as_rows([gate, up, out])
    assert gate_rows.data_ptr() == gate.data_ptr() and up_rows.data_ptr() == up.data_ptr()
    assert gate_rows.stride() == (2 * 96, 1) and gate_rows.shape == (30, 96)
    assert (n_rows, n_cols, strides) == (30, 96, [2 * 96, 2 * 96, 96])
    assert out_rows.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("shape", [(0, 128), (3, 0, 64), (4, 0)])
@pytest.mark.parametrize("op", sorted(OPS))
def test_empty_input_gives_empty_result_without_launch(lk, op, shape, backend_name, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty input")

    monkeypatch.setattr(lk._gated, "_forward_triton", no_launch)
    monkeypatch.setattr(lk._gated, "_backward_triton", no_launch)
    a, b, _ = make_pair(shape, torch.float32)
    out = OPS[op][0](lk, a, b)
    assert out.shape == shape and out.dtype == torch.float32
    d_a, d_b = torch.autograd.grad(out, (a, b), torch.randn(shape))
    assert d_a.shape == shape and d_b.shape == shape


def bad_inputs():
    x = torch.randn(4, 8)
    return [
        ("a", lambda f: f(x.tolist(), x), TypeError, "`a` must be a torch.Tensor"),
        ("b", lambda f: f(x, 3.0), TypeError, "`b` must be a torch.Tensor"),
        ("shape", lambda f: f(x, torch.randn(4, 9)), ValueError, "same shape"),
        ("dtype", lambda f: f(x, x.half()), TypeError, "same dtype"),
        ("device", lambda f: f(x, torch.randn(4, 8, device="meta")), ValueError, "same device"),
        ("integer", lambda f: f(x.long(), x.long()), TypeError, "must be float32, float16, bfloat16 or float64"),
        ("bool", lambda f: f(x > 0, x > 0), TypeError, "must be float32, float16, bfloat16 or float64"),
        ("complex", lambda f: f(x.cfloat(), x.cfloat()), TypeError, "must be float32, float16, bfloat16 or float64"),
        ("float8", lambda f: f(x.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)), TypeError, "must be float32"),
        ("0-d", lambda f: f(torch.tensor(1.0), torch.tensor(2.0)), ValueError, "at least one dimension"),
    ]


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
@pytest.mark.parametrize("function", ["LigerSiLUMulFunction", "LigerGELUMulFunction"])
def test_bad_input_raises_before_launch(lk, function, case, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("reached the kernels with bad input")

    monkeypatch.setattr(lk._gated, "gated_forward", no_launch)
    _, call, error, message = case
    with pytest.raises(error, match=message) as info:
        call(getattr(lk, function).apply)
    assert function in str(info.value)


FUNCTIONAL_FORMS = {  # name: (the name its errors carry, the call)
    "silu_mul": ("LigerSiLUMulFunction", lambda lk: lk.silu_mul),
    "gelu_mul": ("LigerGELUMulFunction", lambda lk: lk.gelu_mul),
    "gated_mul": ("gated_mul", lambda lk: lk.gated_mul),
}


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
@pytest.mark.parametrize("form", sorted(FUNCTIONAL_FORMS))
@pytest.mark.parametrize("grad", [False, True])
def test_functional_forms_raise_the_checks_errors_before_launch(lk, form, grad, case, monkeypatch):
    """The functional forms' one-frame common case (``_gated.eager_call``) takes only what their checks accept:
    everything else raises the checks' own errors, with or without a gradient."""

    def no_launch(*args, **kwargs):
        raise AssertionError("reached the kernels with bad input")

    monkeypatch.setattr(lk._gated, "gated_forward", no_launch)
    monkeypatch.setattr(lk._gated, "_eager_gated", no_launch)
    name, function = FUNCTIONAL_FORMS[form]
    _, call, error, message = case

    def leaf(t):  # with a gradient: each floating tensor a leaf that requires one
        usable = grad and isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        return t.detach().requires_grad_() if usable else t

    with torch.set_grad_enabled(grad), pytest.raises(error, match=message) as info:
        call(lambda a, b: function(lk)(leaf(a), leaf(b)))
    assert name in str(info.value)


@pytest.mark.parametrize("name", ["LigerSiLUMulFunction", "LigerGELUMulFunction"])
def test_public_function_binds_arguments_without_parsing_its_signature(lk, name, monkeypatch):
    """PyTorch's apply binds each call's arguments through inspect.signature(forward): the Functions carry it
    precomputed (host cost, issue 15), the very Signature inspect would compute, so every call binds alike."""
    function = getattr(lk, name)
    assert function.forward.__signature__ == inspect.Signature.from_callable(function.forward, follow_wrapped=False)
    parsed = []
    parse = inspect._signature_from_function  # what inspect.signature does for a function without __signature__
    monkeypatch.setattr(inspect, "_signature_from_function", lambda *a, **k: parsed.append(a) or parse(*a, **k))
    assert inspect.signature(lambda x: x) and parsed, "the probe does not see inspect's parsing"
    parsed.clear()
    a, b = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    with backend("torch"):
        if name == "LigerSiLUMulFunction":
            got, want = function.apply(a, b, 2.0, down_multiplier=0.5), lk.silu_mul(a, b, 2.0, 0.5)
        else:
            got, want = function.apply(a, b, approximate="none"), lk.gelu_mul(a, b, "none")
        got.sum().backward()
    assert parsed == []
    assert torch.equal(got, want)


BINDINGS = {  # name: (calls that bind, calls the binding rejects), each as (positional tail, keywords)
    "LigerSiLUMulFunction": (
        [
            ((), {}),
            ((2.0,), {}),
            ((2.0, 0.5), {}),
            ((2.0, 0.5, False), {}),
            ((), {"down_multiplier": 0.5}),
            ((-1.5,), {"in_place_backward": False, "down_multiplier": 3.0}),
        ],
        [((2.0, 0.5, False, 1), {}), ((2.0,), {"gate_multiplier": 1.0}), ((), {"scale": 1.0}), ((), {"b": None})],
    ),
    "LigerGELUMulFunction": (
        [
            ((), {}),
            (("none",), {}),
            (("tanh", False), {}),
            ((), {"approximate": "none"}),
            ((), {"in_place_backward": False}),
        ],
        [(("none", False, 3), {}), (("none",), {"approximate": "tanh"}), ((), {"approx": "none"})],
    ),
}


@pytest.mark.parametrize("name", sorted(BINDINGS))
def test_public_function_apply_binds_as_pytorch_does(lk, name, monkeypatch):
    """The Functions' own apply (bind_cheaply) skips inspect's binding: every call it takes must reach forward,
    setup_context and backward with the arguments PyTorch's apply binds, and every call the binding rejects must
    fail as PyTorch's does."""
    function = getattr(lk, name)
    torch_apply = torch.autograd.Function.apply.__func__
    bound = []
    bind = inspect.Signature.bind
    monkeypatch.setattr(inspect.Signature, "bind", lambda *a, **k: bound.append(a) or bind(*a, **k))
    binds, rejected = BINDINGS[name]
    for tail, keywords in binds:
        a, b = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
        d_out = torch.randn(3, 8)
        with backend("torch"):
            got = function.apply(a, b, *tail, **keywords)
            assert bound == [], f"{tail} {keywords}: the call went through inspect's binding"
            want = torch_apply(function, a, b, *tail, **keywords)
            assert bound, "the probe does not see PyTorch's binding"
            bound.clear()
            assert type(got.grad_fn) is type(want.grad_fn)
            assert torch.equal(got, want), (tail, keywords)
            for g, w in zip(torch.autograd.grad(got, (a, b), d_out), torch.autograd.grad(want, (a, b), d_out)):
                assert torch.equal(g, w), (tail, keywords)
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    for tail, keywords in rejected:
        with pytest.raises(TypeError) as want:
            torch_apply(function, a, b, *tail, **keywords)
        with pytest.raises(TypeError) as got:
            function.apply(a, b, *tail, **keywords)
        assert str(got.value) == str(want.value)
    with pytest.raises(TypeError) as got:
        function.apply(a)
    assert "missing a required argument: 'b'" in str(got.value)
    subclass = type("Subclass", (function,), {})  # PyTorch's apply, for the subclass's own backward class
    out = subclass.apply(a.requires_grad_(), b)
    assert type(out.grad_fn) is subclass._backward_cls and bound


@pytest.mark.parametrize("name", [*sorted(BINDINGS), "silu_mul", "silu_mul, as up"])
def test_dead_functorch_wrappers_are_unwrapped(lk, name):
    """A tensor made inside a finished torch.func transform and used afterwards is a dead wrapper: PyTorch's apply
    unwraps it, so the gradient reaches what it was computed from; the Functions' own apply must too, and so
    must the functional forms, which call autograd's C++ apply directly (they send it to the composite)."""
    call = getattr(lk, name).apply if name in BINDINGS else lk.silu_mul
    if name == "silu_mul, as up":
        call = lambda up, gate: lk.silu_mul(gate, up)  # noqa: E731
    x0, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    escaped = []

    def f(x):
        y = x * 2
        escaped.append(y)
        return call(y, b).sum()

    with backend("torch"):
        torch.func.grad(f)(x0)
        (got,) = torch.autograd.grad(call(escaped[0], b).sum(), x0, allow_unused=True)
        (want,) = torch.autograd.grad(call(x0 * 2, b).sum(), x0)
    assert got is not None
    if name not in BINDINGS:  # the composite's autograd against the fused backward's one rounding: fp32 apart
        assert rel_err(got, want) < 1e-6
    else:
        assert torch.equal(got, want)


# The functional forms and the public Functions (each asks the routing questions in its own code)
ROUTED_FORMS = {
    **{name: call for name, (_, call) in FUNCTIONAL_FORMS.items()},
    "LigerSiLUMulFunction.apply": lambda lk: lk.LigerSiLUMulFunction.apply,
    "LigerGELUMulFunction.apply": lambda lk: lk.LigerGELUMulFunction.apply,
}


@pytest.mark.parametrize("state", ["torch.export", "torch.jit.trace", "forward AD"])
@pytest.mark.parametrize("form", sorted(ROUTED_FORMS))
def test_traced_or_forward_differentiated_calls_take_the_composite(lk, form, state, monkeypatch):
    """While torch.export or torch.jit.trace records (their flags set here as they set them) or a forward-AD
    level is open, a functional form's or public Function's forward, and the backward of a node recorded before,
    run the PyTorch composite: no kernel launch, whose output a program of aten ops would not hold."""
    if not lk._backend.triton_interpreted():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    function = ROUTED_FORMS[form]
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    d_out = torch.randn(4, 8)
    with backend("triton"):
        recorded = function(lk)(a, b)  # before: the kernels
        want_out = lk._gated._forward_torch(
            a.detach(),
            b.detach(),
            lk.activations.GELU_TANH if "gelu" in form.lower() else lk.activations.SILU,
            1.0,
            1.0,
        )
        want = torch.autograd.grad(recorded, (a, b), d_out, retain_graph=True)

        def no_launch(*args, **kwargs):
            raise AssertionError("a kernel was launched")

        monkeypatch.setattr(lk._gated, "launch_prepared", no_launch)
        monkeypatch.setattr(lk._gated, "_forward_triton", no_launch)
        monkeypatch.setattr(lk._gated, "_backward_triton", no_launch)
        if state == "torch.export":
            monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
        elif state == "torch.jit.trace":
            monkeypatch.setattr(lk._gated, "_is_tracing", lambda: True)
            monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
        with torch.autograd.forward_ad.dual_level() if state == "forward AD" else contextlib.nullcontext():
            with torch.no_grad():
                assert rel_err(function(lk)(a, b), want_out) < 1e-6
            got = torch.autograd.grad(recorded, (a, b), d_out)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6


@pytest.mark.parametrize("batched", ["gate", "up"])
@pytest.mark.parametrize("vmap", ["torch.func.vmap", "legacy _vmap"])
@pytest.mark.parametrize("form", sorted(ROUTED_FORMS))
def test_a_batched_gate_or_up_alone_takes_the_composite(lk, form, vmap, batched, backend_name):
    """Mapped over one of its two inputs (the other a plain tensor), a call sees a batched tensor, which has no
    storage a kernel could read, beside a plain one: the composite runs, against float64."""
    function = ROUTED_FORMS[form](lk)
    mapped, plain = torch.randn(3, 4, 8), torch.randn(4, 8)
    call = (lambda x: function(x, plain)) if batched == "gate" else (lambda x: function(plain, x))
    transform = torch.func.vmap if vmap == "torch.func.vmap" else torch._vmap_internals._vmap
    got = transform(call)(mapped)
    gate, up = (mapped.double(), plain.double()) if batched == "gate" else (plain.double(), mapped.double())
    if "gelu" in form.lower():
        want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    else:
        want = torch.nn.functional.silu(gate) * up
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("op", sorted(OPS))
def test_public_function_leaves_caller_tensors_intact(lk, op, backend_name):
    """Gradients go to fresh tensors: a gate the caller still holds (and reads after backward) keeps its values."""
    a, b, _ = make_pair((8, 300), torch.float32)
    a_before, b_before = a.detach().clone(), b.detach().clone()
    out = OPS[op][0](lk, a, b)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.equal(a.detach(), a_before) and torch.equal(b.detach(), b_before)
    assert a.grad.data_ptr() != a.data_ptr() and b.grad.data_ptr() != b.data_ptr()


class CountingAllocator:
    """Counts the kernel-output allocations made through _backend.new_tensor and _backend.new_like."""

    def __init__(self, lk, monkeypatch):
        self.count = 0
        for name in ("new_tensor", "new_like"):
            inner = getattr(lk._backend, name)

            def counted(*args, inner=inner, **kwargs):
                self.count += 1
                return inner(*args, **kwargs)

            monkeypatch.setattr(lk._backend, name, counted)


def require_interpreted_triton():
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter; see test_gpu.py on a GPU")


IN_PLACE_CALLS = {
    "swiglu": lambda lk, a, b, in_place: lk.LigerSiLUMulFunction.apply(a, b, 1.0, 1.0, in_place),
    "geglu": lambda lk, a, b, in_place: lk.LigerGELUMulFunction.apply(a, b, "tanh", in_place),
    "silu_mul": lambda lk, a, b, in_place: lk.silu_mul(a, b, 1.0, 1.0, in_place),
    "gelu_mul": lambda lk, a, b, in_place: lk.gelu_mul(a, b, "tanh", in_place),
}


@pytest.mark.parametrize("op", sorted(IN_PLACE_CALLS))
def test_in_place_backward_writes_into_gate_and_up(lk, op, monkeypatch):
    """Opted in, backward allocates nothing gate/up-sized: the gradients take over the saved buffers, with
    the same values the out-of-place path writes."""
    require_interpreted_triton()
    call = IN_PLACE_CALLS[op]
    x_a, x_b, _ = make_pair((8, 300), torch.float32)
    d_out = torch.randn(8, 300)
    with backend("triton"):
        gate, up = x_a * 1.0, x_b * 1.0  # buffers that only the op reads, as in the layers
        want = torch.autograd.grad(call(lk, gate, up, False), (gate, up), d_out)
        gate, up = x_a * 1.0, x_b * 1.0
        out = call(lk, gate, up, True)
        allocations = CountingAllocator(lk, monkeypatch)
        d_gate, d_up = torch.autograd.grad(out, (gate, up), d_out)
    assert allocations.count == 0, "in-place backward allocated gradient buffers"
    assert d_gate.data_ptr() == gate.data_ptr() and d_up.data_ptr() == up.data_ptr()
    assert torch.equal(d_gate, want[0]) and torch.equal(d_up, want[1])


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op", sorted(IN_PLACE_CALLS))
def test_a_node_that_also_saved_gate_raises_after_the_in_place_backward(lk, op, name):
    """Another node that saved ``gate`` and runs after the op's backward (``gate * w``, recorded before the op)
    would read the gradient written over it: the in-place backward bumps gate's and up's versions, so autograd
    raises its in-place error instead of a wrong gradient."""
    if name == "triton":
        require_interpreted_triton()
    call = IN_PLACE_CALLS[op]
    a, b, _ = make_pair((4, 64), torch.float32)
    w = torch.randn(4, 64, requires_grad=True)
    with backend(name):
        gate, up = a * 1.0, b * 1.0
        others = (gate * w).sum() + (up * w).sum()
        loss = (call(lk, gate, up, True) * w).sum() + others  # (a contiguous incoming gradient, w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op", sorted(IN_PLACE_CALLS))
@pytest.mark.parametrize("hooked", [False, True])
def test_in_place_backward_leaves_a_producer_that_saved_its_output_alone(lk, op, name, hooked):
    """``gate = exp(z)``: exp's node saved gate and reads it in its backward, after the op's. Under a saved-tensor
    hook active when exp ran (and no longer when the op runs) autograd does not check versions: writing the
    gradient over gate gave exp's backward that gradient for exp(z), silently (d_z wrong by 125%). Without the hook
    it raised autograd's in-place error. The gradients are now written fresh, exact either way; up is the
    output of a Python Function (which may have saved it) in the same way."""
    if name == "triton":
        require_interpreted_triton()
    z, u = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    scope = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooked else contextlib.nullcontext()
    with backend(name):
        with scope:
            gate, up = torch.exp(z), _SavesOutput.apply(u)
        d_z, d_u = torch.autograd.grad((IN_PLACE_CALLS[op](lk, gate, up, True) * 1.5).sum(), (z, u))
    z64, u64 = z.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    approximate = "none" if op in ("swiglu", "silu_mul") else "tanh"
    gate64 = torch.exp(z64)
    act = gate64 * torch.sigmoid(gate64) if approximate == "none" else F.gelu(gate64, approximate="tanh")
    want = torch.autograd.grad((act * torch.exp(u64) * 1.5).sum(), (z64, u64))
    assert rel_err(d_z, want[0]) < 1e-6 and rel_err(d_u, want[1]) < 1e-6


PRODUCERS_THAT_SAVE_THEIR_OUTPUT = {
    "sdpa": lambda x: torch.nn.functional.scaled_dot_product_attention(x[None], x[None] * 0.5, x[None] * 2.0)[0],
    # _unsafe_view shares exp's output without making a view of it (no _base): exp's node made that memory
    "exp through _unsafe_view": lambda x: torch.ops.aten._unsafe_view(torch.exp(x), x.shape),
    "qr": lambda x: torch.linalg.qr(x)[0],
    "inv": lambda x: torch.linalg.inv(x + 4 * torch.eye(4, dtype=x.dtype)),
    "cholesky": lambda x: torch.linalg.cholesky(x @ x.mT + torch.eye(4, dtype=x.dtype)),
}


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("producer", sorted(PRODUCERS_THAT_SAVE_THEIR_OUTPUT))
def test_in_place_backward_over_outputs_saved_under_other_names(lk, name, producer):
    """SDPA keeps its attention output, the factorizations their factors, each under a name of its own: as for
    exp, under a saved-tensor hook active when they ran the in-place backward gave their backward the gradients
    (d_A off by 44% to 17,000x); only the nodes of ops whose derivative reads no output are written over."""
    if name == "triton":
        require_interpreted_triton()
    make = PRODUCERS_THAT_SAVE_THEIR_OUTPUT[producer]
    a64 = torch.randn(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, g0 = a64.float().requires_grad_(), torch.randn(2, 4, 4, requires_grad=True)
    with backend(name):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            up = make(a)
        (d_a,) = torch.autograd.grad(lk.silu_mul(g0 * 1.0, up, 1.0, 1.0, True).sum(), (a,))
    a64.requires_grad_()
    (want,) = torch.autograd.grad((F.silu(g0.detach().double()) * make(a64)).sum(), (a64,))
    assert rel_err(d_a, want) < 1e-5


def test_in_place_backward_asks_a_freed_or_hooked_producer_nothing(lk):
    """The producer's saved output is asked about without unpacking it: a producer whose graph a backward has freed
    (unpacking raised "backward through the graph a second time") and one whose unpack hook would run."""
    z, u = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(t) or t):
        gate = torch.exp(z)
    gate.sum().backward(retain_graph=True)
    unpacked.clear()
    up = torch.exp(u)
    up.sum().backward()  # up's producer freed
    out = lk.silu_mul(gate, up, 1.0, 1.0, True)
    assert unpacked == []
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    d_gate, d_up = torch.autograd.grad(out.sum(), (gate, up))
    want = torch.autograd.grad((F.silu(g64) * u64).sum(), (g64, u64))
    assert rel_err(d_gate, want[0]) < 1e-6 and rel_err(d_up, want[1]) < 1e-6


class _SavesOutput(torch.autograd.Function):
    """exp as a Python Function that saves its output."""

    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, d_out):
        (out,) = ctx.saved_tensors
        return d_out * out


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_in_place_backward_with_an_incoming_gradient_over_gate_s_memory_is_exact(lk, name):
    """``grad_outputs`` made as a view of gate's own storage, one element apart: the kernel reads the incoming
    gradient block by block while it writes the gradients over gate, so later blocks read gradients where the
    incoming gradient was (d_up off by 1.2 from column 2048 on). The gradients are written fresh there."""
    if name == "triton":
        require_interpreted_triton()
    width = 4100  # more than one 2048-column block
    h = torch.randn(1, width + 1, requires_grad=True) * 1.0
    up = torch.randn(1, width, requires_grad=True)
    gate, d_out = h[:, 1:], h[:, :width]
    want = d_out.detach().double() * torch.nn.functional.silu(gate.detach().double())
    with backend(name):
        (d_up,) = torch.autograd.grad(lk.silu_mul(gate, up * 1.0, 1.0, 1.0, True), (up,), d_out)
    assert rel_err(d_up, want) < 1e-6


@pytest.mark.parametrize("multiplier", [2, np.float64(0.5), np.float32(-1.5), True.__class__(1) + 1])
def test_the_multipliers_reach_the_kernels_as_floats(lk, multiplier, monkeypatch):
    """An int or a numpy float multiplier is converted before the launch: the kernel is the one a float
    compiles (an int would be specialized on its value class), with the same result."""
    require_interpreted_triton()
    a, b, _ = make_pair((4, 64), torch.float32)
    seen = []
    launch = lk._gated.launch_prepared
    monkeypatch.setattr(
        lk._gated,
        "launch_prepared",
        lambda kernel, tensors, plan, trailing: seen.append(trailing) or launch(kernel, tensors, plan, trailing),
    )
    with backend("triton"):
        out = lk.silu_mul(a, b, multiplier, multiplier)
        torch.autograd.grad(out.sum(), (a, b))
        want = lk.silu_mul(a, b, float(multiplier), float(multiplier))
    assert seen and all(type(value) is float for trailing in seen for value in trailing)
    assert torch.equal(out, want)


def test_in_place_backward_with_a_retained_graph_is_exact(lk):
    """backward(retain_graph=True) twice, two autograd.grad calls on one graph, and
    autograd.functional.jacobian all read gate/up again: a retained graph makes backward write fresh
    gradients instead of writing over them, so every pass equals the plain composite."""
    require_interpreted_triton()
    with backend("triton"):
        a, b, _ = make_pair((4, 64), torch.float32)
        gate, up = a * 1.0, b * 1.0
        out = lk.LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0, True)
        first = torch.autograd.grad(out.sum(), (a, b), retain_graph=True)
        second = torch.autograd.grad(out.sum(), (a, b))
        ref_a, ref_b = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
        want = torch.autograd.grad((torch.nn.functional.silu(ref_a) * ref_b).sum(), (ref_a, ref_b))
        for got in (*first, *second):
            assert got is not None
        for got, expected in zip(first + second, want + want):
            assert rel_err(got, expected) < 1e-6

        a_small, b_small, _ = make_pair((3, 5), torch.float32)
        jac = torch.autograd.functional.jacobian(
            lambda p, q: lk.silu_mul(p * 1.0, q * 1.0, 1.0, 1.0, True), (a_small, b_small)
        )
        ref = torch.autograd.functional.jacobian(
            lambda p, q: torch.nn.functional.silu(p) * q, (a_small.double(), b_small.double())
        )
        for got, expected in zip(jac, ref):
            assert rel_err(got, expected) < 1e-6


SAVED_TENSOR_HOOKS = {
    "a user's hook that keeps what it packs": lambda kept: torch.autograd.graph.saved_tensors_hooks(
        lambda t: kept.append(t) or t, lambda t: t
    ),
    "save_on_cpu": lambda kept: torch.autograd.graph.save_on_cpu(),
}


@pytest.mark.parametrize("hook", sorted(SAVED_TENSOR_HOOKS) + ["checkpoint"])
@pytest.mark.parametrize("op", sorted(IN_PLACE_CALLS))
def test_in_place_backward_is_not_taken_under_saved_tensor_hooks(lk, op, hook, monkeypatch):
    """Under any saved-tensor hook an unpacked tensor skips autograd's version check: gate written over by
    the in-place backward would reach another node that saved it (here the product with c) without an error,
    and a user's pack may keep gate and up themselves. The opt-in then writes fresh gradients: every
    gradient exact, every kept tensor intact."""
    require_interpreted_triton()
    call = IN_PLACE_CALLS[op]
    x_a, x_b, _ = make_pair((4, 40), torch.float32)
    c = torch.randn(4, 40, requires_grad=True)
    d_out = torch.randn(4, 40)

    def region(a, b, c, in_place):
        gate, up = a * 1.0, b * 1.0
        return (call(lk, gate, up, in_place) * d_out).sum() + (gate * c).sum()  # gate saved by a second node

    with backend("triton"):
        want = torch.autograd.grad(region(x_a, x_b, c, False), (x_a, x_b, c))
        kept = []
        allocations = CountingAllocator(lk, monkeypatch)
        if hook == "checkpoint":
            loss = torch.utils.checkpoint.checkpoint(region, x_a, x_b, c, True, use_reentrant=False)
        else:
            with SAVED_TENSOR_HOOKS[hook](kept):
                loss = region(x_a, x_b, c, True)
        values = [t.detach().clone() for t in kept]
        allocations.count = 0
        got = torch.autograd.grad(loss, (x_a, x_b, c))
    assert all(torch.equal(t, v) for t, v in zip(kept, values)), "a kept tensor was written"
    for name, g, w in zip(("a", "b", "c"), got, want):
        assert rel_err(g, w) < 1e-6, f"{name}: {rel_err(g, w):.2e}"
    forwards = 1 if hook == "checkpoint" else 0  # the checkpoint's recompute allocates its output once more
    assert allocations.count == forwards + 2, "backward wrote over gate and up"


@pytest.mark.parametrize("form", ["Function", "silu_mul"])
def test_in_place_backward_refuses_aliased_and_leaf_buffers(lk, form, backend_name):
    """in_place_backward=True with a and b the same tensor, or with leaves (a user's parameters), writes
    fresh gradients: the values are exact and the leaves keep their values."""
    apply = (
        (lambda p, q: lk.LigerSiLUMulFunction.apply(p, q, 1.0, 1.0, True))
        if form == "Function"
        else (lambda p, q: lk.silu_mul(p, q, 1.0, 1.0, True))
    )
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    x = torch.randn(4, 40, dtype=dtype, requires_grad=True)
    y = x * 1.0
    (d_x,) = torch.autograd.grad(apply(y, y).sum(), x)
    ref = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad((torch.nn.functional.silu(ref) * ref).sum(), ref)
    assert rel_err(d_x, want) < 1e-6
    leaf_a = torch.randn(4, 40, dtype=dtype, requires_grad=True)
    leaf_b = torch.randn(4, 40, dtype=dtype, requires_grad=True)
    kept = leaf_a.detach().clone(), leaf_b.detach().clone()
    apply(leaf_a, leaf_b).sum().backward()
    assert torch.equal(leaf_a.detach(), kept[0]) and torch.equal(leaf_b.detach(), kept[1])
    fused = torch.randn(4, 80, dtype=dtype, requires_grad=True)  # halves of a leaf: views of the caller's tensor
    kept = fused.detach().clone()
    apply(*fused.chunk(2, dim=-1)).sum().backward()
    assert torch.equal(fused.detach(), kept)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    op=st.sampled_from(sorted(OPS)),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    width=st.one_of(st.integers(1, 40), st.integers(41, 2100)),
    strided=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    name=st.sampled_from(["torch", "triton"] if INTERPRETED else ["torch"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes_layouts_dtypes(lk, op, lead, width, strided, dtype, name, seed):
    torch.manual_seed(seed)
    with backend(name), poisoned_outputs(lk):
        a, b, _ = make_pair((*lead, width), dtype, strided=strided)
        check_op(lk, op, a, b, dtype, name, bound="faithful")


@pytest.mark.parametrize("op", sorted(OPS))
def test_double_backward_is_exact(lk, op, backend_name):
    """Second order through autograd.grad(create_graph=True), as HVPs, gradient penalties and Sophia take it:
    the activation's second derivative is there, equal to the float64 composite's."""
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    a, b, _ = make_pair((4, 40), dtype)
    v = torch.randn(4, 40, dtype=dtype)
    apply, reference = OPS[op]
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    got = _hvp(lambda p, q: apply(lk, p, q), a, b, v)
    want = _hvp(reference, a64, b64, v.double())
    # No worse than PyTorch's own composite in the same dtype (second derivatives cancel in fp32).
    a_same, b_same = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    eager = _hvp(reference, a_same, b_same, v)
    for g, e, w in zip(got, eager, want):
        bound = 1e-12 if dtype == torch.float64 else 1.5 * rel_err(e, w) + 16 * torch.finfo(dtype).eps
        assert rel_err(g, w) <= bound, f"{op}: {rel_err(g, w):.3e} > {bound:.3e}"


def _hvp(f, a, b, v):
    """(d/da, d/db) of <d(sum f^2)/da, v>: needs f's second derivatives in both inputs."""
    (d_a,) = torch.autograd.grad((f(a, b) ** 2).sum(), a, create_graph=True)
    return torch.autograd.grad((d_a * v).sum(), (a, b))


def test_gradgradcheck(lk):
    a, b, _ = make_pair((3, 7), torch.float64)
    for f in (lk.LigerSiLUMulFunction.apply, lk.silu_mul, lambda p, q: lk.gelu_mul(p, q, "none")):
        assert torch.autograd.gradgradcheck(f, (a, b))


@pytest.mark.parametrize("op", sorted(OPS))
def test_torch_func_transforms(lk, op, backend_name):
    """vmap, grad and jacrev over the ops (per-sample gradients, Jacobians): equal to the composite on both
    backends; the transformed tensors never reach a kernel."""
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    apply, reference = OPS[op]
    a, b, _ = make_pair((3, 4, 6), dtype)
    a, b = a.detach(), b.detach()

    def f(p, q):
        return apply(lk, p, q)

    bound = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(torch.func.vmap(f)(a, b), reference(a.double(), b.double())) < bound
    assert rel_err(torch.func.vmap(f, in_dims=(0, None))(a, b[0]), reference(a.double(), b[0].double())) < bound
    got = torch.func.grad(lambda p: f(p, b).sum())(a)
    want = torch.func.grad(lambda p: reference(p, b.double()).sum())(a.double())
    assert rel_err(got, want) < bound
    got = torch.func.jacrev(f, argnums=(0, 1))(a[0, 0], b[0, 0])
    want = torch.func.jacrev(reference, argnums=(0, 1))(a[0, 0].double(), b[0, 0].double())
    for g, w in zip(got, want):
        assert rel_err(g, w) < bound


@pytest.mark.parametrize("op", sorted(OPS))
def test_plain_tensors_inside_a_transform_take_gradients(lk, op, backend_name):
    """Under an active torch.func transform an op on plain tensors that take gradients (parameters the
    transformed function closes over) is exact and differentiable by ordinary autograd; PyTorch's apply of the
    eager Function would raise there, so the functional forms and layers run the composite."""
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    apply, reference = OPS[op]
    a, b, _ = make_pair((4, 6), dtype)
    x = torch.randn(3, 4, 6, dtype=dtype)
    out = torch.func.vmap(lambda row: apply(lk, a, b) * row)(x)
    want = reference(a.double(), b.double()) * x.double()
    bound = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(out, want) < bound
    got = torch.autograd.grad(out.sum(), (a, b))
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    expected = torch.autograd.grad((reference(a64, b64) * x.double()).sum(), (a64, b64))
    for g, w in zip(got, expected):
        assert rel_err(g, w) < bound


def test_in_place_backward_refuses_self_overlapping_buffers(lk, backend_name):
    """Expanded (stride-0) views of a non-leaf: several elements share one memory location, so gradients go to
    fresh tensors."""
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    base = torch.randn(1, 40, dtype=dtype, requires_grad=True)
    other = torch.randn(4, 40, dtype=dtype, requires_grad=True)
    gate, up = (base * 1.0).expand(4, 40), other * 1.0
    d_base, d_other = torch.autograd.grad(lk.silu_mul(gate, up, 1.0, 1.0, True).sum(), (base, other))
    ref_base, ref_other = base.detach().double().requires_grad_(), other.detach().double().requires_grad_()
    want = torch.autograd.grad(
        (torch.nn.functional.silu(ref_base.expand(4, 40)) * ref_other).sum(), (ref_base, ref_other)
    )
    assert rel_err(d_base, want[0]) < 1e-6 and rel_err(d_other, want[1]) < 1e-6


def test_in_place_backward_under_torch_compile(lk):
    """torch.compile traces with fake tensors, which have no storage to compare: the in-place decision says no
    for them (without reading a data pointer), and the compiled call with in_place_backward=True equals eager."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a FakeTensor's data pointer warns (and errors on some builds)
        base = torch.randn(4, 40, requires_grad=True)
        assert not lk._gated.may_write_over(base * 2.0, base * 3.0)
    torch._dynamo.reset()
    x = torch.randn(4, 40, requires_grad=True)
    f = lambda x: lk.silu_mul(x * 2.0, x * 3.0, 1.0, 1.0, True)
    want = torch.autograd.grad(f(x).sum(), x)[0]
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x).sum(), x)[0]
    torch._dynamo.reset()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(__import__("harness").LK.activations.REGISTRY))
def test_in_place_activation_matches_the_reference(lk, name, dtype):
    """Every registry entry's ``torch_in_place`` (the MLP layers' small inference calls) writes the activation
    over its input, within one rounding of the float64 reference."""
    activation = lk.activations.REGISTRY[name]
    z = torch.randn(4, 300, dtype=torch.float64) * 4
    x = z.to(dtype)
    want = activation.reference(x.to(torch.float64))
    out = activation.torch_in_place(x)
    assert out.data_ptr() == x.data_ptr() and out.dtype == dtype
    assert rel_err(out, want) <= 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_launch_plans_never_stand_for_the_multipliers(lk, device):
    """The kernels' launches are planned once per layout; the multipliers, which change from call to call, are
    passed at every launch (on a GPU through the direct launch's cache, keyed per call): interleaved calls on
    one layout with other multipliers each get their own, forward and backward."""
    a = torch.randn(4, 64, dtype=torch.float32, device=device, requires_grad=True)
    b = torch.randn(4, 64, dtype=torch.float32, device=device, requires_grad=True)
    with backend("triton"):
        for gate_multiplier, down_multiplier in [(1.0, 1.0), (2.5, 1.0), (1.0, -3.0), (0.5, 0.25), (1.0, 1.0)]:
            out = lk.gated_mul(a, b, "silu", gate_multiplier=gate_multiplier, down_multiplier=down_multiplier)
            d_a, d_b = torch.autograd.grad(out, (a, b), torch.ones_like(out))
            a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
            want = torch.nn.functional.silu(a64 * gate_multiplier) * b64 * down_multiplier
            want_grads = torch.autograd.grad(want, (a64, b64), torch.ones_like(want))
            for what, got, ref in (("out", out, want), ("d_a", d_a, want_grads[0]), ("d_b", d_b, want_grads[1])):
                assert_faithful(got, ref, torch.float32, f"{what}, multipliers {gate_multiplier}, {down_multiplier}")


def test_the_forward_common_case_launches_what_the_general_path_does(lk, monkeypatch):
    """``gated_forward`` launches contiguous tensors in one frame: the same kernel, plan, inputs and multipliers
    as ``_forward_triton``, into an output of the same layout; a strided gate or up takes ``_forward_triton``."""
    seen, general_calls = [], []
    record = lambda kernel, tensors, plan, trailing: seen.append((kernel, tensors, plan, trailing))  # noqa: E731
    monkeypatch.setattr(lk._gated, "launch_prepared", record)
    general = lk._gated._forward_triton
    silu = lk.activations.REGISTRY["silu"]
    gate, up = torch.randn(4, 64), torch.randn(4, 64)
    with backend("triton"):
        fast_out = lk._gated.gated_forward(gate, up, silu, 2.0, -3.0)
        general_out = general(gate, up, silu, 2.0, -3.0)
        (fast, slow) = seen
        assert fast[0] is slow[0] and fast[2] is slow[2] and fast[3] == slow[3] == (2.0, -3.0)
        same = lambda tensors, out: len(tensors) == 3 and all(map(operator.is_, tensors, (gate, up, out)))  # noqa: E731
        assert same(fast[1], fast_out) and same(slow[1], general_out)
        assert (fast_out.shape, fast_out.stride(), fast_out.dtype) == (gate.shape, gate.stride(), gate.dtype)
        monkeypatch.setattr(lk._gated, "_forward_triton", lambda *args: general_calls.append(args) or general(*args))
        strided = torch.randn(4, 128)[:, :64]
        for pair in ((strided, up), (gate, strided), (gate, up)):
            lk._gated.gated_forward(*pair, silu)
    assert [args[:2] for args in general_calls] == [(strided, up), (gate, strided)]


@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_the_common_cases_find_their_plan_by_plan_s_own_key(lk, name, monkeypatch):
    """The forward's and the backward's common case look their plan up by ``_plan``'s key inline: once a call has
    made the plans, the same calls find them without ``_plan`` (a key written otherwise would call it each time)."""
    activation = lk.activations.REGISTRY[name]
    gate, up = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    d_out = torch.randn(4, 64)

    def step():
        out = lk.gated_mul(gate, up, name, 1.5, 0.5)
        return out, torch.autograd.grad(out, (gate, up), d_out)

    with backend("triton"):
        want = step()
        with torch.no_grad():
            lk._gated.gated_forward(gate, up, activation, 1.5, 0.5)
        made = []
        plan = lk._gated._plan
        monkeypatch.setattr(lk._gated, "_plan", lambda *args: made.append(args) or plan(*args))
        got = step()
        with torch.no_grad():
            lk._gated.gated_forward(gate, up, activation, 1.5, 0.5)
    assert made == []
    for g, w in zip((got[0], *got[1]), (want[0], *want[1])):
        assert torch.equal(g, w)


def test_each_launch_is_planned_from_its_own_call(lk, monkeypatch):
    """The launch plans are cached per layout: the backward, the tiled MLP's recompute (which also stores the
    forward output) and a launch after the maintainers' sweep changed the block size each get their own."""
    seen = []
    monkeypatch.setattr(lk._gated, "launch_prepared", lambda kernel, tensors, plan, trailing: seen.append(plan))
    silu = lk.activations.REGISTRY["silu"]
    gate, up = torch.randn(4, 64), torch.randn(4, 64)
    with backend("triton"):
        lk._gated.gated_backward(gate, gate.clone(), up.clone(), silu)
        lk._gated.gated_recompute_backward(gate.clone(), gate.clone(), up.clone(), silu)
        monkeypatch.setattr(lk._gated, "BLOCK", 64)
        lk._gated.gated_backward(gate, gate.clone(), up.clone(), silu)
    plans = [(plan.meta["STORE_OUT"], plan.meta["BLOCK"], plan.grid) for plan in seen]
    assert plans == [(False, 2048, (1,)), (True, 2048, (1,)), (False, 64, (4,))]
