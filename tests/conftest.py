"""Shared fixtures.

The package under test is the variant tree that scripts/build_variants.py writes, loaded through
``kernels.get_local_kernel`` under the module name the loader gives it, the way users load it: a broken
relative import or a file missing from the variant fails the suite.

Without a GPU, Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1, set here before anything
imports Triton), so CI executes the real kernel code on every commit.
"""

import contextlib
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the package is loaded from a local build: no network, ever
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import kernels  # noqa: E402
import pytest  # noqa: E402


def _interpreter_loops_on_numpy_2():
    """Triton 3.6's interpreter holds kernel scalars as 1-element arrays and turns them into loop bounds with
    int(array), which numpy >= 2.4 refuses: every `for i in range(n)` over a runtime `n` fails. Take the
    element instead (the interpreter re-applies its patches at each launch, so this wraps its patcher)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _interpreter_loops_on_numpy_2()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import build_variants  # noqa: E402

BACKENDS = ("torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="session")
def variant_root(tmp_path_factory) -> Path:
    """A repository root whose build/ holds freshly built variants of the current sources."""
    root = tmp_path_factory.mktemp("liger_kernels_repo")
    build_variants.build(root / "build")
    return root


@pytest.fixture(scope="session")
def lk(variant_root):
    """The package, as ``kernels`` loads it."""
    module = kernels.get_local_kernel(variant_root)
    assert module.__name__ != "liger_kernels", "expected the loader's own module name"
    return module


@contextlib.contextmanager
def backend(name: str):
    """Run the ops with the PyTorch path ("torch") or the Triton kernels ("triton")."""
    old = os.environ.get("LIGER_KERNELS_BACKEND")
    os.environ["LIGER_KERNELS_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["LIGER_KERNELS_BACKEND"]
        else:
            os.environ["LIGER_KERNELS_BACKEND"] = old


def skip_unless_runnable(name: str, device: str = "cpu") -> None:
    if name == "triton" and device == "cpu" and not INTERPRETED:
        pytest.skip("Triton on CPU tensors needs the interpreter; the GPU tests cover compiled Triton")


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    skip_unless_runnable(request.param)
    with backend(request.param):
        yield request.param


@contextlib.contextmanager
def poisoned_outputs(lk):
    """Kernel outputs come back NaN-filled from the allocator, so an element a kernel fails to write shows."""
    original = lk._backend.new_tensor

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    lk._backend.new_tensor = poisoned
    try:
        yield
    finally:
        lk._backend.new_tensor = original


@pytest.fixture(autouse=True)
def poison(request):
    if "lk" in request.fixturenames:
        with poisoned_outputs(request.getfixturevalue("lk")):
            yield
    else:
        yield


@pytest.fixture
def tagged():
    """Users tag the MLP classes themselves: no transformers model tags its MLP as SwiGLUMLP/GeGLUMLP."""
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    kernels.replace_kernel_forward_from_hub(LlamaMLP, "SwiGLUMLP")
    kernels.replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
    yield
    for cls in (LlamaMLP, GemmaMLP):
        del cls.kernel_layer_name, cls.kernel_condition


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


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
