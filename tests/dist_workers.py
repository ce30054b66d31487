"""Workers for the multi-process tests (spawned: they must live in an importable module)."""

import contextlib
import copy
import datetime
import json
import types
from pathlib import Path

import kernels
import torch
import torch.distributed as dist

from ddp_demo import GatedMLP


def _package(variant_root):
    """The package as kernels loads it, with the tests' one-token minimum shard (conftest.tiny_shards): these
    workers run in their own processes, and their tiny MLPs must tile as real ones would."""
    lk = kernels.get_local_kernel(Path(variant_root))
    lk._tiling.MIN_SHARD_TOKENS = 1
    lk._tiling.MIN_SHARD_WORK = 0
    lk._tiling.MIN_BLOCK_COLUMNS = 1
    return lk


@contextlib.contextmanager
def gloo_group(rank, world, port, seconds=60, backend="gloo"):
    """A process group (gloo on CPU; nccl with LIGER_TEST_DIST_BACKEND=nccl on a machine with two GPUs),
    torn down in order: a barrier once the body is done, then destroy."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=seconds),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def uneven_sequences(rank, world, port, variant_root, options, out_dir):
    """Ranks with different sequence lengths and automatic shards. With no engine that gathers per shard, each
    rank runs its own shard count and no collective at all (a collective would pair with the logging
    all_reduce that follows, or hang); with ``zero3`` (parameters gathered per shard) the ranks agree on the
    largest count with one all_reduce."""
    with gloo_group(rank, world, port, seconds=30):
        lk = _package(variant_root)
        torch.manual_seed(rank)
        module = GatedMLP(64, 96).double()
        if options.get("zero3"):  # what DeepSpeed ZeRO-3 leaves on its parameters: gathered per shard here
            for i, p in enumerate(module.parameters()):
                p.ds_id = i
        calls = []

        def counting(mlp, shard):
            calls.append(shard.shape[-2])
            return mlp(shard)

        x = torch.randn(1, options["seq"][rank], 64, dtype=torch.float64, requires_grad=True)
        out = lk.apply_tiled_mlp(counting, module, x)
        forward_calls = len(calls)
        out.sum().backward()
        ref = x.detach().requires_grad_()
        module_ref = GatedMLP(64, 96).double()
        module_ref.load_state_dict(module.state_dict())
        module_ref(ref).sum().backward()
        diff = max(
            (x.grad - ref.grad).abs().max().item(),
            *[(p.grad - q.grad).abs().max().item() for p, q in zip(module.parameters(), module_ref.parameters())],
        )
        logged = torch.tensor([float(rank + 1)])
        dist.all_reduce(logged)
        result = {
            "forward_calls": forward_calls,
            "total_calls": len(calls),
            "rows": calls,
            "diff": diff,
            "logged": logged.item(),
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def rank_subset_calls(rank, world, port, variant_root, options, out_dir):
    """Only rank 0 runs the tiled layer of a model kernelized for training (evaluation, generation or
    logging on one rank), forward and backward; then every rank joins a logging all_reduce."""
    with gloo_group(rank, world, port, seconds=30):
        lk = _package(variant_root)
        torch.manual_seed(0)
        module = GatedMLP(64, 96).double()
        if rank == 0:
            x = torch.randn(1, 300, 64, dtype=torch.float64, requires_grad=True)
            with torch.no_grad():
                lk.apply_tiled_mlp(lambda m, s: m(s), module, x)
            lk.apply_tiled_mlp(lambda m, s: m(s), module, x).sum().backward()
        logged = torch.tensor([float(rank + 1)])
        dist.all_reduce(logged)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"logged": logged.item()}))


def engine_cases(rank, world, port, variant_root, options, out_dir):
    """DDP or FSDP2 (fully_shard), as each case's "engine" says, with tiled MLPs against an untiled single-process
    run on the global batch (every gradient, and the weights after one SGD step with lr 1), for each of
    ``options["cases"]`` (name: options) in one process group per rank, so the suite starts the ranks once:
    {name: result}, where a case that raised holds its error. Every case builds its own models."""
    with gloo_group(rank, world, port, backend=options.get("backend", "gloo")):
        _each_case(options, rank, out_dir, lambda case: _engine_run(rank, world, Path(variant_root), case))


def demo_cases(rank, world, port, variant_root, options, out_dir):
    """tools/ddp_demo's training loop (the reporter's repro: DDP on gloo, the kernelized model against an untiled
    reference) for each of ``options["cases"]`` in one process group per rank: {name: {"log": the loop's log}},
    where a case that raised holds its error."""
    import gc

    from ddp_demo import train

    def run(case):
        log = train(rank, world, Path(variant_root), case)
        gc.collect()  # DDP's reducer must go while its process group still exists
        return {"log": log}

    with gloo_group(rank, world, port, seconds=120):
        _each_case(options, rank, out_dir, run)


def _each_case(options, rank, out_dir, run):
    """``run(case)`` for each of ``options["cases"]`` (the backend added), the ranks meeting after each:
    {name: result}, where a case that raised holds its error; written to ``out_dir`` after every case (a later
    hang still leaves what ran)."""
    import traceback

    results, broken = {}, None
    for name, case in options["cases"].items():
        if broken is not None:
            results[name] = {"error": f"not run: the ranks lost each other in {broken!r}"}
            continue
        try:
            results[name] = run({"backend": options.get("backend", "gloo"), **case})
        except Exception:  # noqa: BLE001  (reported per case; the ranks meet at the barrier below)
            results[name] = {"error": traceback.format_exc()}
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001  (a case that failed on the other rank only: it timed out in a collective)
            broken = name
            results[name].setdefault("error", "the ranks did not meet after this case:\n" + traceback.format_exc())
        if out_dir is not None:
            (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    return results


def _device(options, rank):
    return torch.device("cuda", rank) if options.get("backend") == "nccl" else torch.device("cpu")


def _tile_layers(lk, causal_lm) -> None:
    """Each decoder layer one sequence-tiled node, in chunks of 64 tokens; each call counted in TILED_CALLS (a
    call that ran the layer's own forward proves nothing about the tiled path)."""
    causal_lm.config.use_cache = False  # a cache asked for is filled by the layers' own forward
    TILED_CALLS.clear()  # an earlier case that raised left its calls
    assert lk.tile_decoder_layers(causal_lm, chunk=64, min_tokens=0) == len(causal_lm.model.layers)
    for layer in causal_lm.model.layers:
        layer.register_forward_hook(
            lambda m, a, out: TILED_CALLS.append(type(out.grad_fn).__name__ == "TiledDecoderLayerBackward")
        )


def _models(options, variant_root, device=None):
    """(model with tiled MLPs, untiled reference, the units to shard, loss_of(model, rank, micro))."""
    import copy

    device = torch.device("cpu") if device is None else device
    lk = _package(variant_root)
    torch.manual_seed(0)
    if options["model"] in ("llama", "llama_fused_loss"):
        from transformers import LlamaForCausalLM

        from ddp_demo import kernelize_tiled, tiny_llama_config

        reference = LlamaForCausalLM(tiny_llama_config())
        causal_lm = kernelize_tiled(copy.deepcopy(reference), variant_root)
        if options.get("tile_layers"):
            _tile_layers(lk, causal_lm)
        units = (
            list(causal_lm.model.layers) if options.get("wrap") == "layers" else [x.mlp for x in causal_lm.model.layers]
        )
        fused = options["model"] == "llama_fused_loss"
        if fused:  # the loss through lk.CausalLMWithFusedLoss: the lm_head weight is sharded with the root unit
            units.append(causal_lm.lm_head)
        model = lk.CausalLMWithFusedLoss(causal_lm) if fused else causal_lm

        def loss_of(m, r, micro):
            ids = torch.randint(0, 97, (1, 256), generator=torch.Generator().manual_seed(10 * micro + r))
            ids = ids.to(device)
            if fused and m is not reference:
                return m(input_ids=ids, labels=ids)
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
            return (m(x.to(device)) * torch.randn(2, 256, 64, generator=g).to(device)).mean()

    if options.get("freeze"):
        # True: embeddings and norms; or the names to freeze (a projection of each MLP: a LoRA base weight)
        frozen = ("embed", "norm") if options["freeze"] is True else tuple(options["freeze"])
        for m in (model, reference):
            for name, p in m.named_parameters():
                if any(part in name for part in frozen):
                    p.requires_grad_(False)
    return model.to(device), reference.to(device), units, loss_of


TILED_CALLS = []  # per tiled decoder-layer call of the running case: whether it ran tiled


def _tiled_counts() -> dict:
    """The running case's decoder-layer calls and how many of them ran tiled; the record is emptied."""
    counts = {"tiled_calls": sum(TILED_CALLS), "layer_calls": len(TILED_CALLS)}
    TILED_CALLS.clear()
    return counts


def _engine_run(rank, world, variant_root, options):
    import gc

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _device(options, rank)
    model, reference, units, loss_of = _models(options, variant_root, device)
    fsdp = options["engine"] == "fsdp2"
    if fsdp:
        if options.get("wrap") == "projections":  # units inside the MLPs: each projection, then each MLP
            for unit in units:
                for proj in (unit.gate_proj, unit.up_proj, unit.down_proj):
                    fully_shard(proj, reshard_after_forward=options.get("reshard", True))
        if options.get("wrap") in ("layers", "mlp", "projections"):
            for unit in units:
                fully_shard(unit, reshard_after_forward=options.get("reshard", True))
        fully_shard(model, reshard_after_forward=options.get("reshard", True))
        wrapped, full = model, lambda t: t.full_tensor()
    else:
        wrapped = DDP(
            model,
            device_ids=[rank] if device.type == "cuda" else None,
            find_unused_parameters=options.get("find_unused_parameters", False),
            static_graph=options.get("static_graph", False),
        )
        full = lambda t: t  # noqa: E731

    micro_batches = options.get("micro_batches", 1)
    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        if fsdp:
            model.set_requires_gradient_sync(last)
        with contextlib.nullcontext() if fsdp or last else wrapped.no_sync():
            loss_of(wrapped, rank, micro).backward()
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
        grad_diff = max(grad_diff, (full(p.grad) - q.grad).abs().max().item())
    for m in (model, reference):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0).step()
    weight_diff = max((full(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    del wrapped, model
    gc.collect()  # DDP's reducer goes while its process group still exists
    return {"grad_diff": grad_diff, "weight_diff": weight_diff, "missing": missing, **_tiled_counts()}


def fsdp2_stale_compute_params(rank, world, port, variant_root, options, out_dir):
    """compute_params captured before fully_shard point at parameters FSDP2 replaced: a clear error, never a
    silently missing gradient."""
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, world, port):
        lk = _package(variant_root)

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


def zero_cases(rank, world, port, variant_root, options, out_dir):
    """DeepSpeed ZeRO (stage 2 or 3) with tiled MLPs against an untiled single-process run on the global batch
    (every gradient, gathered, and the weights after one SGD step with lr 1; or, with ``count_collectives``,
    the collectives a step issues), for each of ``options["cases"]`` (name: options) in one process per rank,
    so the suite pays for starting DeepSpeed once: {name: result}, where a case that raised holds its error.
    Every case builds and releases its own engine and models."""
    import copy
    import os

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed

    if options.get("backend") == "nccl":
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend=options.get("backend", "gloo"), timeout=datetime.timedelta(seconds=90))
    try:
        return _each_case(
            options, rank, out_dir, lambda case: _zero_run(rank, world, Path(variant_root), case, deepspeed, copy)
        )
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _zero_run(rank, world, variant_root, options, deepspeed, copy):
    import gc

    from deepspeed.utils import safe_get_full_grad

    lk = _package(variant_root)
    device = _device(options, rank)
    stage, accumulation = options["stage"], options.get("accumulation", 1)
    seqs = options.get("seq_by_rank") or [options.get("seq", 256)] * world
    config = {
        "train_batch_size": world * accumulation,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if options.get("bucket"):
        config["zero_optimization"].update(
            reduce_bucket_size=options["bucket"], allgather_bucket_size=options["bucket"]
        )
    torch.manual_seed(0)
    if options["model"] in ("llama", "llama_fused_loss"):
        from transformers import LlamaForCausalLM

        from ddp_demo import kernelize_tiled, tiny_llama_config

        fused = options["model"] == "llama_fused_loss"  # the loss through lk.CausalLMWithFusedLoss (no logits)
        reference = LlamaForCausalLM(tiny_llama_config())

        def build():
            model = kernelize_tiled(copy.deepcopy(reference), variant_root)
            if options.get("tile_layers"):
                _tile_layers(lk, model)
            return lk.CausalLMWithFusedLoss(model) if fused else model

        def loss_of(m, r, micro):
            ids = torch.randint(0, 97, (1, seqs[r]), generator=torch.Generator().manual_seed(10 * micro + r))
            ids = ids.to(device)
            if fused and m is not reference:
                return m(input_ids=ids, labels=ids)
            return m(input_ids=ids, labels=ids).loss
    else:
        reference = torch.nn.Sequential(*[GatedMLP(64, 160) for _ in range(3)])
        if options.get("share") == "twice":  # the first MLP is called again last (ALBERT-style sharing)
            reference = torch.nn.Sequential(reference[0], reference[1], reference[0])
        elif options.get("share") == "tied":  # the first and last MLP share their gate weight
            reference[2].gate_proj.weight = reference[0].gate_proj.weight
        # "mlps": the package's tiled layer (the gated fast path); "mlps_generic": a user's fn that calls the
        # projections, which DeepSpeed's hooks gather per shard unless the MLP is a ZeRO-3 leaf.
        if options["model"] == "mlps":
            tiled = lk.LigerTiledSwiGLUMLP.forward
        else:

            def tiled(block, x):
                return lk.apply_tiled_mlp(GatedMLP.forward, block, x)

        def build():
            model = copy.deepcopy(reference)
            for block in model:
                block.forward = types.MethodType(tiled, block)
            return model

        assert options.get("share") is None or not options.get("zero_init")

        def loss_of(m, r, micro, seq=None):
            g = torch.Generator().manual_seed(10 * micro + r)
            # A ZeRO-3 leaf's gradients are reduced by a full backward hook on the leaf, which fires before the
            # leaf's backward when none of its inputs needs a gradient (plain modules too): a real model's
            # hidden states always need one.
            x = torch.randn(1, seq or seqs[r], 64, generator=g).requires_grad_(bool(options.get("leaf")))
            out = x.to(device)
            if options.get("direct"):  # each MLP called directly, outside the engine's forward
                for block in getattr(m, "module", m):
                    out = block(out)
            else:
                out = m(out)
            return (out * torch.randn(1, seq or seqs[r], 64, generator=g).to(device)).mean()

    freeze = options.get("freeze")
    for name, p in reference.named_parameters():
        if (freeze == "embed_norm" and ("embed" in name or "norm" in name)) or (
            freeze == "non_mlp" and ".mlp." not in name
        ):
            p.requires_grad_(False)
    if options.get("zero_init"):
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build()
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for p, q in zip(model.parameters(), reference.parameters()):
                p.data.copy_(q.data)
    else:
        model = build()
    for p, q in zip(model.parameters(), reference.parameters()):
        p.requires_grad_(q.requires_grad)
    if options.get("leaf"):  # DeepSpeed then hooks the MLP alone and gathers all its weights around each call
        from deepspeed.utils import set_z3_leaf_modules
        from transformers.models.llama.modeling_llama import LlamaMLP

        set_z3_leaf_modules(model, [GatedMLP, LlamaMLP])
    reference.to(device)
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    partitioned = stage != 3 or all(p.numel() == 0 for p in engine.module.parameters())
    if options.get("count_collectives"):
        return _count_collectives(lk, engine, loss_of, rank)
    for micro in range(accumulation):
        engine.backward(loss_of(engine, rank, micro))
        for r in range(world):
            (loss_of(reference, r, micro) / (world * accumulation)).backward()
        if micro < accumulation - 1:
            engine.step()  # a no-op step at a non-boundary micro-batch, as DeepSpeed's loop does
    grad_diff, missing = 0.0, []
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        if not q.requires_grad:
            continue
        full = safe_get_full_grad(p)
        if full is None or not torch.isfinite(full).all():
            missing.append(name)
            continue
        grad_diff = max(grad_diff, (full - q.grad).abs().max().item())
    engine.step()
    torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=1.0).step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        weight_diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(params, reference.parameters()))
    del engine, model
    gc.collect()
    return {"grad_diff": grad_diff, "weight_diff": weight_diff, "missing": missing, "partitioned": partitioned,
            **_tiled_counts()}  # fmt: skip


def _count_collectives(lk, engine, loss_of, rank):
    """Collectives in a forward and backward at 2 and at 8 shards (64 wide, one-token minimum shard), each
    measured on its second step (DeepSpeed records its module trace on the first steps, and a new sequence
    length changes what it prefetches), and how many tiled calls agreed on their count across ranks. Only
    the counts matter: the weights move freely."""
    agreed, harmonize = [], lk._tiling.harmonize_num_shards
    lk._tiling.harmonize_num_shards = lambda count, x: agreed.append(count) or harmonize(count, x)
    try:
        engine.backward(loss_of(engine, rank, 0))
        engine.step()
        counts = {}
        for seq in (128, 128, 512, 512):
            counts[seq] = _collectives(lambda seq=seq: engine.backward(loss_of(engine, rank, 0, seq)))
            engine.step()
    finally:  # the process runs other cases after this one
        lk._tiling.harmonize_num_shards = harmonize
    return {"collectives": counts, "agreed": len(agreed)}


def _collectives(step) -> list[int]:
    """[DeepSpeed's, c10d's]: the collectives ``step()`` issues through DeepSpeed's communication backend
    (its gathers, on CPU partly outside c10d), and the c10d collectives the profiler records (any issued
    through torch.distributed directly)."""
    from deepspeed.comm import comm
    from torch.profiler import ProfilerActivity, profile

    backend, calls, originals = comm.cdb, [], {}
    for name in dir(backend):
        if name.startswith(("all_", "allgather", "reduce", "broadcast", "gather", "scatter", "inference_all")):
            originals[name] = getattr(backend, name)
            setattr(backend, name, lambda *a, _f=originals[name], _n=name, **k: calls.append(_n) or _f(*a, **k))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        for name, fn in originals.items():
            setattr(backend, name, fn)
    return [len(calls), sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))]


# ----------------------------------------------------------------------------------------------------------
# The causal-LM loss under DDP.


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
    from transformers import LlamaForCausalLM

    from ddp_demo import tiny_llama_config

    with gloo_group(rank, world, port):
        lk = _package(variant_root)
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
