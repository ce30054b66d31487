"""Hub metadata: build.toml, each variant's metadata.json (as kernels reads it), the card kernel-builder fills
in from CARD.md, and LICENSE say the same things."""

import copy
import re

import pytest
from kernels._rust import Metadata

from harness import ROOT, build_variants

LICENSE = "BSD-2-Clause"
UPSTREAM = "https://github.com/linkedin/Liger-Kernel"


@pytest.fixture(scope="module")
def config():
    return build_variants.read_config(ROOT)


def test_license_everywhere(config, variant_root):
    assert config["general"]["license"] == LICENSE
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 2-Clause License\n")
    assert re.search(r"^Copyright \(c\) \d{4}, liger-kernels authors$", text, re.MULTILINE)
    for backend in config["general"]["backends"]:
        assert Metadata.read_from_file(variant_root / "build" / f"torch-{backend}" / "metadata.json").license == LICENSE


def test_upstream_and_source_reach_the_metadata(config, variant_root):
    general = config["general"]
    assert general["upstream"] == UPSTREAM
    assert general["source"].startswith("https://github.com/")
    for backend in general["backends"]:
        metadata = Metadata.read_from_file(variant_root / "build" / f"torch-{backend}" / "metadata.json")
        assert (metadata.upstream, metadata.source) == (general["upstream"], general["source"])
        assert metadata.version == general["version"] and str(metadata.name) == general["name"]


def test_kernels_info_reads_the_local_build(config, variant_root):
    from kernels.cli.info import _local_kernel_info

    info = _local_kernel_info(variant_root)
    assert (info["license"], info["upstream"], info["source"]) == (LICENSE, UPSTREAM, config["general"]["source"])
    assert info["backends"] == sorted(config["general"]["backends"])


def test_build_toml_keeps_to_the_builder_format(config):
    """kernel-builder rejects unknown [general] keys and non-git URLs; so does the local build."""
    build_variants.check_config(config)
    with pytest.raises(ValueError, match="does not know"):
        build_variants.check_config({"general": {**config["general"], "homepage": UPSTREAM}})
    with pytest.raises(ValueError, match="git URL"):
        build_variants.check_config({"general": {**config["general"], "upstream": "github.com/linkedin/Liger-Kernel"}})
    with pytest.raises(ValueError, match="edition"):
        build_variants.check_config({"general": {**config["general"], "edition": 4}})


def frontmatter(card: str) -> dict:
    assert card.startswith("---\n")
    block = card.split("---\n")[1]
    return dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)


def test_card_is_filled_in_like_kernel_builder(config, variant_root, lk):
    card = build_variants.render_card(config, ROOT)
    assert (variant_root / "build" / "CARD.md").read_text() == card
    assert "{{" not in card and "{%" not in card
    assert frontmatter(card) == {"library_name": "kernels", "license": LICENSE.lower()}
    assert f'get_kernel("{config["general"]["hub"]["repo-id"]}", version={config["general"]["version"]})' in card
    layers = card.split("## Available layers\n")[1].split("\n## ")[0]
    listed = set(re.findall(r"^- `(\w+)`$", layers, re.MULTILINE))
    assert {layer for row in lk.mapping.LAYERS.values() for layer in row if layer} <= listed
    assert f"## Upstream\n\nThe kernels and their Python API follow {UPSTREAM};" in card
    assert f"kept in {config['general']['source']}." in card


def test_card_names_the_mapped_layer_names(lk):
    """The card lists the mapping's layer names in prose (kernel-builder fills in no package data there)."""
    text = (ROOT / "CARD.md").read_text()
    sentence = re.search(r"gives this repository \(([^)]*)\)", text.replace("\n", " ")).group(1)
    assert re.findall(r"`(\w+)`", sentence) == list(lk.mapping.LAYERS)


def test_card_context_without_optional_fields(config):
    bare = copy.deepcopy(config)
    for key in ("upstream", "source"):
        del bare["general"][key]
    card = build_variants.render_card(bare, ROOT)
    assert "## Upstream" not in card and "## Source" not in card
