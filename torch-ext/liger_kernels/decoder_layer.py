"""A Llama-form decoder layer run over chunks of the sequence, one autograd node per layer that keeps the
layer's input and what its attention computed, never the layer's activations at full length:
``tile_decoder_layers(model)``.

Why. Under gradient checkpointing a layer's backward recomputes the whole layer at once: at 131,072 tokens of
Llama-3-8B width the first layer's backward holds the recomputed norm output, the rotated queries, the
attention output, its gradient and dq (S x hidden each), beside the weights' gradients (benchmarks/NOTES.md
§26, §29). Here forward and backward both run chunk by chunk (``chunk`` tokens):

forward, chunk c = [s0, s1):
    n1 = rms_norm(x_c);  q = rope(n1 Wqᵀ), k = rope(n1 Wkᵀ), v = n1 Wvᵀ;  K[s0:s1], V[s0:s1] = k, v
    o = causal attention of q over K[:s1], V[:s1]: the diagonal block (causal) and the keys before it (no
        mask), merged by their logsumexps
    h = x_c + o Woᵀ;  z_c = h + down(act(n2 Wgᵀ) * (n2 Wuᵀ)),  n2 = rms_norm(h)

backward, chunks in reverse: the chunk's forward is recomputed but for o, which the forward kept. Causality
makes chunk c the last to send gradient to its own keys, so after chunk c's attention backward its rows of
dK and dV are complete and its projections' backward runs at once; dK and dV are the only full-length sums
(fp32). The weights' gradients are summed over chunks in fp32 (``_grad_sums``) and cast once.

Kept from forward to backward: a copy of the input x, K, V and o, on CUDA in pinned host memory (copied on a
side stream, started back one chunk ahead; (2 + 2 kv_heads / heads) x S x hidden x 2 bytes of host memory per
layer in bf16), the logsumexps (fp32, on the device) and the attention calls' random state. The layer's
gradient checkpoint is not needed: a tiled layer is its own (``tile_decoder_layers`` bypasses the model's
checkpoint for the calls it serves).

Served: decoder layers whose forward and attention forward are Llama's, with RMSNorms of a form ``rms_norm``
computes, plain ``nn.Linear`` projections (attention biases allowed, none on the MLP), a gated MLP of a
registered activation, sdpa's attention (under a name containing "sdpa") with no mask, no cache and no
dropout; tensors on CUDA in bf16/fp16 (cuDNN's attention) or on the CPU. Any other call runs the layer's own
forward.
"""

import ast
import functools
import sys
import textwrap
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import _backend, _grad_sums, _hosts, _replay
from . import attention as _attention
from . import gated_mlp as _gated_mlp
from . import layers as _layers
from ._gated import gated_forward, gated_recompute_backward
from .rms_norm import norm_backward, norm_forward
from .rotary import _dense_like, _rotate, liger_rotary_pos_emb, rotary_backward, rotary_forward

DEFAULT_CHUNK = 8192
# Shorter calls run the layer's own forward: the tiled backward's fixed costs (the fp32 weight-gradient sums,
# twice a layer's weights, and the MLP's row buffers) outweigh the activations it saves below about this many
# tokens at Llama-3-8B's width (benchmarks/NOTES.md §29: 5.28 GiB against 4.01 at 16k, 6.76 against 7.75 at 64k).
MIN_TOKENS = 32768
# Tokens per MLP step within a chunk: its three [rows, intermediate] buffers (168 MiB at I = 14336 in bf16).
MLP_ROWS = 2048

# ----------------------------------------------------------------------------------------------------------
# The attention pieces run attention.py's ops: cuDNN's SDPA (what F.scaled_dot_product_attention runs for
# bf16/fp16 on an H100/H200) and the CPU flash ops with the same contract. Their ``causal`` is the top-left
# causal mask: for the diagonal block, whose queries and keys are the same positions, the layer's mask.


def _ops_for(x: torch.Tensor, spec):
    """The attention ops for ``x``'s device and dtype, or None where the tiled layer does not run: on CUDA
    cuDNN's SDPA, where it is enabled (an ``sdpa_kernel`` restriction without it keeps the layer's own
    forward) and runs: compute capability 8.0 or later, head dims that are multiples of 8 up to 128."""
    if x.device.type == "cpu":
        return _attention.CPU_OPS
    if (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
        and spec.head_dim % 8 == 0
        and spec.head_dim <= 128
    ):
        return _attention.CUDNN_OPS
    return None


def _merge(o_diag, lse_diag, o_past, lse_past, out):
    """Write into ``out`` the attention over both pieces' keys: each piece's output weighted by its share of
    the row's exp-sum, exp(lse_piece - lse). Returns the merged lse."""
    lse = torch.logaddexp(lse_diag, lse_past)
    wide = torch.promote_types(o_diag.dtype, torch.float32)
    rows = (*out.shape[:3], 1)  # lse is [B, heads, c] (or with a trailing 1)
    merged = o_past.to(wide).mul_((lse_past - lse).exp_().reshape(rows))
    merged.addcmul_(o_diag.to(wide), (lse_diag - lse).exp_().reshape(rows))
    out.copy_(merged)
    return lse


# ----------------------------------------------------------------------------------------------------------
# What the forward keeps: on CUDA a pinned host copy (made on a side stream after the work queued so far; the
# source's memory is held for that stream), on the CPU the tensor itself. Only the layer's own buffers go
# there: nothing else writes into them.


def _keep(t: torch.Tensor):
    return _attention._to_host((t,), (True,))[0] if t.is_cuda else t


def _fetch(held: torch.Tensor, device: torch.device):
    """Start ``held`` back to ``device``; ``_arrived`` of the result is the tensor, ready for the current stream."""
    if device.type != "cuda":
        return (held,), None
    return _attention._to_device((held,), (True,), device)


def _arrived(moving) -> torch.Tensor:
    return _attention._arrived(moving)[0]


# ----------------------------------------------------------------------------------------------------------
# The layer's math.


class Spec(types.SimpleNamespace):
    """heads, kv_heads, head_dim, scale; norm1, norm2: (eps, offset, llama); activation; chunk; ops."""


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _heads(t, heads, d):
    """[B, c, heads * D] as [B, heads, c, D] (the layout transformers hands the attention)."""
    return t.view(t.shape[0], t.shape[1], heads, d).transpose(1, 2)


def _projections(spec, x_c, w1, wq, bq, wk, bk, wv, bv, cos_c, sin_c):
    """(q, k, v) of one chunk, q and k rotated."""
    n1, _ = norm_forward(x_c, w1, *spec.norm1, False)
    d = spec.head_dim
    q = _heads(F.linear(n1, wq, bq), spec.heads, d)
    k = _heads(F.linear(n1, wk, bk), spec.kv_heads, d)
    q, k = rotary_forward(q, k, cos_c, sin_c)
    return q, k, _heads(F.linear(n1, wv, bv), spec.kv_heads, d)


def _bshd(batch, c, heads, d, dtype, device) -> torch.Tensor:
    """An uninitialized [B, heads, c, D] tensor stored as [B, c, heads, D]."""
    return torch.empty(batch, c, heads, d, dtype=dtype, device=device).transpose(1, 2)


def _attend(spec, q, keys, values, s0, s1):
    """(o in [B, c, heads, D] storage, lse, random states) of the chunk's queries over keys [0, s1)."""
    forward = spec.ops[0]
    o_diag, lse_diag, state_diag = forward(q, keys[:, :, s0:s1], values[:, :, s0:s1], spec.scale, True)
    o = _bshd(q.shape[0], q.shape[2], q.shape[1], q.shape[3], q.dtype, q.device)
    if s0 == 0:
        o.copy_(o_diag)
        return o, lse_diag, (state_diag,)
    o_past, lse_past, state_past = forward(q, keys[:, :, :s0], values[:, :, :s0], spec.scale, False)
    return o, _merge(o_diag, lse_diag, o_past, lse_past, o), (state_diag, state_past)


def _mlp_forward(spec, n2_rows, wg, wu, wd):
    out = torch.empty(n2_rows.shape[0], wd.shape[0], dtype=n2_rows.dtype, device=n2_rows.device)
    for r0 in range(0, n2_rows.shape[0], MLP_ROWS):
        rows = n2_rows[r0 : r0 + MLP_ROWS]
        hidden = gated_forward(F.linear(rows, wg), F.linear(rows, wu), spec.activation)
        torch.mm(hidden, wd.t(), out=out[r0 : r0 + MLP_ROWS])
    return out


def forward(spec, x, cos, sin, params):
    """(z, kept) for the layer's input ``x`` [B, S, H]; no autograd."""
    w1, wq, bq, wk, bk, wv, bv, wo, bo, w2, wg, wu, wd = params
    batch, seq, _ = x.shape
    d = spec.head_dim
    keys = _bshd(batch, seq, spec.kv_heads, d, x.dtype, x.device)
    values = _bshd(batch, seq, spec.kv_heads, d, x.dtype, x.device)
    z = torch.empty_like(x, memory_format=torch.contiguous_format)
    kept = types.SimpleNamespace(x=[], o=[], lse=[], states=[], bounds=[])
    for s0 in range(0, seq, spec.chunk):
        s1 = min(seq, s0 + spec.chunk)
        x_c = x[:, s0:s1]
        cos_c, sin_c = cos[:, s0:s1].unsqueeze(1), sin[:, s0:s1].unsqueeze(1)
        q, k, v = _projections(spec, x_c, w1, wq, bq, wk, bk, wv, bv, cos_c, sin_c)
        keys[:, :, s0:s1] = k
        values[:, :, s0:s1] = v
        o, lse, states = _attend(spec, q, keys, values, s0, s1)
        h = x_c + F.linear(o.transpose(1, 2).reshape(batch, s1 - s0, -1), wo, bo)
        n2, _ = norm_forward(h, w2, *spec.norm2, False)
        z[:, s0:s1] = h + _mlp_forward(spec, _rows(n2), wg, wu, wd).view_as(h)
        # the caller may write into x after the call: the copy kept is of a private clone
        kept.x.append(_keep(x_c.clone(memory_format=torch.contiguous_format)))
        kept.o.append(_keep(o))
        kept.lse.append(lse)
        kept.states.append(states)
        kept.bounds.append((s0, s1))
    kept.keys, kept.values = _keep(keys), _keep(values)
    return z, kept


def backward(spec, kept, d_z, cos, sin, params, needs):
    """(d_x, gradients of ``params``) from the output's gradient ``d_z``; ``needs``: which parameters want a
    gradient. One chunk at a time, in reverse; each chunk's buffers are freed before the next one's exist."""
    device = d_z.device
    batch, seq, hidden = d_z.shape
    dtype = params[1].dtype
    wide = torch.promote_types(dtype, torch.float32)
    run = types.SimpleNamespace(
        spec=spec, kept=kept, d_z=d_z, cos=cos, sin=sin, params=params, needs=needs, sums=[None] * len(params),
        dtype=dtype, wide=wide, keys=_arrived(_fetch(kept.keys, device)), values=_arrived(_fetch(kept.values, device)),
        d_keys=torch.zeros(batch, seq, spec.kv_heads, spec.head_dim, dtype=wide, device=device).transpose(1, 2),
        d_values=torch.zeros(batch, seq, spec.kv_heads, spec.head_dim, dtype=wide, device=device).transpose(1, 2),
        d_x=torch.empty(batch, seq, hidden, dtype=d_z.dtype, device=device),
    )  # fmt: skip

    def start(i):
        return _fetch(kept.x[i], device), _fetch(kept.o[i], device)

    coming = start(len(kept.bounds) - 1)
    for i in range(len(kept.bounds) - 1, -1, -1):
        moving, coming = coming, (start(i - 1) if i else None)  # the next chunk's copies start now
        _backward_chunk(run, i, _arrived(moving[0]), _arrived(moving[1]))
        del moving
    return run.d_x, _grad_sums.cast_each(run.sums, params)


def _backward_chunk(run, i, x_c, o):
    """Chunk i's share of the backward: its rows of d_x, its weight-gradient terms, its keys' dK and dV terms."""
    spec, params, needs, sums, dtype = run.spec, run.params, run.needs, run.sums, run.dtype
    w1, wq, bq, wk, bk, wv, bv, wo, bo, w2, wg, wu, wd = params
    d, heads, kv_heads = spec.head_dim, spec.heads, spec.kv_heads
    mm = _grad_sums.add_matmul
    s0, s1 = run.kept.bounds[i]
    batch, c = x_c.shape[0], s1 - s0
    cos_c, sin_c = run.cos[:, s0:s1].unsqueeze(1), run.sin[:, s0:s1].unsqueeze(1)
    n1, rstd1 = norm_forward(x_c, w1, *spec.norm1, True)  # q again; k and v come back from the forward
    q_pre = _heads(F.linear(n1, wq, bq), heads, d)
    q = _dense_like(q_pre, dtype)
    _rotate(q_pre, None, q, None, cos_c, sin_c, backward=False)  # the forward's q, bit for bit
    del q_pre
    o_rows = o.transpose(1, 2).reshape(batch * c, heads * d)
    h = x_c + F.linear(o_rows, wo, bo).view_as(x_c)
    n2, rstd2 = norm_forward(h, w2, *spec.norm2, True)
    d_z_c = run.d_z[:, s0:s1]

    # MLP and the post-attention norm
    d_n2 = _mlp_backward(run, _rows(n2), _rows(d_z_c))
    del n2
    d_h, d_w2 = norm_backward(d_n2.view_as(h), h, w2, rstd2, *spec.norm2, True, needs[9])
    del d_n2, h
    sums[9] = _grad_sums.accumulate(sums[9], d_w2)
    d_h.add_(d_z_c)  # the residual
    d_h_rows = _rows(d_h)

    # o_proj
    if needs[7]:
        sums[7] = mm(sums[7], d_h_rows.t(), o_rows)
    if needs[8] and bo is not None:
        sums[8] = _grad_sums.accumulate(sums[8], _grad_sums.row_sum(d_h_rows))
    d_o = (d_h_rows @ wo).view(batch, c, heads, d).transpose(1, 2)

    # attention, per piece and group of KV heads; each piece's backward takes the merged output and lse, which
    # give its share of the softmax and the rows' dO.O
    d_q = torch.empty(batch, c, heads, d, dtype=run.wide, device=x_c.device).transpose(1, 2)
    lse, states = run.kept.lse[i], run.kept.states[i]
    pieces = [(s0, s1, True, states[0])] + ([(0, s0, False, states[1])] if s0 else [])
    for first, (k0, k1, causal, state) in enumerate(pieces):
        groups = _attention.backward_groups(q, run.keys[:, :, k0:k1])
        per_q, per_kv = heads // groups, kv_heads // groups
        for g in range(groups):
            qh, kvh = slice(g * per_q, (g + 1) * per_q), slice(g * per_kv, (g + 1) * per_kv)
            dq_g, dk_g, dv_g = spec.ops[1](
                d_o[:, qh], q[:, qh], run.keys[:, kvh, k0:k1], run.values[:, kvh, k0:k1], o[:, qh],
                lse[:, qh].contiguous(), state, spec.scale, causal,
            )  # fmt: skip
            if first == 0:
                d_q[:, qh] = dq_g
            else:
                d_q[:, qh] += dq_g
            run.d_keys[:, kvh, k0:k1] += dk_g
            run.d_values[:, kvh, k0:k1] += dv_g
            del dq_g, dk_g, dv_g
    del d_o, q, o, o_rows

    # this chunk's keys have all their gradient now: the q, k, v projections and the input norm
    d_q_low = _bshd(batch, c, heads, d, dtype, x_c.device).copy_(d_q)
    del d_q
    d_k_low = _bshd(batch, c, kv_heads, d, dtype, x_c.device).copy_(run.d_keys[:, :, s0:s1])
    d_v_low = _bshd(batch, c, kv_heads, d, dtype, x_c.device).copy_(run.d_values[:, :, s0:s1])
    d_q_low, d_k_low = rotary_backward(d_q_low, d_k_low, cos_c, sin_c, dtype, dtype)
    n1_rows = _rows(n1)
    d_n1 = None
    for index, grad, weight in ((1, d_q_low, wq), (3, d_k_low, wk), (5, d_v_low, wv)):
        grad_rows = grad.transpose(1, 2).reshape(batch * c, -1)
        if needs[index]:
            sums[index] = mm(sums[index], grad_rows.t(), n1_rows)
        if needs[index + 1] and params[index + 1] is not None:
            sums[index + 1] = _grad_sums.accumulate(sums[index + 1], _grad_sums.row_sum(grad_rows))
        d_n1 = grad_rows @ weight if d_n1 is None else d_n1.addmm_(grad_rows, weight)
    del d_q_low, d_k_low, d_v_low, grad_rows, n1, n1_rows
    d_x_norm, d_w1 = norm_backward(d_n1.view_as(x_c), x_c, w1, rstd1, *spec.norm1, True, needs[0])
    sums[0] = _grad_sums.accumulate(sums[0], d_w1)
    torch.add(d_h, d_x_norm, out=run.d_x[:, s0:s1])


def _mlp_backward(run, n2_rows, d_z_rows):
    """d_n2 from the MLP's output gradient, ``MLP_ROWS`` rows at a time (their [rows, intermediate] buffers
    freed before the next rows'), with the MLP's weight-gradient terms."""
    d_n2 = torch.empty_like(n2_rows)
    for r0 in range(0, n2_rows.shape[0], MLP_ROWS):
        rows = slice(r0, r0 + MLP_ROWS)
        _mlp_rows_backward(run, n2_rows[rows], d_z_rows[rows], d_n2[rows])
    return d_n2


def _mlp_rows_backward(run, rows, d_out, d_rows):
    """gated_recompute_backward writes d_gate and d_up over the gate and up buffers and the activation's output
    (the down projection's input) over d_hidden."""
    _, _, _, _, _, _, _, _, _, _, wg, wu, wd = run.params
    sums, needs, mm = run.sums, run.needs, _grad_sums.add_matmul
    gate, up = F.linear(rows, wg), F.linear(rows, wu)
    hidden_out = gated_recompute_backward(d_out @ wd, gate, up, run.spec.activation)
    d_gate, d_up = gate, up
    if needs[12]:
        sums[12] = mm(sums[12], d_out.t(), hidden_out)
    if needs[10]:
        sums[10] = mm(sums[10], d_gate.t(), rows)
    if needs[11]:
        sums[11] = mm(sums[11], d_up.t(), rows)
    torch.mm(d_gate, wg, out=d_rows).addmm_(d_up, wu)


class TiledDecoderLayer(torch.autograd.Function):
    """The layer's output from its input ``x``, ``cos``, ``sin`` and its 13 parameters (w1, wq, bq, wk, bk, wv,
    bv, wo, bo, w2, wg, wu, wd; biases may be None), with ``spec`` (see ``Spec``)."""

    @staticmethod
    def forward(ctx, spec, x, cos, sin, *params):
        z, kept = forward(spec, x, cos, sin, params)
        ctx.spec, ctx.kept = spec, kept
        ctx.save_for_backward(cos, sin, *params)
        return z

    @staticmethod
    def backward(ctx, d_z):
        functorch = torch._C._functorch  # is_grads_batched batches with the legacy vmap, torch.func with the other
        if (
            functorch.is_legacy_batchedtensor(d_z)
            or functorch.is_batchedtensor(d_z)
            or functorch.is_functorch_wrapped_tensor(d_z)
        ):
            raise RuntimeError(
                "tile_decoder_layers: batched gradients (is_grads_batched=True, jacobian(vectorize=True), vmap) "
                "through a tiled decoder layer are not supported; untile the model (untile_decoder_layers) for them"
            )
        if torch.is_grad_enabled():  # create_graph: these gradients have no derivative of their own
            raise RuntimeError(
                "tile_decoder_layers: double backward through a tiled decoder layer is not supported; untile the "
                "model (untile_decoder_layers) for it"
            )
        cos, sin, *params = ctx.saved_tensors
        needs = [n and p is not None for n, p in zip(ctx.needs_input_grad[4:], params)]
        kept = ctx.kept
        if not _backend.graph_is_retained():  # as autograd frees saved tensors: nothing reads them again
            ctx.kept = None
        d_x, grads = backward(ctx.spec, kept, d_z, cos, sin, params, needs)
        return (None, d_x if ctx.needs_input_grad[1] else None, None, None, *grads)


# ----------------------------------------------------------------------------------------------------------
# Which layers and calls are served. A layer's class must have Llama's decoder-layer forward and its attention
# Llama's attention forward (their source, read once per class), so the math above is exactly what the layer
# computes; each call must then be one the tiled path reproduces.

_LLAMA_SOURCES = None


def _llama_sources():
    """The source of Llama's decoder-layer forward, attention forward, ``apply_rotary_pos_emb`` and
    ``rotate_half``, read from modeling_llama's file (the functions there may have been replaced since)."""
    global _LLAMA_SOURCES
    if _LLAMA_SOURCES is None:
        from transformers.models.llama import modeling_llama

        with open(modeling_llama.__file__) as file:
            text = file.read()
        top = {n.name: n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

        def forward_of(cls):
            method = next(n for n in top[cls].body if isinstance(n, ast.FunctionDef) and n.name == "forward")
            return textwrap.dedent(_segment(text, method))

        _LLAMA_SOURCES = (
            forward_of("LlamaDecoderLayer"),
            forward_of("LlamaAttention"),
            _segment(text, top["apply_rotary_pos_emb"]),
            _segment(text, top["rotate_half"]),
        )
    return _LLAMA_SOURCES


def _segment(text, node) -> str:
    """A definition's source, its decorators included (as inspect.getsource gives it)."""
    lines = text.splitlines(keepends=True)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return "".join(lines[first - 1 : node.end_lineno])


def _source(function):
    try:
        return _hosts.own_source(function)  # (not a functools.wraps wrapper's wrapped function)
    except (OSError, TypeError):
        return None


_CLASS_FORMS = {}  # (layer class's forward, attention class's forward) -> bool
_MLP = _gated_mlp.GatedMLP("tile_decoder_layers", tuple(_gated_mlp.REGISTRY), default=None)


# The package's MLP layers (what kernelize sets on an MLP) and the activations each computes.
_MLP_LAYERS = {
    _layers.LigerSwiGLUMLP.forward: _gated_mlp.swiglu_mlp,
    _layers.LigerTiledSwiGLUMLP.forward: _gated_mlp.swiglu_mlp,
    _layers.LigerGEGLUMLP.forward: _gated_mlp.geglu_mlp,
    _layers.LigerTiledGEGLUMLP.forward: _gated_mlp.geglu_mlp,
}


def _mlp_serving(mlp):
    """What computes the MLP's call, as a ``GatedMLP``: its host's forward (any registered activation), or a
    package layer set on it as kernelize does (that layer's activations); None for anything else."""
    forward = mlp.__dict__.get("forward")
    if forward is None:
        return _MLP
    if type(forward) is not types.MethodType or forward.__self__ is not mlp:
        return None
    return _MLP if forward.__func__ is type(mlp).forward else _MLP_LAYERS.get(forward.__func__)


def _has_llama_form(layer) -> bool:
    """The layer's class has Llama's decoder-layer forward, its attention's class Llama's attention forward, and
    the rotary function that forward calls (a global of the attention's module) is Llama's, or the package's."""
    attention = getattr(layer, "self_attn", None)
    if not isinstance(attention, nn.Module):
        return False
    key = (type(layer).forward, type(attention).forward)  # a patched forward is another key
    known = _CLASS_FORMS.get(key)
    if known is None:
        layer_source, attention_source, _, _ = _llama_sources()
        known = _CLASS_FORMS[key] = (
            _source(type(layer).forward) == layer_source and _source(type(attention).forward) == attention_source
        )
    return known and _llama_rotary(type(attention))


def _llama_rotary(attention_class) -> bool:
    """Whether ``apply_rotary_pos_emb`` in the attention class's module is Llama's (source for source, with its
    ``rotate_half``) or the package's; read at each call, as the forward reads it (kernelize and patches
    replace it)."""
    module = sys.modules.get(attention_class.__module__)
    rotary = _rotary_function(getattr(module, "apply_rotary_pos_emb", None))
    if rotary is liger_rotary_pos_emb or rotary is None:
        return rotary is not None
    half = getattr(module, "rotate_half", None)
    known = _ROTARY_FORMS.get((rotary, half))  # either replaced since is another key
    if known is None:
        _, _, rotary_source, half_source = _llama_sources()
        known = _ROTARY_FORMS[(rotary, half)] = (
            isinstance(rotary, types.FunctionType)
            and rotary.__globals__.get("rotate_half") is half
            and _source(rotary) == rotary_source
            and _source(half) == half_source
        )
    return known


_ROTARY_FORMS = {}  # (the module's apply_rotary_pos_emb, its rotate_half) -> bool


def _rotary_function(rotary):
    """The function a module's ``apply_rotary_pos_emb`` runs: itself, or where transformers made it a kernels
    ``Func`` module (``use_kernel_func_from_hub``), the function that module wraps, or the package's rotary
    where kernelize set the package's layer on it; None where it is something else."""
    if not isinstance(rotary, nn.Module):
        return rotary
    forward = rotary.__dict__.get("forward")
    if forward is not None:  # set by kernelize: the package's layer, or the module's own (no kernel mapped for it)
        bound = type(forward) is types.MethodType and forward.__self__ is rotary
        if bound and forward.__func__ is _layers.liger_rotary_pos_emb_layer.forward:
            # the layer computes the function's own form; Llama's is the package's rotary
            dtype, sign, refusal = _hosts.rotary_host(type(rotary))
            return liger_rotary_pos_emb if (dtype, sign, refusal) == (_hosts.ROTARY_PROMOTED, 1.0, "") else None
        if not (bound and forward.__func__ is type(rotary).forward):
            return None
    return _hosts.kernels_function(type(rotary))


def _bound_to(module, functions) -> bool:
    """Whether the module's call runs one of ``functions``: its class's forward, or one set on the instance as
    ``kernels.kernelize`` sets a layer's (a method bound to the module itself)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return type(module).forward in functions
    return type(forward) is types.MethodType and forward.__self__ is module and forward.__func__ in functions


def _norm_form(norm):
    """(eps, offset, llama) for an RMSNorm module ``rms_norm`` computes, else None: the host's own forward or
    the package's LigerRMSNorm on it (the same math, for the hosts it accepts)."""
    if not _bound_to(norm, (type(norm).forward, _layers.LigerRMSNorm.forward)) or _hosts.has_hooks(norm):
        return None
    casting, offset, eps_attribute, refusal = _hosts.rms_norm_host(type(norm))
    if refusal:
        return None
    return float(getattr(norm, eps_attribute)), float(offset), casting == "llama"


def _operands(layer):
    """(spec without chunk and ops, params) where the layer's modules are ones the tiled path computes exactly,
    else None."""
    if not _has_llama_form(layer) or _hosts.global_hooks():
        return None
    attention, mlp = layer.self_attn, layer.mlp
    if "forward" in attention.__dict__ or _hosts.has_hooks(attention) or _hosts.has_hooks(mlp):
        return None
    serving = _mlp_serving(mlp)
    if serving is None:
        return None
    norm1, norm2 = _norm_form(layer.input_layernorm), _norm_form(layer.post_attention_layernorm)
    if norm1 is None or norm2 is None:
        return None
    projections = [_hosts.linear_operands(getattr(attention, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    try:
        activation, form, act_fn = serving._resolve(mlp)
    except ValueError:  # the host's own forward, or the package's layer, would not compute this math
        return None
    if form != _hosts.SEPARATE or _gated_mlp._is_hooked(act_fn):
        return None
    mlp_projections = [_hosts.linear_operands(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(projections) or not all(mlp_projections) or any(b is not None for _, b in mlp_projections):
        return None
    config = attention.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = attention.head_dim
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = projections
    if wq.shape[0] != heads * head_dim or wk.shape[0] != kv_heads * head_dim or heads % kv_heads:
        return None
    spec = Spec(heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=float(attention.scaling),
                norm1=norm1, norm2=norm2, activation=activation)  # fmt: skip
    params = (layer.input_layernorm.weight, wq, bq, wk, bk, wv, bv, wo, bo, layer.post_attention_layernorm.weight,
              *(w for w, _ in mlp_projections))  # fmt: skip
    return spec, params


# Keywords a decoder layer's call may carry that the tiled path may ignore: what they ask for is what it
# computes (or, for the cache, checked to be absent).
_IGNORED = {"position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states"}


_CACHE_WARNED = []


def _say_a_cache_keeps_it_untiled(hidden_states) -> None:
    """Once per process: a training call long enough to tile came with a KV cache, which transformers' models build
    for every call unless ``use_cache=False`` is passed (or the model's config says so); the tiled path does not
    fill one, so the layers run their own forward, at full length, and the memory the tiling saves is not saved."""
    if not _CACHE_WARNED:
        _CACHE_WARNED.append(True)
        warnings.warn(
            f"tile_decoder_layers: a training call of {hidden_states.shape[0] * hidden_states.shape[1]} tokens came "
            "with a KV cache, which the tiled layers do not fill, so the layers ran untiled: pass use_cache=False to "
            "the model (causal_lm_loss does), or set model.config.use_cache = False",
            stacklevel=3,
        )


def _tiled_call(layer, hidden_states, attention_mask, past_key_values, position_embeddings, kwargs):
    """(spec, params, cos, sin) where this call is one the tiled path serves, else None."""
    if (
        not torch.is_grad_enabled()
        or type(hidden_states) is not torch.Tensor
        or hidden_states.dim() != 3
        or hidden_states.shape[1] < 2
        or hidden_states.shape[0] * hidden_states.shape[1] < layer.__dict__.get("_tiled_min_tokens", 0)
        or attention_mask is not None
        or position_embeddings is None
        or kwargs.get("output_attentions")
        or any(v is not None for k, v in kwargs.items() if k not in _IGNORED)
    ):
        return None
    if past_key_values is not None:
        _say_a_cache_keeps_it_untiled(hidden_states)
        return None
    if torch.compiler.is_compiling() or _backend.exporting() or _backend.forward_ad_active():
        return None
    if torch._C._are_functorch_transforms_active() or _attention._modes_active():
        return None
    if torch.nn.functional.scaled_dot_product_attention is not _attention._SDPA:
        return None  # replaced (context parallelism's ring attention patches it): the layer's attention is that
    if _replay.autocast_enabled(hidden_states.device.type):  # (the query raises for a device without autocast: meta)
        return None  # the layer's ops would run in autocast's dtypes
    attention = layer.self_attn
    if layer.training and attention.attention_dropout:
        return None
    if not getattr(attention, "is_causal", True) or not _sdpa_named(attention.config):
        return None  # a mask-less call is causal attention under sdpa only
    found = _operands(layer)
    if found is None:
        return None
    spec, params = found
    cos, sin = position_embeddings
    dtype = hidden_states.dtype
    tensors = [t for t in params if t is not None]
    if any(type(t) not in (torch.Tensor, nn.Parameter) or t.dtype != dtype or t.device != hidden_states.device
           for t in tensors) or not any(t.requires_grad for t in (hidden_states, *tensors)):  # fmt: skip
        return None
    if (
        type(cos) is not torch.Tensor
        or type(sin) is not torch.Tensor
        or cos.requires_grad
        or sin.requires_grad
        or cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[1:] != (hidden_states.shape[1], spec.head_dim)
        or cos.shape[0] not in (1, hidden_states.shape[0])
        or cos.device != hidden_states.device
        or cos.dtype != dtype
    ):
        return None
    ops = _ops_for(hidden_states, spec)
    if ops is None:
        return None
    return spec, params, cos, sin, ops


def _sdpa_named(config) -> bool:
    """Whether the config's attention is transformers' sdpa function or the package's (registered under a name
    with sdpa's mask function): with no mask, each computes causal softmax attention."""
    name = getattr(config, "_attn_implementation", None)
    if not isinstance(name, str) or "sdpa" not in name:
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS.get(name)
    return function is _attention.sdpa_attention_forward or function is _attention._transformers().stock


def _tiled_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, position_embeddings=None, **kwargs):  # fmt: skip
    """The decoder layer's forward, tiled where the call is one the tiled path serves."""
    state = self.__dict__
    checkpoint = state.get("_gradient_checkpointing_func")
    if checkpoint is not None and not isinstance(checkpoint, _Bypass):  # set since (gradient_checkpointing_enable)
        state["_gradient_checkpointing_func"] = _Bypass(self, checkpoint)  # from the next call on
    found = _tiled_call(self, hidden_states, attention_mask, past_key_values, position_embeddings, kwargs)
    if found is None:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    spec, params, cos, sin, ops = found
    spec = Spec(**vars(spec), chunk=self.__dict__["_tiled_chunk"], ops=ops)
    return TiledDecoderLayer.apply(spec, hidden_states, cos, sin, *params)


class _Bypass:
    """The layer's ``_gradient_checkpointing_func`` while tiled: a call the tiled path serves runs without the
    checkpoint (the tiled layer keeps no more than a checkpoint would), any other through ``checkpoint``."""

    def __init__(self, layer, checkpoint):
        self.layer, self.checkpoint = layer, checkpoint

    def __call__(self, function, *args, **kwargs):
        if isinstance(function, functools.partial) and len(args) == 1 and not kwargs:
            keywords = dict(function.keywords)  # the layer's call: its keywords as _tiled_forward takes them
            mask, cache = keywords.pop("attention_mask", None), keywords.pop("past_key_values", None)
            found = _tiled_call(self.layer, args[0], mask, cache, keywords.pop("position_embeddings", None), keywords)
            if found is not None:
                return function(*args)
        return self.checkpoint(function, *args, **kwargs)


def _decoder_layers(model):
    return [m for m in model.modules() if _has_llama_form(m)]


def _is_tiled(layer) -> bool:
    forward = layer.__dict__.get("forward")
    return type(forward) is types.MethodType and forward.__func__ is _tiled_forward and forward.__self__ is layer


def tile_decoder_layers(model: nn.Module, chunk: int = DEFAULT_CHUNK, min_tokens: int = MIN_TOKENS) -> int:
    """Run every decoder layer of ``model`` that has Llama's form as a sequence-tiled layer (see the module's
    docstring): training calls of at least ``min_tokens`` tokens (batch x length) with no mask and no cache
    take it, every other call the layer's own forward (kernelized norms and MLPs included). Call it after
    ``gradient_checkpointing_enable``: a tiled call then runs without the model's checkpoint, the others
    through it. Returns the number of layers tiled; ``untile_decoder_layers`` undoes it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tile_decoder_layers: `model` must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("chunk", chunk), ("min_tokens", min_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "chunk"):
            raise ValueError(f"tile_decoder_layers: `{name}` must be a positive int (tokens), got {value!r}")
    # a layer with a forward of its own on the instance (accelerate's hooks set one) keeps it, untiled
    layers = [m for m in _decoder_layers(model) if _is_tiled(m) or "forward" not in m.__dict__]
    if not layers:
        raise ValueError(
            "tile_decoder_layers: the model has no decoder layer of Llama's form (LlamaDecoderLayer's and "
            "LlamaAttention's forward, Llama's apply_rotary_pos_emb or the package's)"
        )
    for layer in layers:
        state = layer.__dict__
        state["_tiled_chunk"], state["_tiled_min_tokens"] = chunk, min_tokens
        state["forward"] = types.MethodType(_tiled_forward, layer)
        checkpoint = state.get("_gradient_checkpointing_func")
        if checkpoint is not None and not isinstance(checkpoint, _Bypass):
            state["_gradient_checkpointing_func"] = _Bypass(layer, checkpoint)
    return len(layers)


def untile_decoder_layers(model: nn.Module) -> int:
    """Undo ``tile_decoder_layers``; returns the number of layers restored."""
    restored = 0
    for layer in model.modules():
        state = layer.__dict__
        if state.pop("_tiled_chunk", None) is None:
            continue
        state.pop("_tiled_min_tokens", None)
        if _is_tiled(layer):
            del state["forward"]
        checkpoint = state.get("_gradient_checkpointing_func")
        if isinstance(checkpoint, _Bypass):
            state["_gradient_checkpointing_func"] = checkpoint.checkpoint
        restored += 1
    return restored
