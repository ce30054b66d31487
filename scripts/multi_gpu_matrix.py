"""The CPU suite's distributed matrix (DDP, FSDP2, DeepSpeed ZeRO-2/3 cases of tests/) on GPUs with NCCL.

    python scripts/multi_gpu_matrix.py          # needs 2 GPUs, kernels and deepspeed importable

Each case runs the same worker as its CPU test, with backend nccl and cuda tensors, and prints the largest
gradient and post-step weight differences against the untiled single-process reference (fp32).
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]

import build_variants  # noqa: E402
from dist_workers import engine_case, zero_case  # noqa: E402
from test_deepspeed import CASES as ZERO_CASES  # noqa: E402
from test_fsdp2 import CASES as FSDP2_CASES  # noqa: E402
from test_tiled_distributed import STACK_CASES  # noqa: E402
from train_ddp import launch  # noqa: E402


def main():
    matrix = [(f"DDP stack, {name}", engine_case, {"engine": "ddp", "model": "mlps", **o}) for name, o in STACK_CASES.items()]
    matrix += [(f"FSDP2 {name}", engine_case, {"engine": "fsdp2", **o}) for name, o in FSDP2_CASES.items()]
    matrix += [(name, zero_case, o) for name, o in ZERO_CASES.items()]
    worst = 0.0
    with tempfile.TemporaryDirectory() as root:
        build_variants.build(Path(root) / "build")
        for name, worker, options in matrix:
            with tempfile.TemporaryDirectory() as out:
                results = launch(worker, 2, root, {**options, "backend": "nccl"}, out)
            grad = max(r["grad_diff"] for r in results)
            weight = max(r["weight_diff"] for r in results)
            missing = sorted({m for r in results for m in r["missing"]})
            worst = max(worst, grad, weight)
            print(f"{name:<55} grad {grad:9.2e}  weight {weight:9.2e}  missing {missing}", flush=True)
    print(f"largest difference over the matrix: {worst:.2e} (bound 1e-6)")


if __name__ == "__main__":
    main()
