"""Llama-8B MLP (H 4096, I 14336, bf16, batch 1), forward + backward, on the GPU: time and extra peak
memory over what was allocated before the step (weight and input gradients included), for eager PyTorch,
torch.compile of it, this package's fused and tiled layers, and the peer liger-kernel's (when its wheel is
importable). Beyond 65,536 tokens only the tiled MLPs run (the point of tiling).

    python benchmarks/bench_mlp.py [--seqs 8192,32768,65536,131072,1048576] [--json OUT.json]

Ceilings measured in the same run: bf16 GEMM 8192^3. The tiled/untiled ratio is against the faster
untiled MLP in the same run (this package's or the peer's), as issue #5 asks.
"""

import argparse
import json
import sys
import types
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import liger_kernels as lk  # noqa: E402
from benchmark_mlp import _Host  # noqa: E402  (the same host module the `kernels benchmark` script uses)

H, I = 4096, 14336


def gemm_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, warmup=20, rep=200)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def implementations(host):
    impls = {"eager": host.forward, "torch.compile": torch.compile(host.forward)}
    for name, layer in (("fused", lk.LigerSwiGLUMLP), ("tiled", lk.LigerTiledSwiGLUMLP)):
        impls[name] = types.MethodType(layer.forward, host)
    try:
        from liger_kernel.ops import LigerSiLUMulFunction as PeerSiLUMul
        from liger_kernel.ops import apply_tiled_mlp as peer_tiled

        def peer_mlp(module, x):
            return module.down_proj(PeerSiLUMul.apply(module.gate_proj(x), module.up_proj(x)))

        impls["peer fused"] = lambda x: peer_mlp(host, x)
        impls["peer tiled"] = lambda x: peer_tiled(
            fn=peer_mlp, mlp_module=host, x=x, num_shards=None, compute_params=list(host.parameters())
        )
    except ImportError as error:
        print(f"(peer liger-kernel not importable: {error})")
    return impls


def step(forward, x, d_out, host):
    out = forward(x)
    out.backward(d_out)
    x.grad = None
    for p in host.parameters():
        p.grad = None


def measure(forward, x, d_out, host):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = forward(x)
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - before
    out.backward(d_out)
    del out
    x.grad = None
    for p in host.parameters():
        p.grad = None
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    print(f"           ({forward_peak / 2**30:.2f} GiB of it in forward)")
    # at least ~1 s of steps (median of ~15 at S = 32768): the GPU settles at its sustained clocks
    ms = do_bench(lambda: step(forward, x, d_out, host), warmup=100, rep=1000, return_mode="median")
    return ms, peak


def run(seqs):
    torch.manual_seed(0)
    host = _Host(H, I).cuda().bfloat16()
    results = {"gemm_tflops": gemm_tflops(), "rows": []}
    print(f"bf16 GEMM 8192^3: {results['gemm_tflops']:.0f} TFLOP/s")
    print(f"{'S':>8} {'impl':<13} {'ms':>9} {'peak GiB':>9} {'TFLOP/s (9 units)':>18}")
    impls = implementations(host)
    for seq in seqs:
        x = torch.randn(1, seq, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        d_out = torch.randn(1, seq, H, device="cuda", dtype=torch.bfloat16)
        flops = 2 * seq * H * I * 9  # 3 GEMMs forward, 6 backward
        timings = {}
        for name, forward in impls.items():
            if seq > 65536 and "tiled" not in name:
                continue
            try:
                ms, peak = measure(forward, x, d_out, host)
            except torch.OutOfMemoryError:
                print(f"{seq:>8} {name:<13} out of memory")
                torch.cuda.empty_cache()
                continue
            timings[name] = ms
            results["rows"].append({"seq": seq, "impl": name, "ms": ms, "peak_bytes": peak})
            print(f"{seq:>8} {name:<13} {ms:9.2f} {peak / 2**30:9.2f} {flops / (ms * 1e-3) / 1e12:18.0f}")
            torch.cuda.empty_cache()
        untiled = [timings[k] for k in ("fused", "peer fused") if k in timings]
        if untiled and "tiled" in timings:
            print(f"{seq:>8} tiled / faster untiled = {timings['tiled'] / min(untiled):.3f}")
        del x, d_out
        torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="8192,32768,65536,131072,1048576")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run([int(s) for s in args.seqs.split(",")])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
