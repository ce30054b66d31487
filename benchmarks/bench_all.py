"""Issue #5's benchmark in one run on the GPU: the ceilings (copy bandwidth, bf16 GEMM), the fused activations
(bench_activations.py) and the Llama-8B MLP (bench_mlp.py) for this package, eager PyTorch, torch.compile and
the peer liger-kernel 0.8.5. Writes OUT.json, and OUT.png when matplotlib is importable (plot.py makes the
PNG from the JSON on any machine).

    python benchmarks/bench_all.py --out benchmarks/results/h200 [--seqs 8192,...] [--sweep]
"""

import argparse
import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_activations  # noqa: E402
import bench_mlp  # noqa: E402
import plot  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="path prefix for OUT.json and OUT.png")
    parser.add_argument("--seqs", default="8192,32768,65536,131072,1048576")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    results = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
    }
    try:
        results["versions"]["liger-kernel"] = version("liger-kernel")
    except PackageNotFoundError:
        pass
    results["activations"] = bench_activations.run(args.sweep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    results["mlp"] = bench_mlp.run([int(s) for s in args.seqs.split(",")])
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(plot.summary(results))
    try:
        plot.plot(results, args.out.with_suffix(".png"))
    except ImportError as error:
        print(f"(no PNG: {error}; run benchmarks/plot.py on the JSON)")


if __name__ == "__main__":
    main()
