"""Model-level long-context training step: Llama-3-8B-width LlamaForCausalLM, random weights, bf16, gradient
checkpointing on (non-reentrant), batch 1, forward + backward of the causal-LM loss, for:

- ``vanilla``: stock transformers, ``model(input_ids, labels=input_ids).loss`` (logits materialized, upcast).
- ``peer``: liger-kernel 0.8.5's ``apply_liger_kernel_to_llama(model=m)`` (FLCE, RMSNorm, SwiGLU, rope).
- ``peer_tiled``: the same plus the peer's ``LigerTiledSwiGLUMLP`` forward bound on every LlamaMLP (0.8.5 ships
  the class, but ``apply_liger_kernel_to_llama`` has no option for it); "n/a" without liger-kernel.
- ``ours``: this package's tiled SwiGLU MLP bound on every LlamaMLP, its RMSNorm on every LlamaRMSNorm (when the
  package has ``LigerRMSNorm``), its rotary as modeling_llama's ``apply_rotary_pos_emb`` (restored after), its
  sdpa attention (``register_sdpa_attention``: the backward split by KV heads, when the package has it), and the
  loss through ``causal_lm_loss`` (decoder, then the fused linear cross-entropy; no logits); on the 4-layer model
  its checkpoints keep the attention's forward for the recompute (``keep_attention_context``, in pinned host
  memory: S x 8 KiB a layer, which the 32-layer model's lengths would take past this machine's memory).
- ``ours_layers``: ``ours`` with its decoder layers sequence-tiled from 32,768 tokens on
  (``tile_decoder_layers``: each layer one autograd node that keeps its input, K, V and the attention output
  in pinned host memory, no checkpoint; shorter calls run ``ours``); 4-layer model only (host memory, as
  below).
- ``ours_offload``: ``ours`` with the checkpoints' inputs (each layer's hidden states) in pinned host memory, as
  transformers' ``gradient_checkpointing_enable(offload=True)`` keeps them (``save_on_cpu`` around each
  checkpoint: copies on the compute stream); 4-layer model only, as ``keep_attention_context``.
- ``ours_recompute``: ``ours`` with the plain checkpoint (the attention forward recomputed), to show what keeping
  it buys.
- ``ours_sdpa``: ``ours`` with transformers' own sdpa attention, to show what the split backward buys.
- ``ours_untiled``: ``ours`` with the fused (untiled) SwiGLU MLP, to show what tiling buys.

Before measuring, a tiny float32 model checks that every variant's loss and weight gradients equal vanilla's
(asserted in ``--quick``, recorded and flagged otherwise). All variants run on one model (same weights); a
variant's bindings are undone after each measurement.

Per variant and sequence length S: ``ms`` (median of the timed steps after 1 warm-up: 3 steps, 2 when a step
is predicted above 4 s, 1 above 15 s; after each variant's first step, the others run in rounds of one step
per variant, in alternating order), ``extra_gib`` (``max_memory_allocated`` after a reset, minus what was
allocated before the step: activations, recompute buffers and the weights' gradients, which are set to None
before each step, so their size, ``grads_gib``, is inside the figure), ``tokens_per_s``, and the loss.

- 4-layer model: S = 16384, 65536, 131072 for every variant ("oom" recorded), then the largest S that fits per
  variant (one step per try): doubling from the largest fit, then bisecting to a multiple of 4096, with up to
  two tries per variant at the largest S its memory line allows instead (``Bench.search``); the cheapest
  pending try runs first, and none starts whose predicted time exceeds the budget left.
- 32-layer model (the full Llama-3-8B): S = 32768, 65536, 131072; memory per token from the two longest
  (one point: an upper bound), the largest S it implies on this GPU's total memory, and one step of ``ours``
  near it. Two points are not enough where the peak moves between them: at 32k the peak is in the last
  layer's backward (every layer's weight gradients, 15 GiB, held), from 64k on in the first layer's backward
  (all 32 checkpoints held), which grows faster with S; a line through 32k and 64k predicts too little
  memory per token. Steps predicted above 30 s run without a warm-up once the variant has run a shorter S.
  The implied step takes minutes: ``--no-confirm`` leaves it out, ``--confirm-from RUN.json`` runs only it,
  from that run's figures. Likewise ``--search-from RUN.json ...`` runs only the 4-layer search, from the rows
  and tries of earlier runs (past 500k tokens a try takes minutes: attention is quadratic in S).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        python benchmarks/suite/bench_model.py --only 4layer --budget 420 --out model_4layer.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        python benchmarks/suite/bench_model.py --only 32layer --no-confirm --budget 560 --out model_32.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        python benchmarks/suite/bench_model.py --confirm-from model_32.json --budget 560 --out confirm_32.json
    python benchmarks/suite/bench_model.py --device cpu --quick     # CPU smoke test of every code path
"""

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
import liger_kernels as lk

try:
    from liger_kernel.transformers import apply_liger_kernel_to_llama as peer_apply

    try:
        from liger_kernel.transformers import LigerTiledSwiGLUMLP as PeerTiledSwiGLUMLP
    except ImportError:
        PeerTiledSwiGLUMLP = None
    PEER_ERROR = None
except Exception as error:  # noqa: BLE001  (an incompatible peer must not stop the benchmark)
    peer_apply = PeerTiledSwiGLUMLP = None
    PEER_ERROR = f"{type(error).__name__}: {error}"

GIB = 2**30
# The stock classes and functions, captured before any variant patches modeling_llama.
LLAMA_MLP = modeling_llama.LlamaMLP
LLAMA_RMS_NORM = modeling_llama.LlamaRMSNorm
PATCHED_GLOBALS = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
# What a variant may bind on a module instance (the peer also sets plain attributes such as ``offset`` on the
# norms; the stock forwards never read those).
INSTANCE_KEYS = (
    "forward", "_get_name", "extra_repr", "_mlp_forward", "num_shards", "_gradient_checkpointing_func",
    "_tiled_chunk", "_tiled_min_tokens",
)  # fmt: skip

LLAMA3_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 1 << 20,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attn_implementation": "sdpa",
}  # fmt: skip
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000}  # fmt: skip

LAYER_TILING = {}  # tile_decoder_layers' arguments for ours_layers (its defaults but in the smoke test)
FOUR_LAYER_ONLY = ("ours_offload", "ours_layers")
VARIANTS = (
    "ours", "ours_layers", "ours_offload", "ours_recompute", "ours_sdpa", "ours_untiled",
    "peer", "peer_tiled", "vanilla",
)  # fmt: skip

# Per phase: model, layers, fixed S, search start / step / cap. Quick mode: the tiny model on the CPU, with
# out-of-memory simulated above a per-variant length so that the search and its recovery run too.
FULL = {
    "4layer": {"layers": 4, "lengths": (16384, 65536, 131072), "start": 16384, "step": 4096, "cap": 1 << 20},
    "32layer": {"layers": 32, "lengths": (32768, 65536, 131072), "step": 4096},
}
QUICK = {
    "4layer": {"layers": 2, "lengths": (64, 128, 256), "start": 64, "step": 16, "cap": 512},
    "32layer": {"layers": 4, "lengths": (128, 256, 384), "step": 16},
}
QUICK_OOM_ABOVE = {"vanilla": 200, "peer": 300, "peer_tiled": 400, "ours_untiled": 300}

# Smoke check tolerances (float32): the variants differ from vanilla only by the order of float32 sums.
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


# ----------------------------------------------------------------------------------------------------------
# Models and variants


def make_config(base: dict, layers: int) -> LlamaConfig:
    config = LlamaConfig(**base, num_hidden_layers=layers)
    assert config.rope_parameters["rope_theta"] == 500000.0, config.rope_parameters
    return config


def build_model(config: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def available_variants() -> list[str]:
    if peer_apply is None:
        return [v for v in VARIANTS if not v.startswith("peer")]
    return [v for v in VARIANTS if v != "peer_tiled" or PeerTiledSwiGLUMLP is not None]


def _snapshot(model):
    instance = {}
    for module in model.modules():
        kept = {key: module.__dict__[key] for key in INSTANCE_KEYS if key in module.__dict__}
        if kept:
            instance[module] = kept
    return {
        "globals": {name: getattr(modeling_llama, name) for name in PATCHED_GLOBALS},
        "class_forward": type(model).__dict__["forward"],
        "instance": instance,
        "attention": model.config._attn_implementation,
    }


def restore(model, saved) -> None:
    """Undo a variant: modeling_llama's globals, the class forward, and every instance binding."""
    for name, value in saved["globals"].items():
        setattr(modeling_llama, name, value)
    type(model).forward = saved["class_forward"]
    if model.config._attn_implementation != saved["attention"]:
        model.set_attn_implementation(saved["attention"])
    for module in model.modules():
        for key in INSTANCE_KEYS:
            module.__dict__.pop(key, None)
        module.__dict__.update(saved["instance"].get(module, {}))


def _bind(module, name, function) -> None:
    module.__dict__[name] = types.MethodType(function, module)


def _offloaded_checkpoint(function, *args, **kwargs):
    """transformers' ``gradient_checkpointing_enable(offload=True)``: what the checkpoint saves for its recompute
    (the layer's inputs) goes to pinned host memory."""
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return checkpoint(function, *args, **kwargs)


def _counted(tiled_forward, info, *args, **kwargs):
    """A tiled layer's call, counted: every call runs the package's rotary once (inside the tiled layer, or in
    the layer's own attention), and the tiled ones are counted apart."""
    out = tiled_forward(*args, **kwargs)
    info["rope_calls"] += 1
    info["tiled_calls"] = info.get("tiled_calls", 0) + (type(out.grad_fn).__name__ == "TiledDecoderLayerBackward")
    return out


def apply_variant(name: str, model, num_shards=None, keep_attention=True):
    """Patch ``model`` as variant ``name``; returns ``(loss_fn(ids), saved, info)``; ``restore(model, saved)``
    undoes it. ``info["rope_calls"]`` counts this package's rotary calls (ours; ours_layers: its layer calls, each
    running the package's rotary once, inside the tiled layer or not; ``info["tiled_calls"]`` the tiled ones).
    ``keep_attention=False``: every variant on the plain checkpoint."""
    saved = _snapshot(model)
    info = {"rope_calls": 0}
    mlps = [m for m in model.modules() if isinstance(m, LLAMA_MLP)]
    norms = [m for m in model.modules() if isinstance(m, LLAMA_RMS_NORM)]

    def stock_loss(ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    if name == "vanilla":
        return stock_loss, saved, info
    if name in ("peer", "peer_tiled"):
        if peer_apply is None:
            raise RuntimeError(f"liger-kernel is not importable: {PEER_ERROR}")
        peer_apply(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model)
        if name == "peer_tiled":
            for mlp in mlps:  # the peer's tiled layer reads these members of its own instances
                mlp.__dict__["num_shards"] = None
                _bind(mlp, "_mlp_forward", PeerTiledSwiGLUMLP._mlp_forward)
                _bind(mlp, "forward", PeerTiledSwiGLUMLP.forward)
        return stock_loss, saved, info
    if name in ("ours", "ours_layers", "ours_offload", "ours_recompute", "ours_sdpa", "ours_untiled"):
        tiled = name != "ours_untiled"
        if keep_attention and name != "ours_recompute" and hasattr(lk, "keep_attention_context"):
            # what gradient_checkpointing_enable(gradient_checkpointing_kwargs=..., offload=...) sets on every
            # decoder layer
            kept = functools.partial(
                _offloaded_checkpoint if name == "ours_offload" else checkpoint,
                use_reentrant=False, context_fn=lk.keep_attention_context,
            )  # fmt: skip
            for layer in model.model.layers:
                layer.__dict__["_gradient_checkpointing_func"] = kept
        layer = lk.LigerTiledSwiGLUMLP if tiled else lk.LigerSwiGLUMLP
        for mlp in mlps:
            _bind(mlp, "forward", layer.forward)
            if num_shards is not None and tiled:  # the host attribute the tiled layer reads
                mlp.__dict__["num_shards"] = num_shards
        if name != "ours_sdpa" and hasattr(lk, "register_sdpa_attention"):
            model.set_attn_implementation(lk.register_sdpa_attention())
        if hasattr(lk, "LigerRMSNorm"):
            for norm in norms:
                _bind(norm, "forward", lk.LigerRMSNorm.forward)

        def rotary(q, k, cos, sin, unsqueeze_dim=1):
            info["rope_calls"] += 1
            return lk.liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

        modeling_llama.apply_rotary_pos_emb = rotary
        if name == "ours_layers":  # after the checkpoint is set: the tiled calls bypass it, the others keep it
            # the package's rotary itself (a tiled layer takes no other), its calls counted per layer call
            modeling_llama.apply_rotary_pos_emb = lk.liger_rotary_pos_emb
            if lk.tile_decoder_layers(model, **LAYER_TILING) != len(model.model.layers):
                raise RuntimeError("tile_decoder_layers did not take every decoder layer")
            for layer in model.model.layers:
                layer.__dict__["forward"] = functools.partial(_counted, layer.__dict__["forward"], info)
        return (lambda ids: lk.causal_lm_loss(model, ids, labels=ids)), saved, info
    raise ValueError(f"unknown variant {name!r}")


# ----------------------------------------------------------------------------------------------------------
# The correctness check: every variant against vanilla on a tiny float32 model.


def _loss_and_grads(model, variant, ids, num_shards=None):
    loss_fn, saved, info = apply_variant(variant, model, num_shards)
    try:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(ids)
        loss.backward()
        grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    finally:
        restore(model, saved)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads, info


def _compare(loss, grads, ref_loss, ref_grads) -> dict:
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    missing = [n for n, g in ref_grads.items() if g is not None and grads.get(n) is None]
    grad_rel, worst = 0.0, None
    for n, ref in ref_grads.items():
        if ref is None or grads.get(n) is None:
            continue
        rel = float((grads[n].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        if rel > grad_rel:
            grad_rel, worst = rel, n
    ok = loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL and not missing and math.isfinite(loss)
    return {"loss": loss, "loss_rel": loss_rel, "grad_rel": grad_rel, "worst_param": worst,
            "missing_grads": missing, "ok": ok}  # fmt: skip


VERIFY_SHARDS = 2


def verify(device: str, seq: int = 96) -> dict:
    """Loss and weight gradients of every variant against vanilla: tiny Llama (2 layers, hidden 64, vocab
    1000), float32, gradient checkpointing on, S = ``seq``, some labels ignored; the tiled variant's MLPs asked
    for 2 shards through their host attribute (the automatic count does not tile so few tokens). Then vanilla
    again, to check that the variants' bindings were undone."""
    model = build_model(make_config(TINY, 2), torch.float32, device)
    ids = torch.randint(0, TINY["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss, ref_grads, _ = _loss_and_grads(model, "vanilla", ids)
    result = {"seq": seq, "vanilla_loss": ref_loss, "tolerances": {"loss_rel": LOSS_RTOL, "grad_rel": GRAD_RTOL}}
    for variant in available_variants():
        if variant == "vanilla":
            continue
        try:
            loss, grads, info = _loss_and_grads(model, variant, ids, num_shards=VERIFY_SHARDS)
        except Exception as error:  # noqa: BLE001
            result[variant] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        result[variant] = _compare(loss, grads, ref_loss, ref_grads)
        if variant.startswith("ours"):
            result[variant]["rope_calls"] = info["rope_calls"]
            result[variant]["ok"] &= info["rope_calls"] > 0  # the patched rotary must be the one called
    loss, grads, _ = _loss_and_grads(model, "vanilla", ids)
    result["vanilla_after_restore"] = _compare(loss, grads, ref_loss, ref_grads)
    result["ok"] = all(r["ok"] for r in result.values() if isinstance(r, dict) and "ok" in r)
    del model, ref_grads, grads
    gc.collect()
    return result


# ----------------------------------------------------------------------------------------------------------
# Measurement


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def _free(model, cuda: bool) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def implied_max_tokens(points, total_bytes: int, base_bytes: int, step: int):
    """Largest multiple of ``step`` tokens whose extra memory (linear in S through ``points`` [(S, bytes)])
    fits in ``total_bytes - base_bytes``. One point: no intercept, an upper bound on memory per token."""
    points = sorted(points)
    if not points:
        return None
    if len(points) >= 2:
        (s1, m1), (s2, m2) = points[-2], points[-1]
        slope = (m2 - m1) / (s2 - s1)
        intercept, method, used = m1 - slope * s1, "two points", [s1, s2]
    else:
        (s1, m1) = points[0]
        slope, intercept, method, used = m1 / s1, 0.0, "one point (upper bound on memory per token)", [s1]
    if slope <= 0:
        return {"method": method, "points": used, "bytes_per_token": slope, "intercept_gib": intercept / GIB,
                "max_S": None}  # fmt: skip
    tokens = (total_bytes - base_bytes - intercept) / slope
    return {"method": method, "points": used, "kib_per_token": slope / 1024, "intercept_gib": intercept / GIB,
            "max_S": int(tokens // step * step)}  # fmt: skip


class Bench:
    def __init__(self, device: str, quick: bool, budget_s: float, out_path=None):
        self.device, self.quick, self.cuda = device, quick, device.startswith("cuda")
        self.start = time.perf_counter()
        self.deadline = self.start + budget_s
        self.phase_deadline = self.deadline
        self.out_path = out_path
        self.result = None
        self.times = {}  # (phase, variant) -> [(S, seconds per step)]
        self.broken = {}  # (phase, variant) -> error

    # --- time budget -----------------------------------------------------------------------------------
    def left(self) -> float:
        return min(self.deadline, self.phase_deadline) - time.perf_counter()

    def predict(self, phase, variant, seq):
        """Seconds per step at ``seq``: from this variant's (else any variant's) longest measured step,
        scaled by (S/S0)^2 above S0 (attention dominates; overestimates the linear part) or S/S0 below."""
        points = self.times.get((phase, variant)) or [p for (ph, _), ps in self.times.items() if ph == phase
                                                       for p in ps]  # fmt: skip
        if not points:
            return None
        s0, t0 = max(points)
        return t0 * (seq / s0) ** 2 if seq > s0 else t0 * seq / s0

    def save(self) -> None:
        if self.out_path and self.result is not None:
            self.result["elapsed_s"] = time.perf_counter() - self.start
            tmp = Path(str(self.out_path) + ".tmp")
            tmp.write_text(json.dumps(self.result, indent=2))
            tmp.replace(self.out_path)

    # --- one measurement ---------------------------------------------------------------------------------
    def _step(self, model, loss_fn, ids, oom_above):
        model.zero_grad(set_to_none=True)
        base = 0
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        begin = time.perf_counter()
        if oom_above is not None and ids.shape[1] > oom_above:
            raise torch.OutOfMemoryError(f"simulated: S {ids.shape[1]} > {oom_above} (--quick)")
        loss = loss_fn(ids)
        loss.backward()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        extra = torch.cuda.max_memory_allocated() - base if self.cuda else None
        return seconds, extra, float(loss.detach())

    def attempt(self, model, phase, variant, seq, warmup, timed, free=True) -> dict:
        row = {"model": phase, "variant": variant, "S": seq}
        if (phase, variant) in self.broken:
            return dict(row, status="skipped", error=f"earlier error: {self.broken[(phase, variant)]}")
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, vocab, (1, seq), generator=generator).to(self.device)
        oom_above = QUICK_OOM_ABOVE.get(variant) if self.quick else None
        steps, status, error = [], "ok", None
        loss_fn, saved, info = apply_variant(variant, model, keep_attention=phase != "32layer")
        try:
            for _ in range(warmup + timed):
                steps.append(self._step(model, loss_fn, ids, oom_above))
        except Exception as exc:  # noqa: BLE001  (out of memory or a failing variant: record it, go on)
            status = "oom" if _is_oom(exc) else "error"
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        finally:
            restore(model, saved)
        del ids, loss_fn
        if free or status != "ok":
            _free(model, self.cuda)
        else:  # between interleaved steps the allocator keeps its blocks (peaks count allocated bytes only)
            model.zero_grad(set_to_none=True)
            gc.collect()
        if status == "error":
            self.broken[(phase, variant)] = error
        row.update(status=status, steps=len(steps), warmup=warmup)
        if error:
            row["error"] = error
        if status == "ok":
            seconds = [s for s, _, _ in steps[warmup:]] or [steps[-1][0]]
            median = statistics.median(seconds)
            # The warm-up step may autotune (extra buffers): memory from the timed steps.
            extras = [e for _, e, _ in (steps[warmup:] or steps) if e is not None]
            row.update(
                ms=median * 1e3, ms_steps=[s * 1e3 for s in seconds], warmup_ms=steps[0][0] * 1e3 if warmup else None,
                extra_gib=max(extras) / GIB if extras else None, extra_bytes=max(extras) if extras else None,
                tokens_per_s=seq / median, loss=steps[-1][2],
            )  # fmt: skip
            if variant.startswith("ours"):
                row["rope_calls_per_step"] = info["rope_calls"] / len(steps)
            if "tiled_calls" in info:
                row["tiled_calls_per_step"] = info["tiled_calls"] / len(steps)
            self.times.setdefault((phase, variant), []).append((seq, median))
        print(f"  [{time.perf_counter() - self.start:6.0f}s] {phase} {variant:12s} S={seq:>8}: {status}"
              + (f" {row['ms']:.0f} ms, extra {_fmt(row['extra_gib'], '.2f')} GiB" if status == "ok" else "")
              + (f" ({error[:120]})" if status == "error" else ""), flush=True)  # fmt: skip
        return row

    def plan(self, phase, variant, seq):
        """(warm-up steps, timed steps) for a fixed length: 1 warm-up and 3 timed steps (fewer when a step is
        predicted long), or a skipped row where the budget does not allow one. A step predicted above 30 s runs
        without a warm-up once this variant has run in this phase: its kernels are compiled, and the step is
        long beside what a warm-up would take off it."""
        per_step = self.predict(phase, variant, seq)
        # the smoke test (--quick) always plans 3: its check of the rounds must not depend on the machine's load
        timed = 3 if self.quick or per_step is None or per_step <= 4 else 2 if per_step <= 15 else 1
        warmup = 0 if per_step is not None and per_step > 30 and (phase, variant) in self.times else 1
        while per_step is not None and timed > 1 and (warmup + timed) * per_step > self.left():
            timed -= 1
        if self.left() <= 0 or (per_step is not None and (warmup + timed) * per_step > self.left()):
            predicted = "?" if per_step is None else f"{(warmup + timed) * per_step:.0f}"
            return {"model": phase, "variant": variant, "S": seq, "status": "skipped",
                    "error": f"budget: predicted {predicted} s, {self.left():.0f} s left"}  # fmt: skip
        return warmup, timed

    # --- phases --------------------------------------------------------------------------------------------
    def fixed_lengths(self, model, phase, lengths, variants) -> list[dict]:
        """Every variant at every length. At one length the variants' timed steps are interleaved: each runs its
        warm-up and a first step, then one step per variant and round, the order reversed every other round,
        so that a drift of the GPU's clocks over the minutes a length takes (the model runs at its power cap:
        NOTES.md §21) falls on every variant alike rather than on the last ones."""
        rows = []
        for seq in lengths:
            batch, more = [], {}  # more: variant -> (its row, timed steps still to run)
            for variant in variants:
                planned = (0, 0) if (phase, variant) in self.broken else self.plan(phase, variant, seq)
                if isinstance(planned, dict):
                    batch.append(planned)
                    continue
                warmup, timed = planned
                row = self.attempt(model, phase, variant, seq, warmup, min(timed, 1), free=timed <= 1)
                batch.append(row)
                if row["status"] == "ok" and timed > 1:
                    more[variant] = (row, timed - 1)
                self.result[phase]["rows"] = rows + batch
                self.save()
            for i in range(max((n for _, n in more.values()), default=0)):
                order = [v for v in variants if v in more and more[v][1] > i]
                for variant in order if i % 2 else reversed(order):
                    if (self.predict(phase, variant, seq) or 0) > self.left():
                        continue
                    step = self.attempt(model, phase, variant, seq, 0, 1, free=i == more[variant][1] - 1)
                    self.merge(more[variant][0], step)
                    self.save()
            if more:
                _free(model, self.cuda)
            rows.extend(batch)
            self.result[phase]["rows"] = rows
            self.save()
        return rows

    def merge(self, row: dict, step: dict) -> None:
        """One more timed step (an ``attempt`` row of one step) into a fixed length's row."""
        if step["status"] != "ok":
            row.setdefault("failed_rounds", []).append({k: step.get(k) for k in ("status", "error")})
            return
        row["ms_steps"] += step["ms_steps"]
        row["ms"] = statistics.median(row["ms_steps"])
        row["tokens_per_s"] = row["S"] / row["ms"] * 1e3
        if step.get("extra_bytes") is not None and step["extra_bytes"] > (row.get("extra_bytes") or 0):
            row.update(extra_bytes=step["extra_bytes"], extra_gib=step["extra_gib"])
        row["steps"] += 1
        key = (row["model"], row["variant"])
        self.times[key] = [p for p in self.times[key] if p[0] != row["S"]] + [(row["S"], row["ms"] / 1e3)]

    def usable_bytes(self):
        """Bytes a step could still get: the GPU's free memory plus what the allocator holds unused (the CUDA
        context and other processes excluded, unlike the total memory the implied S is quoted on)."""
        if not self.cuda:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def search(self, model, phase, rows, variants, start, step, cap) -> dict:
        """Largest S (multiple of ``step``) that fits, per variant: double from the largest fit until one
        does not, then bisect; one step per try; the cheapest pending try first, within the budget.

        Past 500k tokens a try takes minutes, so the memory line may stand in for a doubling or a midpoint:
        the largest S that the line through the variant's two longest fits' peaks allows on the memory a step
        can get (``usable_bytes``), kept strictly between the largest fit and the smallest length out of memory
        (so the step above the largest fit where the line says it is the limit), is tried instead of a
        doubling beyond it or of the midpoint. The line is a guess (the peak's place can move with S: 2.45
        GiB above the line at 1,048,576 tokens for ``ours``, NOTES.md §30), so each variant has at most two
        guided tries; after them the search doubles and bisects: at most two tries more than without it."""
        state, peaks, guided = {}, {}, {}
        for variant in variants:
            fits = [r["S"] for r in rows if r["variant"] == variant and r["status"] == "ok"]
            lo = max(fits) if fits else None
            mine = [r for r in rows if r["variant"] == variant and r["status"] == "oom"]
            ooms = [r["S"] for r in mine if lo is None or r["S"] > lo]
            measured = [r for r in rows if r["variant"] == variant and r["status"] == "ok" and r.get("extra_gib")]
            peaks[variant] = {r["S"]: r.get("extra_bytes") or r["extra_gib"] * GIB for r in measured}
            guided[variant] = 0
            state[variant] = {"max_S": lo, "oom_at": min(ooms) if ooms else None, "attempts": []}
        usable = self.usable_bytes()
        self.result[phase]["search_usable_gib"] = None if usable is None else usable / GIB
        done = set()

        def line_guess(variant):
            """The largest S the variant's memory line allows, or None (no two fits, no GPU, two guided
            tries spent)."""
            if usable is None or len(peaks[variant]) < 2 or guided[variant] >= 2:
                return None
            implied = implied_max_tokens(list(peaks[variant].items()), usable, 0, step)
            return implied and implied.get("max_S")

        def candidate(variant):
            """(S to try next or None, whether the line chose it)."""
            s = state[variant]
            lo, hi = s["max_S"], s["oom_at"]
            if lo is None and hi is None:
                return start, False
            if lo is None:
                c = hi // 2 // step * step
                return (c if c >= step else None), False
            if hi is not None and hi - lo <= step:
                return None, False
            guess = line_guess(variant)
            if hi is None:
                if lo >= cap:
                    return None, False
                plain = min(2 * lo, cap)
                if guess is None or guess >= plain:
                    return plain, False
                return max(guess, lo + step), True  # at or below the largest fit: the step above it
            if guess is not None:
                return min(max(guess, lo + step), hi - step), True
            return (lo + hi) // 2 // step * step, False

        def show(s, variant):
            s["peaks_gib"] = {str(k): v / GIB for k, v in sorted(peaks[variant].items())}

        while True:
            pending = []
            for variant in state:
                if variant in done or (phase, variant) in self.broken:
                    done.add(variant)
                    continue
                c, by_line = candidate(variant)
                if c is None:
                    done.add(variant)
                    continue
                pending.append((self.predict(phase, variant, c) or 0.0, c, variant, by_line))
            if not pending:
                break
            cost, seq, variant, by_line = min(pending)
            if cost > self.left() or self.left() <= 0:
                for _, c, v, _ in pending:
                    state[v]["stopped"] = f"budget: next try S={c} predicted {self.predict(phase, v, c) or 0:.0f} s"
                break
            row = self.attempt(model, phase, variant, seq, 0, 1)
            row["guided"] = by_line
            s = state[variant]
            s["attempts"].append(row)
            if row["status"] == "ok":
                s["max_S"] = seq
                if row.get("extra_bytes"):
                    peaks[variant][seq] = row["extra_bytes"]
            elif row["status"] == "oom":
                s["oom_at"] = seq
            else:
                done.add(variant)
            guided[variant] += by_line
            show(s, variant)
            self.result[phase]["search"] = state
            self.save()
        for variant, s in state.items():
            s["complete"] = "stopped" not in s and (phase, variant) not in self.broken
            s["at_cap"] = s["max_S"] == cap
            show(s, variant)
        self.result[phase]["search"] = state
        return state


# ----------------------------------------------------------------------------------------------------------


def _model_info(model) -> dict:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": sum(p.numel() for p in model.parameters()), "weights_gib": params / GIB,
            "grads_gib": params / GIB}  # fmt: skip


def _build(bench: Bench, name: str, spec: dict, dtype, lengths):
    config = make_config(TINY if bench.quick else LLAMA3_8B, spec["layers"])
    out = bench.result[name] = {"layers": spec["layers"], "lengths": list(lengths), "rows": []}
    model = build_model(config, dtype, bench.device)
    out.update(_model_info(model))
    if bench.cuda:
        torch.cuda.synchronize()
        out["allocated_before_gib"] = torch.cuda.memory_allocated() / GIB
    print(f"{name}: {out['params']:,} parameters, {out['weights_gib']:.2f} GiB", flush=True)
    return config, out, model


def _done_with(bench: Bench, model) -> None:
    bench.save()
    del model
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()


def _phase(bench: Bench, name: str, spec: dict, dtype, variants, confirm: bool = True) -> dict:
    config, out, model = _build(bench, name, spec, dtype, spec["lengths"])
    rows = bench.fixed_lengths(model, name, spec["lengths"], variants)
    total = torch.cuda.get_device_properties(bench.device).total_memory if bench.cuda else None
    base_bytes = torch.cuda.memory_allocated() if bench.cuda else None
    implied = {}
    for variant in variants:
        points = [(r["S"], r["extra_bytes"]) for r in rows if r["variant"] == variant and r["status"] == "ok"
                  and r.get("extra_bytes") is not None]  # fmt: skip
        implied[variant] = implied_max_tokens(points, total, base_bytes, spec["step"]) if total else None
    out["implied"] = implied
    if "start" in spec:
        bench.search(model, name, rows, variants, spec["start"], spec["step"], spec["cap"])
    elif confirm:
        out["confirm"] = _confirm(bench, model, name, implied.get("ours"), spec["step"], config)
    _done_with(bench, model)
    return out


def _confirm_only(bench: Bench, name: str, spec: dict, dtype, source: dict) -> dict:
    """The confirming step of ``ours`` from an earlier run's implied largest S (its step times predict)."""
    earlier = source[name]
    config, out, model = _build(bench, name, spec, dtype, [])
    out["implied"] = earlier["implied"]
    out["implied_from"] = {"elapsed_s": source.get("elapsed_s"), "env": source.get("env")}
    for row in earlier["rows"]:
        if row["status"] == "ok":
            bench.times.setdefault((name, row["variant"]), []).append((row["S"], row["ms"] / 1e3))
    out["confirm"] = _confirm(bench, model, name, earlier["implied"].get("ours"), spec["step"], config)
    _done_with(bench, model)
    return out


def _search_only(bench: Bench, spec: dict, dtype, sources: list, variants) -> dict:
    """The 4-layer model's largest-S search alone, from earlier runs' 4-layer rows and search tries (their step
    times predict, their fits and out-of-memory lengths bound the search), for ``variants``."""
    config, out, model = _build(bench, "4layer", spec, dtype, [])
    earlier = []
    for source in sources:
        phase = source.get("4layer") or {}
        tries = [r for s in (phase.get("search") or {}).values() for r in s.get("attempts", [])]
        earlier += [r for r in phase.get("rows", []) + tries if r.get("variant") in variants]
    for row in earlier:
        if row["status"] == "ok":
            bench.times.setdefault(("4layer", row["variant"]), []).append((row["S"], row["ms"] / 1e3))
    out["search_from"] = [{"elapsed_s": s.get("elapsed_s"), "env": s.get("env")} for s in sources]
    out["seeded_rows"] = [{k: r.get(k) for k in ("variant", "S", "status", "ms", "extra_gib")} for r in earlier]
    bench.search(model, "4layer", earlier, variants, spec["start"], spec["step"], spec["cap"])
    _done_with(bench, model)
    return out


def _confirm(bench, model, phase, implied, step, config) -> list[dict]:
    """One step of ``ours`` at 97% of the implied largest S, then at 90% if that does not fit."""
    if not implied or not implied.get("max_S"):
        return [{"status": "skipped", "error": "no memory figures (CPU, or ours did not run)"}]
    tries = []
    for fraction in (0.97, 0.90):
        seq = min(int(implied["max_S"] * fraction) // step * step, config.max_position_embeddings)
        predicted = bench.predict(phase, "ours", seq)
        if predicted is not None and predicted > bench.left():
            tries.append({"S": seq, "status": "skipped", "error": f"budget: predicted {predicted:.0f} s, "
                          f"{bench.left():.0f} s left"})  # fmt: skip
            break
        row = bench.attempt(model, phase, "ours", seq, 0, 1)
        tries.append(row)
        if row["status"] != "oom":
            break
    return tries


def _env(device: str) -> dict:
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "has_LigerRMSNorm": hasattr(lk, "LigerRMSNorm"), "variants": available_variants(),
           "has_sdpa_attention": hasattr(lk, "register_sdpa_attention"),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "gradient_checkpointing": "non-reentrant; ours, ours_layers, ours_offload, ours_sdpa, ours_untiled on "
                                     "the 4-layer model: keep_attention_context where the package has it; "
                                     "ours_offload: the checkpoints' inputs in pinned host memory; ours_layers: "
                                     "its tiled layer calls bypass the checkpoint",
           "attention": "sdpa; ours, ours_recompute, ours_untiled: register_sdpa_attention's where the package "
                        "has it"}  # fmt: skip
    try:
        from importlib.metadata import version

        env["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger_kernel"] = None
    env["peer_error"] = PEER_ERROR
    env["peer_tiled"] = (
        "peer LigerTiledSwiGLUMLP.forward bound on each LlamaMLP (apply_liger_kernel_to_llama has no tiled option)"
        if PeerTiledSwiGLUMLP is not None
        else "n/a"
    )
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, total_memory_gib=props.total_memory / GIB)
    return env


def run(budget_s: float = 300.0, only: str | None = None, device: str = "cuda", quick: bool = False,
        out_path=None, confirm: bool = True, confirm_from: dict | None = None, variants=None,
        search: bool = True, search_from: list | None = None) -> dict:  # fmt: skip
    """Everything above, as a JSON-serializable dict; no measurement starts once ``budget_s`` is spent (nor
    one predicted to outlast it). ``only``: "4layer" or "32layer". ``confirm``: False leaves out the step at
    the 32-layer model's implied largest S; ``confirm_from``: an earlier run's result, whose implied largest S
    that step then takes, and nothing else runs. ``variants``: a subset to measure (all by default; every
    variant is verified); ``search``: False leaves out the 4-layer model's largest-S search; ``search_from``:
    earlier runs' results, from whose 4-layer rows and tries only that search then runs (nothing verified)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: use --device cpu --quick for the smoke test")
    LAYER_TILING.clear()
    if quick:  # the smoke test's lengths run ours_layers both ways: its shortest untiled, the others in chunks
        LAYER_TILING.update(chunk=64, min_tokens=128)
    bench = Bench(device, quick, budget_s, out_path)
    specs = QUICK if quick else FULL
    phases = [only] if only else list(specs)
    bench.result = {"env": _env(device), "budget_s": budget_s, "quick": quick}
    dtype = torch.float32 if quick else torch.bfloat16
    if confirm_from is not None:
        _confirm_only(bench, "32layer", specs["32layer"], dtype, confirm_from)
        bench.result["elapsed_s"] = time.perf_counter() - bench.start
        bench.save()
        return bench.result
    if search_from is not None:
        chosen = [v for v in available_variants() if variants is None or v in variants]
        _search_only(bench, specs["4layer"], dtype, search_from, chosen)
        bench.result["elapsed_s"] = time.perf_counter() - bench.start
        bench.save()
        return bench.result
    print("verify (tiny float32 model, every variant against vanilla) ...", flush=True)
    bench.result["verify"] = verify(device)
    print(f"  verify ok: {bench.result['verify']['ok']}", flush=True)
    if quick:
        assert bench.result["verify"]["ok"], json.dumps(bench.result["verify"], indent=2)
        check = implied_max_tokens([(32768, 10 * GIB), (65536, 18 * GIB)], 141 * GIB, 16 * GIB, 4096)
        assert check["max_S"] == int((125 * GIB - 2 * GIB) / (8 * GIB / 32768)) // 4096 * 4096, check
    variants = [v for v in available_variants() if variants is None or v in variants]
    for i, name in enumerate(phases):
        # With both phases, the 4-layer one leaves 45% of the budget to the 32-layer one.
        bench.phase_deadline = bench.start + 0.55 * budget_s if len(phases) > 1 and i == 0 else bench.deadline
        spec = specs[name] if search else {k: v for k, v in specs[name].items() if k not in ("start", "cap")}
        # 32 layers' host copies at those lengths would take past this machine's memory (the docstring)
        phase_variants = [v for v in variants if name != "32layer" or v not in FOUR_LAYER_ONLY]
        _phase(bench, name, spec, dtype, phase_variants, confirm and search)
    bench.result["elapsed_s"] = time.perf_counter() - bench.start
    bench.save()
    if quick:
        _check_quick(bench.result, variants)
    return bench.result


def _check_quick(result, variants) -> None:
    """The smoke run went through every path: measured rows, simulated out-of-memory, the search's bisection."""
    rows = [r for phase in ("4layer", "32layer") if phase in result for r in result[phase]["rows"]]
    incomplete = [r for r in rows if r["status"] not in ("ok", "oom")]
    assert not incomplete, f"the smoke run did not run every path (budget too small?): {incomplete}"
    ran = set()  # every variant in some phase: the 32-layer phase leaves out FOUR_LAYER_ONLY
    for phase in ("4layer", "32layer"):
        if phase in result:
            ran |= {v for v in variants if phase == "4layer" or v not in FOUR_LAYER_ONLY}
    assert {r["variant"] for r in rows if r["status"] == "ok"} == ran, rows
    if "4layer" in result:
        search, cap = result["4layer"]["search"], QUICK["4layer"]["cap"]
        for variant in variants:
            expected = QUICK_OOM_ABOVE[variant] // 16 * 16 if variant in QUICK_OOM_ABOVE else cap
            assert search[variant]["max_S"] == expected and search[variant]["complete"], (variant, search[variant])
    for r in rows:
        if r["status"] == "ok" and r["variant"].startswith("ours"):
            assert r["rope_calls_per_step"] > 0, r
        if r["status"] == "ok" and r["variant"] == "ours_layers":  # tiled from 128 tokens on (LAYER_TILING)
            layers = result[r["model"]]["layers"]
            assert r.get("tiled_calls_per_step", 0) == (layers if r["S"] >= 128 else 0), r
        if r["status"] == "ok":  # the first step and two interleaved rounds
            assert len(r["ms_steps"]) == 3 and r["steps"] == r["warmup"] + 3, r


# ----------------------------------------------------------------------------------------------------------
# Report


def _fmt(value, spec="") -> str:
    return "–" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    lines = []
    env = result["env"]
    lines.append(f"torch {env['torch']}, transformers {env['transformers']}, liger-kernel {env['liger_kernel']}, "
                 f"{env.get('gpu', env['device'])}; LigerRMSNorm: {env['has_LigerRMSNorm']}; "
                 f"peer_tiled: {env['peer_tiled']}")  # fmt: skip
    verify_result = result.get("verify", {})
    lines.append(f"\nverify (float32, tiny model; loss rel / weight-grad rel vs vanilla): ok={verify_result.get('ok')}")
    for variant, r in verify_result.items():
        if isinstance(r, dict) and "ok" in r:
            lines.append(
                f"- {variant}: "
                + (f"{r['loss_rel']:.1e} / {r['grad_rel']:.1e}" if "loss_rel" in r else r.get("error", ""))
                + ("" if r["ok"] else "  **FAILED**")
            )
    for phase in ("4layer", "32layer"):
        if phase not in result:
            continue
        out = result[phase]
        lines.append(f"\n### {phase} ({out['layers']} layers, {out['weights_gib']:.2f} GiB weights; extra peak "
                     f"includes the weights' gradients, {out['grads_gib']:.2f} GiB)\n")  # fmt: skip
        lines.append("| variant | S | ms/step | extra peak GiB | tokens/s | loss |")
        lines.append("|---|---|---|---|---|---|")
        for r in out["rows"]:
            if r["status"] == "ok":
                lines.append(f"| {r['variant']} | {r['S']} | {r['ms']:.0f} | {_fmt(r.get('extra_gib'), '.2f')} "
                             f"| {r['tokens_per_s']:.0f} | {r['loss']:.4f} |")  # fmt: skip
            else:
                lines.append(f"| {r['variant']} | {r['S']} | {r['status']} | | | {r.get('error', '')[:60]} |")
        lines.append("\n| variant | KiB/token | from S | implied max S (total memory) |")
        lines.append("|---|---|---|---|")
        for variant, imp in out.get("implied", {}).items():
            imp = imp or {}
            note = f" ({imp['method']})" if imp.get("method", "").startswith("one point") else ""
            used = ", ".join(str(s) for s in imp.get("points", [])) or "–"
            lines.append(f"| {variant} | {_fmt(imp.get('kib_per_token'), '.1f')} | {used} | "
                         f"{_fmt(imp.get('max_S'))}{note} |")  # fmt: skip
        if "search" in out:
            lines.append("\n| variant | largest S that fits | smallest S that did not | search |")
            lines.append("|---|---|---|---|")
            for variant, s in out["search"].items():
                how = "complete" if s.get("complete") else s.get("stopped", "stopped (error)")
                if s.get("at_cap"):
                    how = "reached the cap (max_position_embeddings)"
                lines.append(f"| {variant} | {_fmt(s['max_S'])} | {_fmt(s['oom_at'])} | {how} |")
        for row in out.get("confirm", []):
            lines.append(f"\nconfirm ours at S={row.get('S')}: {row['status']}"
                         + (f", {row['ms']:.0f} ms, extra {_fmt(row.get('extra_gib'), '.2f')} GiB"
                            if row["status"] == "ok" else f" {row.get('error', '')}"))  # fmt: skip
    lines.append(f"\nelapsed {result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; no new measurement after that")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (updated after each measurement)")
    parser.add_argument("--only", choices=("4layer", "32layer"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, short S: the smoke test (CPU)")
    parser.add_argument("--no-confirm", action="store_true", help="leave out the step at the 32-layer implied S")
    parser.add_argument("--confirm-from", type=Path, metavar="RUN_JSON",
                        help="run only that step, at the implied S of this earlier run's 32-layer phase")  # fmt: skip
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="measure only these (all are verified)")
    parser.add_argument("--search-from", type=Path, nargs="+", metavar="RUN_JSON",
                        help="run only the 4-layer largest-S search, from earlier runs' 4-layer rows")  # fmt: skip
    parser.add_argument(
        "--no-search", action="store_true", help="fixed lengths only: no 4-layer search, no 32-layer confirming step"
    )
    args = parser.parse_args()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    source = json.loads(args.confirm_from.read_text()) if args.confirm_from else None
    seeds = [json.loads(path.read_text()) for path in args.search_from] if args.search_from else None
    result = run(args.budget, only=args.only, device=args.device, quick=args.quick, out_path=args.out,
                 confirm=not args.no_confirm, confirm_from=source, variants=args.variants,
                 search=not args.no_search, search_from=seeds)  # fmt: skip
    print(markdown(result))
    if args.out and "4layer" in result:
        try:
            import plot

            plot.plot_model(result, args.out.with_suffix(".png"))
        except ImportError as error:  # matplotlib: only for the PNG (requirements-bench.txt)
            print(f"no plot ({error})")


if __name__ == "__main__":
    main()
