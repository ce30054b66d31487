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


def fsdp2_case(rank, world, port, variant_root, options, out_dir):
    """FSDP2 (fully_shard) with tiled MLPs against an untiled single-process run on the global batch: every
    gradient, and the weights after one SGD step with lr 1."""
    import copy
    import types

    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        result = _fsdp2_run(rank, world, Path(variant_root), options, fully_shard, copy, types)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp2_run(rank, world, variant_root, options, fully_shard, copy, types):
    import gc

    lk = kernels.get_local_kernel(variant_root)
    torch.manual_seed(0)
    if options["model"] == "llama":
        from train_ddp import kernelize_tiled, tiny_llama_config
        from transformers import LlamaForCausalLM

        reference = LlamaForCausalLM(tiny_llama_config())
        model = kernelize_tiled(copy.deepcopy(reference), variant_root)
        units = list(model.model.layers) if options["wrap"] == "layers" else [layer.mlp for layer in model.model.layers]

        def loss_of(m, r, micro):
            ids = torch.randint(0, 97, (1, 256), generator=torch.Generator().manual_seed(10 * micro + r))
            return m(input_ids=ids, labels=ids).loss
    else:
        reference = torch.nn.Sequential(*[GatedMLP(64, 160) for _ in range(3)])
        model = copy.deepcopy(reference)
        for block in model:
            block.forward = types.MethodType(lk.LigerTiledSwiGLUMLP.forward, block)
        units = list(model)

        def loss_of(m, r, micro):
            g = torch.Generator().manual_seed(10 * micro + r)
            x = torch.randn(2, 256, 64, generator=g)
            return (m(x) * torch.randn(2, 256, 64, generator=g)).mean()

    if options.get("freeze"):
        for m in (model, reference):
            for name, p in m.named_parameters():
                if "embed" in name or "norm" in name:
                    p.requires_grad_(False)
    if options["wrap"] in ("layers", "mlp"):
        for unit in units:
            fully_shard(unit, reshard_after_forward=options.get("reshard", True))
    fully_shard(model, reshard_after_forward=options.get("reshard", True))

    micro_batches = options.get("micro_batches", 1)
    for micro in range(micro_batches):
        model.set_requires_gradient_sync(micro == micro_batches - 1)
        loss_of(model, rank, micro).backward()
        for r in range(world):
            (loss_of(reference, r, micro) / world).backward()
    grad_diff, missing = 0.0, []
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not p.requires_grad:
            assert p.grad is None and q.grad is None, name
            continue
        if p.grad is None:
            missing.append(name)
            continue
        grad_diff = max(grad_diff, (p.grad.full_tensor() - q.grad).abs().max().item())
    for m in (model, reference):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0).step()
    weight_diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    del model
    gc.collect()
    return {"grad_diff": grad_diff, "weight_diff": weight_diff, "missing": missing}


def fsdp2_stale_compute_params(rank, world, port, variant_root, options, out_dir):
    """compute_params captured before fully_shard point at parameters FSDP2 replaced: a clear error, never a
    silently missing gradient."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        lk = kernels.get_local_kernel(Path(variant_root))

        class CapturingMLP(GatedMLP):
            """Captures its parameters at construction, as the Hub package's tiled layers did."""

            def forward(self, x):
                return lk.apply_tiled_mlp(GatedMLP.forward, self, x, 4, compute_params=self.captured)

        torch.manual_seed(0)
        module = CapturingMLP(64, 160)
        module.captured = list(module.parameters())
        fully_shard(module)
        x = torch.randn(1, 256, 64)  # needs no grad: only the weights carry the backward
        error = ""
        try:
            module(x).sum().backward()
        except RuntimeError as e:
            error = str(e)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"error": error}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
