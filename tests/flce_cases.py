"""Float64 references for the fused linear cross-entropy and the cross-entropy rows, and random inputs."""

import torch
import torch.nn.functional as F

# name -> options of liger_fused_linear_cross_entropy (ce_weight=True means: random class weights)
CASES = {
    "plain": {},
    "bias": {"bias": True},
    "ignore_index=3": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.2},
    "ce_weight": {"ce_weight": True},
    "ce_weight+smoothing": {"ce_weight": True, "label_smoothing": 0.3},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 3.0},
    "token_scaling": {"use_token_scaling": True},
    "everything": {
        "bias": True, "ce_weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 4.0,
        "use_token_scaling": True,
    },
}


def make_inputs(n, hidden, vocab, dtype=torch.float32, case=None, ignore_every=4, seed=None, device="cpu"):
    """Leaf x (n, hidden), weight (vocab, hidden), bias or None, targets with every `ignore_every`-th row
    ignored, ce_weight or None, and the keyword options of the case (without bias / ce_weight)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    options = dict(CASES[case or "plain"])
    ignore_index = options.get("ignore_index", -100)
    x = torch.randn(n, hidden, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.25).to(device, dtype).requires_grad_()
    bias = torch.randn(vocab, generator=generator).to(device, dtype).requires_grad_() if options.pop("bias", False) else None
    target = torch.randint(0, vocab, (n,), generator=generator)
    target[::ignore_every] = ignore_index  # (a class index as ignore_index also ignores rows drawn with it)
    ce_weight = torch.rand(vocab, generator=generator) + 0.5 if options.pop("ce_weight", False) else None
    return x, weight, bias, target.to(device), None if ce_weight is None else ce_weight.to(device), options


def reference_rows(logits, target, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                   softcap=None, use_token_scaling=False):  # fmt: skip
    """(ce rows, z rows) in float64 from F.cross_entropy(reduction="none"), zero for ignored rows."""
    logits = logits.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    weight = None if ce_weight is None else ce_weight.double()
    ce = F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         reduction="none")  # fmt: skip
    kept = target != ignore_index
    lse = torch.logsumexp(logits, -1)
    z = torch.where(kept, lse_square_scale * lse**2, 0.0)
    if use_token_scaling:
        p_y = torch.exp(logits.gather(-1, torch.where(kept, target, 0)[:, None])[:, 0] - lse).detach()
        ce, z = ce * p_y, z * p_y
    return torch.where(kept, ce, 0.0), z


def reference_loss(logits, target, reduction="mean", ce_weight=None, ignore_index=-100, **options):
    """The loss the package promises, in float64. Without token scaling "mean" is exactly F.cross_entropy's
    own reduction (checked against it), plus the z-loss averaged over the kept rows."""
    ce, z = reference_rows(logits, target, ce_weight, ignore_index, **options)
    kept = target != ignore_index
    if reduction == "none":
        return ce + z
    if reduction == "sum":
        return ce.sum() + z.sum()
    weights = kept.double() if ce_weight is None else ce_weight.double()[torch.where(kept, target, 0)] * kept
    loss = ce.sum() / weights.sum() + z.sum() / kept.sum()
    if not options.get("use_token_scaling"):
        capped = logits.double()
        if options.get("softcap") is not None:
            capped = options["softcap"] * torch.tanh(capped / options["softcap"])
        direct = F.cross_entropy(capped, target, weight=None if ce_weight is None else ce_weight.double(),
                                 ignore_index=ignore_index, label_smoothing=options.get("label_smoothing", 0.0))  # fmt: skip
        torch.testing.assert_close(loss - z.sum() / kept.sum(), direct, rtol=1e-12, atol=0, equal_nan=True)
    return loss


def reference_z_loss(logits, target, reduction="mean", ce_weight=None, ignore_index=-100, **options):
    _, z = reference_rows(logits, target, ce_weight, ignore_index, **options)
    kept = target != ignore_index
    return z if reduction == "none" else z.sum() if reduction == "sum" else z.sum() / kept.sum()


def linear64(x, weight, bias):
    """Leaf float64 copies of x, weight, bias, and the float64 logits."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    logits = x64 @ w64.T + (b64 if b64 is not None else 0.0)
    return x64, w64, b64, logits
