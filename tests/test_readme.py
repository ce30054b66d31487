"""Every ```python block of README.md, and of the card kernel-builder fills in from CARD.md, runs as written.

The blocks of a document run top to bottom in one namespace, as a reader pastes them into one session. Two
substitutions stand in for the reader's machine: the device string "cuda" becomes "cpu", and the checkout
path /path/to/liger-kernels becomes a fresh build of this repository. The Hub is stood in for too:
LOCAL_KERNELS serves kernels-community/liger-kernels from that build (conftest sets HF_HUB_OFFLINE=1), and a
Hub cache that has seen version 3 (refs/v3, what one online run leaves) lets kernels resolve the version.
Blocks under a heading that says "Offline" run with no Hub cache at all, as the recipe there promises.
"""

import copy
import re

import kernels
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from harness import ROOT, build_variants

HUB_REPO = "kernels-community/liger-kernels"
CHECKOUT = "/path/to/liger-kernels"


def python_blocks(markdown: str) -> list:
    """``(heading, code)`` for each ```python block, with the last heading above it."""
    blocks, heading, code, fence = [], "", None, None
    for line in markdown.splitlines():
        if code is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence = line[3:].strip()
                code = []
        elif line.startswith("```"):
            if fence == "python":
                blocks.append((heading, "\n".join(code) + "\n"))
            code = None
        else:
            code.append(line)
    assert code is None, "unclosed code fence"
    return blocks


def on_this_machine(code: str, checkout) -> str:
    return code.replace('"cuda"', '"cpu"').replace(CHECKOUT, str(checkout))


@pytest.fixture
def hub(variant_root, tmp_path, monkeypatch):
    """LOCAL_KERNELS on the build, a Hub cache holding refs/v3 of this repository, nothing cached in kernels;
    ``hub.offline()`` empties the cache. Tags the blocks put on transformers classes are removed afterwards."""
    from huggingface_hub.file_download import repo_folder_name

    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO}={variant_root}")
    cache = tmp_path / "hub-cache"
    ref = cache / repo_folder_name(repo_id=HUB_REPO, repo_type="kernel") / "refs" / "v3"
    ref.parent.mkdir(parents=True)
    ref.write_text("v3")
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.setattr(kernels.layer.layer, "_CACHED_LAYER", {})
    kernels.LayerRepository._resolve_revision.cache_clear()
    saved_mapping = copy.deepcopy(kernels.layer.globals._KERNEL_MAPPING.get())
    tagged_before = {cls: "kernel_layer_name" in vars(cls) for cls in (LlamaMLP, torch.nn.Linear)}

    class Hub:
        @staticmethod
        def offline():
            monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "no-cache"))
            monkeypatch.setattr(kernels.layer.layer, "_CACHED_LAYER", {})
            kernels.LayerRepository._resolve_revision.cache_clear()

    yield Hub
    kernels.LayerRepository._resolve_revision.cache_clear()
    kernels.layer.globals._KERNEL_MAPPING.set(saved_mapping)
    for cls, was_tagged in tagged_before.items():
        if not was_tagged and "kernel_layer_name" in vars(cls):
            del cls.kernel_layer_name, cls.kernel_condition


def run_blocks(blocks, checkout, hub) -> dict:
    namespace = {"__name__": "__readme__"}
    for index, (heading, code) in enumerate(blocks):
        if "offline" in heading.lower():
            hub.offline()
        code = compile(on_this_machine(code, checkout), f"<block {index} under {heading!r}>", "exec")
        exec(code, namespace)  # noqa: S102 -- running the README is the point
    return namespace


def forward_layer(module) -> str:
    return module.forward.__func__.__qualname__.split(".")[0]


def test_readme_python_blocks_run(lk, variant_root, hub, monkeypatch):
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4
    ns = run_blocks(blocks, variant_root, hub)

    # what the blocks claim: the package loaded through kernels, the MLPs and RMSNorms swapped in
    assert ns["lk"] is lk
    model = ns["model"]
    assert {forward_layer(m) for m in model.modules() if isinstance(m, LlamaMLP)} == {"LigerTiledSwiGLUMLP"}
    assert {forward_layer(m) for m in model.modules() if isinstance(m, LlamaRMSNorm)} == {"LigerRMSNorm"}

    # the KernelConfig example resolves to version 3 (KernelConfig refuses cpu: resolve as on a cuda machine)
    from transformers.utils import kernel_config as kc

    def resolved(config):
        config = copy.deepcopy(config)
        config.sanitize_kernel_mapping(model)
        monkeypatch.setattr(kc, "infer_device", lambda model: "cuda")
        config.create_compatible_mapping(model)
        return {name: next(iter(devices["cuda"].values())) for name, devices in config.kernel_mapping.items()}

    repos = resolved(ns["kernel_config"])
    assert set(repos) == {"SwiGLUMLP", "RMSNorm"}
    for name, repo in repos.items():
        assert (repo._repo_id, repo._version, repo._revision) == (HUB_REPO, 3, None), name
    assert repos["SwiGLUMLP"].layer_name == "LigerTiledSwiGLUMLP"
    # why the README passes the version: the plain string form asks for version 1
    plain = kc.KernelConfig({"SwiGLUMLP": f"{HUB_REPO}:LigerTiledSwiGLUMLP"})
    assert resolved(plain)["SwiGLUMLP"]._version == 1


def test_card_python_blocks_run(lk, variant_root, hub):
    card = build_variants.render_card(build_variants.read_config(ROOT), ROOT)
    blocks = python_blocks(card)
    assert blocks
    ns = run_blocks(blocks, variant_root, hub)
    assert ns["liger"] is lk
    assert torch.allclose(ns["out"], F.silu(ns["gate"]) * ns["up"], rtol=1e-6, atol=1e-6)


def test_readme_mapping_table_is_the_package_table(lk):
    text = (ROOT / "README.md").read_text()
    header = "| layer name | `Mode.TRAINING` | `Mode.INFERENCE` |"
    assert text.count(header) == 1
    rows = text.split(header)[1].split("\n\n")[0].splitlines()[2:]
    table = {}
    for row in rows:
        name, training, inference = (cell.strip().strip("`") for cell in row.strip("|").split("|")[:3])
        table[name] = (training, None if inference == "–" else inference)
    assert table == lk.mapping.LAYERS


def test_readme_links_stay_in_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "../" not in text
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target


def test_readme_pins_are_requirements_pins():
    pins = set((ROOT / "requirements.txt").read_text().split())
    quoted = re.findall(r"`([A-Za-z][\w-]*==[\w.]+)`", (ROOT / "README.md").read_text())
    assert quoted and set(quoted) <= pins, set(quoted) - pins
