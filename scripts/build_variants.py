"""Write the variant tree kernel-builder produces for this Python/Triton package, from build.toml.

    python scripts/build_variants.py [--out build]

gives build/torch-<backend>/ for each backend in build.toml, each holding the package (torch-ext/<name>/)
and a metadata.json. It is the local equivalent of the nix build in flake.nix (the release path), for
development and tests: `kernels.get_local_kernel(<repo root>)` loads from it.
"""

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def read_config(root: Path = ROOT) -> dict:
    with open(root / "build.toml", "rb") as f:
        return tomllib.load(f)


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
    return {
        "name": general["name"],
        "id": f"_{module_name(config)}_v{general['version']}_{backend}_{digest}",
        "version": general["version"],
        "license": general["license"],
        "python-depends": general.get("python-depends", []),
        "backend": {"type": backend},
    }


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
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="where to write the variants")
    args = parser.parse_args()
    for variant in build(args.out):
        print(variant)


if __name__ == "__main__":
    main()
