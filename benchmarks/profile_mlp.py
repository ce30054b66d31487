"""Where the Llama-8B MLP's step time goes on the GPU: one forward + backward under torch.profiler, per
implementation, with the GPU kernel time summed by kernel and the gap between kernel time and wall time.

    python benchmarks/profile_mlp.py [--seq 32768] [--impls fused,tiled] [--trace DIR]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mlp import H, I, _Host, implementations, step  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--impls", default="fused,tiled")
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    host = _Host(H, I).cuda().bfloat16()
    x = torch.randn(1, args.seq, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn_like(x)
    impls = implementations(host)
    for name in args.impls.split(","):
        forward = impls[name]
        for _ in range(3):
            step(forward, x, d_out, host)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            step(forward, x, d_out, host)
            end.record()
            torch.cuda.synchronize()
        wall = start.elapsed_time(end)
        kernels = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                key = event.name[:90]
                total, count = kernels.get(key, (0.0, 0))
                kernels[key] = (total + event.device_time / 1e3, count + 1)
        busy = sum(t for t, _ in kernels.values())
        flops = 2 * args.seq * H * I
        print(f"\n== {name}, S={args.seq}: wall {wall:.2f} ms, kernels {busy:.2f} ms, idle {wall - busy:.2f} ms")
        print(f"   (one GEMM-unit 2*S*H*I at 741 TFLOP/s = {flops / 741e12 * 1e3:.2f} ms)")
        for key, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"   {t:8.2f} ms {n:4d}x  {key}")
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{name}_{args.seq}.json"))


if __name__ == "__main__":
    main()
