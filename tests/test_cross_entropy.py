"""cross_entropy on given logits (what LigerForCausalLMLoss and its layer compute from a model's logits) against
float64 PyTorch on every option, both backends: the loss, the z-loss and the extras, and the logits' gradient
through the loss and through the returned z-loss, for any incoming gradients."""

import pytest
import torch
import torch.nn.functional as F

from harness import (
    FLCE_CASES,
    backend,
    make_inputs,
    reference_loss,
    reference_z_loss,
    rel_err,
    skip_unless_runnable,
)

REDUCTIONS = ("mean", "sum", "none")
FP32_BOUND = 16 * torch.finfo(torch.float32).eps
N, V = 13, 50
CASES = sorted(name for name, options in FLCE_CASES.items() if "bias" not in options)  # bias: the fused op's


def logits_and_options(case, dtype=torch.float32, shape=(N,)):
    x, weight, _, target, ce_weight, options = make_inputs(N, 8, V, case=case, seed=len(case))
    logits = (x.detach().double() @ weight.detach().double().T).to(dtype).reshape(*shape, V).requires_grad_()
    return logits, target.reshape(shape), ce_weight, options


def incoming(like, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(like.shape, generator=generator, dtype=torch.float64) + 0.5).to(like.dtype)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(lk, case, reduction, backend_name):
    logits, target, ce_weight, options = logits_and_options(case)
    out = lk.cross_entropy.cross_entropy(
        logits, target, ce_weight, reduction=reduction, return_z_loss=True, return_token_accuracy=True, **options
    )
    logits64 = logits.detach().double().requires_grad_()
    want = reference_loss(logits64, target, reduction, ce_weight, **options)
    want_z = reference_z_loss(logits64, target, reduction, ce_weight, **options)
    assert out.loss.dtype == torch.float32 and out.loss.shape == want.shape
    assert rel_err(out.loss, want) <= FP32_BOUND, f"loss: {rel_err(out.loss, want):.3e}"
    if options.get("lse_square_scale"):
        assert rel_err(out.z_loss, want_z) <= FP32_BOUND
    else:
        assert not out.z_loss.any()  # exactly zero without a z-loss
    # Both returned losses are differentiable: a gradient through each must reach the logits.
    d_loss, d_z = incoming(out.loss, 1), incoming(out.z_loss, 2)
    (got,) = torch.autograd.grad((out.loss, out.z_loss), logits, (d_loss, d_z))
    (ref,) = torch.autograd.grad((want, want_z), logits64, (d_loss.double(), d_z.double()))
    assert got.dtype == logits.dtype and got.shape == logits.shape
    assert rel_err(got, ref) <= FP32_BOUND, f"grad: {rel_err(got, ref):.3e}"
    kept = target != options.get("ignore_index", -100)
    predicted = logits.detach().argmax(-1)
    if reduction != "none":
        accuracy = ((predicted == target) & kept).sum() / kept.sum()
        assert out.token_accuracy.item() == pytest.approx(accuracy.item(), abs=1e-7)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batched_bf16_logits_and_retained_graph(lk, reduction, backend_name):
    """(B, S, V) bf16 logits: the loss in fp32, the gradient in bf16 to one bf16 rounding of the exact one; a
    second backward through the retained graph gives the same gradient."""
    logits, target, ce_weight, options = logits_and_options("everything", torch.bfloat16, shape=(1, N))
    loss = lk.cross_entropy.cross_entropy(logits, target, ce_weight, reduction=reduction, **options)
    logits64 = logits.detach().double().requires_grad_()
    want = reference_loss(logits64.view(N, V), target.view(N), reduction, ce_weight, **options)
    assert loss.dtype == torch.float32 and rel_err(loss, want.view(loss.shape)) <= FP32_BOUND
    d_loss = incoming(loss, 3)
    first = torch.autograd.grad(loss, logits, d_loss, retain_graph=True)[0]
    second = torch.autograd.grad(loss, logits, d_loss)[0]
    (ref,) = torch.autograd.grad(want, logits64, d_loss.double().view(want.shape))
    assert first.dtype == torch.bfloat16 and torch.equal(first, second)
    assert rel_err(first, ref) <= torch.finfo(torch.bfloat16).eps, f"grad: {rel_err(first, ref):.3e}"


def test_calls_of_one_shape_launch_with_their_own_options(lk):
    """The Triton path launches from plans made once per layout and options (NOTES.md §34). Calls of one shape
    that differ only in an option, the reduction or the z-loss handed out, one after another in both orders,
    must each get their own kernels' constexprs: a plan keyed without one of them hands a later call an
    earlier call's, and the loss, the z-loss, the accuracy or the gradient comes out wrong."""
    skip_unless_runnable("triton")
    configs = [(case, reduction, False) for case in CASES for reduction in REDUCTIONS]
    configs += [(case, "mean", True) for case in CASES]  # (the z-loss and the accuracy handed out)
    with backend("triton"):
        for order in (configs, configs[::-1]):
            for case, reduction, extras in order:
                logits, target, ce_weight, options = logits_and_options(case)
                out = lk.cross_entropy.cross_entropy(
                    logits,
                    target,
                    ce_weight,
                    reduction=reduction,
                    return_z_loss=extras,
                    return_token_accuracy=extras,
                    **options,
                )
                loss = out.loss if extras else out
                logits64 = logits.detach().double().requires_grad_()
                want = reference_loss(logits64, target, reduction, ce_weight, **options)
                (got,) = torch.autograd.grad(loss, logits, incoming(loss, 4))
                (ref,) = torch.autograd.grad(want, logits64, incoming(loss, 4).double())
                what = f"{case}, {reduction}, extras handed out: {extras}"
                assert rel_err(loss, want) <= FP32_BOUND and rel_err(got, ref) <= FP32_BOUND, what
                if extras:
                    want_z = reference_z_loss(logits64, target, reduction, ce_weight, **options)
                    assert rel_err(out.z_loss, want_z) <= FP32_BOUND or not want_z.any() and not out.z_loss.any(), what
                    kept = target != options.get("ignore_index", -100)
                    accuracy = ((logits.detach().argmax(-1) == target) & kept).sum() / kept.sum()
                    assert out.token_accuracy.item() == pytest.approx(accuracy.item(), abs=1e-7), what


def test_calls_of_one_shape_launch_with_their_own_layouts(lk):
    """As above, for what the options leave alike: the logits' row stride (a padded vocabulary's slice after
    contiguous logits of the same shape), the vocabulary at one row stride, a negative z-loss scale after a
    positive one, and "mean" with ignore_index 0 through the fused loss (divisors handed to the sums) and then
    through cross_entropy (divisors found by the sums) on as many rows."""
    skip_unless_runnable("triton")
    generator = torch.Generator().manual_seed(7)
    padded = torch.randn(6, 64, generator=generator, dtype=torch.float64)
    target = torch.randint(1, 40, (6,), generator=generator)
    target[0] = 0

    def check(logits, **options):
        logits = logits.float().requires_grad_()
        loss = lk.cross_entropy.cross_entropy(logits, target, **options)
        logits64 = logits.detach().double().requires_grad_()
        want = reference_loss(logits64, target, **options)
        (got,) = torch.autograd.grad(loss, logits)
        (ref,) = torch.autograd.grad(want, logits64)
        assert rel_err(loss, want) <= FP32_BOUND and rel_err(got, ref) <= FP32_BOUND, (logits.stride(), options)

    with backend("triton"):
        check(padded[:, :50].contiguous())
        check(padded.float()[:, :50])  # row stride 64
        check(padded.float()[:, :40])  # row stride 64, 40 classes
        for scale in (0.05, -0.05, 0.0):
            check(padded[:, :50].contiguous(), lse_square_scale=scale)
        x, weight = torch.randn(6, 8, generator=generator), torch.randn(50, 8, generator=generator)
        fused = lk.liger_fused_linear_cross_entropy(x, weight, target, ignore_index=0)
        want = F.cross_entropy((x.double() @ weight.double().T), target, ignore_index=0)
        assert rel_err(fused, want) <= FP32_BOUND
        check(x @ weight.T, ignore_index=0)


def test_torch_func_transforms_over_plain_logits(lk, backend_name):
    """A transformed function reading the loss of plain logits (not the transform's own input) gets the PyTorch
    composite and the same loss, as F.cross_entropy would: PyTorch's apply refuses the eager Functions under an
    active transform."""
    logits, target, ce_weight, options = logits_and_options("everything")
    for ce_weight_ in (ce_weight, None):
        want = lk.cross_entropy.cross_entropy(logits, target, ce_weight_, **options)

        def scaled(s, ce_weight_=ce_weight_):
            return s * lk.cross_entropy.cross_entropy(logits, target, ce_weight_, **options)

        assert rel_err(torch.func.grad(scaled)(torch.tensor(2.0)), want) <= FP32_BOUND
    plain = lk.cross_entropy.cross_entropy(logits, target)  # the common case's expression
    assert (
        rel_err(torch.func.grad(lambda s: s * lk.cross_entropy.cross_entropy(logits, target))(torch.tensor(2.0)), plain)
        <= FP32_BOUND
    )


def test_logits_are_never_written(lk, backend_name):
    logits, target, ce_weight, options = logits_and_options("everything")
    before = logits.detach().clone()
    loss = lk.cross_entropy.cross_entropy(logits, target, ce_weight, **options)
    loss.backward()
    assert torch.equal(logits.detach(), before) and logits.grad is not None


def test_double_backward_is_a_clear_error(lk, backend_name):
    logits, target, _, _ = logits_and_options("plain")
    loss = lk.cross_entropy.cross_entropy(logits, target)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, logits, create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_z_loss_feeds_the_loss_in_the_graph(lk, reduction, backend_name):
    """The loss is the cross-entropy's share plus z_loss, in the graph too: z_loss receives the loss's
    gradient (retain_grad sees it), and a hook that drops z_loss's gradient leaves the cross-entropy's alone."""
    logits, target, ce_weight, options = logits_and_options("z_loss")
    out = lk.cross_entropy.cross_entropy(logits, target, ce_weight, reduction=reduction, return_z_loss=True, **options)
    out.z_loss.retain_grad()
    out.loss.backward(retain_graph=True)
    assert out.z_loss.grad is not None and out.z_loss.grad.item() == 1.0
    logits.grad = None
    out.z_loss.register_hook(lambda grad: grad * 0)
    out.loss.backward()
    logits64 = logits.detach().double().requires_grad_()
    without_z = {**options, "lse_square_scale": 0.0}
    (want,) = torch.autograd.grad(reference_loss(logits64, target, reduction, ce_weight, **without_z), logits64)
    assert rel_err(logits.grad, want) <= FP32_BOUND


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES)
def test_the_loss_alone_is_the_sum_the_graph_would_make(lk, case, reduction, backend_name):
    """Without ``return_z_loss`` the node hands out the loss itself instead of its two parts for an addition:
    the same bits as the loss made by that addition (``return_z_loss=True``), and the same gradient for any
    incoming one."""
    logits, target, ce_weight, options = logits_and_options(case)
    call = lk.cross_entropy.cross_entropy
    alone = call(logits, target, ce_weight, reduction=reduction, **options)
    both = call(logits, target, ce_weight, reduction=reduction, return_z_loss=True, **options)
    assert torch.equal(alone, both.loss)
    d_loss = incoming(alone, 3)
    (got,) = torch.autograd.grad(alone, logits, d_loss)
    (want,) = torch.autograd.grad(both.loss, logits, d_loss)
    assert torch.equal(got, want)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_common_case_returns_what_the_checked_path_does(lk, reduction, backend_name, monkeypatch):
    """``cross_entropy``'s common case (2-D logits, 1-D int64 targets, the loss alone) skips the checks and the
    route: its loss and gradient are bit for bit those of the same rows as 3-D logits, which take them; its bad
    input raises the checks' errors."""
    ce = lk.cross_entropy
    checked = []
    check_target = ce.check_target
    monkeypatch.setattr(ce, "check_target", lambda *args: checked.append(args) or check_target(*args))
    generator = torch.Generator().manual_seed(11)
    rows = torch.randn(37, 29, generator=generator)
    target = torch.randint(0, 29, (37,), generator=generator)
    target[::4] = -100
    options = {"reduction": reduction, "label_smoothing": 0.1, "lse_square_scale": 1e-3}
    x = rows.clone().requires_grad_()
    loss = ce.cross_entropy(x, target, **options)
    assert not checked
    x3 = rows.clone()[None].requires_grad_()
    want = ce.cross_entropy(x3, target[None], **options)
    assert len(checked) == 1
    assert torch.equal(loss, want)
    d_loss = torch.tensor(1.7)
    (grad,) = torch.autograd.grad(loss, x, d_loss)
    assert torch.equal(grad, torch.autograd.grad(want, x3, d_loss)[0][0])
    # layouts the kernels cannot read as they are take the checks (and a contiguous copy): the same loss and
    # gradient as the contiguous tensors'
    column_strided = rows.t().contiguous().t()
    strided_target = torch.stack((target, target), 1)[:, 0]
    assert column_strided.stride(1) != 1 and strided_target.stride(0) != 1
    for logits, labels in ((column_strided, target), (rows, strided_target)):
        checked.clear()
        x_strided = logits.clone(memory_format=torch.preserve_format).requires_grad_()
        got = ce.cross_entropy(x_strided, labels, **options)
        assert len(checked) == 1 and torch.equal(got, loss)
        assert torch.equal(torch.autograd.grad(got, x_strided, d_loss)[0], grad)
    for bad, error, message in (
        ({"target": target.clone().fill_(29)}, ValueError, "values must be in \\[0, 29\\)"),
        ({"ignore_index": 1.5}, TypeError, "`ignore_index` must be an int"),
        ({"label_smoothing": float("nan")}, TypeError, "`label_smoothing`"),
        ({"reduction": "avg"}, ValueError, "`reduction` must be one of"),
    ):
        with pytest.raises(error, match=message):
            ce.cross_entropy(x, **{"target": target, **options, **bad})


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
def test_the_gradient_divides_its_scales_as_pytorch(lk, weighted, backend_name):
    """The eager loss's backward hands "mean"'s divisors to the gradient, which on the Triton path divides the
    incoming gradient in its own launch: bit for bit the gradient of scales divided by PyTorch first, each
    divisor apart (None: undivided), per-row scales too."""
    ce = lk.cross_entropy
    generator = torch.Generator().manual_seed(3 + weighted)
    logits = torch.randn(9, 37, generator=generator)
    target = torch.randint(0, 37, (9,), generator=generator)
    target[2] = -100
    ce_weight = torch.rand(37, generator=generator) + 0.5 if weighted else None
    total = ce.class_weight_total(ce_weight)
    d, rows = torch.tensor(1.3), torch.rand(9, generator=generator) + 0.5
    weights, count = torch.tensor(7.7), torch.tensor(3.0)
    for opts in (
        ce.Options(lse_square_scale=1e-2, label_smoothing=0.05),
        ce.Options(lse_square_scale=1e-2, use_token_scaling=True),  # divided before the scaling by p_y
    ):
        lse = ce.row_stats(logits, target, ce_weight, total, opts, False)[0]
        for ce_scale, z_scale, by in (
            (d, d, (weights, count)),
            (d, d, (count, count)),
            (d, rows, (None, count)),
            (rows, d, (weights, None)),
        ):
            got = ce.row_grad(logits, target, ce_weight, total, lse, ce_scale, z_scale, opts, divisors=by)
            divided = [s if b is None else s / b for s, b in zip((ce_scale, z_scale), by)]
            want = ce.row_grad(logits, target, ce_weight, total, lse, *divided, opts)
            assert torch.equal(got, want), (opts, by)


def test_an_absent_gradient_is_not_divided(lk, backend_name):
    """Only z_loss in the graph, with class weights of 0 for every class (W = 0): the loss's absent gradient is
    zeros that "mean" must not divide by W (0 / 0); the gradient is z_loss's, finite, as float64's."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 11, generator=generator)
    target = torch.randint(0, 11, (5,), generator=generator)
    target[1] = -100
    x = logits.clone().requires_grad_()
    out = lk.cross_entropy.cross_entropy(x, target, torch.zeros(11), lse_square_scale=1e-2, return_z_loss=True)
    (got,) = torch.autograd.grad(out.z_loss * 3.0, x)
    x64 = logits.double().requires_grad_()
    kept = target != -100
    want_z = 1e-2 * torch.logsumexp(x64, -1)[kept].square().sum() / kept.sum()
    (want,) = torch.autograd.grad(want_z * 3.0, x64)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [1, 1024, 2500])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
def test_device_reductions_match_pytorch(lk, rows, weighted, device):
    """The Triton path's divisors and sums of the loss rows (one program looping over the rows in blocks of
    REDUCE_BLOCK: one block, exactly one, several) against the PyTorch path's ops, in float64: the count
    exact, the summed class weights, their reciprocals and the reduced losses to fp32 rounding; NaN rows (an
    out-of-range target) and an all-ignored batch give NaN as PyTorch's."""
    skip_unless_runnable("triton", device)  # (on the CPU: Triton's interpreter)
    ce_module = lk.cross_entropy
    assert ce_module.REDUCE_BLOCK == 1024
    generator = torch.Generator().manual_seed(rows + weighted)
    target = torch.randint(0, 40, (rows,), generator=generator)
    target[torch.rand(rows, generator=generator) < 0.3] = -7
    target[0] = 3  # at least one row kept (the all-ignored batch comes last)
    ce_weight = torch.rand(40, generator=generator, dtype=torch.float64) + 0.5 if weighted else None
    ce = torch.rand(rows, generator=generator) * 5
    z = torch.rand(rows, generator=generator) * 1e-3
    target, ce, z, ce_weight = (None if t is None else t.to(device) for t in (target, ce, z, ce_weight))
    opts = ce_module.Options(ignore_index=-7)
    kept = target != -7
    weights = ce_weight[target.clamp(min=0)][kept].sum() if weighted else kept.sum().double()
    with backend("triton"):
        assert ce_module.reduces_on_device(ce) and not ce_module.reduces_on_device(ce.clone().requires_grad_())
        divisors = ce_module.denominators(target, ce_weight, opts, ce)
        assert len(divisors) == 4 and all(d.shape == () and d.dtype == torch.float32 for d in divisors)
        assert divisors[1].item() == kept.sum().item()
        for got, want in zip(divisors, (weights, kept.sum(), 1 / weights, 1 / kept.sum())):
            assert rel_err(got, want) <= FP32_BOUND, (got, want)
        for reduction in ("mean", "sum"):
            opts = opts._replace(reduction=reduction)
            ce_part, z_loss, _, loss = ce_module.reduced_parts(ce, z, None, target, ce_weight, opts, False, divisors)
            scale_ce, scale_z = (weights, kept.sum()) if reduction == "mean" else (1, 1)
            want_ce, want_z = ce.double().sum() / scale_ce, z.double().sum() / scale_z
            for got, want in ((ce_part, want_ce), (z_loss, want_z), (loss, want_ce + want_z)):
                assert got.shape == () and rel_err(got, want) <= FP32_BOUND, (reduction, got, want)
        # the eager loss's form: "mean"'s divisors found in the sums' own launch, bit for bit the two launches'
        mean = opts._replace(reduction="mean")
        *fused, found = ce_module.reduced_with_divisors(ce, z, None, target, ce_weight, mean, False)
        apart = ce_module.reduced_parts(ce, z, None, target, ce_weight, mean, False, divisors)
        assert fused[2] is None and all(torch.equal(f, a) for f, a in zip(fused[:2] + fused[3:], apart[:2] + apart[3:]))
        assert len(found) == 2 and all(torch.equal(f, d) for f, d in zip(found, divisors[:2]))
        assert (found[0] is found[1]) == (not weighted)
        assert (
            rel_err(ce_module.row_scales(target, ce_weight, opts._replace(reduction="mean"), ce)[0], 1 / weights)
            <= FP32_BOUND
        )
        poisoned = ce.clone()
        poisoned[-1] = float("nan")  # a kept target out of range makes its row NaN
        assert ce_module.reduced_parts(poisoned, z, None, target, ce_weight, opts, False, divisors)[3].isnan()
        ignored = torch.full_like(target, -7)
        divisors = ce_module.denominators(ignored, ce_weight, opts._replace(reduction="mean"), ce)
        assert divisors[1].item() == 0 and divisors[0].item() == 0
        mean = opts._replace(reduction="mean")
        assert ce_module.reduced_parts(ce * 0, z * 0, None, ignored, ce_weight, mean, False, divisors)[3].isnan()
        # kept targets out of range count class 0's weight in both paths (their rows' loss is NaN anyway)
        wild = torch.tensor([3, 1_000_000, -5, -7, 39], device=device)
        with backend("torch"):
            want = ce_module.denominators(wild, ce_weight, mean, ce[:5])
        got = ce_module.denominators(wild, ce_weight, mean, ce[:5])
        assert got[1].item() == want[1].item() == 4 and rel_err(got[0], want[0]) <= FP32_BOUND


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_reductions_are_compensated(lk, device):
    """The row sums and the summed class weights of the Triton path add each lane's rows with Kahan's
    compensation: 100 ones after 2**24 in one lane (a plain fp32 sum loses every one) give 2**24 + 100 exactly,
    and an inf or a NaN among the rows still gives PyTorch's inf or NaN."""
    skip_unless_runnable("triton", device)
    ce_module = lk.cross_entropy
    rows = ce_module.REDUCE_BLOCK * 101
    values = torch.zeros(rows, device=device)
    values[0] = 2.0**24
    values[ce_module.REDUCE_BLOCK :: ce_module.REDUCE_BLOCK] = 1.0  # the same lane as row 0
    target = torch.full((rows,), -100, device=device)
    target[:: ce_module.REDUCE_BLOCK] = 1
    target[0] = 0
    ce_weight = torch.tensor([2.0**24, 1.0], device=device)
    opts = ce_module.Options(reduction="sum")
    with backend("triton"):
        loss = ce_module.reduced_parts(values, values * 0, None, target, None, opts, False)[3]
        assert loss.item() == 2.0**24 + 100
        weights, count = ce_module.denominators(target, ce_weight, opts, values)[:2]
        assert weights.item() == 2.0**24 + 100 and count.item() == 101
        zeros = torch.zeros_like(values)
        for bad, want in ((float("inf"), float("inf")), (float("nan"), float("nan"))):
            values[7] = bad
            got = ce_module.reduced_parts(values, zeros, None, target, None, opts, False)[3].item()
            assert got == want or (got != got and want != want), (bad, got)
        # a lane's compensated total may overflow where the plain sum does not: the plain sum is the answer
        values[7] = 0.0
        top = torch.finfo(torch.float32).max
        values[0], values[ce_module.REDUCE_BLOCK], values[2 * ce_module.REDUCE_BLOCK] = (
            top,
            0.3 * 2.0**104,
            0.3 * 2.0**104,
        )
        got = ce_module.reduced_parts(values, zeros, None, target, None, opts, False)[3].item()
        assert got == top, got  # each 0.3 ulp rounds away in the plain sum; compensated, they overflow


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_weights_strided_or_infinite_on_an_unused_class(lk, reduction, backend_name):
    """A strided ce_weight view is read as its values (the kernels index it densely), and an infinite weight of
    a class that no kept target has changes nothing, as in F.cross_entropy: no inf * 0 for ignored rows or for
    the smoothing term that is absent."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(50, 13, generator=generator, dtype=torch.float64)
    target = torch.randint(1, 13, (50,), generator=generator)
    target[::3] = -100
    strided = (torch.rand(26, generator=generator) + 0.5)[::2]
    assert strided.stride(0) == 2
    infinite = torch.rand(13, generator=generator) + 0.5
    infinite[0] = float("inf")  # class 0: never a kept target; an ignored row's stand-in in the PyTorch path
    for ce_weight in (strided, infinite):
        x = logits.float().requires_grad_()
        loss = lk.cross_entropy.cross_entropy(x, target, ce_weight, reduction=reduction)
        (grad,) = torch.autograd.grad(loss, x)
        x64 = logits.clone().requires_grad_()
        want = torch.nn.functional.cross_entropy(x64, target, weight=ce_weight.double(), reduction=reduction)
        (want_grad,) = torch.autograd.grad(want, x64)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert rel_err(loss, want) <= FP32_BOUND and rel_err(grad, want_grad) <= FP32_BOUND


def test_a_masked_start_of_the_vocabulary_is_no_nan(lk, backend_name):
    """Every logit of the first column block -inf (a masked range at the start of the vocabulary, or a -inf bias):
    the online logsumexp must not rescale from -inf to -inf (NaN); it did, on the Triton path, for the loss and
    the gradient alike. The fused loss runs the same kernel."""
    vocab = lk.cross_entropy.MAX_BLOCK + 100
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    logits[:, : lk.cross_entropy.MAX_BLOCK] = float("-inf")
    logits.requires_grad_()
    target = torch.randint(lk.cross_entropy.MAX_BLOCK, vocab, (3,), generator=generator)
    logits64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(logits64, target)
    loss = lk.cross_entropy.cross_entropy(logits, target)
    assert rel_err(loss, want) <= FP32_BOUND, f"loss {loss.item()} against {want.item()}"
    (got,) = torch.autograd.grad(loss, logits)
    (ref,) = torch.autograd.grad(want, logits64)
    assert rel_err(got, ref) <= FP32_BOUND


@pytest.mark.parametrize("softcap", [30.0, 1e4, 1e8])
def test_a_softcap_far_above_the_logits_keeps_their_precision(lk, softcap, backend_name):
    """softcap * tanh(x / softcap) with x / softcap near 0: tanh must not be computed as (1 - e) / (1 + e) there,
    whose 1 - e cancels and quantized the capped logits (relative error 0.13 in the loss at softcap 1e8, 2e-3 in
    the gradient at 1e6, on the Triton path)."""
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(N, V, generator=generator) * 3).requires_grad_()
    target = torch.randint(0, V, (N,), generator=generator)
    logits64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(softcap * torch.tanh(logits64 / softcap), target)
    loss = lk.cross_entropy.cross_entropy(logits, target, softcap=softcap)
    assert rel_err(loss, want) <= FP32_BOUND
    (got,) = torch.autograd.grad(loss, logits)
    (ref,) = torch.autograd.grad(want, logits64)
    assert rel_err(got, ref) <= FP32_BOUND
