"""The package the way users load it: the variant tree, get_local_kernel, get_kernel with LOCAL_KERNELS."""

import json

import kernels
import pytest

from harness import ROOT, build_variants


def test_variant_tree_layout_and_metadata(variant_root):
    config = build_variants.read_config(ROOT)
    backends = sorted(config["general"]["backends"])
    assert backends == ["cpu", "cuda", "metal", "rocm", "xpu"]
    ids = set()
    for backend in backends:
        variant = variant_root / "build" / f"torch-{backend}"
        assert (variant / "liger_kernels" / "__init__.py").is_file()
        assert not list(variant.rglob("__pycache__"))
        metadata = json.loads((variant / "metadata.json").read_text())
        assert metadata["name"] == config["general"]["name"] == "liger-kernels"
        assert metadata["version"] == config["general"]["version"] == 3
        assert metadata["license"] == config["general"]["license"]
        assert metadata["python-depends"] == []
        assert metadata["backend"] == {"type": backend}
        ids.add(metadata["id"])
    assert len(ids) == len(backends)


def test_get_local_kernel_loads_the_cpu_variant(lk, variant_root):
    assert "_cpu_" in lk.__name__
    assert lk.__file__.startswith(str(variant_root / "build" / "torch-cpu"))
    for name in (
        "LigerSiLUMulFunction",
        "LigerGELUMulFunction",
        "LigerTiledMLPFunction",
        "apply_tiled_mlp",
        "kernel_mapping",
        "register_kernel_mapping",
    ):
        assert hasattr(lk, name), name
    for name in ("LigerSwiGLUMLP", "LigerGEGLUMLP", "LigerTiledSwiGLUMLP", "LigerTiledGEGLUMLP", "LigerLinear"):
        assert hasattr(lk.layers, name), name


def test_get_kernel_with_local_override(variant_root, monkeypatch):
    """LOCAL_KERNELS=kernels-community/liger-kernels=<root> with HF_HUB_OFFLINE=1 (set in conftest)."""
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/liger-kernels={variant_root}")
    module = kernels.get_kernel("kernels-community/liger-kernels", version=3)
    assert module.__file__.startswith(str(variant_root / "build" / "torch-cpu"))
    assert module.layers.LigerTiledSwiGLUMLP.forward


def test_mapping_version_is_build_toml_version(lk):
    assert lk.mapping.HUB_VERSION == build_variants.read_config(ROOT)["general"]["version"]
    assert lk.mapping.HUB_REPO_ID == build_variants.read_config(ROOT)["general"]["hub"]["repo-id"]


def test_build_without_the_package_fails_loudly(tmp_path):
    (tmp_path / "build.toml").write_text((ROOT / "build.toml").read_text())
    with pytest.raises(FileNotFoundError):
        build_variants.build(tmp_path / "build", root=tmp_path)
