"""DeepSpeed ZeRO-3 parameters in a tiled call: gathered once per call, never once per shard.

ZeRO-3 partitions every parameter across ranks (``ds_id`` marks one; outside its module's forward it holds
no data) and gathers it with hooks on the module that owns it, before that module's forward and again
before its backward. A tiled call runs the MLP's projections once per shard, so those hooks would gather
each weight once per shard in forward and twice per shard in backward (recompute and gradient), and every
rank would have to run the same number of shards or wait forever in a gather. Two layouts avoid that:

* The MLP, or a module above it, is a ZeRO-3 leaf (``deepspeed.utils.set_z3_leaf_modules`` before
  ``deepspeed.initialize``): DeepSpeed hooks only the leaf, gathers all its parameters once around the call
  and once around its backward, and reduces their gradients when the leaf's backward ends. Inside the call
  the parameters are ordinary full tensors (``gathered_around_call``).
* The projections are plain ``nn.Linear`` modules hooked by ZeRO-3 alone (``is_engine_hook``) and the MLP's
  owner declares the gated fast path, which reads the weights and never calls the projections, so their
  hooks never fire. Inside DeepSpeed's forward, reading a partitioned weight gathers it and registers it as
  an external parameter of the running module, which DeepSpeed then gathers around that module's forward
  and backward: the weights are whole for the call (``is_whole``) and are ordinary inputs, as in the leaf
  layout. Outside DeepSpeed's forward (a module called directly) the tiled call does what the hooks would:
  it gathers the MLP's parameters once in forward and once in backward (``gathered``) and hands each summed
  gradient to DeepSpeed once per call (``deliver``); a weight that two such calls share then reaches
  DeepSpeed's gradient hook twice in one backward, which DeepSpeed does not expect (its own forward never
  takes this path).

Either way no collective runs inside the shard loop and ranks may run different shard counts. Anything else
(a user's ``fn`` that calls hooked projections) gathers per shard through DeepSpeed's hooks, as DeepSpeed's
own tiled MLP does, and its shard count is agreed across ranks (``_tiling.harmonize_num_shards``).
"""

import contextlib

import torch


def is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def gathered_around_call(mlp_module, params) -> bool:
    """Whether DeepSpeed gathers ``params``, the ZeRO-3 parameters of ``mlp_module``, around the whole call:
    each belongs to a ZeRO-3 leaf module that is ``mlp_module`` or contains it (DeepSpeed records the leaf on
    the parameter when it registers its hooks)."""
    if not params:
        return False
    leaves = {id(leaf): leaf for leaf in (getattr(p, "ds_z3_leaf_module", None) for p in params)}
    if None in leaves.values():
        return False
    return all(leaf is mlp_module or any(m is mlp_module for m in leaf.modules()) for leaf in leaves.values())


# DeepSpeed's own module hooks, by the module that defines them:
# * ZeRO-3's, on every module it manages (closures, one wrapped by DeepSpeed's NVTX decorator, which keeps the
#   hook in its closure): they gather the module's parameters before forward and backward, release them
#   after, and record the order;
# * the flops profiler's, which count and time, on rank 0 only and for one step: were they to change how a
#   tiled call runs, rank 0 would run other collectives than the rest and ZeRO-3 would hang.
_ENGINE_HOOK_MODULES = ("deepspeed.runtime.zero.parameter_offload", "deepspeed.profiling.flops_profiler.profiler")
_ENGINE_HOOK_WRAPPER_MODULE = "deepspeed.utils.nvtx"


def is_engine_hook(hook) -> bool:
    module = getattr(hook, "__module__", None)
    if module == _ENGINE_HOOK_WRAPPER_MODULE:
        wrapped = [cell.cell_contents for cell in getattr(hook, "__closure__", None) or ()]
        return any(getattr(f, "__module__", None) in _ENGINE_HOOK_MODULES for f in wrapped if callable(f))
    return module in _ENGINE_HOOK_MODULES


@contextlib.contextmanager
def gathered(params):
    """The partitioned ones among ``params`` gathered (one collective, the same on every rank) for the
    block, and partitioned again after it; parameters that were already whole stay whole."""
    missing = [p for p in params if _status(p) == "NOT_AVAILABLE"]
    if not missing:
        yield
        return
    import deepspeed  # deepspeed.zero is an attribute of the package, not a module to import from

    with deepspeed.zero.GatheredParameters(missing):
        yield


def _status(param) -> str:
    status = getattr(param, "ds_status", None)
    return getattr(status, "name", str(status))


def is_whole(param) -> bool:
    """Gathered now (or holding its values without DeepSpeed's status, as a copy marked by hand does)."""
    return _status(param) not in ("NOT_AVAILABLE", "INFLIGHT")


def deliver(params, grads) -> None:
    """Accumulate each gradient into its parameter's ``.grad`` through autograd, once: DeepSpeed's gradient
    hook on the parameter fires as it does for an untiled module, and reduces it. The parameters must be
    gathered (whole) while this runs."""
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
