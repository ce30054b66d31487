"""Host (CPU) time per call of the fused activations on the GPU: tiny tensors, so the GPU never holds the host
back and the wall time per call is the host's own cost (dispatch, checks, the Triton launch).

    python benchmarks/probe_host.py [--profile]
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
import liger_kernels as lk  # noqa: E402


def host_us(fn, calls=2000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(a, requires_grad=True)
    d_out = torch.randn_like(a)
    impls = {
        "lk.silu_mul (custom op)": lk.silu_mul,
        "lk.LigerSiLUMulFunction": lk.LigerSiLUMulFunction.apply,
        "eager silu(a) * b": lambda x, y: F.silu(x) * y,
    }
    try:
        from liger_kernel.ops import LigerSiLUMulFunction as Peer

        impls["liger-kernel 0.8.5"] = Peer.apply
    except ImportError:
        pass
    print(f"{'impl':<26} {'fwd us':>8} {'fwd no-grad us':>15} {'fwd+bwd us':>11}")
    for name, fn in impls.items():
        forward = host_us(lambda: fn(a, b))
        with torch.no_grad():
            no_grad = host_us(lambda: fn(a, b))
        both = host_us(lambda: torch.autograd.grad(fn(a, b), (a, b), d_out))
        print(f"{name:<26} {forward:8.1f} {no_grad:15.1f} {both:11.1f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            lk.silu_mul(a, b)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
