"""pytest's fixtures and hooks; the shared helpers are in harness.py (imported first: it sets up the
environment, TRITON_INTERPRET included, before anything imports Triton)."""

# isort: off
import harness  # noqa: F401  (first: it sets HF_HUB_OFFLINE and TRITON_INTERPRET before kernels or Triton load)

# isort: on
from pathlib import Path

import kernels
import pytest

from harness import BACKENDS, HAS_CUDA, LK, VARIANT_ROOT, backend, poisoned_outputs, skip_unless_runnable


@pytest.fixture(scope="session")
def variant_root() -> Path:
    """A repository root whose build/ holds freshly built variants of the current sources."""
    return VARIANT_ROOT


@pytest.fixture(scope="session")
def lk():
    """The package, as ``kernels`` loads it."""
    assert LK.__name__ != "liger_kernels", "expected the loader's own module name"
    return LK


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    skip_unless_runnable(request.param)
    with backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def poison(request):
    if "lk" in request.fixturenames:
        with poisoned_outputs(request.getfixturevalue("lk")):
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def tiny_shards(request, monkeypatch):
    """The tests' MLPs are tiny (S of tens to hundreds of tokens), far below the automatic shard count's minimum
    shard length: with it lowered to one token, automatic calls still tile as they would at real sizes, so the
    tiled machinery is what runs. Tests of the policy itself are marked ``shard_policy`` and see the real one."""
    if "lk" in request.fixturenames and "shard_policy" not in request.keywords:
        monkeypatch.setattr(request.getfixturevalue("lk")._tiling, "MIN_SHARD_TOKENS", 1)
        monkeypatch.setattr(request.getfixturevalue("lk")._tiling, "MIN_SHARD_WORK", 0)
        monkeypatch.setattr(request.getfixturevalue("lk")._tiling, "MIN_BLOCK_COLUMNS", 1)
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


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
