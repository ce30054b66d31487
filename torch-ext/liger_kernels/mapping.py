"""The kernel mapping for ``kernels.kernelize``: every layer transformers' default mapping takes from this
package, in the same modes, plus the ``Mode.TORCH_COMPILE`` modes (every layer here traces under compile).

:data:`LAYERS` is the one table: for each layer name that transformers (or the user) tags, the layer used for
``Mode.TRAINING`` and the one for ``Mode.INFERENCE``. Both are registered with and without
``Mode.TORCH_COMPILE``, on every device this package is built for. Usage::

    from kernels import Mode, kernelize, use_kernel_mapping
    with use_kernel_mapping(lk.kernel_mapping()):
        kernelize(model, mode=Mode.TRAINING, device="cuda")

or ``lk.register_kernel_mapping()`` once for the whole process.
"""

from collections.abc import Iterable, Sequence
from pathlib import Path

HUB_REPO_ID = "kernels-community/liger-kernels"
HUB_VERSION = 3  # build.toml's [general] version: the kernel API version (a test keeps the two equal)
DEVICES = ("cuda", "rocm", "xpu", "mps", "cpu")  # the variants build.toml's backends give (metal is "mps")

# layer name -> (layer for Mode.TRAINING, layer for Mode.INFERENCE). None for inference leaves that mode to
# kernels' own fallback, which picks the training layer, as transformers' default mapping does for these.
LAYERS = {
    "SwiGLUMLP": ("LigerTiledSwiGLUMLP", "LigerSwiGLUMLP"),
    "GeGLUMLP": ("LigerTiledGEGLUMLP", "LigerGEGLUMLP"),
    "Linear": ("LigerLinear", None),
    "RMSNorm": ("LigerRMSNorm", "LigerRMSNorm"),
    "ForCausalLMLoss": ("LigerForCausalLMLossLayer", None),
    "rotary_pos_emb": ("liger_rotary_pos_emb_layer", "liger_rotary_pos_emb_layer"),
}


def layer_modes(name: str) -> dict:
    """``{Mode: layer}`` for one row of :data:`LAYERS`: its training and inference layers, each with and
    without ``Mode.TORCH_COMPILE``."""
    from kernels import Mode

    training, inference = LAYERS[name]
    modes = {Mode.TRAINING: training, Mode.TRAINING | Mode.TORCH_COMPILE: training}
    if inference is not None:
        modes[Mode.INFERENCE] = inference
        modes[Mode.INFERENCE | Mode.TORCH_COMPILE] = inference
    return modes


def kernel_mapping(
    repo_path: str | Path | None = None,
    *,
    repo_id: str = HUB_REPO_ID,
    version: int = HUB_VERSION,
    revision: str | None = None,
    devices: Sequence[str] = DEVICES,
    layers: Iterable[str] | None = None,
) -> dict:
    """The mapping ``{layer name: {device: {Mode: repository}}}`` for ``kernels.use_kernel_mapping``.

    Layers come from the Hub (``repo_id`` at ``version``), or from ``repo_id`` at a ``revision`` (a branch
    such as ``"v3"``, a tag or a commit), or, given ``repo_path``, from a local repository (a checkout whose
    ``build/`` holds the variants, as ``make variants`` writes it).

    ``revision`` is the form that works offline with ``LOCAL_KERNELS``: ``kernels`` resolves a ``version`` by
    asking the Hub (or its cache) for the version branches before it looks at ``LOCAL_KERNELS``, and fails
    offline; a revision goes straight to the loader, which honours ``LOCAL_KERNELS``. Branch ``v3`` is what
    version 3 resolves to online, so ``revision="v3"`` loads the same files.

    ``layers`` picks rows of :data:`LAYERS` by name (default: all).
    """
    from kernels import LayerRepository, LocalLayerRepository

    if repo_path is not None and revision is not None:
        raise ValueError("kernel_mapping: pass repo_path (a local checkout) or revision (a Hub revision), not both")
    names = list(LAYERS) if layers is None else list(layers)
    unknown = [name for name in names if name not in LAYERS]
    if unknown:
        raise ValueError(f"kernel_mapping: layers must be names from {sorted(LAYERS)}, got {unknown}")

    def repository(layer: str):
        if repo_path is not None:
            return LocalLayerRepository(Path(repo_path), layer_name=layer)
        if revision is not None:
            return LayerRepository(repo_id, layer_name=layer, revision=revision)
        return LayerRepository(repo_id, layer_name=layer, version=version)

    mapping = {}
    for name in names:
        modes = {mode: repository(layer) for mode, layer in layer_modes(name).items()}
        mapping[name] = {device: dict(modes) for device in devices}
    return mapping


def register_kernel_mapping(repo_path: str | Path | None = None, **kwargs) -> dict:
    """Register :func:`kernel_mapping` (same arguments) with ``kernels`` for the whole process; returns it."""
    import kernels

    mapping = kernel_mapping(repo_path, **kwargs)
    kernels.register_kernel_mapping(mapping)
    return mapping
