"""The kernel mapping for ``kernels.kernelize``, shaped like transformers' default one for this package.

* "SwiGLUMLP" -> ``LigerTiledSwiGLUMLP`` for training, ``LigerSwiGLUMLP`` for inference;
* "GeGLUMLP"  -> ``LigerTiledGEGLUMLP`` for training, ``LigerGEGLUMLP`` for inference;
* "Linear"    -> ``LigerLinear`` for training;

each also under ``Mode.TORCH_COMPILE``, on every device the package runs on (Triton on CUDA/ROCm/XPU, the
PyTorch path on CPU and Metal). Usage::

    from kernels import kernelize, Mode, use_kernel_mapping
    with use_kernel_mapping(lk.kernel_mapping()):
        kernelize(model, mode=Mode.TRAINING, device="cuda")

or ``lk.register_kernel_mapping()`` once for the whole process.
"""

from pathlib import Path
from typing import Optional, Sequence, Union

HUB_REPO_ID = "kernels-community/liger-kernels"
HUB_VERSION = 3  # build.toml's [general] version: the kernel API version (a test keeps the two equal)
DEVICES = ("cuda", "rocm", "xpu", "mps", "cpu")
LAYERS = {  # layer name transformers tags -> (training layer, inference layer)
    "SwiGLUMLP": ("LigerTiledSwiGLUMLP", "LigerSwiGLUMLP"),
    "GeGLUMLP": ("LigerTiledGEGLUMLP", "LigerGEGLUMLP"),
    "Linear": ("LigerLinear", None),
}


def kernel_mapping(
    repo_path: Optional[Union[str, Path]] = None,
    *,
    repo_id: str = HUB_REPO_ID,
    version: int = HUB_VERSION,
    devices: Sequence[str] = DEVICES,
) -> dict:
    """The mapping, with layers from the Hub (``repo_id`` at ``version``) or, given ``repo_path``, from a
    local repository (a checkout with ``build/``, as ``make variants`` writes it)."""
    from kernels import LayerRepository, LocalLayerRepository, Mode

    def repository(layer: str):
        if repo_path is not None:
            return LocalLayerRepository(Path(repo_path), layer_name=layer)
        return LayerRepository(repo_id, layer_name=layer, version=version)

    mapping = {}
    for name, (training, inference) in LAYERS.items():
        modes = {Mode.TRAINING: repository(training), Mode.TRAINING | Mode.TORCH_COMPILE: repository(training)}
        if inference is not None:
            modes[Mode.INFERENCE] = repository(inference)
            modes[Mode.INFERENCE | Mode.TORCH_COMPILE] = repository(inference)
        mapping[name] = {device: dict(modes) for device in devices}
    return mapping


def register_kernel_mapping(repo_path: Optional[Union[str, Path]] = None, **kwargs) -> dict:
    """Register :func:`kernel_mapping` with ``kernels`` for the whole process; returns it."""
    import kernels

    mapping = kernel_mapping(repo_path, **kwargs)
    kernels.register_kernel_mapping(mapping)
    return mapping
