"""The host's cost per call of every public entry point, next to its eager PyTorch composite and the peer
liger-kernel 0.8.5's equivalent (when importable); and the fused activations launched back to back.

    python benchmarks/suite/bench_host.py [--out OUT.json]
    python benchmarks/suite/bench_host.py --device cpu --quick     # smoke test of the code, no GPU

Host cost (``rows``): CPU wall time per call on tiny bf16 CUDA inputs (16 x 4096 unless the entry says
otherwise), 300 calls after 50 warm-up, median of 5 rounds that alternate between the variants
(timing.host_us):
- ``fwd_us``: the forward. Training entries run it with grad enabled and inputs requiring grad (a training
  step's forward, autograd node included); inference entries (the decode MLPs) under ``torch.no_grad()``, as
  transformers' ``generate`` runs.
- ``fwd_bwd_us``: forward, then ``backward()`` on the outputs, then the gradients dropped (``.grad = None``,
  the same for every variant). Training entries only.
- ``*_synced_us``: the same calls timed until the GPU has finished them. Well above the host figure, the GPU
  set the pace (the decode MLPs stream 350 MB of weights per token): the host figure is then not the host's
  own cost, and the tables mark it.
Where the peer has no such entry point, its cell stays empty.

Back to back (``back_to_back``): silu_mul and gelu_mul (both forms) at 8192 x 4096 bf16, 20 launches back to
back between two CUDA events (median of 15), forward (no grad) and backward (``autograd.grad`` through one
retained forward, 20 times), as % of the copy ceiling: what an eager loop sees when the host barely keeps up;
bench_activations.py's CUDA-graph figures are the GPU's own time. ``bwd_step``: the backward as a training
step runs it, one ``autograd.grad`` through the 20 calls' nodes (on 20 input pairs, so nothing is summed):
each node costs the host its backward alone, not a graph task of its own. ``bwd_node``: what one more call's
node adds to a training step's backward pass, from passes through 20 and 80 calls' nodes recorded afresh
(timing.pass_ms), so that the pass's own fixed cost, the same for every implementation, is left out.
"""

import argparse
import contextlib
import json
import sys
import types
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing

DTYPE = torch.bfloat16
PASS_NODES = 4  # the longer step's pass, in multiples of the 20 calls of the shorter
FULL = {
    "rows": 16,
    "hidden": 4096,
    "intermediate": 14336,
    "vocab": 2048,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "decode_batches": (1, 8),
    "calls": 300,
    "warmup": 50,
    "repeats": 5,
    "bandwidth": (8192, 4096),
}
QUICK = {
    "rows": 4,
    "hidden": 64,
    "intermediate": 128,
    "vocab": 96,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "decode_batches": (1, 2),
    "calls": 4,
    "warmup": 1,
    "repeats": 2,
    "bandwidth": (8, 64),
}
ROLES = ("ours", "eager", "peer")


class Entry(NamedTuple):
    name: str  # the public entry point, as a user calls it
    inputs: str  # what it runs on, for the table
    mode: str  # "train" (forward with grad, and forward + backward) or "inference" (forward under no_grad)
    variants: dict  # role -> (label, fn() -> output(s)); role in ROLES
    leaves: tuple = ()  # tensors whose .grad a backward fills (dropped after each call)
    d_outs: tuple | None = None  # gradients for the leading outputs; None: the first output is a scalar loss


# ----------------------------------------------------------------------------------------------------------
# Inputs


def _randn(shape, device, scale=1.0, grad=True):
    return (scale * torch.randn(shape, device=device)).to(DTYPE).requires_grad_(grad)


def _pair(cfg, device):
    shape = (cfg["rows"], cfg["hidden"])
    return _randn(shape, device), _randn(shape, device), _randn(shape, device, grad=False)


class Peers:
    """The peer's entry points, each None when it cannot be imported."""

    def __init__(self):
        self.silu_mul = timing.peer("liger_kernel.ops:LigerSiLUMulFunction")
        self.gelu_mul = timing.peer("liger_kernel.ops:LigerGELUMulFunction")
        self.tiled = timing.peer("liger_kernel.ops:apply_tiled_mlp")
        self.rms_norm_function = timing.peer("liger_kernel.ops:LigerRMSNormFunction")
        self.rms_norm_module = timing.peer("liger_kernel.transformers.rms_norm:LigerRMSNorm")
        self.rope = timing.peer("liger_kernel.transformers.rope:liger_rotary_pos_emb")
        self.flce_loss = timing.peer("liger_kernel.transformers:LigerFusedLinearCrossEntropyLoss")
        self.flce_function = timing.peer("liger_kernel.ops:LigerFusedLinearCrossEntropyFunction")
        self.ce_loss = timing.peer("liger_kernel.transformers:LigerCrossEntropyLoss")

    def gated(self, name):
        return {"silu": self.silu_mul, "gelu_tanh": self.gelu_mul}.get(name)


def _peer_mlp(function):
    """The peer's fused MLP, as its LigerSwiGLUMLP / LigerGEGLUMLP compute it, on a host's projections."""
    if function is None:
        return None
    return lambda module, x: module.down_proj(function.apply(module.gate_proj(x), module.up_proj(x)))


def _instance(cls, *args, **kwargs):
    """``cls(*args, **kwargs)``, or None (with a note) where the class is missing or its constructor fails."""
    if cls is None:
        return None
    try:
        return cls(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (a peer built for another transformers)
        print(f"(peer {getattr(cls, '__name__', cls)} not usable: {type(error).__name__}: {str(error)[:120]})")
        return None


def _variant(label, fn):
    return None if fn is None else (label, fn)


# ----------------------------------------------------------------------------------------------------------
# The entry points. Each builder returns Entries; a builder that fails (an import, a refused host) is
# reported and the others still run.


def gated_entries(lk, cfg, device, peers):
    a, b, d = _pair(cfg, device)
    shape = f"{cfg['rows']}x{cfg['hidden']}"
    silu, gelu_tanh = (lambda: F.silu(a) * b), (lambda: F.gelu(a, approximate="tanh") * b)
    peer_silu = peers.silu_mul and (lambda: peers.silu_mul.apply(a, b))
    peer_gelu = peers.gelu_mul and (lambda: peers.gelu_mul.apply(a, b))

    def entry(name, ours, eager_label, eager, peer):
        variants = {"ours": (name, ours), "eager": (eager_label, eager), "peer": _variant("liger-kernel", peer)}
        return Entry(name, shape, "train", variants, (a, b), (d,))

    entries = [
        entry("silu_mul", lambda: lk.silu_mul(a, b), "F.silu(a) * b", silu, peer_silu),
        entry("gelu_mul", lambda: lk.gelu_mul(a, b), "F.gelu(a, 'tanh') * b", gelu_tanh, peer_gelu),
        entry(
            'gelu_mul(approximate="none")',
            lambda: lk.gelu_mul(a, b, "none"),
            "F.gelu(a) * b",
            lambda: F.gelu(a) * b,
            None,
        ),
        entry(
            "LigerSiLUMulFunction.apply", lambda: lk.LigerSiLUMulFunction.apply(a, b), "F.silu(a) * b", silu, peer_silu
        ),
        entry(
            "LigerGELUMulFunction.apply",
            lambda: lk.LigerGELUMulFunction.apply(a, b),
            "F.gelu(a, 'tanh') * b",
            gelu_tanh,
            peer_gelu,
        ),
    ]
    for name, activation in lk.activations.REGISTRY.items():
        peer = peers.gated(name)
        entries.append(
            entry(
                f'gated_mul("{name}")',
                lambda name=name: lk.gated_mul(a, b, name),
                f"{name}(a) * b",
                lambda reference=activation.reference: reference(a) * b,
                peer and (lambda peer=peer: peer.apply(a, b)),
            )
        )
    return entries


def _llama_mlp(cfg, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], hidden_act="silu")
    with torch.device(device):
        return LlamaMLP(config).to(DTYPE)


def _gemma_mlp(cfg, device):
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], hidden_activation="gelu_pytorch_tanh"
    )
    with torch.device(device):
        return GemmaMLP(config).to(DTYPE)


def mlp_entries(lk, cfg, device, peers):
    """The MLP layers bound to transformers hosts, as kernelize binds them: decode (1 token per sequence, no
    grad) and a 16-token training step; the tiled layers (one shard at 16 tokens: their fixed cost)."""
    llama, gemma = _llama_mlp(cfg, device), _gemma_mlp(cfg, device)
    size = f"H {cfg['hidden']}, I {cfg['intermediate']}"
    peer_swiglu, peer_geglu = _peer_mlp(peers.silu_mul), _peer_mlp(peers.gelu_mul)
    entries = []

    def bound(layer, host):
        return types.MethodType(layer.forward, host)

    def entry(name, inputs, mode, host, ours, peer_fn, x, d_out):
        variants = {
            "ours": (name, lambda: ours(x)),
            "eager": (f"{type(host).__name__}.forward", lambda: host(x)),
            "peer": _variant("liger-kernel", peer_fn and (lambda: peer_fn(host, x))),
        }
        return Entry(name, inputs, mode, variants, (x, *host.parameters()), (d_out,))

    for batch in cfg["decode_batches"]:
        x = _randn((batch, 1, cfg["hidden"]), device, grad=False)
        entries.append(
            entry(
                "LigerSwiGLUMLP",
                f"decode, batch {batch}, LlamaMLP {size}",
                "inference",
                llama,
                bound(lk.LigerSwiGLUMLP, llama),
                peer_swiglu,
                x,
                None,
            )
        )
    x = _randn((1, 1, cfg["hidden"]), device, grad=False)
    entries.append(
        entry(
            "LigerGEGLUMLP",
            f"decode, batch 1, GemmaMLP {size}",
            "inference",
            gemma,
            bound(lk.LigerGEGLUMLP, gemma),
            peer_geglu,
            x,
            None,
        )
    )

    tokens = (1, cfg["rows"], cfg["hidden"])
    x, d_out = _randn(tokens, device), _randn(tokens, device, grad=False)
    train = f"{cfg['rows']} tokens, LlamaMLP {size}"
    entries.append(
        entry("LigerSwiGLUMLP", train, "train", llama, bound(lk.LigerSwiGLUMLP, llama), peer_swiglu, x, d_out)
    )

    def peer_tiled(fn):
        if peers.tiled is None or fn is None:
            return None
        return lambda host, x: peers.tiled(
            fn=fn, mlp_module=host, x=x, num_shards=None, compute_params=list(host.parameters())
        )

    entries.append(
        entry(
            "LigerTiledSwiGLUMLP",
            train,
            "train",
            llama,
            bound(lk.LigerTiledSwiGLUMLP, llama),
            peer_tiled(peer_swiglu),
            x,
            d_out,
        )
    )
    entries.append(
        entry(
            "LigerTiledGEGLUMLP",
            f"{cfg['rows']} tokens, GemmaMLP {size}",
            "train",
            gemma,
            bound(lk.LigerTiledGEGLUMLP, gemma),
            peer_tiled(peer_geglu),
            x,
            d_out,
        )
    )

    def host_forward(module, shard):  # any fn: the generic recompute, not the gated fast path
        return type(module).forward(module, shard)

    entries.append(
        entry(
            "apply_tiled_mlp(fn = the host's forward)",
            train,
            "train",
            llama,
            lambda x: lk.apply_tiled_mlp(host_forward, llama, x),
            peer_tiled(host_forward),
            x,
            d_out,
        )
    )

    with torch.device(device):
        linear = torch.nn.Linear(cfg["hidden"], cfg["hidden"], bias=False).to(DTYPE)
    entries.append(
        entry(
            "LigerLinear",
            f"{cfg['rows']} tokens, Linear {cfg['hidden']}x{cfg['hidden']}",
            "train",
            linear,
            bound(lk.LigerLinear, linear),
            None,
            x,
            d_out,
        )
    )
    return entries


def rms_norm_entries(lk, cfg, device, peers):
    """rms_norm, LigerRMSNormFunction and the LigerRMSNorm layer, where this checkout has them."""
    if not hasattr(lk, "rms_norm"):
        print("(no rms_norm in this checkout: its host rows are left out)")
        return []
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with torch.device(device):
        host = LlamaRMSNorm(cfg["hidden"], eps=1e-6).to(DTYPE)
    x, d_out = _randn((cfg["rows"], cfg["hidden"]), device), _randn((cfg["rows"], cfg["hidden"]), device, grad=False)
    weight, eps, shape = host.weight, host.variance_epsilon, f"{cfg['rows']}x{cfg['hidden']}"
    eager = ("LlamaRMSNorm.forward", lambda: host(x))
    peer_function = peers.rms_norm_function
    peer_fn = _variant("liger-kernel", peer_function and (lambda: peer_function.apply(x, weight, eps)))
    entries = [
        Entry(
            "rms_norm",
            shape,
            "train",
            {"ours": ("rms_norm", lambda: lk.rms_norm(x, weight, eps)), "eager": eager, "peer": peer_fn},
            (x, weight),
            (d_out,),
        )
    ]
    function = getattr(lk, "LigerRMSNormFunction", None)
    if function is not None:
        ours = ("LigerRMSNormFunction.apply", lambda: function.apply(x, weight, eps))
        entries.append(
            Entry(ours[0], shape, "train", {"ours": ours, "eager": eager, "peer": peer_fn}, (x, weight), (d_out,))
        )
    layer = getattr(lk, "LigerRMSNorm", None) or getattr(lk.layers, "LigerRMSNorm", None)
    if layer is not None:
        with torch.device(device):
            peer_module = _instance(peers.rms_norm_module, cfg["hidden"], eps=eps)
        peer_module = peer_module and peer_module.to(DTYPE)
        forward = types.MethodType(layer.forward, host)
        variants = {
            "ours": ("LigerRMSNorm", lambda: forward(x)),
            "eager": eager,
            "peer": _variant("liger-kernel", peer_module and (lambda: peer_module(x))),
        }
        leaves = (x, weight) + ((peer_module.weight,) if peer_module is not None else ())
        entries.append(Entry("LigerRMSNorm", f"{shape}, LlamaRMSNorm host", "train", variants, leaves, (d_out,)))
    return entries


def rotary_entries(lk, cfg, device, peers):
    from transformers.models.llama import modeling_llama

    seq, dim = cfg["rows"], cfg["head_dim"]
    q_base = _randn((1, seq, cfg["heads"], dim), device)
    k_base = _randn((1, seq, cfg["kv_heads"], dim), device)
    q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)  # [B, H, S, D], as Llama's attention hands them over
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * torch.rand(dim // 2, device=device)
    angles = torch.cat((angles, angles), dim=-1)[None]
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    d_q, d_k = torch.randn_like(q), torch.randn_like(k)
    rope = modeling_llama.apply_rotary_pos_emb
    variants = {
        "ours": ("liger_rotary_pos_emb", lambda: lk.liger_rotary_pos_emb(q, k, cos, sin)),
        "eager": ("transformers apply_rotary_pos_emb", lambda: rope(q, k, cos, sin)),
        "peer": _variant("liger-kernel", peers.rope and (lambda: peers.rope(q, k, cos, sin))),
    }
    inputs = f"q [1, {cfg['heads']}, {seq}, {dim}], k [1, {cfg['kv_heads']}, {seq}, {dim}]"
    layer = lk.liger_rotary_pos_emb_layer()
    layer_variants = dict(variants, ours=("liger_rotary_pos_emb_layer", lambda: layer(q, k, cos, sin)))
    return [
        Entry("liger_rotary_pos_emb", inputs, "train", variants, (q_base, k_base), (d_q, d_k)),
        Entry("liger_rotary_pos_emb_layer", inputs, "train", layer_variants, (q_base, k_base), (d_q, d_k)),
    ]


def attention_entries(lk, cfg, device, peers):
    """sdpa_attention_forward against transformers' own: at these lengths it is that function behind its checks
    (the split backward is for long sequences), so the row is what the checks cost; the peer has none."""
    if not hasattr(lk, "sdpa_attention_forward"):
        return []
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as stock

    heads, kv_heads, dim = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    config = types.SimpleNamespace(_attn_implementation="sdpa")
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, config=config)
    ours = lk.sdpa_attention_forward
    entries = []
    for mode, q_len in (("train", cfg["rows"]), ("inference", 1)):
        q_base = _randn((1, q_len, heads, dim), device, grad=mode == "train")
        kv_base = [_randn((1, cfg["rows"], kv_heads, dim), device, grad=mode == "train") for _ in range(2)]
        q, k, v = (t.transpose(1, 2) for t in (q_base, *kv_base))
        variants = {
            "ours": ("sdpa_attention_forward", lambda q=q, k=k, v=v: ours(module, q, k, v, None)[0]),
            "eager": ("transformers sdpa_attention_forward", lambda q=q, k=k, v=v: stock(module, q, k, v, None)[0]),
            "peer": _variant("liger-kernel", None),
        }
        inputs = f"q [1, {heads}, {q_len}, {dim}], k, v [1, {kv_heads}, {cfg['rows']}, {dim}]"
        if mode == "train":
            entries.append(Entry("sdpa_attention_forward", inputs, mode, variants, (q_base, *kv_base),
                                 (torch.randn_like(q_base),)))  # fmt: skip
        else:
            entries.append(Entry("sdpa_attention_forward, decode", inputs, mode, variants))
    return entries


def loss_entries(lk, cfg, device, peers):
    rows, hidden, vocab = cfg["rows"], cfg["hidden"], cfg["vocab"]
    x = _randn((rows, hidden), device, 0.5)
    weight = _randn((vocab, hidden), device, hidden**-0.5)
    target = torch.randint(0, vocab, (rows,), device=device)
    shape = f"x {rows}x{hidden}, V {vocab}"
    eager = ("F.cross_entropy((x @ W.T).float(), t)", lambda: F.cross_entropy((x @ weight.T).float(), target))
    peer_loss = _instance(peers.flce_loss)
    peer_function = peers.flce_function

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    entries = [
        Entry(
            "liger_fused_linear_cross_entropy",
            shape,
            "train",
            {
                "ours": (
                    "liger_fused_linear_cross_entropy",
                    lambda: lk.liger_fused_linear_cross_entropy(x, weight, target),
                ),
                "eager": eager,
                "peer": _variant("liger-kernel", peer_loss and (lambda: peer_loss(weight, x, target))),
            },
            (x, weight),
        ),
        Entry(
            "LigerFusedLinearCrossEntropyFunction.apply",
            shape,
            "train",
            {
                "ours": (
                    "LigerFusedLinearCrossEntropyFunction.apply",
                    lambda: first(lk.LigerFusedLinearCrossEntropyFunction.apply(x, weight, target)),
                ),
                "eager": eager,
                "peer": _variant(
                    "liger-kernel", peer_function and (lambda: first(peer_function.apply(x, weight, target)))
                ),
            },
            (x, weight),
        ),
    ]

    logits = _randn((1, rows, vocab), device)
    labels = torch.randint(0, vocab, (1, rows), device=device)
    flat_target = labels.view(-1)
    peer_ce = _instance(peers.ce_loss)
    entries.append(
        Entry(
            "cross_entropy.cross_entropy",
            f"logits {rows}x{vocab}",
            "train",
            {
                "ours": (
                    "cross_entropy",
                    lambda: lk.cross_entropy.cross_entropy(logits.view(rows, vocab), flat_target),
                ),
                "eager": (
                    "F.cross_entropy(logits.float(), t)",
                    lambda: F.cross_entropy(logits.view(rows, vocab).float(), flat_target),
                ),
                "peer": _variant("liger-kernel", peer_ce and (lambda: peer_ce(logits.view(rows, vocab), flat_target))),
            },
            (logits,),
        )
    )
    from transformers.loss.loss_utils import ForCausalLMLoss

    entries.append(
        Entry(
            "LigerForCausalLMLoss",
            f"logits 1x{rows}x{vocab}",
            "train",
            {
                "ours": ("LigerForCausalLMLoss", lambda: lk.LigerForCausalLMLoss(logits, labels, vocab)),
                "eager": ("transformers ForCausalLMLoss", lambda: ForCausalLMLoss(logits, labels, vocab)),
            },
            (logits,),
        )
    )
    layer = lk.LigerForCausalLMLossLayer()
    entries.append(
        Entry(
            "LigerForCausalLMLossLayer",
            f"logits 1x{rows}x{vocab}",
            "train",
            {
                "ours": ("LigerForCausalLMLossLayer", lambda: layer(logits, labels, vocab)),
                "eager": ("transformers ForCausalLMLoss", lambda: ForCausalLMLoss(logits, labels, vocab)),
            },
            (logits,),
        )
    )
    hidden_states = x.detach().view(1, rows, hidden).requires_grad_()
    entries.append(
        Entry(
            "LigerForCausalLMLoss(hidden_states, lm_head_weight)",
            shape,
            "train",
            {
                "ours": (
                    "LigerForCausalLMLoss, fused",
                    lambda: lk.LigerForCausalLMLoss(
                        None, labels, vocab, hidden_states=hidden_states, lm_head_weight=weight
                    ),
                ),
                "eager": (
                    "transformers ForCausalLMLoss(x @ W.T)",
                    lambda: ForCausalLMLoss(hidden_states @ weight.T, labels, vocab),
                ),
            },
            (hidden_states, weight),
        )
    )
    return entries


BUILDERS = (gated_entries, mlp_entries, rms_norm_entries, rotary_entries, attention_entries, loss_entries)


# ----------------------------------------------------------------------------------------------------------
# Measurement


def _forward_backward(fn, leaves, d_outs):
    def call():
        out = fn()
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if d_outs is None:
            outs[0].backward()
        else:
            torch.autograd.backward(outs[: len(d_outs)], d_outs)
        for t in leaves:
            t.grad = None

    return call


def measure_entry(entry: Entry, cfg, device) -> list:
    """One row per variant of ``entry``: the forward's host time and the step's, each timed in rounds that
    alternate between the variants (timing.host_us)."""
    roles = [role for role in ROLES if entry.variants.get(role) is not None]
    rows = {}
    for role in roles:
        label, _ = entry.variants[role]
        rows[role] = {"entry": entry.name, "inputs": entry.inputs, "mode": entry.mode, "variant": role, "impl": label}
    counts = {k: cfg[k] for k in ("calls", "warmup", "repeats")}
    phases = {"fwd": {role: entry.variants[role][1] for role in roles}}
    if entry.mode != "inference":
        phases["fwd_bwd"] = {
            role: _forward_backward(entry.variants[role][1], entry.leaves, entry.d_outs) for role in roles
        }
    for phase, fns in phases.items():
        fns = {role: fn for role, fn in fns.items() if "error" not in rows[role]}
        with torch.no_grad() if entry.mode == "inference" else contextlib.nullcontext():
            measured = timing.host_us(fns, device, **counts)
        for role, result in measured.items():
            if isinstance(result, Exception):
                rows[role]["error"] = f"{type(result).__name__}: {str(result)[:300]}"
            else:
                rows[role][f"{phase}_us"], rows[role][f"{phase}_synced_us"] = result
        for t in entry.leaves:
            t.grad = None
    return [rows[role] for role in roles]


def host_rows(cfg, device, peers) -> list:
    lk = timing.package()
    rows = []
    for builder in BUILDERS:
        try:
            entries = builder(lk, cfg, device, peers)
        except Exception as error:  # noqa: BLE001
            print(f"host: {builder.__name__} failed: {type(error).__name__}: {str(error)[:300]}")
            rows.append({"entry": builder.__name__, "variant": "ours", "error": f"{type(error).__name__}: {error}"})
            continue
        for entry in entries:
            for row in measure_entry(entry, cfg, device):
                rows.append(row)
                _print_row(row)
        timing.free(device)
    return rows


def _print_row(row):
    def us(key):
        return "–" if row.get(key) is None else f"{row[key]:.1f}"

    text = (
        row.get("error")
        or f"fwd {us('fwd_us')} ({us('fwd_synced_us')} synced)  fwd+bwd {us('fwd_bwd_us')} "
        f"({us('fwd_bwd_synced_us')} synced)"
    )
    print(f"  {row['entry'][:40]:<40} {row['inputs'][:38]:<38} {row['variant']:<5} {text}")


def back_to_back_rows(copy_bytes_per_s: float, cfg, device, peers) -> list:
    """silu_mul, gelu_mul (tanh, exact), their eager composites and the peer's, launched back to back."""
    lk = timing.package()
    rows_n, cols = cfg["bandwidth"]
    a, b, d_out = (torch.randn(rows_n, cols, device=device, dtype=DTYPE) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    nbytes = a.numel() * a.element_size()
    # A training step's backward runs every node in one pass: its own pairs, so that no gradient is summed.
    nodes = timing.GRAPH_CALLS if torch.device(device).type == "cuda" else 2
    pairs = [tuple(torch.randn_like(t).requires_grad_() for t in (a, b)) for _ in range(PASS_NODES * nodes)]
    d_outs = [d_out] * nodes
    ops = {
        "silu_mul": {
            "ours": lk.silu_mul,
            "eager": lambda a, b: F.silu(a) * b,
            "peer": peers.silu_mul and peers.silu_mul.apply,
        },
        "gelu_mul": {
            "ours": lk.gelu_mul,
            "eager": lambda a, b: F.gelu(a, approximate="tanh") * b,
            "peer": peers.gelu_mul and peers.gelu_mul.apply,
        },
        'gelu_mul(approximate="none")': {
            "ours": lambda a, b: lk.gelu_mul(a, b, "none"),
            "eager": lambda a, b: F.gelu(a) * b,
        },
    }
    rows = []
    for op, variants in ops.items():
        for role, fn in variants.items():
            if fn is None:
                continue
            row = {"op": op, "shape": [rows_n, cols], "variant": role, "fwd_bytes": 3 * nbytes, "bwd_bytes": 5 * nbytes}
            holder = {}

            def backward(fn=fn, holder=holder):
                if "out" not in holder:
                    holder["out"] = fn(a, b)
                torch.autograd.grad(holder["out"], (a, b), d_out, retain_graph=True)

            def backward_in_one_pass(fn=fn, holder=holder):
                if "outs" not in holder:
                    holder["outs"] = [fn(x, y) for x, y in pairs[:nodes]]
                inputs = [t for pair in pairs[:nodes] for t in pair]
                torch.autograd.grad(holder["outs"], inputs, d_outs, retain_graph=True)

            def step_pass_ms(n, fn=fn):
                """A training step's backward through n calls' nodes, recorded afresh for each pass."""
                inputs = [t for pair in pairs[:n] for t in pair]
                return timing.pass_ms(
                    lambda: [fn(x, y) for x, y in pairs[:n]],
                    lambda outs: torch.autograd.grad(outs, inputs, [d_out] * n),
                    device,
                )

            try:
                with torch.no_grad():
                    row["fwd_ms"] = timing.back_to_back_ms(lambda fn=fn: fn(a, b), device)
                row["bwd_ms"] = timing.back_to_back_ms(backward, device)
                row["bwd_step_ms"] = timing.back_to_back_ms(backward_in_one_pass, device, calls=1) / nodes
                # What one more node adds to a step's pass, its fixed cost (autograd.grad's own, the same for
                # every implementation: NOTES.md §33) apart: the pass of PASS_NODES times as many calls, less
                # the pass of 20, per added node.
                few, many = step_pass_ms(nodes), step_pass_ms(PASS_NODES * nodes)
                row["bwd_node_ms"] = (many - few) / ((PASS_NODES - 1) * nodes)
                for phase in ("fwd", "bwd", "bwd_step", "bwd_node"):
                    # (a difference of two medians, bwd_node can come out at or under 0 where the timings are
                    # noise, as on the CPU's smoke test: no share of the ceiling then)
                    if copy_bytes_per_s and row[f"{phase}_ms"] > 0:
                        seconds = row[f"{phase}_ms"] * 1e-3
                        moved = row["fwd_bytes"] if phase == "fwd" else row["bwd_bytes"]
                        row[f"{phase}_pct"] = 100 * moved / seconds / copy_bytes_per_s
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            holder.clear()
            rows.append(row)
            print(
                f"  {op:<30} {role:<5} "
                + (
                    row.get("error")
                    or f"fwd {row.get('fwd_pct', 0):5.1f}%  bwd {row.get('bwd_pct', 0):5.1f}%  "
                    f"bwd in one pass {row.get('bwd_step_pct', 0):5.1f}%  a node of a step's pass "
                    f"{row.get('bwd_node_pct', 0):5.1f}% of copy"
                )
            )
    timing.free(device)
    return rows


def run(copy_bytes_per_s: float, device: str = "cuda", quick: bool = False) -> dict:
    """{"rows": host cost per call per (entry, variant), "back_to_back": % of copy per (op, variant)}."""
    cfg = QUICK if quick else FULL
    print(
        f"host us per call ({cfg['calls']} calls after {cfg['warmup']}, median of {cfg['repeats']} alternating rounds):"
    )
    peers = Peers()
    result = {"config": {**cfg, "alternating": True}}  # (the plot's table says how the rows were timed)
    result["rows"] = host_rows(cfg, device, peers)
    print(f"back to back, {cfg['bandwidth'][0]}x{cfg['bandwidth'][1]} bf16:")
    result["back_to_back"] = back_to_back_rows(copy_bytes_per_s, cfg, device, peers)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few calls: a smoke test")
    args = parser.parse_args(argv)
    timing.suite_settings()
    if args.quick:
        timing.quick_mode()
    copy = timing.copy_bytes_per_s(args.device, 2**20 if args.quick else 2**30)
    result = run(copy, args.device, args.quick)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "copy_bytes_per_s": copy, **result}, indent=2))


if __name__ == "__main__":
    main()
