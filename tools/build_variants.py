"""Write the variant tree kernel-builder produces for this Python/Triton package, from build.toml.

    python tools/build_variants.py [--out build]

gives build/torch-<backend>/ for each backend in build.toml, each holding the package (torch-ext/<name>/)
and a metadata.json, and build/CARD.md, the Hub card filled in from the CARD.md template. It is the local
equivalent of the nix build in flake.nix (the release path), for development and tests:
`kernels.get_local_kernel(Path(<repo root>))` loads from it.
"""

import argparse
import ast
import hashlib
import json
import shutil
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# The [general] keys of kernel-builder's build.toml (edition 5); the builder rejects any other key.
GENERAL_KEYS = {
    "name",
    "version",
    "edition",
    "license",
    "upstream",
    "source",
    "backends",
    "cuda",
    "hub",
    "kernel-depends",
    "neuron",
    "python-depends",
    "tpu",
    "xpu",
}
GIT_URL_SCHEMES = ("https://", "http://", "git://", "ssh://", "git+ssh://", "git+https://", "git+http://")


def read_config(root: Path = ROOT) -> dict:
    with open(root / "build.toml", "rb") as f:
        config = tomllib.load(f)
    check_config(config)
    return config


def check_config(config: dict) -> None:
    """What kernel-builder would refuse in [general]: unknown keys, another edition, a non-git upstream/source."""
    general = config["general"]
    unknown = sorted(set(general) - GENERAL_KEYS)
    if unknown:
        raise ValueError(f"build.toml [general]: kernel-builder does not know {unknown}")
    if general.get("edition") != 5:
        raise ValueError(f"build.toml [general]: edition must be 5, got {general.get('edition')!r}")
    for key in ("upstream", "source"):
        url = general.get(key)
        if url is not None and not url.startswith(GIT_URL_SCHEMES):
            raise ValueError(
                f"build.toml [general]: {key} must be a git URL ({', '.join(GIT_URL_SCHEMES)}), got {url!r}"
            )


def module_name(config: dict) -> str:
    return config["general"]["name"].replace("-", "_")


def source_digest(source: Path) -> str:
    """A short hash of the package sources, so two different builds never share a module id."""
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.py")):
        digest.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def metadata(config: dict, backend: str, digest: str) -> dict:
    general = config["general"]
    data = {
        "name": general["name"],
        "id": f"_{module_name(config)}_v{general['version']}_{backend}_{digest}",
        "version": general["version"],
        "license": general["license"],
    }
    data.update({key: general[key] for key in ("upstream", "source") if key in general})
    data["python-depends"] = general.get("python-depends", [])
    data["backend"] = {"type": backend}
    return data


def card_context(config: dict, root: Path = ROOT) -> dict:
    """What kernel-builder fills the CARD.md template with: the repository and version, the package's
    ``__all__`` (less "layers") as functions, the classes of layers.py when ``__all__`` has "layers", whether
    benchmarks/benchmark.py exists, upstream, source, and the license in lower case."""
    general = config["general"]
    package = root / "torch-ext" / module_name(config)
    exported = []
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exported = [elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)]
    layers = None
    if "layers" in exported:
        tree = ast.parse((package / "layers.py").read_text())
        layers = [node.name for node in tree.body if isinstance(node, ast.ClassDef)] or None
    return {
        "repo_id": general["hub"]["repo-id"],
        "version": general["version"],
        "functions": [name for name in exported if name != "layers"] or None,
        "layers": layers,
        "has_benchmark": (root / "benchmarks" / "benchmark.py").exists(),
        "upstream": general.get("upstream"),
        "source": general.get("source"),
        "license": general["license"].lower(),
    }


def render_card(config: dict, root: Path = ROOT) -> str:
    """CARD.md filled in as kernel-builder does (a minijinja template with trim_blocks; jinja2 reads it the
    same way); kernel-builder uploads the result as the Hub repository's README.md."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string((root / "CARD.md").read_text()).render(card_context(config, root))


def build(out: Path, root: Path = ROOT) -> list:
    config = read_config(root)
    name = module_name(config)
    source = root / "torch-ext" / name
    digest = source_digest(source)
    written = []
    for backend in config["general"]["backends"]:
        variant = out / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        shutil.copytree(source, variant / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (variant / "metadata.json").write_text(json.dumps(metadata(config, backend, digest), indent=2) + "\n")
        written.append(variant)
    if (root / "CARD.md").exists():
        (out / "CARD.md").write_text(render_card(config, root))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="where to write the variants")
    args = parser.parse_args()
    for variant in build(args.out):
        print(variant)


if __name__ == "__main__":
    main()
