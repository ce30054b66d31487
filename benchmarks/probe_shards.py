"""Time and extra peak memory of the tiled Llama-8B MLP against its shard count, on the GPU.

    python benchmarks/probe_shards.py [--seq 32768] [--shards 4,6,7,8,10,16]
"""

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mlp import H, I, _Host, lk, measure  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--shards", default="4,6,7,8,10,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    host = _Host(H, I).cuda().bfloat16()
    x = torch.randn(1, args.seq, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn_like(x)
    forward = types.MethodType(lk.LigerTiledSwiGLUMLP.forward, host)
    for shards in [int(s) for s in args.shards.split(",")]:
        host.num_shards = shards
        ms, peak = measure(forward, x, d_out, host)
        print(f"S={args.seq} shards={shards:3d} rows/shard={args.seq // shards:6d}  {ms:8.2f} ms  {peak / 2**30:.2f} GiB")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
