"""What SwiGLU and GeGLU share (the machinery in _gated.py): dtypes, layouts, widths, empty inputs, bad
input, and who may have their buffers overwritten by backward. Every case runs on both backends."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FLOAT_DTYPES, INTERPRETED, backend, poisoned_outputs
from gated_cases import OPS, check_op, make_pair


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
    gate_rows, up_rows, out_rows = lk._gated._as_rows([gate, up, out])
    assert gate_rows.data_ptr() == gate.data_ptr() and up_rows.data_ptr() == up.data_ptr()
    assert gate_rows.stride() == (2 * 96, 1) and gate_rows.shape == (30, 96)
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
        ("integer", lambda f: f(x.long(), x.long()), TypeError, "floating dtype"),
        ("bool", lambda f: f(x > 0, x > 0), TypeError, "floating dtype"),
        ("complex", lambda f: f(x.cfloat(), x.cfloat()), TypeError, "floating dtype"),
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
    """Counts the kernel-output allocations made through _backend.new_tensor."""

    def __init__(self, lk, monkeypatch):
        self.count = 0
        inner = lk._backend.new_tensor

        def counted(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(lk._backend, "new_tensor", counted)


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


def test_in_place_backward_cannot_be_replayed(lk):
    """A second backward would read gradients where gate/up were: autograd must refuse, not compute."""
    require_interpreted_triton()
    with backend("triton"):
        a, b, _ = make_pair((4, 64), torch.float32)
        gate, up = a * 1.0, b * 1.0
        out = lk.LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0, True)
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


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
def test_double_backward_raises(lk, op, backend_name):
    """First-order gradients only: differentiating them again raises instead of returning a wrong zero."""
    a, b, _ = make_pair((4, 40), torch.float64 if backend_name == "torch" else torch.float32)
    out = OPS[op][0](lk, a, b)
    (d_a,) = torch.autograd.grad(out.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(d_a.sum(), a)
