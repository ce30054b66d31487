"""transformers' sdpa attention, with the long causal training call's backward run one group of KV heads at a
time: the same cuDNN kernels, a fraction of their workspace.

The backward of one cuDNN SDPA call keeps, besides its outputs, an fp32 accumulator for dq (4 bytes per element
of q) and, where KV heads are shared (grouped-query attention), dk and dv expanded to every query head in 16
bits (4 bytes more): 2056 MiB at 65,536 tokens for Llama-3-8B's 32 query heads of 128, 4112 MiB at 131,072
(benchmarks/NOTES.md §26). Heads never mix in attention, so the backward of each group of KV heads with its
query heads is the full call's backward restricted to those heads: the same kernels give the same dk and dv,
and dq up to the order of cuDNN's own fp32 atomic accumulation. Run per group, the workspace is one group's.
The forward stays one call (split by heads, cuDNN's forward lost 4% to its tail at 8 groups; the backward's
split costs nothing measurable).

Use it as an attention implementation (``register_sdpa_attention``). Every call that is not a long causal
training call, with no mask, on CUDA tensors for which PyTorch itself would choose cuDNN, is transformers' own
``sdpa_attention_forward``, unchanged.

Under gradient checkpointing every layer's forward runs twice, its attention forward included: a tenth of a
long step at 64k tokens, more beyond (attention is quadratic in S, the rest linear). ``keep_attention_context``
is a ``context_fn`` for non-reentrant ``torch.utils.checkpoint`` under which those long calls keep what their
forward computed (the output and its row logsumexps, in pinned host memory by default) and the recompute takes
it back instead of running the attention again.
"""

import threading
import types

import torch

from . import _backend

aten = torch.ops.aten

# Bytes of the backward's workspace per element of q: the fp32 dq accumulator, and dk, dv expanded to the query
# heads in 16 bits where KV heads are shared. A call is split when the workspace exceeds this per group.
DQ_ACCUMULATOR_BYTES = 4
SHARED_KV_EXPANSION_BYTES = 4
MAX_GROUP_WORKSPACE = 256 * 2**20

_CUDNN = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value)
_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is, unpatched
# Keywords a model hands the attention for what transformers' sdpa does not compute (attention sinks, a sparse
# attention's selection): under the name "sdpa" such models mask the scores themselves or refuse sdpa.
UNSUPPORTED_KEYWORDS = ("s_aux", "sinks", "indices", "block_indices")


def _modes_active() -> bool:
    """A torch-function or dispatch mode (a tracer, a profiler of ops, a sharding dispatcher) would see the
    stock call's ops, not these."""
    return torch._C._len_torch_function_stack() > 0 or torch._C._len_torch_dispatch_stack() > 0


def backward_groups(query: torch.Tensor, key: torch.Tensor) -> int:
    """The fewest groups of KV heads (a divisor of their count) whose backward workspace each stays within
    ``MAX_GROUP_WORKSPACE``; one KV head per group at most. The dq accumulator follows the queries, the
    expansion of dk and dv to the query heads the keys (their lengths differ for the tiled decoder layer's
    pieces)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    workspace = query.numel() * DQ_ACCUMULATOR_BYTES
    if q_heads != kv_heads:
        workspace += batch * q_heads * key.shape[2] * dim * SHARED_KV_EXPANSION_BYTES
    for groups in range(1, kv_heads + 1):
        if kv_heads % groups == 0 and workspace <= groups * MAX_GROUP_WORKSPACE:
            return groups
    return kv_heads


# ----------------------------------------------------------------------------------------------------------
# The ops: cuDNN's (what F.scaled_dot_product_attention runs when it chooses cuDNN), and the CPU flash ops with
# the same contract, through which the tests check the grouping itself on the CPU in float64. ``causal`` is the
# top-left causal mask (queries and keys of equal length here; the tiled decoder layer also attends without
# one).


def _cudnn_forward(query, key, value, scale, causal=True):
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (seed, offset)


def _cudnn_backward(d_out, query, key, value, out, lse, state, scale, causal=True):
    seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        d_out, query, key, value, out, lse, seed, offset, None, None, None, query.shape[2], key.shape[2], 0.0,
        causal, scale=scale,
    )  # fmt: skip


def _cpu_forward(query, key, value, scale, causal=True):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_backward(d_out, query, key, value, out, lse, state, scale, causal=True):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, query, key, value, out, lse, 0.0, causal, scale=scale
    )


CUDNN_OPS = (_cudnn_forward, _cudnn_backward)
CPU_OPS = (_cpu_forward, _cpu_backward)


def _new_in_layout_of(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor with ``t``'s shape, dtype, device and memory layout (``empty_like``'s)."""
    stride = torch.empty_like(t, device="meta").stride()
    return _backend.new_strided(t.shape, stride, t.dtype, t.device)


class GroupedCausalAttention(torch.autograd.Function):
    """Causal attention of ``query`` [B, Hq, S, D] over ``key`` and ``value`` [B, Hkv, S, D] (Hq a multiple of
    Hkv): one forward call of ``ops``, and its backward one call per group of ``groups`` groups of KV heads."""

    @staticmethod
    def forward(ctx, query, key, value, scale, groups, ops, kept=None):
        if type(groups) is not int or groups < 1 or key.shape[1] % groups or query.shape[1] % key.shape[1]:
            raise ValueError(
                f"GroupedCausalAttention: `groups` must be a positive divisor of the {key.shape[1]} KV heads (and "
                f"the {query.shape[1]} query heads a multiple of them), got {groups!r}"
            )
        # kept: (this checkpointed call's pass, the call's signature) under keep_attention_context, else None
        if kept is None:
            out, lse, state = ops[0](query, key, value, scale)
        else:
            out, lse, state = kept[0].forward(kept[1], lambda: ops[0](query, key, value, scale))
        ctx.save_for_backward(query, key, value, out, lse, *state)
        ctx.scale, ctx.groups, ctx.ops = scale, groups, ops
        return out

    @staticmethod
    def backward(ctx, d_out):
        if torch.is_grad_enabled():  # create_graph: the gradients would have no derivative of their own
            raise RuntimeError(
                "sdpa_attention_forward: double backward through the grouped attention is not supported (cuDNN's "
                "attention backward has no derivative either); use attn_implementation='eager' for it"
            )
        query, key, value, out, lse, *state = ctx.saved_tensors
        if d_out.stride() != out.stride():  # the kernels read d_out in out's layout
            d_out = torch.empty_like(out).copy_(d_out)
        d_query, d_key, d_value = (_new_in_layout_of(t) for t in (query, key, value))
        q_heads, kv_heads = query.shape[1] // ctx.groups, key.shape[1] // ctx.groups
        for group in range(ctx.groups):
            q = slice(group * q_heads, (group + 1) * q_heads)
            kv = slice(group * kv_heads, (group + 1) * kv_heads)
            grads = ctx.ops[1](
                d_out[:, q], query[:, q], key[:, kv], value[:, kv], out[:, q], lse[:, q].contiguous(), state, ctx.scale
            )
            for whole, part, heads in zip((d_query, d_key, d_value), grads, (q, kv, kv)):
                whole[:, heads] = part
        return d_query, d_key, d_value, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The forward kept across a checkpoint's recompute.
#
# Non-reentrant torch.utils.checkpoint calls `context_fn` once per checkpointed call and enters the first context
# around that call's forward, the second around each of its recomputes, which replay the forward's calls in the
# same order. So one store per checkpointed call, filled in call order and read back in call order, pairs every
# recomputed attention call with its own forward; each entry also records the module and the inputs' metadata,
# and a call that does not match (or finds nothing) computes its forward as it would without the store.


class _Kept:
    """One split call's forward results, ``held`` = (output, logsumexps, *random state): on the host (``moved``
    marks those copied from the GPU), or on the GPU until a recompute takes them (``_Store.on_gpu``)."""

    __slots__ = ("signature", "held", "moved", "device")

    def __init__(self, signature, held, moved, device):
        self.signature, self.held, self.moved, self.device = signature, held, moved, device


class _Store:
    """One checkpointed call's split attention results, in call order."""

    def __init__(self, offload: bool):
        self.offload = offload
        self.entries = []
        self.on_gpu = {}  # offload=False: entry index -> (out, lse), until a recompute takes them
        self.recorded = False


class _Recording:
    """The checkpointed call's forward: each split call computes its forward and the store keeps it."""

    def __init__(self, context):
        self.context, self.store = context, context.store

    def forward(self, signature, compute):
        out, lse, state = compute()
        # The output goes on to the model, which may write into it or its views (and the recompute writes
        # again): the store's copy is its own. lse and the random state go to backward only. The random state's
        # tensors travel with the rest: on the GPU they would be held there until the backward, where the plain
        # checkpoint frees them after the forward and makes its own in the recompute.
        held = (out.clone(), lse, *state)
        moved = tuple(t.is_cuda for t in held)
        store = self.store
        if not store.offload:
            store.on_gpu[len(store.entries)] = held
            held = None
        elif any(moved):
            held = _to_host(held, moved)
        store.entries.append(_Kept(signature, held, moved, out.device))
        return out, lse, state


class _Replay:
    """One recompute: its place in the store and the copies it started back to the GPU. Per pass, not per
    store: two threads may recompute one retained graph at once."""

    def __init__(self, context):
        self.context, self.store, self.next = context, context.store, 0
        # the host's copies start back at the recompute's start, so they overlap its norm and projections
        # (by index: a forward still recording in another thread may add entries after this replay began)
        self.moving = {
            i: _to_device(e.held, e.moved, e.device) for i, e in enumerate(self.store.entries) if e.held is not None
        }

    def forward(self, signature, compute):
        """The forward's own results where the next entry is this call's, else the call's own forward."""
        index, self.next = self.next, self.next + 1
        entries = self.store.entries
        if index >= len(entries) or entries[index].signature != signature:
            return compute()
        entry = entries[index]
        if entry.held is None:  # on the GPU: handed over once (dict.pop is atomic), then recomputed
            held = self.store.on_gpu.pop(index, None)
            if held is None:
                return compute()
        else:
            held = _arrived(self.moving.pop(index, None) or _to_device(entry.held, entry.moved, entry.device))
        return held[0], held[1], tuple(held[2:])


class _Context:
    """The context torch's checkpoint enters around a checkpointed call's forward (``replaying=False``) or
    around each of its recomputes; re-enterable, from any thread."""

    def __init__(self, store, replaying):
        self.store, self.replaying = store, replaying

    def __enter__(self):
        if not self.replaying:
            if self.store.recorded:
                raise RuntimeError(
                    "keep_attention_context: a pair of contexts serves one checkpointed call; pass the function "
                    "itself as context_fn (context_fn=lk.keep_attention_context), not a pair made once"
                )
            self.store.recorded = True
        _stack().append(_Replay(self) if self.replaying else _Recording(self))
        return self

    def __exit__(self, *exc):
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):  # this context's own pass, wherever it is
            if stack[i].context is self:
                del stack[i]  # a replay's untaken copies go with it
                break
        return False


_LOCAL = threading.local()


def _stack() -> list:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def keep_attention_context(offload: bool = True):
    """A ``context_fn`` for non-reentrant ``torch.utils.checkpoint``: inside each checkpointed call, the grouped
    attention calls (``sdpa_attention_forward``'s long causal training calls) keep their forward's output and
    logsumexps, and the recompute takes them back instead of running the attention forward again. Gradients are
    bit for bit the plain checkpoint's wherever the recompute sees the forward's inputs, parameters and random
    state (what the checkpoint itself assumes; not with ``preserve_rng_state=False`` and dropout before it).
    ``offload=True`` keeps them in pinned host memory (copied on a side stream; the GPU holds no more at its
    peak than under the plain checkpoint), ``offload=False`` on the GPU (about S x hidden x 2 bytes per layer
    more)::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": lk.keep_attention_context})
    """
    if type(offload) is not bool:
        raise TypeError(f"keep_attention_context: `offload` must be a bool, got {offload!r}")
    store = _Store(offload)
    return _Context(store, False), _Context(store, True)


def _kept(module, query, key, value, scale, groups):
    """(the current checkpointed call's pass, this call's signature) under ``keep_attention_context``, else
    None."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        return None
    inputs = tuple((t.shape, t.stride(), t.dtype, t.device) for t in (query, key, value))
    return stack[-1], (module, scale, groups, inputs)


_COPY_STREAMS = {}


def _copy_stream(device: torch.device):
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _to_host(tensors, moved):
    """``tensors`` with each CUDA one (``moved``) replaced by a copy in pinned host memory, made on a side stream
    once the work queued so far is done (the tensors' memory is held for that stream until the copies have
    read it)."""
    device = next(t.device for t, m in zip(tensors, moved) if m)
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    hosts = []
    with torch.cuda.stream(stream):
        for t, m in zip(tensors, moved):
            if m:
                host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
                t = host
            hosts.append(t)
    return tuple(hosts)


def _to_device(held, moved, device: torch.device):
    """(``held`` with the pinned copies of ``moved`` ones back on ``device``, the event marking them done),
    copied on the side stream after its host copies, into memory allocated on that stream: the copy need not
    wait for the work queued on the compute stream. Where nothing went to a host (the CPU) clones: the
    recompute may write into what it gets, and a retained graph's next recompute takes them again."""
    if not any(moved):
        return tuple(t.clone() for t in held), None
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        copies = []
        for host, m in zip(held, moved):
            if m:
                copy = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
                copy.copy_(host, non_blocking=True)
                host = copy
            copies.append(host)
        return tuple(copies), stream.record_event()


def _arrived(moving):
    """The copies of ``_to_device`` for the current stream: it waits for them, and their memory is held for it."""
    copies, done = moving
    if done is not None:
        current = torch.cuda.current_stream(copies[0].device)  # the output: always a CUDA copy here
        current.wait_event(done)
        for copy in copies:
            if copy.is_cuda:
                copy.record_stream(current)
    return copies


# ----------------------------------------------------------------------------------------------------------
# The attention-interface function.


def _grouped_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs) -> int:
    """The number of backward groups where this call is one the grouped path reproduces exactly, else 0: what
    transformers' ``sdpa_attention_forward`` would run as ``F.scaled_dot_product_attention(query, key, value,
    dropout_p=0, scale=scaling, is_causal=True[, enable_gqa=True])`` with autograd recording, on CUDA tensors
    for which PyTorch itself chooses cuDNN; and whose backward needs more than one group."""
    if attention_mask is not None or dropout != 0 or not torch.is_grad_enabled():
        return 0
    if torch.compiler.is_compiling() or _backend.exporting():
        return 0  # compiled and exported graphs keep the stock call (and ask nothing of symbolic shapes here)
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return 0
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return 0
    q_len, q_heads, kv_heads = query.shape[2], query.shape[1], key.shape[1]
    if not (q_len > 1 and key.shape[2] == q_len == value.shape[2]):
        return 0
    if value.shape[1] != kv_heads or q_heads % kv_heads or not query.shape[0] == key.shape[0] == value.shape[0]:
        return 0
    groups = backward_groups(query, key)  # short calls (one group) end here, before the costlier questions
    if groups == 1:
        return 0
    if any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "cache")):
        return 0
    if _backend.forward_ad_active() or torch._C._are_functorch_transforms_active():
        return 0  # forward-mode AD and torch.func keep the stock call
    if torch.nn.functional.scaled_dot_product_attention is not _SDPA or _modes_active():
        return 0  # sdpa replaced (context parallelism's ring attention patches it) or intercepted: what it says
    if any(type(t) is not torch.Tensor or not t.is_cuda for t in (query, key, value)):
        return 0
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return 0
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") != query.dtype:
        return 0  # sdpa would run in autocast's dtype
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        return 0
    shared = q_heads != kv_heads
    # transformers passes enable_gqa only for a module that declares its groups and head dims sdpa takes
    # (it repeats k and v otherwise: the same attention, which may run other kernels)
    if shared and not (
        getattr(module, "num_key_value_groups", 1) == q_heads // kv_heads and key.shape[-1] == value.shape[-1] <= 256
    ):
        return 0
    if torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scaling, enable_gqa=shared) != _CUDNN:
        return 0
    return groups


def sdpa_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):  # fmt: skip
    """transformers' ``sdpa_attention_forward`` (the attention interface's signature and result), whose long
    causal training calls run their backward one group of KV heads at a time (see the module's docstring).
    The masks must be sdpa's: register the function with ``register_sdpa_attention``, which pairs it with sdpa's
    mask function (a model whose attention name has another mask function, or none, is refused)."""
    for name in UNSUPPORTED_KEYWORDS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"sdpa_attention_forward: the model hands the attention `{name}`, which transformers' sdpa "
                "attention does not apply (the model computes it itself only under the name 'sdpa'); use 'sdpa' "
                "or 'eager' for this model"
            )
    _check_mask_function(module)
    groups = _grouped_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if groups:
        out = GroupedCausalAttention.apply(
            query, key, value, scaling, groups, CUDNN_OPS, _kept(module, query, key, value, scaling, groups)
        )
        return out.transpose(1, 2).contiguous(), None
    return _transformers().stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)  # fmt: skip


_TRANSFORMERS = None


def _transformers():
    """transformers' sdpa function and mask registry, imported at the first call (the package does not need
    transformers to load) and kept: its lazy modules cost tens of µs per import statement."""
    global _TRANSFORMERS
    if _TRANSFORMERS is None:
        from transformers import PretrainedConfig
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as stock
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        plain = PretrainedConfig.__dict__.get("_attn_implementation")
        _TRANSFORMERS = types.SimpleNamespace(
            stock=stock,
            masks=ALL_MASK_ATTENTION_FUNCTIONS,
            sdpa_mask=sdpa_mask,
            plain_name=plain,
            plain_getattribute=PretrainedConfig.__getattribute__,
        )
    return _TRANSFORMERS


def _attention_name(config, found):
    """``config._attn_implementation``. Every attribute read of a transformers config runs its Python
    ``__getattribute__`` (its attribute map): about 3 us for this property and the attribute behind it, per
    attention call. Where the config's class keeps transformers' own property and ``__getattribute__`` (``found``:
    ``_transformers()``) and maps neither name elsewhere, the value is read from the instance's dict, as that
    property reads it."""
    kind = type(config)
    renamed = getattr(kind, "attribute_map", ())
    if (
        found.plain_name is not None
        and getattr(kind, "_attn_implementation", None) is found.plain_name
        and kind.__getattribute__ is found.plain_getattribute
        and "_attn_implementation" not in renamed
        and "_attn_implementation_internal" not in renamed
    ):
        values = object.__getattribute__(config, "__dict__")
        if "_attn_implementation_internal" in values:
            return values["_attn_implementation_internal"]
    return getattr(config, "_attn_implementation", None)


def _check_mask_function(module) -> None:
    """The masks a model hands over are those of the mask function registered under its attention name. Another
    function's than sdpa's (as transformers pairs with an attention kernel loaded by "repo:function" name: flash
    attention's, None for any unpadded batch, also where a cached prefix needs a mask), or none at all (a name
    registered with AttentionInterface alone: no mask even for padding), would be read as sdpa's without an
    error: refused."""
    found = _transformers()
    name = _attention_name(getattr(module, "config", None), found)
    if not isinstance(name, str):
        return
    mask_function = found.masks.get(name)
    if mask_function is not found.sdpa_mask:  # None: no mask function, and no mask for a padded batch either
        what = "no mask function" if mask_function is None else repr(getattr(mask_function, "__name__", mask_function))
        raise ValueError(
            f"sdpa_attention_forward: the attention implementation {name!r} builds its masks with {what}, not "
            "sdpa's; register it with lk.register_sdpa_attention(), which pairs it with sdpa's mask function"
        )


def register_sdpa_attention(name: str = "liger_sdpa") -> str:
    """Registers ``sdpa_attention_forward`` with transformers under ``name``, with sdpa's mask function, and
    returns ``name``: ``model.set_attn_implementation(lk.register_sdpa_attention())``, or
    ``from_pretrained(..., attn_implementation=lk.register_sdpa_attention())``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    registered = AttentionInterface()
    # "sdpa" in the name: transformers then checks that the model supports sdpa; "|", "/" and ":" mean a paged
    # variant or a Hub kernel to transformers
    if (
        not isinstance(name, str)
        or "sdpa" not in name
        or any(c in name for c in "|/:")
        or (name in registered and registered[name] is not sdpa_attention_forward)
    ):
        raise ValueError(
            "register_sdpa_attention: `name` must contain 'sdpa', no '|', '/' or ':', and be no other attention's "
            f"name, got {name!r}"
        )
    AttentionInterface.register(name, sdpa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
