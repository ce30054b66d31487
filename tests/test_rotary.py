"""Rotary position embedding: ``liger_rotary_pos_emb`` and the kernelize layer ``liger_rotary_pos_emb_layer``
against transformers' own ``apply_rotary_pos_emb``, on both backends, in every layout transformers produces."""

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama

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

# transformers' function as the modeling file defines it (the class forward, so a kernelized instance does
# not change the reference); ``self`` is unused.
FUNC = modeling_llama.apply_rotary_pos_emb


def transformers_rope(q, k, cos, sin, unsqueeze_dim=1):
    if isinstance(FUNC, torch.nn.Module):  # transformers >= 5.22 makes the tagged function a module
        return type(FUNC).forward(None, q, k, cos, sin, unsqueeze_dim)
    return FUNC(q, k, cos, sin, unsqueeze_dim)  # earlier releases: the plain function


def gpt_oss_rope(q, k, cos, sin, unsqueeze_dim=1):
    return type(modeling_gpt_oss.apply_rotary_pos_emb).forward(None, q, k, cos, sin, unsqueeze_dim)


# ----------------------------------------------------------------------------------------------------------
# Inputs. q/k come in the layouts transformers' attention modules hand over; cos/sin are [B or 1, S, D] as the
# rotary embedding modules return them (duplicated halves), or free angles per column ("free").

LAYOUTS = {  # name -> unsqueeze_dim
    "bshd_transposed": 1,  # q_proj(x).view(B, S, H, D).transpose(1, 2): the Llama path
    "bhsd": 1,  # contiguous [B, H, S, D]
    "fused_qkv": 1,  # qkv.view(B, S, nq + 2 nk, D) sliced, then transposed
    "partial_rotary": 1,  # q[..., :rotary_dim] of a wider head (Phi, GLM, ...)
    "bshd": 2,  # [B, S, H, D] with unsqueeze_dim=2
    "fused_qkv_bshd": 2,  # slices of the fused projection, not transposed
}


def make_qk(layout, batch, seq, n_q, n_k, dim, dtype, device="cpu"):
    """(q, k, leaves): q/k in `layout`, views of the returned leaves (which require grad)."""

    def leaf(*shape):
        return torch.randn(*shape, device=device).to(dtype).requires_grad_()

    if layout in ("bshd_transposed", "bshd"):
        q, k = leaf(batch, seq, n_q, dim), leaf(batch, seq, n_k, dim)
        leaves = (q, k)
        if layout == "bshd_transposed":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k, leaves
    if layout == "bhsd":
        q, k = leaf(batch, n_q, seq, dim), leaf(batch, n_k, seq, dim)
        return q, k, (q, k)
    if layout == "partial_rotary":
        q_full, k_full = leaf(batch, n_q, seq, dim + 6), leaf(batch, n_k, seq, dim + 6)
        return q_full[..., :dim], k_full[..., :dim], (q_full, k_full)
    qkv = leaf(batch, seq, n_q + 2 * n_k, dim)
    q, k = qkv[:, :, :n_q], qkv[:, :, n_q : n_q + n_k]
    if layout == "fused_qkv":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q, k, (qkv,)


def make_cos_sin(batch, seq, dim, dtype, device="cpu", free=False, half=False, base=10000.0):
    """[batch, seq, dim] (or dim/2 with half) cos/sin of the standard RoPE angles at random positions."""
    if free:
        angles = torch.rand(batch, seq, dim // 2 if half else dim, dtype=torch.float64, device=device) * 6.3
    else:
        inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
        positions = torch.randint(0, 4096, (batch, seq), device=device).double()
        angles = positions[..., None] * inv_freq
        if not half:
            angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_case(layout, dtype, batch=2, seq=5, n_q=4, n_k=2, dim=16, cos_batch=None, device="cpu", **cos_kwargs):
    q, k, leaves = make_qk(layout, batch, seq, n_q, n_k, dim, dtype, device)
    cos, sin = make_cos_sin(batch if cos_batch is None else cos_batch, seq, dim, dtype, device, **cos_kwargs)
    return q, k, cos, sin, LAYOUTS[layout], leaves


def grads(outputs, inputs, d_outs):
    return torch.autograd.grad(outputs, inputs, d_outs)


def as64(*tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def run_both(lk, q, k, cos, sin, unsqueeze_dim, reference=transformers_rope):
    """(ours, reference in float64): each (q_embed, k_embed, d_q, d_k), same random output gradients."""
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    q64, k64, cos64, sin64 = as64(q, k, cos, sin)
    ref_q, ref_k = reference(q64, k64, cos64, sin64, unsqueeze_dim)
    d_q = torch.randn(ref_q.shape, dtype=torch.float64, device=q.device)
    d_k = torch.randn(ref_k.shape, dtype=torch.float64, device=q.device)
    ours = (q_embed, k_embed, *grads((q_embed, k_embed), (q, k), (d_q.to(q_embed.dtype), d_k.to(k_embed.dtype))))
    ref = (
        ref_q,
        ref_k,
        *grads((ref_q, ref_k), (q64, k64), (d_q.to(q_embed.dtype).double(), d_k.to(k_embed.dtype).double())),
    )
    return ours, ref


NAMES = ("q_embed", "k_embed", "d_q", "d_k")


# ----------------------------------------------------------------------------------------------------------
# Exactness and accuracy


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cos_batch", [None, 1], ids=["cos_per_batch", "cos_batch_1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_pytorch_path_equals_transformers_bit_for_bit(lk, layout, cos_batch, dtype):
    """In float64 (and float32, its own compute dtype) the PyTorch path performs transformers' operations
    (each product rounded, then the sum): values and gradients are identical, not merely close."""
    torch.manual_seed(0)
    with backend("torch"):
        q, k, cos, sin, dim, _ = make_case(layout, dtype, cos_batch=cos_batch)
        q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
        ref_q, ref_k = transformers_rope(q, k, cos, sin, dim)
        d_q, d_k = torch.randn_like(ref_q), torch.randn_like(ref_k)
        got = (q_embed, k_embed, *grads((q_embed, k_embed), (q, k), (d_q, d_k)))
        want = (ref_q, ref_k, *grads((ref_q, ref_k), (q, k), (d_q, d_k)))
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert torch.equal(g, w), name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_triton_float32_equals_transformers(lk, layout):
    """The Triton kernels through the interpreter, in float32. numpy rounds each product and the sum as
    PyTorch does, so the interpreted kernel equals transformers' float32 bit for bit; compiled Triton may
    fuse into FMAs, which test_gpu-marked cases below bound against float64 instead."""
    if not INTERPRETED:
        pytest.skip("exactness is a property of the interpreter's arithmetic")
    torch.manual_seed(1)
    with backend("triton"):
        q, k, cos, sin, dim, _ = make_case(layout, torch.float32, cos_batch=1 if layout == "bhsd" else None)
        q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
        d_q, d_k = torch.randn_like(q_embed), torch.randn_like(k_embed)
        got = (q_embed, k_embed, *grads((q_embed, k_embed), (q, k), (d_q, d_k)))
    ref_q, ref_k = transformers_rope(q, k, cos, sin, dim)
    want = (ref_q, ref_k, *grads((ref_q, ref_k), (q, k), (d_q, d_k)))
    for name, g, w in zip(NAMES, got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["bshd_transposed", "fused_qkv", "bshd"])
def test_matches_float64_reference(lk, layout, dtype, backend_name):
    """One rounding of the fp32 result: within 1.5x the error of rounding the exact result once."""
    torch.manual_seed(2)
    q, k, cos, sin, dim, _ = make_case(layout, dtype, batch=2, seq=6, n_q=4, n_k=2, dim=32)
    ours, ref = run_both(lk, q, k, cos, sin, dim)
    truncate = truncates_bf16(backend_name)
    for name, got, want in zip(NAMES, ours, ref):
        assert got.dtype == dtype
        assert_close_to_rounding(got, want, dtype, truncate, what=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_more_accurate_than_transformers_in_half_precision(lk, dtype):
    """transformers computes in the input dtype (three roundings in bf16/fp16); we compute in fp32 and round
    once. Our error is within 1.5x the rounding floor and below transformers' own."""
    torch.manual_seed(3)
    with backend("torch"):
        q, k, cos, sin, dim, _ = make_case("bshd_transposed", dtype, batch=2, seq=64, n_q=8, n_k=2, dim=64)
        ours, ref = run_both(lk, q, k, cos, sin, dim)
        theirs = transformers_rope(q, k, cos, sin, dim)
    for name, got, mine, want in zip(NAMES[:2], theirs, ours, ref):
        floor = rel_err(quantize(want, dtype), want)
        ours_err, theirs_err = rel_err(mine, want), rel_err(got, want)
        assert ours_err <= 1.5 * floor + 4 * compute_eps(dtype), name
        assert ours_err < theirs_err, f"{name}: ours {ours_err:.3e}, transformers {theirs_err:.3e}"


@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.float64], ids=str)
def test_mixed_dtypes_promote_like_transformers(lk, cos_dtype, backend_name):
    """bf16 q/k with fp32 cos/sin (autocast hands these over): the result has transformers' promoted dtype
    and values; the gradients come back in bf16."""
    if backend_name == "triton" and cos_dtype == torch.float64:
        pytest.skip("float64 runs the PyTorch path; forcing Triton on it is an error (test_backend)")
    torch.manual_seed(4)
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", torch.bfloat16)
    cos, sin = make_cos_sin(2, 5, 16, cos_dtype)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    ref_q, ref_k = transformers_rope(q, k, cos, sin, dim)
    assert q_embed.dtype == k_embed.dtype == ref_q.dtype == cos_dtype
    assert torch.equal(q_embed, ref_q) and torch.equal(k_embed, ref_k)
    d_q, d_k = grads((q_embed, k_embed), (q, k), (torch.randn_like(q_embed), torch.randn_like(k_embed)))
    assert d_q.dtype == d_k.dtype == torch.bfloat16


def test_half_width_cos_sin_is_gpt_oss_form(lk, backend_name):
    """cos/sin of width D/2 stand for both halves: gpt-oss tags its function with the same kernel name."""
    torch.manual_seed(5)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", dtype, half=True)
    ours, ref = run_both(lk, q, k, cos, sin, dim, reference=gpt_oss_rope)
    for name, got, want in zip(NAMES, ours, ref):
        if dtype == torch.float64:
            assert torch.equal(got, want), name
        else:
            assert_faithful(got, want, dtype, what=name)


def test_cos_sin_halves_need_not_match(lk, backend_name):
    """transformers' formula holds for any cos/sin, not only duplicated halves: the backward is the transposed
    map, which is a rotation by -sin only when the halves agree."""
    torch.manual_seed(6)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("fused_qkv", dtype, free=True)
    ours, ref = run_both(lk, q, k, cos, sin, dim)
    for name, got, want in zip(NAMES, ours, ref):
        assert_faithful(got, want, dtype, what=name)


def test_pixtral_unsqueeze_dim_0(lk, backend_name):
    """Pixtral passes cos/sin of shape [S, D] with unsqueeze_dim=0 for q of shape [B, H, S, D]."""
    torch.manual_seed(7)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, _ = make_qk("bshd_transposed", 3, 7, 4, 4, 8, dtype)
    cos, sin = make_cos_sin(1, 7, 8, dtype)
    ours, ref = run_both(lk, q, k, cos[0], sin[0], 0)
    for name, got, want in zip(NAMES, ours, ref):
        assert_faithful(got, want, dtype, what=name)


@pytest.mark.parametrize("n_q, n_k", [(8, 1), (6, 3), (2, 2), (1, 4)])
def test_grouped_query_heads(lk, n_q, n_k, backend_name):
    torch.manual_seed(8)
    dtype = torch.float32
    q, k, cos, sin, dim, _ = make_case("fused_qkv", dtype, n_q=n_q, n_k=n_k, cos_batch=1)
    ours, ref = run_both(lk, q, k, cos, sin, dim)
    for name, got, want in zip(NAMES, ours, ref):
        assert got.shape == want.shape
        assert_faithful(got, want, dtype, what=name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    n_q=st.integers(1, 5),
    n_k=st.integers(1, 3),
    half_dim=st.integers(1, 20),
    cos_batch_1=st.booleans(),
    half=st.booleans(),
    free=st.booleans(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    name=st.sampled_from(["torch", "triton"] if INTERPRETED else ["torch"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_shapes_layouts_dtypes(
    lk, layout, batch, seq, n_q, n_k, half_dim, cos_batch_1, half, free, dtype, name, seed
):
    """Random shapes, layouts, GQA ratios, cos/sin forms (shared batch, half width, free halves), dtypes."""
    torch.manual_seed(seed)
    with backend(name), poisoned_outputs(lk):
        cos_batch = 1 if cos_batch_1 else None
        # Free halves make the map non-orthogonal, so outputs can cancel: a tiny fp32 tensor may then err by
        # more than the size-independent bound. In bf16/fp16 the products are exact in fp32, so they can.
        free = free and dtype != torch.float32
        q, k, cos, sin, dim, _ = make_case(
            layout, dtype, batch, seq, n_q, n_k, 2 * half_dim, cos_batch=cos_batch, half=half, free=free
        )
        ours, ref = run_both(lk, q, k, cos, sin, dim, reference=gpt_oss_rope if half else transformers_rope)
    for what, got, want in zip(NAMES, ours, ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert_faithful(got, want, dtype, what=what)


# ----------------------------------------------------------------------------------------------------------
# Memory: inputs read in place, outputs fresh, nothing the caller holds written


class KernelRecorder:
    """Stands in for the Triton kernel object: records the tensors of each launch, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append([a for a in args if isinstance(a, torch.Tensor)])
            return self.kernel[grid](*args, **kwargs)

        return launch


def require_interpreter():
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter")


@pytest.mark.parametrize("layout", ["fused_qkv", "fused_qkv_bshd", "partial_rotary", "bshd_transposed"])
def test_strided_inputs_reach_the_kernel_uncopied(lk, layout, monkeypatch):
    """q/k slices of a fused qkv projection (and the other views) are read where they are: the kernel gets
    the caller's q, k, cos and sin, and one launch serves both q and k, forward and backward alike."""
    require_interpreter()
    recorder = KernelRecorder(lk.rotary._rotary_kernel)
    monkeypatch.setattr(lk.rotary, "_rotary_kernel", recorder)
    with backend("triton"):
        q, k, cos, sin, dim, _ = make_case(layout, torch.float32, cos_batch=1)
        q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
        d_q, d_k = torch.randn_like(q_embed).transpose(1, 2).contiguous().transpose(1, 2), torch.randn_like(k_embed)
        grads((q_embed, k_embed), (q, k), (d_q, d_k))
    assert len(recorder.launches) == 2
    forward, backward = recorder.launches
    assert [t.data_ptr() for t in forward[:2]] == [q.data_ptr(), k.data_ptr()]
    assert [t.data_ptr() for t in forward[4:]] == [cos.data_ptr(), sin.data_ptr()]
    assert [t.data_ptr() for t in forward[2:4]] == [q_embed.data_ptr(), k_embed.data_ptr()]
    assert [t.data_ptr() for t in backward[:2]] == [d_q.data_ptr(), d_k.data_ptr()]


def test_launch_plans_are_per_layout_and_bounded(lk, monkeypatch):
    """Plans are cached by shapes and strides: one layout after another (each checked against float64) never
    reuses another's plan, and the cache stays within MAX_PLANS."""
    monkeypatch.setattr(lk.rotary, "_PLANS", {})
    monkeypatch.setattr(lk.rotary, "MAX_PLANS", 2)
    with backend("triton"):
        for layout in ("bshd_transposed", "fused_qkv", "bshd", "bshd_transposed"):
            q, k, cos, sin, dim, _ = make_case(layout, torch.float32, batch=2, seq=5, n_q=4, n_k=2, dim=16)
            ours, ref = run_both(lk, q, k, cos, sin, dim)
            for name, got, want in zip(NAMES, ours, ref):
                assert rel_err(got, want) < 1e-6, (layout, name)
            assert 1 <= len(lk.rotary._PLANS) <= 2


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_outputs_are_fresh_and_inputs_untouched(lk, layout, backend_name):
    """Callers may read q, k, cos, sin and the output gradients after the call and after backward."""
    torch.manual_seed(9)
    q, k, cos, sin, dim, leaves = make_case(layout, torch.float32)
    before = [t.detach().clone() for t in (*leaves, cos, sin)]
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    d_q, d_k = torch.randn_like(q_embed), torch.randn_like(k_embed)
    d_before = (d_q.clone(), d_k.clone())
    g = grads((q_embed, k_embed), leaves, (d_q, d_k))
    for t, b in zip((*leaves, cos, sin), before):
        assert torch.equal(t.detach(), b)
    assert torch.equal(d_q, d_before[0]) and torch.equal(d_k, d_before[1])
    inputs = {t.untyped_storage().data_ptr() for t in (*leaves, cos, sin, d_q, d_k)}
    for out in (q_embed, k_embed, *g):
        assert out.untyped_storage().data_ptr() not in inputs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_outputs_are_dense_in_the_inputs_memory_order(lk, layout, backend_name):
    """The strides transformers' elementwise result has: dense, ordered like q's (and k's)."""
    q, k, cos, sin, dim, _ = make_case(layout, torch.float32)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    ref_q, ref_k = transformers_rope(q, k, cos, sin, dim)
    assert q_embed.stride() == ref_q.stride() and k_embed.stride() == ref_k.stride()


def test_backward_saves_only_cos_and_sin(lk, backend_name):
    """The map is linear in q and k: the graph keeps cos and sin, not the (much larger) q and k."""
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", torch.float32, seq=64, dim=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    assert sum(t.numel() for t in saved) == 2 * cos.numel()


@pytest.mark.parametrize("shape", [(2, 0, 3, 8), (2, 5, 0, 8), (0, 5, 3, 8), (2, 5, 3, 0)])
def test_empty_inputs_launch_nothing(lk, shape, backend_name, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel ran for an empty input")

    monkeypatch.setattr(lk.rotary, "_launch_triton", no_launch)
    monkeypatch.setattr(lk.rotary, "_rotate_torch_into", no_launch)
    batch, seq, heads, dim = shape
    q = torch.randn(batch, seq, heads, dim).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, min(heads, 1), dim).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(batch, seq, dim), torch.randn(batch, seq, dim)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    d_q, d_k = grads((q_embed, k_embed), (q, k), (torch.randn(q.shape), torch.randn(k.shape)))
    assert d_q.shape == q.shape and d_k.shape == k.shape


def test_empty_q_with_nonempty_k(lk, backend_name):
    """Zero query heads: k is still rotated."""
    q, k, cos, sin, dim, _ = make_case("fused_qkv", torch.float32, n_q=0, n_k=2)
    ours, ref = run_both(lk, q, k, cos, sin, dim)
    assert ours[0].shape == ref[0].shape and ours[0].numel() == 0
    assert_faithful(ours[1], ref[1], torch.float32)
    assert_faithful(ours[3], ref[3], torch.float32)


def test_unused_output_gets_no_gradient(lk, backend_name):
    """Only q_embed reaches the loss: q's gradient is right and k gets none, as with transformers."""
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", dtype)
    q_embed, _ = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    q64, k64, cos64, sin64 = as64(q, k, cos, sin)
    ref_q, _ = transformers_rope(q64, k64, cos64, sin64, dim)
    d_out = torch.randn(q_embed.shape, dtype=torch.float64)
    d_q, d_k = torch.autograd.grad(q_embed, (q, k), d_out.to(dtype), allow_unused=True)
    ref_d_q, ref_d_k = torch.autograd.grad(ref_q, (q64, k64), d_out, allow_unused=True)
    assert d_k is None and ref_d_k is None
    assert_faithful(d_q, ref_d_q, dtype)


def test_layouts_the_kernel_does_not_take_run_the_pytorch_path(lk, monkeypatch):
    """Three strided head dims that cannot merge (a rank-5 q with cos shared along two of them): the kernel
    declines without launching and the PyTorch path gives the same result."""
    require_interpreter()
    recorder = KernelRecorder(lk.rotary._rotary_kernel)
    monkeypatch.setattr(lk.rotary, "_rotary_kernel", recorder)
    torch.manual_seed(10)
    base = torch.randn(3, 4, 5, 2, 8)
    q = base.permute(0, 2, 1, 3, 4)  # heads along dims 0, 1 and 3 (cos varies along none of them)
    cos, sin = make_cos_sin(1, 1, 8, torch.float32)
    cos, sin = cos.view(1, 1, 1, 1, 8), sin.view(1, 1, 1, 1, 8)
    with backend("triton"):
        q_embed, _ = lk.liger_rotary_pos_emb(q, q, cos[0, 0], sin[0, 0], 0)
    assert recorder.launches == []
    ref, _ = transformers_rope(q.double(), q.double(), cos[0, 0].double(), sin[0, 0].double(), 0)
    assert_faithful(q_embed, ref, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch


def bad_inputs():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    return [
        ("q list", lambda f: f(q.tolist(), k, cos, sin), TypeError, "`q` must be a torch.Tensor"),
        ("sin float", lambda f: f(q, k, cos, 0.5), TypeError, "`sin` must be a torch.Tensor"),
        ("integer", lambda f: f(q.long(), k.long(), cos, sin), TypeError, "`q` must be float16, bfloat16"),
        (
            "float8",
            lambda f: f(q, k, cos.to(torch.float8_e4m3fn), sin.to(torch.float8_e4m3fn)),
            TypeError,
            "`cos` must be float16",
        ),
        ("complex", lambda f: f(q.cfloat(), k.cfloat(), cos, sin), TypeError, "`q` must be float16"),
        ("q/k dtype", lambda f: f(q, k.double(), cos, sin), TypeError, "`q` and `k` must have the same dtype"),
        ("cos/sin dtype", lambda f: f(q, k, cos, sin.half()), TypeError, "`cos` and `sin` must have the same dtype"),
        ("device", lambda f: f(q, k.to("meta"), cos, sin), ValueError, "`k` must be on the device of `q`"),
        ("head dims", lambda f: f(q, torch.randn(2, 2, 5, 6), cos, sin), ValueError, "same head dim"),
        ("odd head dim", lambda f: f(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]), ValueError, "must be even"),
        ("ranks", lambda f: f(q, k[0], cos, sin), ValueError, "same number"),
        ("0-d", lambda f: f(torch.tensor(1.0), torch.tensor(1.0), cos, sin), ValueError, "same number"),
        ("cos/sin shapes", lambda f: f(q, k, cos, sin[:1]), ValueError, "`cos` and `sin` must have the same shape"),
        ("cos width", lambda f: f(q, k, cos[..., :6], sin[..., :6]), ValueError, "head dim 8 or half of it"),
        ("seq len", lambda f: f(q, k, cos[:, :4], sin[:, :4]), ValueError, "does not broadcast"),
        ("grows q", lambda f: f(q[:1], k[:1], cos, sin), ValueError, "does not broadcast"),
        ("wrong unsqueeze", lambda f: f(q, k, cos, sin, 2), ValueError, "does not broadcast"),
        ("unsqueeze range", lambda f: f(q, k, cos, sin, 4), ValueError, "`unsqueeze_dim` must be in"),
        ("unsqueeze bool", lambda f: f(q, k, cos, sin, True), TypeError, "`unsqueeze_dim` must be an int"),
        ("unsqueeze float", lambda f: f(q, k, cos, sin, 1.0), TypeError, "`unsqueeze_dim` must be an int"),
    ]


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(lk, case, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("reached the kernels with bad input")

    for name in ("rotary_forward", "_composite"):
        monkeypatch.setattr(lk.rotary, name, no_launch)
    _, call, error, message = case
    with pytest.raises(error, match=message) as info:
        call(lk.liger_rotary_pos_emb)
    assert "liger_rotary_pos_emb" in str(info.value)


# ----------------------------------------------------------------------------------------------------------
# Autograd: gradcheck, cos/sin gradients, double backward, torch.func


def test_gradcheck_float64(lk):
    torch.manual_seed(11)
    with backend("torch"):
        _, _, cos, sin, dim, (qkv,) = make_case("fused_qkv", torch.float64, batch=1, seq=3, n_q=2, n_k=1, dim=4)

        def fn(qkv):
            q, k = qkv[:, :, :2].transpose(1, 2), qkv[:, :, 2:3].transpose(1, 2)
            return lk.liger_rotary_pos_emb(q, k, cos, sin, dim)

        assert torch.autograd.gradcheck(fn, (qkv,))
        assert torch.autograd.gradgradcheck(fn, (qkv,))


def test_transposed_map_is_the_adjoint(lk, backend_name):
    """<rope(x), y> == <x, rope_backward(y)> for the Triton and PyTorch backward alike (fp32)."""
    torch.manual_seed(12)
    q, k, cos, sin, dim, _ = make_case("fused_qkv", torch.float32, free=True)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    y_q, y_k = torch.randn_like(q_embed), torch.randn_like(k_embed)
    d_q, d_k = grads((q_embed, k_embed), (q, k), (y_q, y_k))
    lhs = (q_embed.double() * y_q.double()).sum() + (k_embed.double() * y_k.double()).sum()
    rhs = (q.double() * d_q.double()).sum() + (k.double() * d_k.double()).sum()
    assert abs((lhs - rhs).item()) <= 1e-5 * (abs(lhs.item()) + 1)


@pytest.mark.parametrize("which", ["cos", "sin", "both"])
def test_cos_sin_that_require_grad_get_gradients(lk, which, backend_name):
    """cos/sin requiring grad (a learned or differentiated frequency): the differentiable composite runs, and
    every input gets transformers' gradient."""
    torch.manual_seed(13)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", dtype, cos_batch=1)
    cos.requires_grad_(which in ("cos", "both"))
    sin.requires_grad_(which in ("sin", "both"))
    leaves = [t for t in (q, k, cos, sin) if t.requires_grad]
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    refs64 = as64(q, k, cos, sin)
    ref_q, ref_k = transformers_rope(*refs64, dim)
    d_q, d_k = torch.randn_like(q_embed), torch.randn_like(k_embed)
    got = grads((q_embed, k_embed), leaves, (d_q, d_k))
    want = grads((ref_q, ref_k), [t for t in refs64 if t.requires_grad], (d_q.double(), d_k.double()))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert_faithful(g, w, dtype)


def test_cos_sin_gradcheck(lk):
    torch.manual_seed(14)
    with backend("torch"):
        q, k, cos, sin, dim, _ = make_case("bshd", torch.float64, batch=1, seq=3, n_q=2, n_k=1, dim=4)
        inputs = (q.detach().requires_grad_(), k.detach().requires_grad_(), cos.requires_grad_(), sin.requires_grad_())
        fn = lambda q, k, c, s: lk.liger_rotary_pos_emb(q, k, c, s, dim)
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_double_backward_is_correct(lk, backend_name):
    """create_graph=True: the gradients are built from differentiable ops, so differentiating them again (with
    respect to the output gradients) gives transformers' answer."""
    torch.manual_seed(15)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("fused_qkv", dtype)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
    d_q = torch.randn_like(q_embed, requires_grad=True)
    d_k = torch.randn_like(k_embed, requires_grad=True)
    g_q, g_k = torch.autograd.grad((q_embed, k_embed), (q, k), (d_q, d_k), create_graph=True)
    v_q, v_k = torch.randn_like(g_q), torch.randn_like(g_k)
    got = torch.autograd.grad((g_q * v_q).sum() + (g_k * v_k).sum(), (d_q, d_k))
    ref_q, ref_k = transformers_rope(q, k, cos, sin, dim)
    r_q, r_k = torch.autograd.grad((ref_q, ref_k), (q, k), (d_q, d_k), create_graph=True)
    want = torch.autograd.grad((r_q * v_q).sum() + (r_k * v_k).sum(), (d_q, d_k))
    for g, w in zip(got, want):
        assert_faithful(g, w.double(), dtype)


def test_torch_func_grad_and_vmap(lk, backend_name):
    """torch.func runs the differentiable composite (the kernels cannot see through functorch wrappers)."""
    torch.manual_seed(16)
    dtype = torch.float64 if backend_name == "torch" else torch.float32
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", dtype)
    q, k = q.detach(), k.detach()
    weight = torch.randn(q.shape, dtype=dtype)

    def loss(fn, q):
        return (fn(q, k, cos, sin, dim)[0] * weight).sum()

    got = torch.func.grad(lambda q: loss(lk.liger_rotary_pos_emb, q))(q)
    want = torch.func.grad(lambda q: loss(transformers_rope, q))(q)
    assert_faithful(got, want.double(), dtype)
    stacked = torch.stack([q, 2 * q])
    got = torch.func.vmap(lambda q: lk.liger_rotary_pos_emb(q, k, cos, sin, dim))(stacked)
    want = torch.func.vmap(lambda q: transformers_rope(q, k, cos, sin, dim))(stacked)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert_faithful(g, w.double(), dtype)


# ----------------------------------------------------------------------------------------------------------
# torch.compile and export


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def attention_like(lk, qkv, cos, sin, n_q=4, n_k=2):
    """What an attention module does around the call: fused projection slices, the rope, a reduction."""
    q, k = qkv[:, :, :n_q].transpose(1, 2), qkv[:, :, n_q : n_q + n_k].transpose(1, 2)
    q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin)
    return (q_embed * 1.5).sum(dim=1), k_embed.square().sum()


def test_compile_has_no_graph_break_and_equals_eager(lk, backend_name, fresh_dynamo):
    torch.manual_seed(17)
    qkv = torch.randn(2, 5, 8, 16, requires_grad=True)
    cos, sin = make_cos_sin(2, 5, 16, torch.float32)
    fn = lambda qkv: attention_like(lk, qkv, cos, sin)
    explained = torch._dynamo.explain(fn)(qkv)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any(f"{lk.__name__}.rotary_forward" in op for op in ops), ops
    torch._dynamo.reset()
    want = fn(qkv)
    want_grad = grads(want, qkv, (torch.ones_like(want[0]), torch.ones_like(want[1])))
    got = torch.compile(fn)(qkv)
    got_grad = grads(got, qkv, (torch.ones_like(got[0]), torch.ones_like(got[1])))
    for g, w in zip((*got, *got_grad), (*want, *want_grad)):
        assert rel_err(g, w) < 1e-6


def test_export_uses_the_composite(lk, fresh_dynamo):
    """An exported program holds aten ops only, so it loads without this package."""
    torch.manual_seed(18)
    cos, sin = make_cos_sin(2, 5, 16, torch.float32)

    class Module(torch.nn.Module):
        def forward(self, qkv):
            return attention_like(lk, qkv, cos, sin)

    qkv = torch.randn(2, 5, 8, 16)
    program = torch.export.export(Module(), (qkv,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any(lk.__name__ in t for t in targets), targets
    for got, want in zip(program.module()(qkv), Module()(qkv)):
        assert rel_err(got, want) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# The layer, for kernels.kernelize


def test_exports(lk):
    assert lk.liger_rotary_pos_emb is lk.rotary.liger_rotary_pos_emb is lk.layers.liger_rotary_pos_emb
    assert lk.liger_rotary_pos_emb_layer is lk.layers.liger_rotary_pos_emb_layer
    assert lk.liger_rotary_pos_emb.can_torch_compile and lk.liger_rotary_pos_emb.has_backward


def test_layer_passes_kernels_validation_for_transformers_function(lk):
    """kernels' checks for replacing the module transformers makes of apply_rotary_pos_emb: a stateless
    nn.Module whose forward takes the same arguments."""
    from kernels.layer.layer import _validate_layer

    layer = lk.layers.liger_rotary_pos_emb_layer
    _validate_layer(check_cls=type(FUNC), cls=layer, repo="liger_rotary_pos_emb_layer")
    assert layer.can_torch_compile and layer.has_backward


@pytest.fixture
def restore_llama_rope():
    yield
    FUNC.__dict__.pop("forward", None)  # kernelize binds the layer's forward onto the shared module instance


@pytest.mark.parametrize("mode", ["TRAINING", "INFERENCE", "TRAINING_COMPILE"])
def test_kernelize_llama_rotary(lk, variant_root, mode, restore_llama_rope):
    """kernelize maps transformers' "rotary_pos_emb" to the layer: a float64 Llama computes the same loss
    and gradients bit for bit (the PyTorch path does transformers' float64 arithmetic)."""
    flag = {
        "TRAINING": Mode.TRAINING,
        "INFERENCE": Mode.INFERENCE,
        "TRAINING_COMPILE": Mode.TRAINING | Mode.TORCH_COMPILE,
    }[mode]
    repo = LocalLayerRepository(variant_root, layer_name="liger_rotary_pos_emb_layer")
    mapping = {"rotary_pos_emb": {"cpu": {flag: repo}}}
    torch.manual_seed(19)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 97, (2, 19))
    want = model(input_ids=ids, labels=ids).loss
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model.train() if "TRAINING" in mode else model.eval(), mode=flag, device="cpu")
    bound = FUNC.__dict__.get("forward")
    assert isinstance(bound, types.MethodType) and bound.__func__ is lk.layers.liger_rotary_pos_emb_layer.forward
    got = model(input_ids=ids, labels=ids).loss
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_kernelized_llama_traces_without_graph_break(lk, variant_root, restore_llama_rope, fresh_dynamo):
    """Mode.TRAINING | Mode.TORCH_COMPILE: the whole model is one graph with the rotary op in it."""
    flag = Mode.TRAINING | Mode.TORCH_COMPILE
    mapping = {
        "rotary_pos_emb": {"cpu": {flag: LocalLayerRepository(variant_root, layer_name="liger_rotary_pos_emb_layer")}}
    }
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model.train(), mode=flag, device="cpu")
    ids = torch.randint(0, 97, (2, 19))
    explained = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids).loss)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum(f"{lk.__name__}.rotary_forward" in op for op in ops) == config.num_hidden_layers


# ----------------------------------------------------------------------------------------------------------
# GPU: compiled Triton at Llama-3-8B attention shapes (skipped without a GPU)

LLAMA_8B = {"batch": 1, "seq": 8192, "n_q": 32, "n_k": 8, "dim": 128}


@pytest.fixture
def cuda_auto(lk):
    with backend("auto"):
        assert lk.rotary.use_triton(torch.empty(1, device="cuda"))
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd_transposed", "fused_qkv", "bhsd", "bshd"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_llama_8b_against_float64(lk, dtype, layout, cuda_auto):
    """Values and gradients within 1.5x the rounding floor of float64, and (bf16/fp16) within 1.5x of
    transformers' own error in the same dtype."""
    torch.manual_seed(20)
    q, k, cos, sin, dim, _ = make_case(layout, dtype, device="cuda", **LLAMA_8B)
    ours, ref = run_both(lk, q, k, cos, sin, dim)
    with torch.no_grad():
        theirs_out = transformers_rope(q, k, cos, sin, dim)
    for name, got, want in zip(NAMES, ours, ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert_close_to_rounding(got, want, dtype, what=name)
    if dtype != torch.float32:
        for name, got, theirs, want in zip(NAMES[:2], ours, theirs_out, ref):
            assert rel_err(got, want) <= 1.5 * rel_err(theirs, want), name
    del ours, ref, theirs_out
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_cuda_fused_qkv_allocates_only_the_outputs(lk, cuda_auto):
    """Reading the fused projection in place: the forward's peak extra memory is q_embed and k_embed."""
    q, k, cos, sin, dim, _ = make_case("fused_qkv", torch.bfloat16, device="cuda", **LLAMA_8B)
    with torch.no_grad():
        lk.liger_rotary_pos_emb(q, k, cos, sin, dim)  # compile the kernel first
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        q_embed, k_embed = lk.liger_rotary_pos_emb(q, k, cos, sin, dim)
        torch.cuda.synchronize()
    outputs = (q_embed.numel() + k_embed.numel()) * q_embed.element_size()
    assert torch.cuda.max_memory_allocated() - before <= outputs + 2**20


@pytest.mark.gpu
def test_cuda_compiled_equals_eager(lk, cuda_auto, fresh_dynamo):
    torch.manual_seed(21)
    qkv = torch.randn(1, 2048, 48, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = make_cos_sin(1, 2048, 128, torch.bfloat16, device="cuda")
    fn = lambda qkv: attention_like(lk, qkv, cos, sin, n_q=32, n_k=8)
    want = fn(qkv)
    want_grad = grads(want, qkv, (torch.ones_like(want[0]), torch.ones_like(want[1])))
    got = torch.compile(fn)(qkv)
    got_grad = grads(got, qkv, (torch.ones_like(got[0]), torch.ones_like(got[1])))
    for g, w in zip((*got, *got_grad), (*want, *want_grad)):
        assert rel_err(g, w) < 1e-2


# Tagged "rotary_pos_emb" functions of other forms than Llama's, the layer bound to each (as kernelize binds it):
# model -> (cos/sin half width, what the layer must do)
HOST_FORMS = {
    "olmo2": (False, "served"),  # the result cast back to q's and k's dtypes
    "modernbert": (False, "served"),  # in fp32, cast back to q's dtype
    "hunyuan_vl": (False, "served"),  # the same, with cos and sin in fp32 too
    "nanochat": (False, "served"),  # rotate_half the other way: the rotation by -sin
    "gpt_oss": (True, "served"),  # half-width cos and sin
    "openai_privacy_filter": (False, "refused"),  # interleaved pairs
}


@pytest.mark.parametrize("model", sorted(HOST_FORMS))
def test_the_layer_computes_the_form_of_the_function_it_is_bound_to(lk, model, backend_name):
    """The layer reads the function it replaces: bound to another form than Llama's it computes that form, with
    that function's result dtype, or refuses it (it computed Llama's for every host: NanoChat's rotation came out
    reversed, OLMo's fp32 where the host's is bf16, the interleaved pairs of the privacy filter scrambled)."""
    import importlib

    function = importlib.import_module(f"transformers.models.{model}.modeling_{model}").apply_rotary_pos_emb
    half, expected = HOST_FORMS[model]

    def host(*args):
        return type(function).forward(function, *args)

    def layer(*args):
        return lk.liger_rotary_pos_emb_layer.forward(function, *args)

    torch.manual_seed(7)
    q, k, cos, sin, dim, _ = make_case("bshd_transposed", torch.float32, half=half)
    if expected == "refused":
        with pytest.raises(ValueError, match="modeling_openai_privacy_filter.apply_rotary_pos_emb cannot be served"):
            layer(q, k, cos, sin, dim)
        return
    q64, k64, cos64, sin64 = (t.detach().double().requires_grad_() for t in (q, k, cos, sin))
    q, k = q.requires_grad_(), k.requires_grad_()
    got, want = layer(q, k, cos, sin, dim), host(q64, k64, cos64, sin64, dim)
    d_outs = [torch.randn_like(t) for t in got]
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and rel_err(g, w) < 1e-6
    for g, w in zip(grads(got, (q, k), d_outs), grads(want, (q64, k64), [d.double() for d in d_outs])):
        assert rel_err(g, w) < 1e-6
    low = [t.detach().bfloat16() for t in (q, k)]  # bf16 queries with fp32 cos/sin (autocast over an fp32 model)
    assert [t.dtype for t in layer(*low, cos, sin, dim)] == [t.dtype for t in host(*low, cos, sin, dim)]


def test_a_module_class_tagged_rotary_is_refused_by_name(lk):
    """A module class of the user's own tagged "rotary_pos_emb" (not kernels' module of a function): the layer
    cannot read what it computes and says so, naming itself and the class."""

    class ApplyRotary(torch.nn.Module):
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            return transformers_rope(q, k, cos, sin, unsqueeze_dim)

    q, k, cos, sin, dim, _ = make_case("bshd_transposed", torch.float32)
    with pytest.raises(ValueError, match="liger_rotary_pos_emb_layer .* its class .*ApplyRotary is no function"):
        lk.liger_rotary_pos_emb_layer.forward(ApplyRotary(), q, k, cos, sin, dim)
