"""liger_fused_linear_cross_entropy against float64 PyTorch on every option, both backends (the Triton kernels
through the interpreter on CPU), its autograd contract, bad input, and its memory: the N x V logits never
exist. GPU-marked tests run it at Llama-3 size against a chunked fp32 reference."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from harness import FLCE_CASES as CASES
from harness import (
    INTERPRETED,
    ROOT,
    backend,
    linear64,
    make_inputs,
    quantize,
    reference_loss,
    reference_z_loss,
    rel_err,
    truncates_bf16,
)

REDUCTIONS = ("mean", "sum", "none")
# fp32 arithmetic summed over H and over the rows of a chunk: 16 ulps in norm. A wrong term errs by >= 1e-3.
FP32_BOUND = 16 * torch.finfo(torch.float32).eps
FP64_BOUND = 1e-12
N, H, V = 13, 8, 50


@pytest.fixture
def small_chunks(lk, monkeypatch):
    """Five rows per chunk, so that every small case runs several chunks (and a short last one)."""
    monkeypatch.setattr(lk.fused_linear_cross_entropy, "chunk_rows", lambda n, *args: max(1, min(5, n)))


def incoming_gradient(loss, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(loss.shape, generator=generator, dtype=torch.float64) + 0.5).to(loss.dtype)


def check_against_reference(lk, x, weight, bias, target, ce_weight, options, reduction, bound):
    """Loss and the gradients of x, weight, bias against float64, for a random incoming gradient."""
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, ce_weight, reduction=reduction, **options)
    x64, w64, b64, logits = linear64(x, weight, bias)
    want = reference_loss(logits, target, reduction, ce_weight, **options)
    assert loss.dtype == torch.promote_types(x.dtype, torch.float32) and loss.shape == want.shape
    d_loss = incoming_gradient(loss)
    leaves = [t for t in (x, weight, bias) if t is not None]
    got_grads = torch.autograd.grad(loss, leaves, d_loss)
    want_grads = torch.autograd.grad(want, [t for t in (x64, w64, b64) if t is not None], d_loss.double())
    assert rel_err(loss, want) <= bound, f"loss: {rel_err(loss, want):.3e}"
    for name, got, ref, leaf in zip(("x", "weight", "bias"), got_grads, want_grads, leaves):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert rel_err(got, ref) <= bound, f"grad {name}: {rel_err(got, ref):.3e}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(lk, case, reduction, backend_name, small_chunks):
    x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, case=case)
    check_against_reference(lk, x, weight, bias, target, ce_weight, options, reduction, FP32_BOUND)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_float64_inputs(lk, case, reduction, small_chunks):
    """fp64 runs the PyTorch path in fp64 (whatever the backend setting would pick for other dtypes)."""
    x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, torch.float64, case=case)
    check_against_reference(lk, x, weight, bias, target, ce_weight, options, reduction, FP64_BOUND)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_kernels_loop_over_vocabulary_blocks(lk, reduction, monkeypatch, small_chunks):
    """Vocabulary blocks of 16 columns: 50 classes take four blocks, the last one partial."""
    if not INTERPRETED:
        pytest.skip("runs the Triton kernels on CPU tensors through the interpreter")
    monkeypatch.setattr(lk.cross_entropy, "MAX_BLOCK", 16)
    with backend("triton"):
        x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, case="everything")
        check_against_reference(lk, x, weight, bias, target, ce_weight, options, reduction, FP32_BOUND)


def eager_bf16(x, weight, target, reduction="mean"):
    logits = x @ weight.T
    return F.cross_entropy(logits.float(), target, reduction=reduction)


def test_weight_gradient_slabs_only_where_a_conversion_follows(lk, monkeypatch):
    """The accumulator is split only when it is converted at the end: not for fp32 weights under bf16 autocast
    (the fp32 sums are the returned gradient), nor when accum_dtype is the weight's; and slabs of 8 rows or
    more start on multiples of 8 rows."""
    flce = lk.fused_linear_cross_entropy
    monkeypatch.setattr(flce, "SLAB_BYTES", 21 * 32 * 4)
    x, w = torch.randn(4, 32), torch.randn(96, 32, dtype=torch.bfloat16)
    needs = (True, True, False)
    assert len(flce._accumulators(x, w, torch.float32, torch.bfloat16, None, needs, "cpu")[1]) == 1
    assert len(flce._accumulators(x, w, torch.bfloat16, torch.bfloat16, torch.bfloat16, needs, "cpu")[1]) == 1
    slabs = flce._accumulators(x, w, torch.bfloat16, torch.bfloat16, None, needs, "cpu")[1]
    assert [start for start, _ in slabs] == [0, 16, 32, 48, 64, 80] and sum(t.shape[0] for _, t in slabs) == 96


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("slab_rows", [None, 7])
def test_bfloat16_no_worse_than_eager(lk, backend_name, reduction, slab_rows, monkeypatch):
    """bf16 logits as eager PyTorch has them, the cross-entropy in fp32: loss and gradients within 1.5x the
    error of eager bf16 ``F.cross_entropy((x @ W.T).float(), target)``, both measured against float64. With
    ``slab_rows``, the fp32 weight-gradient accumulator is held in slabs of that many vocabulary rows (the last
    one short), as large vocabularies hold it; "none" recomputes the chunks in backward."""
    if slab_rows is not None:  # (slabs forced: this test's chunks hold the converted gradient)
        monkeypatch.setattr(lk.fused_linear_cross_entropy, "SLAB_BYTES", slab_rows * 32 * 4)
        monkeypatch.setattr(lk.fused_linear_cross_entropy, "_one_accumulator", lambda *args: False)
    torch.manual_seed(0)
    x, weight, _, target, _, _ = make_inputs(64, 32, 96, torch.bfloat16)
    summed = (lambda t: t.sum()) if reduction == "none" else (lambda t: t)
    loss = summed(lk.liger_fused_linear_cross_entropy(x, weight, target, reduction=reduction))
    grads = torch.autograd.grad(loss, (x, weight))
    eager = summed(eager_bf16(x, weight, target, reduction))
    eager_grads = torch.autograd.grad(eager, (x, weight))
    x64, w64, _, logits = linear64(x, weight, None)
    want = summed(reference_loss(logits, target, reduction))
    want_grads = torch.autograd.grad(want, (x64, w64))
    slack = 2.0 if backend_name == "triton" and INTERPRETED else 1.0  # the interpreter truncates bf16 stores
    for what, got, ref, base in (("loss", loss, want, eager), *zip(("x", "weight"), grads, want_grads, eager_grads)):
        bound = 1.5 * slack * rel_err(base, ref) + 4 * torch.finfo(torch.float32).eps
        assert rel_err(got, ref) <= bound, f"{what}: {rel_err(got, ref):.3e} > {bound:.3e}"
        assert got.dtype == (torch.float32 if what == "loss" else torch.bfloat16)


def _counting_accumulators(flce, monkeypatch) -> list:
    """How many pieces each weight-gradient accumulator is made of, as ``_accumulators`` makes them (the
    conversion empties the list of pieces later)."""
    made, original = [], flce._accumulators

    def counted(*args):
        accumulators = original(*args)
        made.extend([] if accumulators[1] is None else [len(accumulators[1])])
        return accumulators

    monkeypatch.setattr(flce, "_accumulators", counted)
    return made


def test_one_accumulator_only_where_the_conversion_costs_no_memory(lk):
    """One weight-gradient accumulator (not slabs) where the chunk buffer holds the converted gradient, so that
    converting it at once holds no more than the loop did: Llama-3's head in bf16; not for few tokens, nor for
    Gemma's 256k vocabulary at H 3072 (chunks smaller than the gradient). cuBLAS sums fp32 only for bf16/fp16
    operands (PyTorch's out_dtype takes no others)."""
    flce = lk.fused_linear_cross_entropy
    one = flce._one_accumulator
    bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64
    assert one(32768, 4096, 128256, bf16, True, bf16)
    assert not one(16, 4096, 128256, bf16, True, bf16)
    assert not one(32768, 3072, 256000, bf16, True, bf16)
    assert not one(0, 4096, 128256, bf16, True, bf16)
    assert one(4096, 64, 1000, fp32, False, bf16)
    cublas = flce._cublas_sums_in_fp32
    assert cublas(fp32, "cuda", bf16) == cublas(fp32, "cuda", torch.float16) == (torch.version.cuda is not None)
    assert not cublas(fp32, "cuda", fp64) and not cublas(fp64, "cuda", bf16) and not cublas(fp32, "cpu", bf16)


class _LargestUpcast(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements one dtype-changing copy (``Tensor.to``) made during the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype:
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize(
    "autocast, accum_dtype",
    [(False, None), (False, torch.float64), (True, None)],
    ids=["bf16", "fp64 sums", "autocast"],
)
def test_upcast_sums_copy_a_slab_at_a_time(lk, backend_name, autocast, accum_dtype, monkeypatch):
    """Where the weight-gradient sums upcast the chunk's gradient (here, on the CPU: bf16 operands into fp32 or
    fp64 sums; fp32 weights under bf16 autocast, whose fp32 sums are one accumulator of all V rows), it is
    upcast at most a slab of rows at a time, never the whole chunk; the gradients stay within 1.5x eager's
    error against float64."""
    flce = lk.fused_linear_cross_entropy
    monkeypatch.setattr(flce, "SLAB_BYTES", 16 * 32 * 8)  # 16 rows of fp64 sums, 32 of fp32
    monkeypatch.setattr(flce, "chunk_rows", lambda n, *args: max(1, min(40, n)))
    torch.manual_seed(2)
    x, weight, _, target, _, _ = make_inputs(64, 32, 96, torch.bfloat16)
    if autocast:
        weight = weight.detach().float().requires_grad_()
    mode, accumulate = _LargestUpcast(), flce._accumulate

    def watched(*args):  # the sums' copies only (the PyTorch path's cross-entropy computes in fp32 anyway)
        with mode:
            return accumulate(*args)

    monkeypatch.setattr(flce, "_accumulate", watched)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target, accum_dtype=accum_dtype)
    grads = torch.autograd.grad(loss, (x, weight))
    rows = 16 if accum_dtype == torch.float64 else 32
    assert 0 < mode.largest <= max(rows * 40, 40 * 32)  # a slab's rows of the 40-row chunk (or x's rows)
    eager_grads = torch.autograd.grad(eager_bf16(x, weight.bfloat16(), target), (x, weight))
    x64, w64, _, logits = linear64(x, weight, None)
    want_grads = torch.autograd.grad(reference_loss(logits, target), (x64, w64))
    slack = 2.0 if backend_name == "triton" and INTERPRETED else 1.0  # the interpreter truncates bf16 stores
    for what, got, ref, base in zip(("x", "weight"), grads, want_grads, eager_grads):
        bound = 1.5 * slack * rel_err(base, ref) + 4 * torch.finfo(torch.float32).eps
        assert got.dtype == weight.dtype if what == "weight" else torch.bfloat16
        assert rel_err(got, ref) <= bound, f"{what}: {rel_err(got, ref):.3e} > {bound:.3e}"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("one", [False, True], ids=["slabs", "one accumulator"])
def test_weight_gradient_over_chunks_and_slabs(lk, backend_name, reduction, one, monkeypatch):
    """Several chunks (the first one's GEMMs write the unzeroed, poisoned accumulator, the others add into it),
    the fp32 accumulator in slabs (each converted, then joined) or in one piece (converted at once; forced
    here, as 5-row chunks are smaller than the gradient): every gradient within 1.5x eager bf16's error against
    float64."""
    flce = lk.fused_linear_cross_entropy
    monkeypatch.setattr(flce, "SLAB_BYTES", 7 * 32 * 4)
    monkeypatch.setattr(flce, "chunk_rows", lambda n, *args: max(1, min(5, n)))
    monkeypatch.setattr(flce, "_one_accumulator", lambda *args: one)
    made = _counting_accumulators(flce, monkeypatch)
    torch.manual_seed(1)
    x, weight, _, target, _, _ = make_inputs(64, 32, 96, torch.bfloat16)
    summed = (lambda t: t.sum()) if reduction == "none" else (lambda t: t)
    grads = torch.autograd.grad(summed(lk.liger_fused_linear_cross_entropy(x, weight, target, reduction=reduction)),
                                (x, weight))  # fmt: skip
    assert made == [1 if one else 14]  # the weight's accumulator, made once (in forward, or for "none" in backward)
    eager_grads = torch.autograd.grad(summed(eager_bf16(x, weight, target, reduction)), (x, weight))
    x64, w64, _, logits = linear64(x, weight, None)
    want_grads = torch.autograd.grad(summed(reference_loss(logits, target, reduction)), (x64, w64))
    slack = 2.0 if backend_name == "triton" and INTERPRETED else 1.0  # the interpreter truncates bf16 stores
    for what, got, ref, base in zip(("x", "weight"), grads, want_grads, eager_grads):
        bound = 1.5 * slack * rel_err(base, ref) + 4 * torch.finfo(torch.float32).eps
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape and got.is_contiguous()
        assert rel_err(got, ref) <= bound, f"{what}: {rel_err(got, ref):.3e} > {bound:.3e}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_batch_matches_pytorch(lk, reduction, backend_name):
    """Nothing to average: "mean" is nan like F.cross_entropy (0/0), "sum" 0; the gradients are zero."""
    x, weight, bias, target, _, _ = make_inputs(6, H, V, case="bias")
    target[:] = -100
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, reduction=reduction, lse_square_scale=0.1)
    grads = torch.autograd.grad(loss, (x, weight, bias), torch.ones_like(loss))
    x64, w64, b64, logits = linear64(x, weight, bias)
    want = F.cross_entropy(logits, target, reduction=reduction)
    want_grads = torch.autograd.grad(want, (x64, w64, b64), torch.ones_like(want))
    torch.testing.assert_close(loss.double(), want, equal_nan=True)
    for got, ref in zip(grads, want_grads):
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_token_accuracy_predicted_tokens_and_z_loss(lk, reduction, backend_name, small_chunks):
    x, weight, bias, target, _, _ = make_inputs(N, H, V, case="bias")
    target[1] = (x[1] @ weight.T + bias).argmax()  # at least one hit
    out = lk.liger_fused_linear_cross_entropy(
        x,
        weight,
        target,
        bias,
        reduction=reduction,
        lse_square_scale=0.05,
        return_z_loss=True,
        return_token_accuracy=True,
        return_predicted_tokens=True,
    )
    assert isinstance(out, lk.CrossEntropyOutput)
    _, _, _, logits = linear64(x, weight, bias)
    kept = target != -100
    predicted = torch.where(kept, logits.argmax(-1), -1)
    assert torch.equal(out.predicted_tokens, predicted) and out.predicted_tokens.dtype == torch.int64
    hits = ((predicted == target) & kept).float()
    want_accuracy = hits if reduction == "none" else hits.sum() / kept.sum()
    assert out.token_accuracy.dtype == torch.float32
    torch.testing.assert_close(out.token_accuracy, want_accuracy, rtol=1e-6, atol=0)
    want_z = reference_z_loss(logits, target, reduction, lse_square_scale=0.05)
    assert rel_err(out.z_loss, want_z) <= FP32_BOUND
    assert rel_err(out.loss, reference_loss(logits, target, reduction, lse_square_scale=0.05)) <= FP32_BOUND
    for extra in (out.z_loss, out.token_accuracy, out.predicted_tokens):
        assert not extra.requires_grad, "only the loss is differentiable"


def test_return_convention(lk):
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    assert isinstance(loss, torch.Tensor) and loss.shape == ()
    out = lk.liger_fused_linear_cross_entropy(x, weight, target, return_token_accuracy=True)
    assert isinstance(out, lk.CrossEntropyOutput)
    assert out.z_loss is None and out.predicted_tokens is None and out.token_accuracy is not None
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=0)
    outputs = lk.LigerFusedLinearCrossEntropyFunction.apply(x, weight, target)
    assert len(outputs) == 4 and outputs[1:] == (None, None, None)
    torch.testing.assert_close(outputs[0], loss, rtol=0, atol=0)
    outputs = lk.LigerFusedLinearCrossEntropyFunction.apply(
        x, weight, target, None, None, -100, 0.1, 0.0, "sum", None, True, None, False, True, True
    )
    assert all(t is not None for t in outputs) and outputs[3].shape == target.shape


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(lk, reduction):
    torch.manual_seed(0)
    x, weight, bias, target, ce_weight, options = make_inputs(5, 3, 7, torch.float64, case="everything", ignore_every=3)
    options["softcap"] = 2.5
    del options["use_token_scaling"]  # a stop-gradient by definition: finite differences see through it

    def fn(x, weight, bias):
        return lk.liger_fused_linear_cross_entropy(x, weight, target, bias, ce_weight, reduction=reduction, **options)

    assert torch.autograd.gradcheck(fn, (x, weight, bias))


def test_published_function_gradcheck(lk):
    x, weight, bias, target, ce_weight, _ = make_inputs(5, 3, 7, torch.float64, case="everything", ignore_every=3)
    apply = lk.LigerFusedLinearCrossEntropyFunction.apply
    assert torch.autograd.gradcheck(
        lambda x, w, b: apply(x, w, target, b, ce_weight, -100, 0.01, 0.1)[0], (x, weight, bias)
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_leaves_inputs_and_incoming_gradient_intact(lk, reduction, backend_name, small_chunks):
    x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, case="everything")
    before = [t.detach().clone() for t in (x, weight, bias, target, ce_weight)]
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, ce_weight, reduction=reduction, **options)
    d_loss = incoming_gradient(loss)
    d_before = d_loss.clone()
    loss.backward(d_loss)
    for t, b in zip((x, weight, bias, target, ce_weight, d_loss), (*before, d_before)):
        assert torch.equal(t.detach(), b)


def test_leading_dimensions_and_int32_targets(lk, backend_name):
    x, weight, bias, target, _, _ = make_inputs(12, H, V, case="bias")
    x3 = x.detach().view(3, 4, H).requires_grad_()
    loss = lk.liger_fused_linear_cross_entropy(x3, weight, target.view(3, 4).int(), bias, reduction="none")
    assert loss.shape == (3, 4)
    flat = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, reduction="none")
    torch.testing.assert_close(loss.view(-1), flat, rtol=0, atol=0)
    (d_x3,) = torch.autograd.grad(loss.sum(), x3)
    assert d_x3.shape == (3, 4, H)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_input(lk, reduction, backend_name):
    x, weight, _, target, _, _ = make_inputs(0, H, V)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, reduction=reduction)
    want = F.cross_entropy(torch.empty(0, V), target, reduction=reduction)
    torch.testing.assert_close(loss, want, equal_nan=True)
    if reduction != "none":
        d_x, d_w = torch.autograd.grad(loss, (x, weight))
        assert d_x.shape == (0, H) and torch.equal(d_w, torch.zeros_like(d_w))


def test_double_backward_raises(lk, backend_name):
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_backward_twice_through_a_retained_graph(lk):
    """Under a retained graph the gradients computed in forward are scaled out of place, so that a later backward
    finds them as forward left them, whatever the first incoming gradient was (0 and inf included) and whatever
    was done to a returned gradient; without it they are scaled in place and handed over."""
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    first = [g.clone() for g in torch.autograd.grad(loss, (x, weight), torch.tensor(2.0), retain_graph=True)]
    second = torch.autograd.grad(loss, (x, weight), torch.tensor(0.5), retain_graph=True)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, 4 * b, rtol=1e-6, atol=0)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    loss.backward()
    torch.testing.assert_close(weight.grad, first[1] / 2, rtol=1e-6, atol=0)
    weight.grad = None
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    loss.backward(retain_graph=True)
    lk.liger_fused_linear_cross_entropy(x, weight, target).backward()  # accumulates into weight.grad
    loss.backward()
    torch.testing.assert_close(weight.grad, 1.5 * first[1], rtol=1e-6, atol=0)
    for d_first in (0.0, float("inf"), float("nan")):
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
        handed = torch.autograd.grad(loss, (x, weight), torch.tensor(d_first), retain_graph=True)
        for g in handed:
            g.zero_()
        again = torch.autograd.grad(loss, (x, weight), torch.tensor(0.5))
        for a, b in zip(again, first):
            torch.testing.assert_close(a, b / 4, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_incoming_gradient_scales_each_gradient_once(lk, dtype, backend_name):
    """The gradients computed in forward are scaled by the fp32 incoming gradient and rounded once (on the
    Triton path by a kernel that reads it on the device and leaves the gradients as they are where it is 1)."""
    x, weight, bias, target, _, _ = make_inputs(N, H, 600, dtype=dtype, case="bias")  # weight: 2 kernel blocks
    unit = torch.autograd.grad(lk.liger_fused_linear_cross_entropy(x, weight, target, bias), (x, weight, bias))
    truncate = truncates_bf16(backend_name)
    for d_loss in (1.0, 0.37, -3.0, -0.0, float("inf"), float("nan")):
        for retain in (False, True):  # in place, and out of place
            loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias)
            got = torch.autograd.grad(loss, (x, weight, bias), torch.tensor(d_loss), retain_graph=retain)
            for g, u in zip(got, unit):
                want = quantize(u.float() * d_loss, dtype, truncate)
                assert torch.equal(g.isnan(), want.isnan()), (dtype, d_loss, retain)
                assert torch.equal(g.nan_to_num(), want.nan_to_num()), (dtype, d_loss, retain)


def test_compiled_autograd_scales_like_eager(lk, backend_name):
    """Compiled autograd traces the backward with PyTorch ops (its tracer cannot run a kernel launch)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    x, weight, bias, target, _, _ = make_inputs(N, H, V, case="bias")
    unit = torch.autograd.grad(lk.liger_fused_linear_cross_entropy(x, weight, target, bias), (x, weight, bias))
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias) * 0.37
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
    for leaf, u in zip((x, weight, bias), unit):
        torch.testing.assert_close(leaf.grad, u * 0.37, rtol=1e-6, atol=0)


def test_saved_tensor_hooks(lk):
    """Under saved-tensor hooks (here: offloading to the CPU) backward reads copies: scaled out of place."""
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    want = torch.autograd.grad(lk.liger_fused_linear_cross_entropy(x, weight, target), (x, weight))
    with torch.autograd.graph.save_on_cpu():
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    for d_loss in (3.0, 0.5):
        got = torch.autograd.grad(loss, (x, weight), torch.tensor(d_loss), retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, d_loss * w, rtol=1e-6, atol=0)


def test_reduction_none_backward_twice_recomputes(lk):
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, reduction="none")
    d_loss = incoming_gradient(loss)
    first = torch.autograd.grad(loss, (x, weight), d_loss, retain_graph=True)
    second = torch.autograd.grad(loss, (x, weight), d_loss)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_only_the_gradients_asked_for(lk, monkeypatch):
    """A frozen head (weight without grad) gets no weight-gradient accumulator; no grad at all: no GEMMs."""
    module = lk.fused_linear_cross_entropy
    calls = []
    real = module._accumulators
    monkeypatch.setattr(module, "_accumulators", lambda *a: calls.append(a[-2]) or real(*a))
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    lk.liger_fused_linear_cross_entropy(x, weight.detach(), target).backward()
    with torch.no_grad():
        lk.liger_fused_linear_cross_entropy(x, weight, target)
    assert calls == [(True, False, False), (False, False, False)]


def test_accum_dtype_and_autocast(lk, backend_name):
    x, weight, bias, target, _, _ = make_inputs(N, H, V, case="bias")
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, accum_dtype=torch.float64)
    grads = torch.autograd.grad(loss, (x, weight, bias))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    x64, w64, b64, logits = linear64(x, weight, bias)
    want_grads = torch.autograd.grad(reference_loss(logits, target), (x64, w64, b64))
    assert all(rel_err(g, w) <= FP32_BOUND for g, w in zip(grads, want_grads))
    # Under autocast the GEMMs run in bf16 as F.linear would; gradients come back in the fp32 parameters' dtype.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias)
        eager = F.cross_entropy(F.linear(x, weight, bias).float(), target)
    grads = torch.autograd.grad(loss, (x, weight, bias))
    eager_grads = torch.autograd.grad(eager, (x, weight, bias))
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    slack = 2.0 if backend_name == "triton" and INTERPRETED else 1.0
    for got, base, ref in zip((loss, *grads), (eager, *eager_grads), (reference_loss(logits, target), *want_grads)):
        assert rel_err(got, ref) <= 1.5 * slack * rel_err(base, ref) + 1e-6
    # fp64 inputs under autocast: autocast casts no float64 tensor, so F.linear computes in fp64 and so does the
    # loss (it ran its GEMMs in bf16: a loss off by 1e-4, gradients by 5e-3), the same as without autocast; the
    # gradients scaled by a non-unit incoming gradient (in PyTorch: the kernels take no fp64). An fp64 input beside
    # an fp32 weight is F.linear's dtype error, a TypeError here. (fp64 takes the PyTorch path on "auto"; a forced
    # Triton backend refuses it.)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    with backend("torch"):
        plain = lk.liger_fused_linear_cross_entropy(x64, w64, target)
        plain_grads = torch.autograd.grad(plain, (x64, w64), torch.tensor(0.37, dtype=torch.float64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lk.liger_fused_linear_cross_entropy(x64, w64, target)
            with pytest.raises(TypeError, match="same dtype"):
                lk.liger_fused_linear_cross_entropy(x64, weight, target)
        grads = torch.autograd.grad(loss, (x64, w64), torch.tensor(0.37, dtype=torch.float64))
    assert loss.dtype == torch.float64 and torch.equal(loss, plain)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain_grads))
    want = torch.autograd.grad(reference_loss(F.linear(x64, w64), target) * 0.37, (x64, w64))
    assert all(rel_err(g, w) <= 1e-12 for g, w in zip(grads, want))


def test_chunk_rows_rule(lk):
    rows = lk.fused_linear_cross_entropy.chunk_rows
    # Llama-3-8B head in bf16: 4H/2 = 8192 rows would be 2 GiB of logits; the 1 GiB cap gives 4096.
    assert rows(32768, 4096, 128256, torch.bfloat16, triton=True) == 4096
    assert rows(32768, 4096, 32000, torch.bfloat16, triton=True) == 8192  # = the fp32 accumulator's bytes
    assert rows(8192, 256, 131072, torch.float32, triton=False) == 256
    assert rows(8192, 256, 131072, torch.bfloat16, triton=False) == 256  # fp32 temporaries on the CPU
    assert rows(8192, 4, 100, torch.float32, triton=False) == 32  # at least 32 rows
    assert rows(7, 4096, 128256, torch.float32, triton=True) == 7
    assert rows(1000, 64, 2**31, torch.float32, triton=True) == 1  # never more than 1 GiB of logits


def test_compiled_equals_eager_without_graph_break(lk):
    torch._dynamo.reset()
    x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, case="everything")

    def fn(x, weight, bias):
        out = lk.liger_fused_linear_cross_entropy(
            x, weight, target, bias, ce_weight, return_token_accuracy=True, **options
        )
        return out.loss, out.token_accuracy

    explained = torch._dynamo.explain(fn)(x, weight, bias)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [str(node.target) for g in explained.graphs for node in g.graph.nodes if node.op == "call_function"]
    assert any(f"{lk.__name__}.flce_forward" in op for op in ops), ops
    for reduction in ("mean", "none"):
        torch._dynamo.reset()

        def loss_of(x, weight, bias, reduction=reduction):
            return lk.liger_fused_linear_cross_entropy(
                x, weight, target, bias, ce_weight, reduction=reduction, **options
            )

        loss = torch.compile(loss_of, backend="aot_eager")(x, weight, bias)
        want = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, ce_weight, reduction=reduction, **options)
        d_loss = incoming_gradient(loss)
        got = torch.autograd.grad(loss, (x, weight, bias), d_loss)
        ref = torch.autograd.grad(want, (x, weight, bias), d_loss)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def test_torch_func_grad(lk):
    """torch.func runs the plain PyTorch composite: the same gradients."""
    x, weight, bias, target, ce_weight, options = make_inputs(N, H, V, torch.float64, case="everything")

    def loss_of(weight):
        return lk.liger_fused_linear_cross_entropy(x.detach(), weight, target, bias.detach(), ce_weight, **options)

    got = torch.func.grad(loss_of)(weight.detach())
    (want,) = torch.autograd.grad(loss_of(weight), weight)
    assert rel_err(got, want) <= FP64_BOUND


def test_torch_func_transforms_over_plain_tensors(lk, backend_name):
    """A transformed function reading the loss of plain tensors (not the transform's own inputs) gets the PyTorch
    composite and the same loss, as F.cross_entropy would (PyTorch's apply refuses the eager Function under an
    active transform); the usual call with a dead torch.func wrapper as the target or the class weights (one
    that a transformed function let out: autograd's C++ apply must not see it) gets the loss and gradient."""
    x, weight, _, target, ce_weight, options = make_inputs(N, H, V, case="ce_weight")
    want = lk.liger_fused_linear_cross_entropy(x, weight, target, None, ce_weight)
    (want_grad,) = torch.autograd.grad(want, weight)
    kept = {}

    def scaled(s):
        kept["loss"] = lk.liger_fused_linear_cross_entropy(x, weight, target, None, ce_weight)
        kept["target"], kept["ce_weight"] = target + (s * 0).long(), ce_weight + s.detach() * 0
        return s * kept["loss"]

    got = torch.func.grad(scaled)(torch.tensor(2.0))
    assert rel_err(got, want) <= FP32_BOUND and rel_err(kept["loss"], want) <= FP32_BOUND
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    assert wrapped(kept["target"]) and wrapped(kept["ce_weight"])  # dead wrappers now
    dead = lk.liger_fused_linear_cross_entropy(x, weight, kept["target"], None, kept["ce_weight"])
    (grad,) = torch.autograd.grad(dead, weight)
    assert rel_err(dead, want) <= FP32_BOUND and rel_err(grad, want_grad) <= FP32_BOUND
    with torch.no_grad():  # the loss alone, no node
        dead = lk.liger_fused_linear_cross_entropy(x, weight, kept["target"], None, kept["ce_weight"])
    assert rel_err(dead, want) <= FP32_BOUND


def test_strided_and_broadcast_targets(lk, backend_name):
    """1-D targets that are a strided view or one broadcast value: read as the values they hold."""
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    _, _, _, logits = linear64(x, weight, None)
    wide = torch.stack([target, target.flip(0)], 1)
    for t in (wide[:, 0], wide[:, 1], target[3].expand(N)):
        assert not t.is_contiguous()
        loss = lk.liger_fused_linear_cross_entropy(x, weight, t)
        (grad,) = torch.autograd.grad(loss, x)
        x64 = x.detach().double().requires_grad_()
        want = reference_loss(x64 @ weight.detach().double().T, t.contiguous())
        (ref,) = torch.autograd.grad(want, x64)
        assert rel_err(loss, want) <= FP32_BOUND and rel_err(grad, ref) <= FP32_BOUND


def test_published_function_hands_out_z_loss_alone(lk, backend_name):
    """``return_z_loss`` alone (no accuracy asked): the z-loss comes back, and the loss with it."""
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    loss, z_loss, accuracy, pred = lk.LigerFusedLinearCrossEntropyFunction.apply(
        x, weight, target, None, None, -100, 0.01, 0.0, "mean", None, True
    )
    _, _, _, logits = linear64(x, weight, None)
    assert accuracy is None and pred is None
    assert rel_err(loss, reference_loss(logits, target, lse_square_scale=0.01)) <= FP32_BOUND
    assert rel_err(z_loss, reference_z_loss(logits, target, lse_square_scale=0.01)) <= FP32_BOUND


def bad_inputs():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    return [
        ("input", lambda f: f(x.tolist(), w, t), TypeError, "`input` must be a torch.Tensor"),
        ("input dtype", lambda f: f(x.long(), w, t), TypeError, "`input` must be float16"),
        ("float8", lambda f: f(x.to(torch.float8_e4m3fn), w, t), TypeError, "`input` must be float16"),
        ("0-d input", lambda f: f(torch.tensor(1.0), w, t), ValueError, "shape \\(\\*, H\\)"),
        ("weight shape", lambda f: f(x, torch.randn(10, 9), t), ValueError, "`weight` must have shape"),
        ("weight 1-d", lambda f: f(x, torch.randn(8), t), ValueError, "`weight` must have shape"),
        ("weight dtype", lambda f: f(x, w.double(), t), TypeError, "same dtype"),
        ("weight device", lambda f: f(x, w.to("meta"), t), ValueError, "same device"),
        ("target float", lambda f: f(x, w, t.float()), TypeError, "integer class indices"),
        ("target shape", lambda f: f(x, w, t[:3]), ValueError, "`target` must have shape"),
        ("target range", lambda f: f(x, w, t.clone().fill_(10)), ValueError, "in \\[0, 10\\)"),
        ("negative target", lambda f: f(x, w, t.clone().fill_(-1)), ValueError, "in \\[0, 10\\)"),
        ("bias shape", lambda f: f(x, w, t, torch.randn(9)), ValueError, "`bias` must have shape"),
        ("bias dtype", lambda f: f(x, w, t, torch.randn(10).double()), TypeError, "`bias` must have the dtype"),
        ("ce_weight shape", lambda f: f(x, w, t, None, torch.rand(3)), ValueError, "`ce_weight` must have shape"),
        ("ce_weight int", lambda f: f(x, w, t, None, torch.ones(10, dtype=torch.long)), TypeError, "`ce_weight`"),
        ("ignore_index", lambda f: f(x, w, t, None, None, 1.5), TypeError, "`ignore_index` must be an int"),
        ("label_smoothing", lambda f: f(x, w, t, None, None, -100, 0.0, 1.5), ValueError, "`label_smoothing`"),
        ("lse_square_scale", lambda f: f(x, w, t, None, None, -100, "0"), TypeError, "`lse_square_scale`"),
        *(  # floats that the options' fast check must not take
            (f"{value} {arg}", lambda f, args=args: f(x, w, t, None, None, -100, *args), TypeError, f"`{arg}`")
            for value in (float("inf"), float("-inf"), float("nan"))
            for arg, args in (("lse_square_scale", (value,)), ("label_smoothing", (0.0, value)))
        ),
        (
            "reduction",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "avg"),
            ValueError,
            "`reduction` must be one of",
        ),
        (
            "softcap",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", 0.0),
            ValueError,
            "`softcap` must be None or a finite positive",
        ),
        (
            "inf softcap",  # tanh(x / inf) * inf is nan: a silent nan loss otherwise
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", float("inf")),
            ValueError,
            "`softcap` must be None or a finite positive",
        ),
        (
            "huge int softcap",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", 10**400),
            ValueError,
            "`softcap` must be None or a finite positive",
        ),
        (
            "accum_dtype",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, torch.int32),
            TypeError,
            "`accum_dtype`",
        ),
        (
            "flag",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", None, 1),
            TypeError,
            "`return_z_loss` must be a bool",
        ),
        (
            "token scaling",
            lambda f: f(x, w, t, None, None, -100, 0.0, 0.0, "mean", None, False, None, "yes"),
            TypeError,
            "`use_token_scaling`",
        ),
    ]


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_before_launch(lk, case, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("reached the computation with bad input")

    monkeypatch.setattr(lk.fused_linear_cross_entropy, "forward_core", no_launch)
    _, call, error, message = case
    with pytest.raises(error, match=message):
        call(lk.liger_fused_linear_cross_entropy)
    with pytest.raises(error, match=message):
        call(lk.LigerFusedLinearCrossEntropyFunction.apply)


def test_ce_weight_requiring_grad_raises(lk):
    x, weight, _, target, _, _ = make_inputs(N, H, V)
    with pytest.raises(ValueError, match="`ce_weight` gets no gradient"):
        lk.liger_fused_linear_cross_entropy(x, weight, target, ce_weight=torch.rand(V, requires_grad=True))


def test_kernels_make_out_of_range_targets_nan(lk):
    """On a device the values are not checked (a synchronization): the kernels poison that row instead of
    reading outside the row."""
    if not INTERPRETED:
        pytest.skip("runs the Triton kernels on CPU tensors through the interpreter")
    ce = lk.cross_entropy
    logits = torch.randn(4, 20)
    target = torch.tensor([3, 20, -5, -100])
    with backend("triton"):
        lse, rows, _, pred = ce.row_stats(logits, target, None, None, ce.Options(), True)
        grad = ce.row_grad(logits, target, None, None, lse, torch.ones(1), torch.ones(1), ce.Options())
    assert torch.isfinite(rows[0]) and rows[1:3].isnan().all() and rows[3] == 0
    assert torch.isfinite(grad[0]).all() and grad[1:3].isnan().all() and torch.equal(grad[3], torch.zeros(20))
    assert pred[3] == -1


MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    import kernels, torch
    lk = kernels.get_local_kernel(Path(sys.argv[1]))
    torch.manual_seed(0)
    n, hidden, vocab = 8192, 256, 131072
    x = torch.randn(n, hidden)
    weight = (torch.randn(vocab, hidden) / 16).requires_grad_()
    target = torch.randint(0, vocab, (n,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(peak - base, loss.item(), weight.grad.norm().item())
    """
)


def test_cpu_peak_memory_stays_far_below_the_logits(variant_root):
    """N = 8192, H = 256, V = 131072 in fp32: the logits alone would take 4 GiB. The process's peak RSS
    grows by less than 1.5 GiB over its level after imports and inputs (the weight gradient takes 128 MiB).
    The weight requires grad, the input does not: the GEMMs whose memory matters (logits, weight gradient)."""
    env = dict(os.environ, LIGER_KERNELS_BACKEND="torch")
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(variant_root)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth, loss, grad_norm = (float(v) for v in result.stdout.split())
    assert growth < 1.5 * 2**30, f"peak RSS grew by {growth / 2**30:.2f} GiB"
    assert 11.0 < loss < 13.0 and grad_norm > 0  # ~ log(131072) = 11.8 for small random logits


# ----------------------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernels at realistic sizes.


def chunked_reference(x, weight, target, rows=2048):
    """Loss, d_x, d_weight of the mean cross-entropy of x @ weight.T, in fp32 from the (upcast) inputs, chunk by
    chunk: the reference for bf16 results (its own error is ~1e-6, theirs ~1e-3)."""
    count = (target != -100).sum()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    d_x = torch.empty_like(x, dtype=torch.float32)
    d_w = torch.zeros_like(weight, dtype=torch.float32)
    w = weight.detach().float()
    for start in range(0, x.shape[0], rows):
        xs = x.detach()[start : start + rows].float()
        logits = (xs @ w.T).requires_grad_()
        part = F.cross_entropy(logits, target[start : start + rows], reduction="sum") / count
        (d_logits,) = torch.autograd.grad(part, logits)
        loss += part.double()
        d_x[start : start + rows] = d_logits @ w
        d_w += d_logits.T @ xs
    return loss, d_x, d_w


@pytest.mark.gpu
def test_cuda_llama3_head_bf16_against_chunked_fp32_reference(lk):
    """N = 32768 tokens, H = 4096, V = 128256 in bf16 (the full logits would be 7.8 GiB): loss and gradients
    within 1.5x eager bf16's error against an fp32 reference, and the extra peak memory no more than what must
    coexist (see below)."""
    torch.manual_seed(0)
    n, hidden, vocab = 32768, 4096, 128256
    x = (torch.randn(n, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5 * 2).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n,), device="cuda")
    target[::7] = -100
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = lk.liger_fused_linear_cross_entropy(x, weight, target)
    d_x, d_w = torch.autograd.grad(loss, (x, weight))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # What must coexist at the peak (the fp32 weight-gradient sum being cast to bf16): the fp32 sum, its bf16
    # copy, the input gradient and one chunk of logits. The full logits alone would be 7.8 GiB.
    chunk = lk.fused_linear_cross_entropy.chunk_rows(n, hidden, vocab, torch.bfloat16, True)
    # (+ the per-row fp32 statistics and the allocator's rounding of each block to 2 MiB)
    bound = vocab * hidden * (4 + 2) + n * hidden * 2 + chunk * vocab * 2 + n * 4 * 4 + 8 * 2**21
    assert extra <= bound, f"extra peak {extra / 2**30:.2f} GiB > {bound / 2**30:.2f} GiB"
    ref = chunked_reference(x, weight, target)
    eager_loss = F.cross_entropy((x @ weight.T).float(), target)  # eager PyTorch: ~60 GiB at this size
    eager = (eager_loss, *torch.autograd.grad(eager_loss, (x, weight)))
    del eager_loss
    for what, got, want, base in zip(("loss", "d_x", "d_weight"), (loss, d_x, d_w), ref, eager):
        bound = 1.5 * rel_err(base, want) + 4 * torch.finfo(torch.float32).eps
        assert rel_err(got, want) <= bound, f"{what}: {rel_err(got, want):.3e} > {bound:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_every_option_against_float64(lk, case, reduction):
    """fp32 on the GPU (Triton kernels, cuBLAS GEMMs, several chunks and vocabulary blocks) against float64."""
    with backend("auto"):
        x, weight, bias, target, ce_weight, options = make_inputs(3000, 256, 9000, case=case, seed=0, device="cuda")
        assert lk._backend.use_triton(x)
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias, ce_weight, reduction=reduction, **options)
        x64, w64, b64, logits = linear64(x, weight, bias)
        want = reference_loss(logits, target, reduction, ce_weight, **options)
        d_loss = incoming_gradient(loss.cpu()).to("cuda")
        leaves = [t for t in (x, weight, bias) if t is not None]
        got = torch.autograd.grad(loss, leaves, d_loss)
        ref = torch.autograd.grad(want, [t for t in (x64, w64, b64) if t is not None], d_loss.double())
    # cuBLAS fp32 GEMMs may use TF32-free but differently ordered sums over H = 256 and 3000 rows
    bound = 64 * torch.finfo(torch.float32).eps
    assert rel_err(loss, want) <= bound
    assert all(rel_err(g, r) <= bound for g, r in zip(got, ref)), [rel_err(g, r) for g, r in zip(got, ref)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "accum_dtype, writes, pieces",
    [(None, True, 1), (None, False, 1), (torch.float64, True, 1)],
    ids=["fp32 sums written by the first GEMM", "fp32 sums zeroed, then added", "fp64 sums upcast by slabs"],
)
def test_cuda_weight_gradient_accumulators(lk, accum_dtype, writes, pieces, monkeypatch):
    """bf16 on the GPU over several chunks, one accumulator (the chunk buffer holds the converted gradient):
    cuBLAS's fp32 sums (its first GEMM writing them where this PyTorch can, else zeroed ones added into), and
    fp64 sums, the chunk's gradient upcast 1024 rows at a time; every gradient within 1.5x eager bf16's error
    against float64."""
    flce = lk.fused_linear_cross_entropy
    monkeypatch.setattr(flce, "SLAB_BYTES", 1024 * 256 * 8)  # fp64 sums upcast in 8 steps at V 8192
    monkeypatch.setattr(lk._grad_sums, "mm_widens", lambda device, into=False: writes or not into)
    made = _counting_accumulators(flce, monkeypatch)
    with backend("auto"):
        x, weight, _, target, _, _ = make_inputs(2048, 256, 8192, torch.bfloat16, seed=0, device="cuda")
        grads = torch.autograd.grad(lk.liger_fused_linear_cross_entropy(x, weight, target, accum_dtype=accum_dtype),
                                    (x, weight))  # fmt: skip
    assert made == [pieces]
    eager_grads = torch.autograd.grad(eager_bf16(x, weight, target), (x, weight))
    x64, w64, _, logits = linear64(x, weight, None)
    want_grads = torch.autograd.grad(reference_loss(logits, target), (x64, w64))
    for what, got, ref, base in zip(("x", "weight"), grads, want_grads, eager_grads):
        bound = 1.5 * rel_err(base, ref) + 4 * torch.finfo(torch.float32).eps
        assert got.dtype == torch.bfloat16 and rel_err(got, ref) <= bound, f"{what}: {rel_err(got, ref):.3e}"


@pytest.mark.gpu
def test_cuda_incoming_gradient_scaling(lk):
    """The compiled scale kernel in bf16: one rounding of the fp32 product, in place and (retained graph) out of
    place, over many kernel blocks; under compiled autograd PyTorch's multiply (d_loss rounded to bf16 first)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    with backend("auto"):
        x, weight, bias, target, _, _ = make_inputs(512, 256, 3000, torch.bfloat16, case="bias", seed=0, device="cuda")
        unit = torch.autograd.grad(lk.liger_fused_linear_cross_entropy(x, weight, target, bias), (x, weight, bias))
        for d_loss in (1.0, 0.37, float("nan")):
            for retain in (False, True):
                loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias)
                got = torch.autograd.grad(
                    loss, (x, weight, bias), torch.tensor(d_loss, device="cuda"), retain_graph=retain
                )
                for g, u in zip(got, unit):
                    want = (u.float() * d_loss).to(torch.bfloat16)
                    assert torch.equal(g.isnan(), want.isnan()) and torch.equal(g.nan_to_num(), want.nan_to_num())
        loss = lk.liger_fused_linear_cross_entropy(x, weight, target, bias) * 0.37
        for leaf in (x, weight, bias):
            leaf.grad = None
        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
        for leaf, u in zip((x, weight, bias), unit):
            assert rel_err(leaf.grad, u.float() * 0.37) < torch.finfo(torch.bfloat16).eps
        torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_compiled_equals_eager(lk):
    torch._dynamo.reset()
    x, weight, bias, target, ce_weight, options = make_inputs(
        2048, 512, 32000, torch.bfloat16, case="everything", seed=0, device="cuda"
    )

    def fn(x, w, b):
        return lk.liger_fused_linear_cross_entropy(x, w, target, b, ce_weight, **options)

    loss = torch.compile(fn)(x, weight, bias)
    got = torch.autograd.grad(loss, (x, weight, bias))
    want_loss = fn(x, weight, bias)
    want = torch.autograd.grad(want_loss, (x, weight, bias))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for g, w in zip(got, want):
        # the same op body; the scaling by d_loss = 1 happens before or after the cast to bf16: one rounding apart
        assert rel_err(g, w) < torch.finfo(torch.bfloat16).eps
    torch._dynamo.reset()


def test_vmap_is_a_clear_error(lk):
    """Per-sample gradients through vmap: the rows are masked by target, which vmap cannot batch; the error says
    so (torch.func.grad alone works)."""
    x, w, t = torch.randn(2, 3, 4), torch.randn(7, 4), torch.randint(0, 7, (2, 3))
    f = torch.func.grad(lambda w_, x_, t_: lk.liger_fused_linear_cross_entropy(x_, w_, t_))
    with pytest.raises(NotImplementedError, match="liger-kernels cross-entropy: torch.func.vmap is not supported"):
        torch.func.vmap(f, (None, 0, 0))(w, x, t)
    got = f(w, x[0], t[0])
    want = torch.func.grad(lambda w_: torch.nn.functional.cross_entropy(x[0] @ w_.T, t[0]))(w)
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_public_function_while_tracing_takes_the_composite_with_its_gradients(lk, reduction, monkeypatch):
    """Under torch.export or torch.jit.trace (``_backend.exporting()``) the public Function computes with aten
    ops only; its backward differentiates that composite: loss and gradients as on the usual path."""
    x, weight, bias, target, _, _ = make_inputs(6, 16, 24, torch.float64, case="bias", seed=3)

    def run():
        function = lk.LigerFusedLinearCrossEntropyFunction
        loss = function.apply(x, weight, target, bias, None, -100, 1e-3, 0.1, reduction)[0]
        d_loss = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
        return (loss, *torch.autograd.grad(loss, (x, weight, bias), d_loss))

    want = run()
    monkeypatch.setattr(lk._backend, "exporting", lambda: True)
    module = sys.modules[f"{lk.__name__}.fused_linear_cross_entropy"]
    monkeypatch.setattr(module, "_forward", lambda *args: pytest.fail("the chunked path ran while tracing"))
    got = run()
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


def test_public_function_while_tracing_refuses_double_backward_and_replays_autocast(lk, monkeypatch):
    """The traced form's backward behaves as the usual one: create_graph=True raises the same error, and the
    recompute runs under the forward's autocast (a bf16 GEMM on fp32 inputs), not outside it."""
    monkeypatch.setattr(lk._backend, "exporting", lambda: True)
    torch.manual_seed(4)
    x = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(24, 16, requires_grad=True)
    target = torch.randint(0, 24, (6,))
    loss = lk.LigerFusedLinearCrossEntropyFunction.apply(x, weight, target)[0]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, (x, weight), create_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lk.LigerFusedLinearCrossEntropyFunction.apply(x.bfloat16(), weight, target)[0]
    grads = torch.autograd.grad(loss, (x, weight))
    logits = (x.detach().bfloat16().float() @ weight.detach().bfloat16().float().T).requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(logits, target), logits)[0]
    assert rel_err(grads[1], want.T @ x.detach().bfloat16().float()) < 2e-2


@pytest.mark.parametrize("strict", [False, True])
def test_public_function_exports_with_a_trainable_head(lk, strict):
    """README Limits: non-strict export of the public Function with a trainable head holds aten ops only; strict
    export traces its backward, which replays the forward's autocast and differentiates the composite with
    autograd.grad: dynamo refuses both."""
    head = torch.nn.Linear(16, 24)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, x, target):
            function = lk.LigerFusedLinearCrossEntropyFunction
            return function.apply(x, self.head.weight, target, self.head.bias)[0]

    x, target = torch.randn(6, 16), torch.randint(0, 24, (6,))
    torch._dynamo.reset()
    if strict:
        with pytest.raises(Exception, match="_composite_backward"):
            torch.export.export(Module(), (x, target), strict=True)
        return
    program = torch.export.export(Module(), (x, target), strict=False)
    assert not any(lk.__name__ in str(n.target) for n in program.graph.nodes if n.op == "call_function")
    want = F.cross_entropy(F.linear(x, head.weight, head.bias), target)
    assert torch.allclose(program.module()(x, target), want, rtol=1e-5, atol=1e-6)
