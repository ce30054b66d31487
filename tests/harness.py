"""The tests' shared helpers, in one module: how the package is loaded and run (backends, poisoned outputs),
the error measures every comparison uses, the ops and models under test with their float64 references, and
the launcher of multi-process tests. conftest.py holds only pytest's fixtures and hooks.

The package under test is the variant tree that tools/build_variants.py writes, loaded through
``kernels.get_local_kernel`` under the module name the loader gives it, the way users load it: a broken
relative import or a file missing from the variant fails the suite. Without a GPU, Triton kernels run through
Triton's interpreter (TRITON_INTERPRET=1, set here before anything imports Triton), so CI executes the real
kernel code on every commit.
"""

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the package is loaded from a local build: no network, ever
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import kernels  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_variants  # noqa: E402
import ddp_demo  # noqa: E402
from ddp_demo import GatedMLP  # noqa: E402, F401  (the gated-MLP model the tiled tests use)

# Built once per test process, at import, so that parametrizations can read the package's registries.
VARIANT_ROOT = Path(tempfile.mkdtemp(prefix="liger_kernels_repo_"))
atexit.register(shutil.rmtree, VARIANT_ROOT, ignore_errors=True)
build_variants.build(VARIANT_ROOT / "build")
LK = kernels.get_local_kernel(VARIANT_ROOT)

BACKENDS = ("torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DIST_BACKEND = os.environ.get("LIGER_TEST_DIST_BACKEND", "gloo")  # "nccl" runs the distributed tests on GPUs


@contextlib.contextmanager
def backend(name: str):
    """Run the ops with the PyTorch path ("torch") or the Triton kernels ("triton")."""
    previous = LK._backend.requested_backend()
    LK._backend.set_backend(name)
    try:
        yield
    finally:
        LK._backend.set_backend(previous)


def skip_unless_runnable(name: str, device: str = "cpu") -> None:
    if name == "triton" and device == "cpu" and not INTERPRETED:
        pytest.skip("Triton on CPU tensors needs the interpreter; the GPU tests cover compiled Triton")


@contextlib.contextmanager
def poisoned_outputs(lk):
    """Kernel outputs come back NaN-filled from the allocator, so an element a kernel fails to write shows."""
    original = lk._backend.new_tensor, lk._backend.new_strided, lk._backend.new_like

    def fill(dtype):
        return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min  # integer outputs: a sentinel

    def poisoned(shape, *, dtype, device):  # keyword-only, as torch.empty's: a positional call fails here too
        return torch.full(shape, fill(dtype), dtype=dtype, device=device)

    def poisoned_strided(shape, stride, dtype, device):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(fill(dtype))

    def poisoned_like(t):
        return torch.full_like(t, fill(t.dtype), memory_format=torch.contiguous_format)

    lk._backend.new_tensor, lk._backend.new_strided, lk._backend.new_like = poisoned, poisoned_strided, poisoned_like
    try:
        yield
    finally:
        lk._backend.new_tensor, lk._backend.new_strided, lk._backend.new_like = original


def python_calls(fn, package_dir: str) -> int:
    """Function calls the package's code makes while ``fn`` runs, and the calls in its own frames: its host
    work, counted. A call into torch or the standard library from the package counts once (one
    ``torch.compiler.is_compiling()``, one ``inspect.signature``); what such a function does inside is torch's
    (autograd's own Python work depends on what else the process imported, dynamo or transformers)."""
    count = 0

    def ours(frame) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(package_dir)

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":  # a Python function: the package's own, or one the package called
            count += ours(frame) or ours(frame.f_back)
        elif event == "c_call":  # a builtin, called from ``frame``
            count += ours(frame)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


# ----------------------------------------------------------------------------------------------------------
# Error measures. Every comparison is against a float64 reference, by relative error ||out - ref|| / ||ref||.


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    return ((out - ref).norm() / ref.norm()).item()


def truncates_bf16(name: str, device: str = "cpu") -> bool:
    """Triton's interpreter casts fp32 to bf16 by truncation, not round-to-nearest (compiled Triton rounds)."""
    return name == "triton" and device == "cpu" and INTERPRETED


def quantize(ref: torch.Tensor, dtype: torch.dtype, truncate: bool = False) -> torch.Tensor:
    if truncate and dtype == torch.bfloat16:
        bits = ref.float().view(torch.int32) & -65536  # keep sign, exponent, top 7 mantissa bits
        return bits.view(torch.float32).to(torch.bfloat16)
    return ref.to(dtype)


def compute_eps(dtype: torch.dtype) -> float:
    """Rounding unit of the arithmetic the kernels do for `dtype` inputs (fp32, or fp64 for fp64)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def assert_close_to_rounding(out, ref, dtype, truncate=False, what="output"):
    """The error of `out` is within 1.5x the error of rounding the exact result to `dtype` once (what a
    kernel computing in fp32 and casting at the end achieves), plus fp32 arithmetic slack."""
    floor = rel_err(quantize(ref, dtype, truncate), ref)
    err = rel_err(out, ref)
    bound = 1.5 * floor + 4 * compute_eps(dtype)
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.3e} (rounding floor {floor:.3e})"


def assert_faithful(out, ref, dtype, what="output"):
    """Size-independent bound: every element within one ulp of the exact result gives a relative error of
    at most eps(dtype). Used where tensors are too small for the statistical bound above.

    fp32 inputs are computed at their own precision, and the gradients have zeros (SiLU' at z = -1.28,
    GELU' at z = -0.75) where one element's relative error is unbounded; a tiny tensor can be dominated by
    such an element, so fp32 gets 16 ulps in norm. A wrong formula, index or mask errs by 1e-3 or more."""
    err = rel_err(out, ref)
    bound = torch.finfo(dtype).eps + 4 * compute_eps(dtype)
    if dtype == torch.float32:
        bound = 16 * torch.finfo(dtype).eps
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.3e}"


def launch(target, world, variant_root, options, out_dir, timeout_s=240):
    """tools/ddp_demo.launch, with the process-group backend the environment asks for (gloo on CPU ranks,
    LIGER_TEST_DIST_BACKEND=nccl on a machine with two GPUs)."""
    return ddp_demo.launch(target, world, variant_root, {"backend": DIST_BACKEND, **options}, out_dir, timeout_s)


# ----------------------------------------------------------------------------------------------------------
# The gated ops under test, each with its float64 reference, and the check they all share.

# name -> (call the package's op, float64 reference). Both take (lk, a, b) / (a, b).
OPS = {
    "swiglu": (
        lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b),
        lambda a, b: F.silu(a) * b,
    ),
    "swiglu_multipliers": (
        lambda lk, a, b: lk.LigerSiLUMulFunction.apply(a, b, 0.75, 1.5),
        lambda a, b: F.silu(0.75 * a) * b * 1.5,
    ),
    "geglu_tanh": (
        lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b, "tanh"),
        lambda a, b: F.gelu(a, approximate="tanh") * b,
    ),
    "geglu_exact": (
        lambda lk, a, b: lk.LigerGELUMulFunction.apply(a, b, "none"),
        lambda a, b: F.gelu(a) * b,
    ),
    # the functional forms, which the layers call: an autograd.Function of their own in eager
    "silu_mul": (
        lambda lk, a, b: lk.silu_mul(a, b, 0.75, 1.5),
        lambda a, b: F.silu(0.75 * a) * b * 1.5,
    ),
    "gelu_mul_exact": (
        lambda lk, a, b: lk.gelu_mul(a, b, "none"),
        lambda a, b: F.gelu(a) * b,
    ),
}
# and every registered activation through the generic functional form, against the registry's reference
for _name, _activation in LK.activations.REGISTRY.items():
    OPS[f"gated_mul_{_name}"] = (
        lambda lk, a, b, name=_name: lk.gated_mul(a, b, name, 0.75, 1.5),
        lambda a, b, reference=_activation.reference: reference(0.75 * a) * b * 1.5,
    )


def make_pair(shape, dtype, device="cpu", strided=False, scale=2.0):
    """Fresh random a, b (leaves when not strided). Strided: the two halves of one fused gate_up tensor,
    rows strided, last dim contiguous, as `.chunk(2, -1)` gives them. Returns (a, b, leaves)."""
    if strided:
        fused = (torch.randn(*shape[:-1], 2 * shape[-1], device=device) * scale).to(dtype).requires_grad_()
        a, b = fused.chunk(2, dim=-1)
        return a, b, (fused,)
    a = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()
    b = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()
    return a, b, (a, b)


def check_op(lk, op, a, b, dtype, backend_name, bound="rounding"):
    """Forward and both gradients against the float64 reference."""
    apply, reference = OPS[op]
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = apply(lk, a, b)
    ref = reference(a64, b64)
    assert out.dtype == dtype and out.shape == a.shape and out.device == a.device
    d_out = torch.randn(out.shape, device=out.device).to(dtype)
    d_a, d_b = torch.autograd.grad(out, (a, b), d_out)
    ref_d_a, ref_d_b = torch.autograd.grad(ref, (a64, b64), d_out.double())
    truncate = truncates_bf16(backend_name, a.device.type)
    for what, got, want in (("out", out, ref), ("d_a", d_a, ref_d_a), ("d_b", d_b, ref_d_b)):
        assert got.dtype == dtype
        if bound == "rounding":
            assert_close_to_rounding(got, want, dtype, truncate, what=f"{op} {what}")
        else:
            assert_faithful(got, want, dtype, what=f"{op} {what}")


# ----------------------------------------------------------------------------------------------------------
# The tiled MLP: models and comparisons (single process and distributed).


class DropoutGatedMLP(GatedMLP):
    """Dropout on the hidden activations: for apply_tiled_mlp with a generic fn (the layers refuse this form)."""

    def __init__(self, hidden, intermediate, dropout):
        super().__init__(hidden, intermediate)
        self.dropout = dropout

    def forward(self, x):
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(F.dropout(h, self.dropout, training=True))


def call(module, x):
    return module(x)


def tiled_and_untiled_grads(lk, module, x, num_shards, d_out=None, compute_params=None, fn=call):
    """(out, grads) of the tiled call of ``fn`` and of the plain module; grads: x's (if it requires grad), then
    every parameter's .grad (None where it stays None)."""
    results = []
    for tiled in (True, False):
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(x.requires_grad)
        out = lk.apply_tiled_mlp(fn, module, leaf, num_shards, compute_params) if tiled else module(leaf)
        if d_out is None:
            d_out = torch.randn_like(out)
        out.backward(d_out)
        grads = ([leaf.grad] if x.requires_grad else []) + [p.grad for p in module.parameters()]
        results.append((out.detach(), [None if g is None else g.clone() for g in grads]))
    return results


def max_abs_diff(tiled, untiled) -> float:
    (out_t, grads_t), (out_u, grads_u) = tiled, untiled
    worst = (out_t - out_u).abs().max().item() if out_t.numel() else 0.0
    for a, b in zip(grads_t, grads_u):
        assert (a is None) == (b is None), "a gradient is None on one side only"
        if a is not None and a.numel():
            worst = max(worst, (a - b).abs().max().item())
    return worst


# ----------------------------------------------------------------------------------------------------------
# Fused linear cross-entropy: float64 references and random inputs.

# name -> options of liger_fused_linear_cross_entropy (ce_weight=True means: random class weights)
FLCE_CASES = {
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
        "bias": True,
        "ce_weight": True,
        "label_smoothing": 0.1,
        "lse_square_scale": 1e-2,
        "softcap": 4.0,
        "use_token_scaling": True,
    },
}


def make_inputs(n, hidden, vocab, dtype=torch.float32, case=None, ignore_every=4, seed=None, device="cpu"):
    """Leaf x (n, hidden), weight (vocab, hidden), bias or None, targets with every `ignore_every`-th row
    ignored, ce_weight or None, and the keyword options of the case (without bias / ce_weight)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    options = dict(FLCE_CASES[case or "plain"])
    ignore_index = options.get("ignore_index", -100)
    x = torch.randn(n, hidden, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.25).to(device, dtype).requires_grad_()
    bias = (
        torch.randn(vocab, generator=generator).to(device, dtype).requires_grad_()
        if options.pop("bias", False)
        else None
    )
    target = torch.randint(0, vocab, (n,), generator=generator)
    target[::ignore_every] = ignore_index  # (a class index as ignore_index also ignores rows drawn with it)
    ce_weight = torch.rand(vocab, generator=generator) + 0.5 if options.pop("ce_weight", False) else None
    return x, weight, bias, target.to(device), None if ce_weight is None else ce_weight.to(device), options


def reference_rows(
    logits,
    target,
    ce_weight=None,
    ignore_index=-100,
    lse_square_scale=0.0,
    label_smoothing=0.0,
    softcap=None,
    use_token_scaling=False,
):
    """(ce rows, z rows) in float64 from F.cross_entropy(reduction="none"), zero for ignored rows."""
    logits = logits.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    weight = None if ce_weight is None else ce_weight.double()
    ce = F.cross_entropy(
        logits, target, weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
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
        direct = F.cross_entropy(
            capped,
            target,
            weight=None if ce_weight is None else ce_weight.double(),
            ignore_index=ignore_index,
            label_smoothing=options.get("label_smoothing", 0.0),
        )
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
