"""Workers for the causal-LM loss's multi-process tests (spawned: they must live in an importable module)."""

import copy
import json
from pathlib import Path

import kernels
import torch
from dist_workers import gloo_group


def _batch(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 97, (2, 16), generator=generator)
    labels = ids.clone()
    labels[rank, -5:] = -100  # different padding on each rank
    return ids, labels


def ddp_fused_loss(rank, world, port, variant_root, options, out_dir):
    """DDP over CausalLMWithFusedLoss(tiny Llama), float64, against the loss on the model's logits for every
    rank's batch in one process: DDP averages the ranks' gradients, so the reference sums loss_r / world."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_ddp import tiny_llama_config
    from transformers import LlamaForCausalLM

    with gloo_group(rank, world, port):
        lk = kernels.get_local_kernel(Path(variant_root))
        torch.manual_seed(0)
        reference = LlamaForCausalLM(tiny_llama_config()).double()
        model = copy.deepcopy(reference)
        ddp = DDP(lk.CausalLMWithFusedLoss(model))
        ids, labels = _batch(rank)
        ddp(ids, labels=labels).backward()
        for r in range(world):  # the model's loss on its logits, in float64 (transformers' own is fp32)
            ids_r, labels_r = _batch(r)
            logits = reference(input_ids=ids_r).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_r[:, 1:].reshape(-1))
            (loss / world).backward()
        grad_diff, missing = 0.0, []
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.grad is None:
                missing.append(name)
                continue
            grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
        del ddp
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"grad_diff": grad_diff, "missing": missing}))
