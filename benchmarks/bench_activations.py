"""Fused SwiGLU / GeGLU on the GPU: time and share of the measured copy bandwidth, against eager PyTorch.

    python benchmarks/bench_activations.py [--sweep] [--json OUT.json]

Bytes counted are the ideal ones: forward reads a, b and writes c (3 tensors); backward reads d_out, a, b
and writes both gradients (5 tensors). The ceiling is a device-to-device copy measured in the same run.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
import liger_kernels as lk  # noqa: E402
from liger_kernels import _gated  # noqa: E402

SHAPES = [(32768, 14336), (8192, 4096)]


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / (ms * 1e-3)


def cases():
    yield "swiglu", lambda a, b: lk.silu_mul(a, b), lambda a, b: F.silu(a) * b
    yield "geglu_tanh", lambda a, b: lk.gelu_mul(a, b, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b
    yield "geglu_exact", lambda a, b: lk.gelu_mul(a, b, "none"), lambda a, b: F.gelu(a) * b


def measure(fn, rows, cols, dtype=torch.bfloat16):
    a = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    d_out = torch.randn(rows, cols, device="cuda", dtype=dtype)
    nbytes = a.numel() * a.element_size()
    fwd = do_bench(lambda: fn(a, b), warmup=25, rep=200)
    out = fn(a, b)
    bwd = do_bench(lambda: torch.autograd.grad(out, (a, b), d_out, retain_graph=True), warmup=25, rep=200)
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_bytes": 3 * nbytes, "bwd_bytes": 5 * nbytes}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also sweep BLOCK x num_warps")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ceiling = copy_bandwidth()
    print(f"copy bandwidth ceiling: {ceiling / 1e12:.2f} TB/s")
    results = {"copy_bytes_per_s": ceiling, "rows": []}
    configs = [(_gated.BLOCK, _gated.NUM_WARPS)]
    if args.sweep:
        configs = [(blk, w) for blk in (1024, 2048, 4096, 8192) for w in (4, 8, 16) if blk // (32 * w) >= 4]
    print(f"{'op':<12} {'shape':<12} {'impl':<16} {'fwd ms':>8} {'fwd %':>6} {'bwd ms':>8} {'bwd %':>6}")
    for name, ours, eager in cases():
        for rows, cols in SHAPES:
            impls = [("eager", eager, None)] + [(f"liger b{blk} w{w}", ours, (blk, w)) for blk, w in configs]
            for label, fn, config in impls:
                if config:
                    _gated.BLOCK, _gated.NUM_WARPS = config
                r = measure(fn, rows, cols)
                fwd_pct = 100 * r["fwd_bytes"] / (r["fwd_ms"] * 1e-3) / ceiling
                bwd_pct = 100 * r["bwd_bytes"] / (r["bwd_ms"] * 1e-3) / ceiling
                results["rows"].append({"op": name, "shape": [rows, cols], "impl": label, **r, "fwd_pct": fwd_pct, "bwd_pct": bwd_pct})
                print(f"{name:<12} {rows}x{cols:<6} {label:<16} {r['fwd_ms']:8.3f} {fwd_pct:6.1f} {r['bwd_ms']:8.3f} {bwd_pct:6.1f}")
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
