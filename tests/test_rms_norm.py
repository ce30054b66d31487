"""RMSNorm (rms_norm.py and the LigerRMSNorm layer): float64 references on both backends, the single-block,
several-rows and looped (wide-row) kernels, layouts, bad input, autograd (gradcheck, double backward,
torch.func), parity with transformers' RMSNorm modules bound as kernelize layers, the host check, kernelize,
torch.compile; and on a GPU the compiled kernels at real sizes."""

import contextlib
import copy
import functools
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from harness import (
    FLOAT_DTYPES,
    INTERPRETED,
    assert_close_to_rounding,
    assert_faithful,
    backend,
    compute_eps,
    poisoned_outputs,
    quantize,
    rel_err,
    truncates_bf16,
)
from test_gated import CountingAllocator
from test_layers import bind

CASTINGS = ("llama", "gemma")
LAYOUTS = ("one block", "rows", "looped")
OFFSETS = {"llama": 0.0, "gemma": 1.0}


def module(lk):
    """The rms_norm module (the package's top-level `rms_norm` is the function)."""
    return sys.modules[f"{lk.__name__}.rms_norm"]


@contextlib.contextmanager
def blocks(lk, layout):
    """Launch parameters that make tiny inputs take each kernel path: "one block" (the defaults: a row in
    registers), "rows" (two rows per step, several programs, several steps per backward program), "looped"
    (rows wider than MAX_BLOCK_COLS, looped over column blocks)."""
    rms = module(lk)
    names = ("MAX_BLOCK_COLS", "FORWARD_TILE", "BACKWARD_TILE", "BACKWARD_THREADS_PER_SM")
    saved = {name: getattr(rms, name) for name in names}
    if layout == "rows":
        rms.FORWARD_TILE, rms.BACKWARD_TILE, rms.BACKWARD_THREADS_PER_SM = 64, 64, 64
    elif layout == "looped":
        rms.MAX_BLOCK_COLS, rms.FORWARD_TILE, rms.BACKWARD_TILE, rms.BACKWARD_THREADS_PER_SM = 16, 32, 32, 64
    rms.clear_launch_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(rms, name, value)
        rms.clear_launch_cache()


def require_interpreted_triton():
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter; the GPU tests cover CUDA")


def make_inputs(shape, dtype, weight_dtype=None, device="cpu", strided=None, offset=0.0):
    """Fresh x (scale 2) and weight (around 1 - offset, so that offset + weight is around 1), both requiring
    grad. ``strided``: "columns" takes x as a column slice of a wider tensor (rows strided, read in place),
    "split" as a slice of the middle dim (leading dims that do not collapse), "transposed" with a column
    stride (copied); then x is a view of the leaf that requires grad."""
    width = shape[-1]
    if strided == "columns":
        base = (torch.randn(*shape[:-1], 3 * width, device=device) * 2).to(dtype).requires_grad_()
        x = base[..., width : 2 * width]
    elif strided == "split" and len(shape) >= 2:
        base = (torch.randn(shape[0], shape[1] + 3, *shape[2:], device=device) * 2).to(dtype).requires_grad_()
        x = base[:, 1 : 1 + shape[1]]
    elif strided == "transposed" and len(shape) >= 2:
        base = (torch.randn(*shape[:-2], width, shape[-2], device=device) * 2).to(dtype).requires_grad_()
        x = base.transpose(-1, -2)
    else:
        x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    weight = (1.0 - offset + 0.5 * torch.randn(width, device=device)).to(weight_dtype or dtype).requires_grad_()
    return x, weight


def reference(x, weight, eps, offset, round_to=None, truncate=False):
    """float64 RMSNorm: (x64, w64, y64). ``round_to``: the llama casting's rounding of x_normed to x's dtype,
    applied as a straight-through (gradients pass it unchanged), truncating where the backend's casts do."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    x_normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if round_to is not None:
        rounded = quantize(x_normed.detach(), round_to, truncate).double()
        x_normed = x_normed + (rounded - x_normed.detach())
    return x64, w64, x_normed * (offset + w64)


def expected_dtypes(x_dtype, weight_dtype, casting):
    """(output dtype, whether x_normed's rounding to x's dtype is coarser than the output)."""
    llama = casting == "llama"
    out_dtype = torch.promote_types(weight_dtype, x_dtype) if llama else x_dtype
    return out_dtype, llama and out_dtype != x_dtype


def check_rms_norm(
    lk, x, weight, casting="llama", offset=0.0, eps=1e-6, backend_name="torch", bound="rounding", call=None
):
    """Forward and both gradients against float64.

    Where the output dtype is x's (same-dtype llama, gemma), the llama rounding of x_normed is part of the
    reference, so a correct kernel is left with the output's one rounding: within 1.5x of that floor. Where
    the output is finer than x (a fp32 weight on bf16 x), the rounding of x_normed is the error that
    remains, and the floor is that of x's dtype, for the output and the weight gradient."""
    call = call or (lambda x, w: lk.rms_norm(x, w, eps, offset, casting))
    out_dtype, coarse = expected_dtypes(x.dtype, weight.dtype, casting)
    truncate = truncates_bf16(backend_name, x.device.type)
    round_to = x.dtype if casting == "llama" and not coarse else None
    x64, w64, ref = reference(x, weight, eps, offset, round_to, truncate)
    out = call(x, weight)
    assert out.dtype == out_dtype and out.shape == x.shape and out.device == x.device
    d_out = torch.randn(x.shape, device=x.device).to(out_dtype)
    d_x, d_w = torch.autograd.grad(out, (x, weight), d_out)
    ref_d_x, ref_d_w = torch.autograd.grad(ref, (x64, w64), d_out.double())
    assert d_x.dtype == x.dtype and d_w.dtype == weight.dtype
    checks = {  # what: (got, want, floor dtype, truncating casts)
        "out": (out, ref, x.dtype if coarse else out_dtype, truncate),
        "d_x": (d_x, ref_d_x, x.dtype, truncate),
        "d_weight": (d_w, ref_d_w, x.dtype if coarse else weight.dtype, truncate),
    }
    for what, (got, want, dtype, truncated) in checks.items():
        label = f"{casting} x {x.dtype} weight {weight.dtype} {what}"
        if bound == "rounding":
            assert_close_to_rounding(got, want, dtype, truncated, what=label)
        else:
            assert_faithful(got, want, dtype, what=label)
        if got.dtype == dtype and dtype in (torch.bfloat16, torch.float16):
            assert_mostly_exact(got, want, dtype, truncated, what=label)


def assert_mostly_exact(got, want, dtype, truncate, what):
    """A kernel computing in fp32 and rounding once returns the once-rounded exact result, except where
    its fp32 error straddles a rounding boundary (a rate of ~1e-3 in fp16, less in bf16). A second rounding
    (a cast in the wrong place) changes a large fraction of the elements while staying within 1.5x of the
    floor in norm, which is why this is checked as well."""
    differ = (got != quantize(want.detach(), dtype, truncate).to(got.device)).sum().item()
    allowed = 0.01 * got.numel() + 2
    assert differ <= allowed, f"{what}: {differ} of {got.numel()} elements differ from the once-rounded result"


# ----------------------------------------------------------------------------------------------------------
# The op against float64


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_float64_reference(lk, dtype, casting, layout, backend_name):
    with blocks(lk, layout):
        x, weight = make_inputs((3, 5, 24), dtype, offset=OFFSETS[casting])
        check_rms_norm(lk, x, weight, casting, OFFSETS[casting], backend_name=backend_name)


@pytest.mark.parametrize(
    "x_dtype, weight_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
    ids=str,
)
@pytest.mark.parametrize("casting", CASTINGS)
def test_mixed_dtypes(lk, x_dtype, weight_dtype, casting, backend_name):
    """A weight of another dtype (fp32 norms on bf16 activations): llama's output dtype is the promotion of
    both, as eager's; gemma's is x's."""
    with blocks(lk, "rows"):
        x, weight = make_inputs((4, 256), x_dtype, weight_dtype, offset=OFFSETS[casting])
        check_rms_norm(lk, x, weight, casting, OFFSETS[casting], backend_name=backend_name)


@pytest.mark.parametrize("layout", ["one block", "looped"])
@pytest.mark.parametrize("strided", ["columns", "split", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs(lk, dtype, strided, layout, backend_name):
    with blocks(lk, layout):
        x, weight = make_inputs((3, 6, 40), dtype, strided=strided)
        assert not x.is_contiguous()
        check_rms_norm(lk, x, weight, backend_name=backend_name)


@pytest.mark.parametrize("layout", ["rows", "looped"])
def test_layouts_take_the_paths_they_name(lk, layout):
    """The tiny shapes above reach what they are meant to: several rows per program, several programs,
    several steps of rows per backward program; or rows looped over column blocks."""
    rms = module(lk)
    with blocks(lk, layout):
        one_block, _, forward_rows, _, backward_rows, _, _ = rms._config(24)
        programs, blocks_per_program = rms._backward_grid(15, 24, torch.device("cpu"))
    assert one_block == (layout == "rows")
    assert programs > 1 and blocks_per_program > 1
    if layout == "rows":
        assert forward_rows > 1 and backward_rows > 1


def test_backward_stages_fit_the_shared_memory_budget(lk, monkeypatch):
    """(stages - 1) tiles of d_y and x wait in shared memory: within BACKWARD_SHARED_BYTES and half the
    device's shared memory per block (an AMD CU has 64 KiB), never fewer than one stage."""
    rms, cpu = module(lk), torch.device("cpu")
    bf16, fp32 = torch.bfloat16, torch.float32
    for shared, expected in ((227 * 1024, (3, 2)), (64 * 1024, (2, 1))):
        monkeypatch.setattr(rms, "_shared_bytes_per_block", lambda device, shared=shared: shared)
        rms.clear_launch_cache()
        assert (rms._backward_stages(4096, bf16, bf16, cpu), rms._backward_stages(8192, fp32, fp32, cpu)) == expected
    rms.clear_launch_cache()


def test_weight_gradient_sum_steps_over_partial_rows(lk, monkeypatch):
    """The partial-sum kernel in steps of SUM_MAX_PARTIALS rows, the last step masked (programs not a multiple)."""
    rms = module(lk)
    monkeypatch.setattr(rms, "SUM_MAX_PARTIALS", 2)
    monkeypatch.setattr(rms, "SUM_TILE", 4)
    monkeypatch.setattr(rms, "BACKWARD_TILE", 64)  # 2 rows a block: many programs for few rows
    rms.clear_launch_cache()
    try:
        with backend("triton"):
            programs, _ = rms._backward_grid(37, 24, torch.device("cpu"))
            assert programs > 2 and programs % 2 == 1, programs
            x, weight = make_inputs((37, 24), torch.float32)
            check_rms_norm(lk, x, weight, "llama", backend_name="triton")
    finally:
        rms.clear_launch_cache()


def test_strided_rows_are_read_in_place(lk):
    fused = torch.randn(4, 6, 3 * 40)
    x = fused[..., 40:80]
    rows = module(lk)._as_rows(x)
    assert rows.data_ptr() == x.data_ptr() and rows.stride() == (120, 1) and rows.shape == (24, 40)


@pytest.mark.parametrize("casting", CASTINGS)
def test_eps_and_offset_reach_the_result(lk, casting, backend_name):
    """A large eps and an offset matter: both reach forward and both gradients."""
    x, weight = make_inputs((6, 24), torch.float32)
    with torch.no_grad():
        x.mul_(0.05)  # mean square ~1e-2, of the order of eps
    check_rms_norm(lk, x, weight, casting, offset=0.75, eps=0.02, backend_name=backend_name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    width=st.integers(8, 80),
    strided=st.sampled_from([None, "columns", "split", "transposed"]),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(FLOAT_DTYPES),
    casting=st.sampled_from(CASTINGS),
    name=st.sampled_from(["torch", "triton"] if INTERPRETED else ["torch"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes_layouts_dtypes(lk, lead, width, strided, layout, dtype, casting, name, seed):
    """Widths below, at, and above the column block (16 when looped) and not multiples of it; any layout."""
    torch.manual_seed(seed)
    with backend(name), poisoned_outputs(lk), blocks(lk, layout):
        x, weight = make_inputs((*lead, width), dtype, strided=strided, offset=OFFSETS[casting])
        check_rms_norm(lk, x, weight, casting, OFFSETS[casting], backend_name=name, bound="faithful")


@pytest.mark.parametrize("function", ["rms_norm", "LigerRMSNormFunction"])
@pytest.mark.parametrize("casting, offset", [("llama", 0.0), ("llama", 0.5), ("gemma", 1.0)])
def test_gradcheck_float64(lk, casting, offset, function):
    fn = lk.rms_norm if function == "rms_norm" else lk.LigerRMSNormFunction.apply
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True)
    with backend("auto"):  # float64: the PyTorch path by the seam's own choice
        assert torch.autograd.gradcheck(lambda x, w: fn(x, w, 1e-5, offset, casting), (x, weight))
        assert torch.autograd.gradgradcheck(lambda x, w: fn(x, w, 1e-5, offset, casting), (x, weight))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)])
def test_empty_input_gives_empty_result_without_launch(lk, shape, backend_name, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty input")

    monkeypatch.setattr(module(lk), "_forward_triton", no_launch)
    monkeypatch.setattr(module(lk), "_backward_triton", no_launch)
    x = torch.randn(shape, requires_grad=True)
    weight = torch.randn(shape[-1], requires_grad=True)
    out = lk.rms_norm(x, weight)
    assert out.shape == shape and out.dtype == torch.float32
    d_x, d_w = torch.autograd.grad(out, (x, weight), torch.randn(shape))
    assert d_x.shape == shape and d_w.shape == (shape[-1],)
    assert not d_x.any() and not d_w.any()


def test_frozen_weight_and_inference_allocate_only_what_they_need(lk, monkeypatch):
    """No weight-gradient buffer for a frozen weight (norms frozen under LoRA), no rstd without autograd."""
    require_interpreted_triton()
    with backend("triton"), blocks(lk, "rows"):
        x, weight = make_inputs((9, 24), torch.float32)
        weight.requires_grad_(False)
        x64, _, ref = reference(x, weight, 1e-6, 0.0)
        out = lk.rms_norm(x, weight)
        allocations = CountingAllocator(lk, monkeypatch)
        d_out = torch.randn(9, 24)
        (d_x,) = torch.autograd.grad(out, (x,), d_out)
        assert allocations.count == 1
        assert_faithful(d_x, torch.autograd.grad(ref, (x64,), d_out.double())[0], torch.float32)
        allocations.count = 0
        with torch.no_grad():
            lk.rms_norm(x, weight)
        assert allocations.count == 1


def test_backward_leaves_caller_tensors_intact(lk, backend_name):
    x, weight = make_inputs((5, 24), torch.float32)
    x_before, w_before = x.detach().clone(), weight.detach().clone()
    out = lk.rms_norm(x, weight)
    d_out = torch.randn(5, 24)
    d_out_before = d_out.clone()
    torch.autograd.grad(out, (x, weight), d_out)
    assert torch.equal(x.detach(), x_before) and torch.equal(weight.detach(), w_before)
    assert torch.equal(d_out, d_out_before)


# ----------------------------------------------------------------------------------------------------------
# Bad input


def bad_inputs():
    x, w = torch.randn(4, 8), torch.ones(8)
    return [
        ("x", lambda f: f(x.tolist(), w), TypeError, "`x` must be a torch.Tensor"),
        ("weight", lambda f: f(x, 1.0), TypeError, "`weight` must be a torch.Tensor"),
        ("integer x", lambda f: f(x.long(), w), TypeError, "`x` must be float32, float16, bfloat16 or float64"),
        ("bool weight", lambda f: f(x, w > 0), TypeError, "`weight` must be float32"),
        ("float8", lambda f: f(x.to(torch.float8_e4m3fn), w), TypeError, "float8_e4m3fn"),
        ("complex", lambda f: f(x.cfloat(), w), TypeError, "complex64"),
        ("0-d", lambda f: f(torch.tensor(1.0), w[:1]), ValueError, "at least one dimension"),
        ("2-d weight", lambda f: f(x, w[None]), ValueError, r"`weight` must have shape \[H\]"),
        ("weight width", lambda f: f(x, torch.ones(9)), ValueError, r"H = x.shape\[-1\] = 8, got \(9,\)"),
        ("device", lambda f: f(x, torch.ones(8, device="meta")), ValueError, "same device"),
        ("negative eps", lambda f: f(x, w, -1e-6), ValueError, "`eps` must be >= 0"),
        ("nan eps", lambda f: f(x, w, float("nan")), ValueError, "`eps` must be finite"),
        ("bool eps", lambda f: f(x, w, True), TypeError, "`eps` must be a real number"),
        ("tensor eps", lambda f: f(x, w, torch.tensor(1e-6)), TypeError, "`eps` must be a real number"),
        ("inf offset", lambda f: f(x, w, 1e-6, float("inf")), ValueError, "`offset` must be finite"),
        ("numpy inf eps", lambda f: f(x, w, np.float64("inf")), ValueError, "`eps` must be finite"),
        ("huge int offset", lambda f: f(x, w, 1e-6, 10**400), ValueError, "`offset` must be finite"),
        ("str offset", lambda f: f(x, w, 1e-6, "1"), TypeError, "`offset` must be a real number"),
        ("casting", lambda f: f(x, w, 1e-6, 0.0, "none"), ValueError, "`casting` must be one of"),
    ]


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
@pytest.mark.parametrize("function", ["rms_norm", "LigerRMSNormFunction"])
def test_bad_input_raises_before_launch(lk, function, case, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("reached the kernels with bad input")

    monkeypatch.setattr(module(lk), "norm_forward", no_launch)
    _, call, error, message = case
    fn = lk.rms_norm if function == "rms_norm" else lk.LigerRMSNormFunction.apply
    with pytest.raises(error, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's own warning (inf - inf) must not replace the clear error
        call(fn)
    assert "rms_norm" in str(info.value)


# ----------------------------------------------------------------------------------------------------------
# Autograd beyond first order: double backward, torch.func


@pytest.mark.parametrize("form", ["rms_norm", "Function"])
@pytest.mark.parametrize("casting", CASTINGS)
def test_double_backward_is_correct(lk, casting, form, backend_name):
    """create_graph=True: the gradients are differentiable, and their derivatives equal float64's."""
    offset = OFFSETS[casting]
    x, weight = make_inputs((4, 24), torch.float32, offset=offset)
    fn = lk.rms_norm if form == "rms_norm" else lk.LigerRMSNormFunction.apply
    x64, w64, ref = reference(x, weight, 1e-6, offset)
    d_out = torch.randn(4, 24, requires_grad=True)
    d_out64 = d_out.detach().double().requires_grad_()
    v_x, v_w = torch.randn(4, 24), torch.randn(24)

    def second_order(out, x, weight, d_out):
        d_x, d_w = torch.autograd.grad(out, (x, weight), d_out, create_graph=True)
        return torch.autograd.grad((d_x * v_x.to(d_x)).sum() + (d_w * v_w.to(d_w)).sum(), (x, weight, d_out))

    got = second_order(fn(x, weight, 1e-6, offset, casting), x, weight, d_out)
    want = second_order(ref, x64, w64, d_out64)
    for name, g, w in zip(("x", "weight", "d_out"), got, want):
        assert rel_err(g, w) < 1e-5, f"second derivative wrt {name}: {rel_err(g, w):.2e}"


def test_torch_func_grad_and_vmap(lk, backend_name):
    """rms_norm under torch.func runs its differentiable PyTorch form; the ctx-style Function is refused."""
    x, weight = make_inputs((3, 5, 24), torch.float32)
    x, weight = x.detach(), weight.detach()
    d_out = torch.randn(3, 5, 24)
    grads = torch.func.grad(lambda x, w: (lk.rms_norm(x, w) * d_out).sum(), argnums=(0, 1))(x, weight)
    x64, w64, ref = reference(x, weight, 1e-6, 0.0)
    want = torch.autograd.grad(ref, (x64, w64), d_out.double())
    for g, w in zip(grads, want):
        assert rel_err(g, w) < 1e-6
    batched = torch.func.vmap(lambda rows: lk.rms_norm(rows, weight))(x)
    assert rel_err(batched, ref) < 1e-6
    per_sample = torch.func.vmap(torch.func.grad(lambda row: lk.rms_norm(row, weight).sum()))(x[0])
    assert per_sample.shape == (5, 24) and torch.isfinite(per_sample).all()
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: lk.LigerRMSNormFunction.apply(x, weight).sum())(x)


# ----------------------------------------------------------------------------------------------------------
# The layer: parity with transformers' modules, the host check, kernelize

HIDDEN = 64
HOSTS = {  # transformers RMSNorm classes tagged "RMSNorm": (class, casting LigerRMSNorm serves it with)
    "llama": (LlamaRMSNorm, "llama"),
    "qwen2": (Qwen2RMSNorm, "llama"),
    "mistral": (MistralRMSNorm, "llama"),
    "deepseek_v4": (DeepseekV4RMSNorm, "gemma"),  # (weight * x_normed).to(input_dtype)
    "nemotron_h": (NemotronHRMSNorm, "gemma"),  # (weight.to(float32) * x_normed).to(input_dtype)
}


def make_host(cls, weight_dtype, eps=1e-5, hidden=HIDDEN):
    torch.manual_seed(1)
    host = cls(hidden, eps=eps)
    with torch.no_grad():
        host.weight.copy_(1.0 + 0.3 * torch.randn(hidden))
    return host.to(weight_dtype)


def run(module, x, d_out):
    x = x.detach().requires_grad_()
    out = module(x)
    return [out, *torch.autograd.grad(out, (x, module.weight), d_out)]


DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("x_dtype, weight_dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("host_name", sorted(HOSTS))
def test_layer_equals_host_bit_for_bit_on_the_pytorch_path(lk, host_name, x_dtype, weight_dtype):
    """The PyTorch path computes the host's own expression: outputs equal bit for bit; gradients no worse
    than the eager host's (1.5x, plus fp32 arithmetic slack) against float64."""
    cls, casting = HOSTS[host_name]
    host = make_host(cls, weight_dtype)
    fused = bind(lk.LigerRMSNorm, copy.deepcopy(host))
    x = torch.randn(3, 17, HIDDEN).mul(2).to(x_dtype)
    out_dtype, coarse = expected_dtypes(x_dtype, weight_dtype, casting)
    d_out = torch.randn(3, 17, HIDDEN).to(out_dtype)
    with backend("torch"):
        got = run(fused, x, d_out)
    want = run(host, x, d_out)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    x64, w64, ref = reference(
        x, host.weight, host.variance_epsilon, 0.0, x_dtype if casting == "llama" and not coarse else None
    )
    exact = [ref, *torch.autograd.grad(ref, (x64, w64), d_out.double())]
    for what, g, e, w in zip(("d_x", "d_weight"), got[1:], want[1:], exact[1:]):
        assert g.dtype == e.dtype
        bound = 1.5 * rel_err(e, w) + 4 * compute_eps(x_dtype)
        assert rel_err(g, w) <= bound, f"{host_name} {what}: {rel_err(g, w):.3e} > {bound:.3e}"


@pytest.mark.parametrize(
    "x_dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
    ids=str,
)
@pytest.mark.parametrize("host_name", ["llama", "qwen2", "deepseek_v4"])
def test_layer_parity_with_host_on_triton(lk, host_name, x_dtype, weight_dtype):
    """The Triton kernels bound to the host: output and both gradients no worse than the eager host's
    (1.5x, plus fp32 slack) against float64. (bf16 stores truncate in the interpreter; the GPU tests take
    bf16.)"""
    require_interpreted_triton()
    cls, casting = HOSTS[host_name]
    host = make_host(cls, weight_dtype)
    fused = bind(lk.LigerRMSNorm, copy.deepcopy(host))
    x = torch.randn(2, 9, HIDDEN).mul(2).to(x_dtype)
    out_dtype, coarse = expected_dtypes(x_dtype, weight_dtype, casting)
    d_out = torch.randn(2, 9, HIDDEN).to(out_dtype)
    with backend("triton"):
        got = run(fused, x, d_out)
    want = run(host, x, d_out)
    x64, w64, ref = reference(
        x, host.weight, host.variance_epsilon, 0.0, x_dtype if casting == "llama" and not coarse else None
    )
    exact = [ref, *torch.autograd.grad(ref, (x64, w64), d_out.double())]
    for what, g, e, w in zip(("out", "d_x", "d_weight"), got, want, exact):
        assert g.dtype == e.dtype
        bound = 1.5 * rel_err(e, w) + 4 * compute_eps(x_dtype)
        assert rel_err(g, w) <= bound, f"{host_name} {what}: {rel_err(g, w):.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma_casting_is_gemma_rms_norm(lk, dtype, backend_name):
    """casting="gemma", offset=1.0 is GemmaRMSNorm's math: bit for bit on the PyTorch path, within rounding
    of float64 on both."""
    torch.manual_seed(0)
    host = GemmaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        host.weight.normal_(0.0, 0.5)
    host = host.to(dtype)
    x = (torch.randn(4, 7, HIDDEN) * 2).to(dtype)
    if backend_name == "torch":
        assert torch.equal(lk.rms_norm(x, host.weight, host.eps, 1.0, "gemma"), host(x))
    x, weight = x.requires_grad_(), host.weight.detach().clone().requires_grad_()
    check_rms_norm(lk, x, weight, "gemma", 1.0, eps=host.eps, backend_name=backend_name)


@pytest.fixture
def declarations(lk):
    """Restores the layer's host registry after a test declares or classifies hosts."""
    saved = dict(lk._hosts._RMS_NORM_HOSTS)
    yield lk._hosts._RMS_NORM_HOSTS
    lk._hosts._RMS_NORM_HOSTS.clear()
    lk._hosts._RMS_NORM_HOSTS.update(saved)


def test_declared_host_is_served(lk, declarations):
    """A host declared with its casting (GemmaRMSNorm: gemma, offset 1, `eps`) is served exactly."""
    host = GemmaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        host.weight.normal_(0.0, 0.5)
    fused = bind(lk.LigerRMSNorm, copy.deepcopy(host))
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match="GemmaRMSNorm"):
        fused(x)
    lk.layers.declare_rms_norm_host(GemmaRMSNorm, casting="gemma", offset=1.0, eps_attribute="eps")
    with backend("torch"):
        assert torch.equal(fused(x), host(x))
    with pytest.raises(ValueError, match="`casting` must be one of"):
        lk.layers.declare_rms_norm_host(GemmaRMSNorm, casting="t5")
    with pytest.raises(TypeError, match="`host_class` must be a class"):
        lk.layers.declare_rms_norm_host(host)


def test_a_declared_host_parametrized_is_served_and_a_look_alike_is_not(lk, declarations):
    """parametrize makes the instance's class a subclass ("ParametrizedGemmaRMSNorm") that adds the weight's
    property and nothing else: the declaration holds for it (it was refused, asked to declare the generated class),
    with the parametrized weight. A user's subclass of that name that changes the host's math is read as any
    class (and refused)."""
    lk.layers.declare_rms_norm_host(GemmaRMSNorm, casting="gemma", offset=1.0, eps_attribute="eps")
    host = GemmaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        host.weight.normal_(0.0, 0.5)

    class Halved(nn.Module):
        def forward(self, weight):
            return 0.5 * weight

    torch.nn.utils.parametrize.register_parametrization(host, "weight", Halved())
    assert type(host).__name__ == "ParametrizedGemmaRMSNorm"
    x = torch.randn(3, HIDDEN)
    with backend("torch"):
        assert torch.equal(bind(lk.LigerRMSNorm, host)(x), type(host).forward(host, x))

    class ParametrizedGemmaRMSNorm(GemmaRMSNorm):  # the same name, another norm
        def _norm(self, x):
            return x

    with pytest.raises(ValueError, match="ParametrizedGemmaRMSNorm"):
        bind(lk.LigerRMSNorm, ParametrizedGemmaRMSNorm(HIDDEN))(x)
    # declared again (here wrongly: another offset), the parametrized host follows, as the host itself does
    lk.layers.declare_rms_norm_host(GemmaRMSNorm, casting="gemma", offset=0.0, eps_attribute="eps")
    with backend("torch"):
        want = lk.rms_norm(x, host.weight, host.eps, 0.0, "gemma")
        assert torch.equal(bind(lk.LigerRMSNorm, host)(x), want)
    # a parametrized host seen (and refused) before its class is declared is served once it is
    other = GemmaRMSNorm(HIDDEN, eps=1e-6)
    torch.nn.utils.parametrize.register_parametrization(other, "weight", Halved())
    del declarations[GemmaRMSNorm]
    with pytest.raises(ValueError, match="declare_rms_norm_host"):
        bind(lk.LigerRMSNorm, other)(x)
    lk.layers.declare_rms_norm_host(GemmaRMSNorm, casting="gemma", offset=1.0, eps_attribute="eps")
    with backend("torch"):
        assert torch.equal(bind(lk.LigerRMSNorm, other)(x), type(other).forward(other, x))


class BiasedRMSNorm(LlamaRMSNorm):
    def __init__(self, hidden, eps=1e-6):
        super().__init__(hidden, eps)
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, hidden_states):
        return super().forward(hidden_states) + self.bias


class DecoratedRMSNorm(LlamaRMSNorm):
    @torch.no_grad()
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _clamped(forward):
    @functools.wraps(forward)
    def clamped(self, hidden_states):
        return forward(self, hidden_states).clamp(-1.0, 1.0)

    return clamped


class WrappedRMSNorm(LlamaRMSNorm):
    """A wrapper assigned in the class body: no decorator line in the source, and inspect.getsource of the forward
    follows ``__wrapped__`` to LlamaRMSNorm's (it was served, without the clamp)."""

    forward = _clamped(LlamaRMSNorm.forward)


def sourceless_host():
    namespace = {"LlamaRMSNorm": LlamaRMSNorm, "torch": torch}
    exec(
        "class SourcelessRMSNorm(LlamaRMSNorm):\n    def forward(self, hidden_states):\n        return hidden_states",
        namespace,
    )  # noqa: S102
    return namespace["SourcelessRMSNorm"](HIDDEN)


REFUSED = {  # host, what the refusal says
    "gemma (1 + weight)": (lambda: GemmaRMSNorm(HIDDEN), "GemmaRMSNorm has a forward of another form"),
    "bias": (lambda: BiasedRMSNorm(HIDDEN), "BiasedRMSNorm has a forward of another form"),
    "t5 (weight-dtype cast)": (lambda: T5LayerNorm(HIDDEN), "T5LayerNorm has a forward of another form"),
    "decorated forward": (lambda: DecoratedRMSNorm(HIDDEN), "DecoratedRMSNorm has a wrapped forward"),
    "wrapper assigned": (lambda: WrappedRMSNorm(HIDDEN), "WrappedRMSNorm has a wrapped forward"),
    "no source": (sourceless_host, "SourcelessRMSNorm has a forward whose source cannot be read"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_layer_refuses_hosts_it_would_not_reproduce(lk, case, declarations):
    make, message = REFUSED[case]
    host = bind(lk.LigerRMSNorm, make())
    with pytest.raises(ValueError, match=message) as info:
        host(torch.randn(2, HIDDEN))
    assert "declare_rms_norm_host" in str(info.value) and "unmapped" in str(info.value)


class RenamedLlamaNorm(nn.Module):
    """The Llama form written differently: other names, a docstring, annotations, `eps` for the epsilon."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize."""
        original: torch.dtype = x.dtype
        x = x.to(torch.float32)
        ms = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(ms + self.eps)
        return self.weight * x.to(original)


class InheritedLlamaNorm(LlamaRMSNorm):
    pass


@pytest.mark.parametrize("cls", [RenamedLlamaNorm, InheritedLlamaNorm])
def test_layer_recognizes_the_llama_form_however_written(lk, cls, declarations):
    host = cls(HIDDEN, eps=0.05)
    with torch.no_grad():
        host.weight.normal_(1.0, 0.3)
    fused = bind(lk.LigerRMSNorm, copy.deepcopy(host))
    x = torch.randn(5, HIDDEN).bfloat16() * 0.2  # mean square ~0.04: the epsilon matters
    with backend("torch"):
        assert torch.equal(fused(x), host(x))
    eps_attribute = "eps" if cls is RenamedLlamaNorm else "variance_epsilon"
    assert declarations[cls][1:3] == (("llama", 0.0, eps_attribute, ""), False)  # (classified, not declared)


def test_every_transformers_rms_norm_is_recognized(lk, declarations):
    """The modules transformers tags "RMSNorm" (the ones its default mapping sends to LigerRMSNorm) that
    these tests import are served, not refused."""
    for cls, casting in HOSTS.values():
        assert lk.layers.rms_norm_host(cls)[:3] == (casting, 0.0, "variance_epsilon")
        assert getattr(cls, "kernel_layer_name", None) == "RMSNorm"


TINY_LLAMA = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_kernelize_maps_llama_norms_to_the_layer(lk, variant_root, mode, backend_name):
    """kernels loads and validates the layer and swaps it into every LlamaRMSNorm of a model; loss and
    gradients follow the eager model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    reference_model = copy.deepcopy(model)
    mapping = {"RMSNorm": {"cpu": {getattr(Mode, mode): LocalLayerRepository(variant_root, layer_name="LigerRMSNorm")}}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=getattr(Mode, mode), device="cpu")
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * 2 + 1
    assert {m.forward.__func__.__qualname__ for m in norms} == {"LigerRMSNorm.forward"}
    ids = torch.randint(0, 97, (2, 11))
    loss = model(input_ids=ids, labels=ids).loss
    ref_loss = reference_model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4


# ----------------------------------------------------------------------------------------------------------
# torch.compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graph_ops(explained):
    return [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("casting", CASTINGS)
def test_compiled_rms_norm_equals_eager_without_graph_break(lk, casting, backend_name, fresh_dynamo):
    x, weight = make_inputs((2, 7, 48), torch.float32, offset=OFFSETS[casting])
    f = lambda x, w: lk.rms_norm(x, w, 1e-5, OFFSETS[casting], casting)
    explained = torch._dynamo.explain(f)(x, weight)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert any(f"{lk.__name__}.rms_norm_forward" in op for op in graph_ops(explained)), graph_ops(explained)
    d_out = torch.randn(2, 7, 48)
    want = [f(x, weight), *torch.autograd.grad(f(x, weight), (x, weight), d_out)]
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x, weight)
    got = [out, *torch.autograd.grad(out, (x, weight), d_out)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.allclose(g, w, rtol=1e-6, atol=1e-6)


def test_compiled_layer_has_no_graph_break(lk, fresh_dynamo, declarations):
    """The host check runs while tracing (a class seen for the first time under compile) and leaves a
    constant: one graph, and compiled equals eager."""

    class FreshLlamaNorm(LlamaRMSNorm):
        pass

    host = bind(lk.LigerRMSNorm, FreshLlamaNorm(48))
    x = torch.randn(3, 5, 48, requires_grad=True)
    explained = torch._dynamo.explain(host)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert FreshLlamaNorm in declarations
    torch._dynamo.reset()
    compiled = torch.compile(host, fullgraph=True)
    assert torch.allclose(compiled(x), host(x), rtol=1e-6, atol=1e-6)


def test_compiled_function_apply_equals_eager(lk, fresh_dynamo):
    x, weight = make_inputs((4, 40), torch.float32)
    f = lambda x, w: lk.LigerRMSNormFunction.apply(x, w, 1e-6)
    d_out = torch.randn(4, 40)
    want = [f(x, weight), *torch.autograd.grad(f(x, weight), (x, weight), d_out)]
    out = torch.compile(f)(x, weight)
    got = [out, *torch.autograd.grad(out, (x, weight), d_out)]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6)


def test_export_uses_aten_ops_only(lk):
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32))

        def forward(self, x):
            return lk.rms_norm(x, self.weight, 1e-6)

    model = Norm()
    x = torch.randn(3, 32)
    program = torch.export.export(model, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any(lk.__name__ in t for t in targets), targets
    assert torch.allclose(program.module()(x), model(x))


# ----------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels at real sizes


@pytest.fixture
def cuda_auto(lk):
    with backend("auto"):
        assert module(lk)._use_triton(torch.empty(1, device="cuda"), torch.empty(1, device="cuda"))
        yield "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("shape", [(32768, 4096), (8192, 8192), (4, 70001)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_matches_float64_reference(lk, shape, casting, cuda_auto):
    torch.manual_seed(0)
    x, weight = make_inputs(shape, torch.bfloat16, device="cuda", offset=OFFSETS[casting])
    check_rms_norm(lk, x, weight, casting, OFFSETS[casting], backend_name=cuda_auto)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "x_dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
    ids=str,
)
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 70001), (20000, 128)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_other_dtypes(lk, shape, x_dtype, weight_dtype, cuda_auto):
    torch.manual_seed(0)
    x, weight = make_inputs(shape, x_dtype, weight_dtype, device="cuda")
    check_rms_norm(lk, x, weight, backend_name=cuda_auto)


@pytest.mark.gpu
def test_cuda_strided_rows(lk, cuda_auto):
    torch.manual_seed(0)
    x, weight = make_inputs((8, 1024, 4096), torch.bfloat16, device="cuda", strided="columns")
    check_rms_norm(lk, x, weight, backend_name=cuda_auto)


@pytest.mark.gpu
def test_cuda_weight_gradient_is_deterministic(lk, cuda_auto):
    x, weight = make_inputs((32768, 4096), torch.bfloat16, device="cuda")
    d_out = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
    first = torch.autograd.grad(lk.rms_norm(x, weight), (x, weight), d_out)
    second = torch.autograd.grad(lk.rms_norm(x, weight), (x, weight), d_out)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "x_dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)], ids=str
)
@pytest.mark.parametrize("host_name", ["llama", "deepseek_v4"])
def test_cuda_layer_parity_with_host(lk, host_name, x_dtype, weight_dtype, cuda_auto):
    cls, casting = HOSTS[host_name]
    host = make_host(cls, weight_dtype, hidden=4096).cuda()
    fused = bind(lk.LigerRMSNorm, copy.deepcopy(host))
    x = (torch.randn(4, 2048, 4096, device="cuda") * 2).to(x_dtype)
    out_dtype, coarse = expected_dtypes(x_dtype, weight_dtype, casting)
    d_out = torch.randn(4, 2048, 4096, device="cuda").to(out_dtype)
    got, want = run(fused, x, d_out), run(host, x, d_out)
    x64, w64, ref = reference(
        x, host.weight, host.variance_epsilon, 0.0, x_dtype if casting == "llama" and not coarse else None
    )
    exact = [ref, *torch.autograd.grad(ref, (x64, w64), d_out.double())]
    for what, g, e, w in zip(("out", "d_x", "d_weight"), got, want, exact):
        assert g.dtype == e.dtype
        bound = 1.5 * rel_err(e, w) + 4 * compute_eps(x_dtype)
        assert rel_err(g, w) <= bound, f"{host_name} {what}: {rel_err(g, w):.3e} > {bound:.3e}"


@pytest.mark.gpu
def test_cuda_compiled_equals_eager(lk, cuda_auto, fresh_dynamo):
    x, weight = make_inputs((4096, 4096), torch.bfloat16, device="cuda")
    f = lambda x, w: lk.rms_norm(x, w, 1e-6)
    explained = torch._dynamo.explain(f)(x, weight)
    assert explained.graph_break_count == 0, explained.break_reasons
    d_out = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    want = [f(x, weight), *torch.autograd.grad(f(x, weight), (x, weight), d_out)]
    out = torch.compile(f, fullgraph=True)(x, weight)
    got = [out, *torch.autograd.grad(out, (x, weight), d_out)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
def test_cuda_double_backward(lk, cuda_auto):
    x, weight = make_inputs((64, 4096), torch.float32, device="cuda")
    d_out = torch.randn(64, 4096, device="cuda")
    x64, w64, ref = reference(x, weight, 1e-6, 0.0)
    v = torch.randn(64, 4096, device="cuda")
    (d_x,) = torch.autograd.grad(lk.rms_norm(x, weight), (x,), d_out, create_graph=True)
    got = torch.autograd.grad((d_x * v).sum(), (x, weight))
    (d_x64,) = torch.autograd.grad(ref, (x64,), d_out.double(), create_graph=True)
    want = torch.autograd.grad((d_x64 * v.double()).sum(), (x64, w64))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_a_weight_that_is_a_view_is_read_through_its_layout(lk, layout, backend_name):
    """A column of a packed tensor (stride 2) or a scalar gain expanded to [H] (stride 0), both gradients
    flowing back to the base: the Triton kernels read the weight element after element, so such a weight is
    copied first (it was read as if contiguous: relative error 0.4 for the column, and a read past the end of
    the scalar's storage)."""
    torch.manual_seed(0)
    x = torch.randn(6, HIDDEN, requires_grad=True)
    base = (torch.randn(HIDDEN, 2) * 0.3 + 1) if layout == "strided" else torch.tensor([1.5])
    weight = base.requires_grad_()[:, 0] if layout == "strided" else base.requires_grad_().expand(HIDDEN)
    check_rms_norm(lk, x, weight, backend_name=backend_name)
    check_rms_norm(lk, x, weight, "gemma", 1.0, backend_name=backend_name)
