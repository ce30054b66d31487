"""The main job's training loop, shared by scripts/ (the demo, the multi-GPU script) and the tests: a tiny
Llama whose MLPs are liger-kernels' tiled SwiGLU layers (kernelized through ``kernels``), trained under DDP on
CPU ranks (gloo) next to an untiled single-process copy that sees the global batch; ``launch``, which spawns
ranks; and the plain gated MLP the distributed cases stack.
"""

import contextlib
import copy
import datetime
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 64


class GatedMLP(torch.nn.Module):
    """A plain-PyTorch SwiGLU MLP in the form the layers serve: the untiled reference."""

    def __init__(self, hidden, intermediate, out_features=None, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate, out_features or hidden, bias=bias)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=97,
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        hidden_act="silu",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kernelize_tiled(model, variant_root: Path):
    """Tag LlamaMLP as "SwiGLUMLP" (transformers does not) and kernelize with the package's own mapping,
    loaded through kernels: in training mode every LlamaMLP runs LigerTiledSwiGLUMLP."""
    import kernels
    from kernels import Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from transformers.models.llama.modeling_llama import LlamaMLP

    lk = kernels.get_local_kernel(variant_root)
    replace_kernel_forward_from_hub(LlamaMLP, "SwiGLUMLP")
    with use_kernel_mapping(lk.kernel_mapping(variant_root, layers=["SwiGLUMLP"]), inherit_mapping=False):
        kernelize(model.train(), mode=Mode.TRAINING, device="cpu")
    tiled = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    assert tiled and all(m.forward.__func__.__qualname__ == "LigerTiledSwiGLUMLP.forward" for m in tiled)
    return model


def batch(rank: int, step: int, micro: int, seq: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, 97, (1, seq), generator=generator)


def run_rank(rank, world, port, variant_root, options, out_dir):
    """One rank: DDP-train the kernelized model and an untiled reference side by side; write a JSON log."""
    import faulthandler
    import gc
    import logging

    faulthandler.dump_traceback_later(options.get("dump_after_s", 200), exit=False)  # where a hang hangs
    logging.getLogger("kernels").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        log = train(rank, world, Path(variant_root), options)
        gc.collect()  # DDP's reducer must go while its process group still exists, or teardown can hang
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(log))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank, world, variant_root, options):
    """The training loop of one rank; every DDP object it makes is gone when it returns."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, options.get("dtype", "float32"))
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_llama_config()).to(dtype)
    model = kernelize_tiled(copy.deepcopy(reference), variant_root)
    if options.get("num_shards") is not None:  # the host attribute the tiled layers read; the demo's sequences
        for mlp in model.modules():  # are far shorter than the automatic count's minimum shard
            if hasattr(mlp, "gate_proj"):
                mlp.num_shards = options["num_shards"]
    for frozen in options.get("freeze", []):
        for name, p in list(model.named_parameters()) + list(reference.named_parameters()):
            if frozen in name:
                p.requires_grad_(False)
    # fused_loss: the loss through the package's one call for a stock CausalLM (decoder, then the fused linear
    # cross-entropy on the LM head: the logits are never built); DDP wraps the module that computes it.
    fused = options.get("fused_loss", False)
    if fused:
        import kernels

        model = kernels.get_local_kernel(variant_root).CausalLMWithFusedLoss(model)
    ddp = DDP(
        model,
        find_unused_parameters=options.get("find_unused_parameters", False),
        static_graph=options.get("static_graph", False),
    )
    lr, seq, micro_batches = 0.5, options.get("seq", 256), options.get("micro_batches", 1)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=lr)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=lr)
    log = []
    for step in range(options.get("steps", 2)):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for micro in range(micro_batches):
            ids = batch(rank, step, micro, seq)
            sync = ddp.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
            with sync:
                loss = ddp(input_ids=ids, labels=ids) if fused else ddp(input_ids=ids, labels=ids).loss
                loss.backward()
            loss_sum += loss.detach().double()
            for r in range(world):  # the reference sees the global batch: the mean over ranks
                ids_r = batch(r, step, micro, seq)
                (reference(input_ids=ids_r, labels=ids_r).loss / world).backward()
        dist.all_reduce(loss_sum)
        grad_diff = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters())
            if p.requires_grad
        )
        assert all(q.grad is None for q in model.parameters() if not q.requires_grad)
        opt.step()
        ref_opt.step()
        weight_diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        log.append(
            {
                "step": step,
                "loss": loss_sum.item() / (world * micro_batches),
                "grad_diff": grad_diff,
                "weight_diff": weight_diff,
                "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
            }
        )
    return log


def launch(target, world, variant_root, options, out_dir, timeout_s=240):
    """Spawn `world` ranks of `target(rank, world, port, variant_root, options, out_dir)`; return their logs.
    A rank that fails fails the launch; ranks still running after `timeout_s` are killed and it raises."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on a network
    args = (world, free_port(), str(variant_root), options, str(out_dir))
    context = mp.start_processes(target, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{target.__name__}: ranks still running after {timeout_s} s")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
