"""Workers for the multi-process tests (spawned: they must live in an importable module)."""

import datetime
import json
from pathlib import Path

import kernels
import torch
import torch.distributed as dist

from tiled_cases import GatedMLP


def uneven_sequences(rank, world, port, variant_root, options, out_dir):
    """Ranks with different sequence lengths and automatic shards. fn runs a collective in every shard,
    as ZeRO-3 and FSDP do when they gather parameters: unequal shard counts would hang here."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        lk = kernels.get_local_kernel(Path(variant_root))
        torch.manual_seed(rank)
        module = GatedMLP(64, 96).double()
        calls = []

        def gathering(mlp, shard):
            token = torch.ones(1)
            dist.all_reduce(token)
            calls.append(shard.shape[-2])
            return mlp(shard)

        x = torch.randn(1, options["seq"][rank], 64, dtype=torch.float64, requires_grad=True)
        out = lk.apply_tiled_mlp(gathering, module, x)
        forward_calls = len(calls)
        out.sum().backward()
        ref = x.detach().requires_grad_()
        module_ref = GatedMLP(64, 96).double()
        module_ref.load_state_dict(module.state_dict())
        module_ref(ref).sum().backward()
        diff = max((x.grad - ref.grad).abs().max().item(), *[
            (p.grad - q.grad).abs().max().item() for p, q in zip(module.parameters(), module_ref.parameters())
        ])  # fmt: skip
        result = {"forward_calls": forward_calls, "total_calls": len(calls), "rows": calls, "diff": diff}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
