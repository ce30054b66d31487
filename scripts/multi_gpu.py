"""On two GPUs: DDP, FSDP2 (units on the MLP blocks, or also on each projection) and DeepSpeed ZeRO-3 with
tiled vs untiled gated MLPs, NCCL.

    python scripts/multi_gpu.py [--gpus 2] [--hidden 1024] [--seq 8192]

For each engine and dtype (fp32, bf16): gradient parity of the tiled stack with an untiled single-GPU
reference in fp32 on the global batch (fp32: max abs error; bf16: relative error, next to the untiled bf16
engine's own), and the step time (forward + backward) and per-rank peak memory of tiled and untiled.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "tools"))


def stack(hidden, intermediate, layer, lk):
    from ddp_demo import GatedMLP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[GatedMLP(hidden, intermediate) for _ in range(2)])
    if layer is not None:
        for block in model:
            block.forward = types.MethodType(getattr(lk, layer).forward, block)
    return model


def data(rank, seq, hidden, device):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(1, seq, hidden, generator=g).to(device), torch.randn(1, seq, hidden, generator=g).to(device)


def wrap(engine, model, dtype, rank):
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(dtype)
        return DDP(model, device_ids=[rank]), lambda p: p.grad, lambda loss: loss.backward()
    if engine in ("fsdp2", "fsdp2_proj"):
        from torch.distributed.fsdp import fully_shard

        model = model.to(dtype)
        for block in model:
            if engine == "fsdp2_proj":  # units on the projections: gathered inside every shard
                for proj in (block.gate_proj, block.up_proj, block.down_proj):
                    fully_shard(proj)
            fully_shard(block)
        fully_shard(model)
        return model, lambda p: p.grad.full_tensor(), lambda loss: loss.backward()
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    config = {
        "train_batch_size": dist.get_world_size(),
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    engine_, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine_, safe_get_full_grad, engine_.backward


def run(rank, world, port, args, out_dir):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    import liger_kernels as lk

    device = torch.device("cuda", rank)
    hidden, intermediate, seq = args.hidden, args.intermediate, args.seq
    rows = []
    try:
        reference = stack(hidden, intermediate, None, lk).to(device)
        for r in range(world):
            x, w = data(r, seq, hidden, device)
            ((reference(x) * w).mean() / world).backward()
        ref_grads = [p.grad.detach().clone() for p in reference.parameters()]
        del reference
        for engine in args.engines.split(","):
            for dtype in (torch.float32, torch.bfloat16):
                for layer in ("LigerTiledSwiGLUMLP", "LigerSwiGLUMLP"):
                    model = stack(hidden, intermediate, layer, lk).to(device)
                    wrapped, full_grad, backward = wrap(engine, model, dtype, rank)
                    x, w = data(rank, seq, hidden, device)
                    x, w = x.to(dtype), w.to(dtype)

                    def step(wrapped=wrapped, backward=backward, x=x, w=w):
                        backward((wrapped(x) * w).float().mean())

                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - before
                    owner = wrapped if engine.startswith("fsdp2") else wrapped.module
                    grads = [full_grad(p) for p in owner.parameters()]
                    if dtype == torch.float32:
                        parity = max((g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads))
                    else:
                        parity = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads))
                    times = []
                    for _ in range(5):
                        if engine == "zero3":
                            wrapped.step()  # DeepSpeed expects a step between backward passes
                        else:
                            for p in wrapped.parameters():
                                p.grad = None
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        step()
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - start) * 1e3)
                    rows.append(
                        {
                            "engine": engine,
                            "dtype": str(dtype)[6:],
                            "layer": layer,
                            "ms": sorted(times)[2],
                            "peak_gib": peak / 2**30,
                            "parity": parity,
                        }
                    )
                    del wrapped, model, grads
                    torch.cuda.empty_cache()
        if rank == 0:
            (Path(out_dir) / "multi_gpu.json").write_text(json.dumps(rows, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--engines", default="ddp,fsdp2,fsdp2_proj,zero3")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.gpus, port, args, args.out), nprocs=args.gpus, join=True)
    rows = json.loads((Path(args.out) / "multi_gpu.json").read_text())
    print(f"{'engine':<6} {'dtype':<9} {'layer':<20} {'step ms':>8} {'peak GiB':>9} {'parity':>10}")
    for r in rows:
        print(
            f"{r['engine']:<6} {r['dtype']:<9} {r['layer']:<20} {r['ms']:8.2f} {r['peak_gib']:9.2f} {r['parity']:10.2e}"
        )
    print("parity: fp32 max abs error of every gradient against the fp32 single-GPU reference; bf16 relative error")


if __name__ == "__main__":
    main()
