"""Rotary position embedding on the GPU at Llama-3-8B attention shapes: time and share of copy bandwidth for this
package, transformers' eager ``apply_rotary_pos_emb``, torch.compile of it, and the peer liger-kernel 0.8.5's
``liger_rotary_pos_emb`` (when importable).

    python benchmarks/suite/bench_rotary.py [--out rotary.json] [--seq 32768]

Shape: B=1, S=32768, 32 query heads, 8 key/value heads, head dim 128, bf16, cos/sin [1, S, 128] bf16. Two
layouts of q/k, both [B, H, S, D] views as transformers' attention hands them over: ``separate`` (q_proj(x) and
k_proj(x) viewed [B, S, H, D] and transposed) and ``fused_qkv`` (slices of one [B, S, 32 + 2*8, D] projection).

Bytes counted are the ideal ones: forward reads q, k, cos, sin and writes q_embed, k_embed; backward reads the
two output gradients, cos and sin and writes the two input gradients.

Timings per row, medians:
- ``graph``: 20 calls captured in one CUDA graph and replayed: the GPU's time per call without the host's
  launch cost (the headline figure);
- ``eager``: 20 calls launched back to back from the host, timed with CUDA events, no synchronization between
  calls (what a host that keeps ahead of the GPU sees);
- ``host``: CPU wall time per call on tiny inputs (B=1, S=16, 4 and 2 heads, D=64), 300 calls after 50 warm-up:
  the host's own cost (checks, dispatch, launch), for the forward and for forward + backward.
The ceiling is a 1 GiB device-to-device copy measured in the same run (``timing.copy_bytes_per_s``). Target: >= 85%.

The peer writes its results into q and k (and its gradients into the output gradients) when their
[B, S, H, D] memory is contiguous, as in the ``separate`` layout: its timings are right, its values drift
between calls, and nothing here reads them.

``--device cpu`` runs every code path with wall-clock timing (no graphs, no percentages): a smoke test.
"""

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
import liger_kernels as lk  # noqa: E402
from timing import back_to_back_ms, copy_bytes_per_s, graph_ms, suite_settings, sync  # noqa: E402  (CUDA-graph replay timing, shared by the suite)

SHAPE = {"batch": 1, "seq": 32768, "n_q": 32, "n_k": 8, "dim": 128}
HOST_SHAPE = {"batch": 1, "seq": 16, "n_q": 4, "n_k": 2, "dim": 64}
LAYOUTS = ("separate", "fused_qkv")
HOST_CALLS, HOST_WARMUP = 300, 50  # host_us's defaults, read per call (the smoke test lowers them)


# ----------------------------------------------------------------------------------------------------------
# Implementations: fn(q, k, cos, sin) -> (q_embed, k_embed)


def implementations():
    from transformers.models.llama import modeling_llama

    transformers_rope = modeling_llama.apply_rotary_pos_emb  # the module transformers' attention calls

    def eager(q, k, cos, sin):
        return transformers_rope(q, k, cos, sin)

    # The function itself, for torch.compile (no module call in the graph). Recent transformers wrap it in a
    # kernelize-able module instance; older ones (5.17) export the plain function.
    plain = transformers_rope if isinstance(transformers_rope, types.FunctionType) else None

    def original(q, k, cos, sin):
        if plain is not None:
            return plain(q, k, cos, sin)
        return type(transformers_rope).forward(None, q, k, cos, sin)

    impls = {
        "liger-kernels": lk.liger_rotary_pos_emb,
        "transformers eager": eager,
        "torch.compile": torch.compile(original),
    }
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb as peer

        impls["liger-kernel 0.8.5"] = peer
    except ImportError as error:
        print(f"(peer liger-kernel not importable: {error})")
    return impls


def make_inputs(layout, batch, seq, n_q, n_k, dim, device, dtype=torch.bfloat16):
    """q, k as [B, H, S, D] views that require grad (through their leaves), cos, sin [B, S, D]."""
    torch.manual_seed(0)
    if layout == "separate":
        q_base = torch.randn(batch, seq, n_q, dim, device=device, dtype=dtype, requires_grad=True)
        k_base = torch.randn(batch, seq, n_k, dim, device=device, dtype=dtype, requires_grad=True)
        q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
    else:
        qkv = torch.randn(batch, seq, n_q + 2 * n_k, dim, device=device, dtype=dtype, requires_grad=True)
        q, k = qkv[:, :, :n_q].transpose(1, 2), qkv[:, :, n_q : n_q + n_k].transpose(1, 2)
    inv_freq = 500000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1).expand(batch, seq, dim)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------------------------
# Timing


# LIGER_BENCH_ROTARY_GRAPH=0 times eagerly only: a failed capture leaves the CUDA context unusable for the
# rest of the process (see NOTES.md).
GRAPH = os.environ.get("LIGER_BENCH_ROTARY_GRAPH", "1") != "0"


def host_us(fn, device, calls=None, warmup=None):
    calls, warmup = calls or HOST_CALLS, warmup or HOST_WARMUP
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync(device)
    return elapsed / calls * 1e6


def phases(fn, q, k, cos, sin):
    """(forward, backward) closures. The forward runs without grad; the backward reuses one forward's graph
    (retain_graph), made on first call, i.e. on the stream the timing runs on. The gradients are taken for
    aliases of q and k made there too: autograd runs a node's backward on the stream its forward ran on, and
    the views make_inputs made on the default stream would have the captured backward wait on that stream,
    which a CUDA-graph capture refuses (the inputs' layout is the views' own)."""
    d_q = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    d_k = torch.randn(k.shape, device=k.device, dtype=k.dtype)
    holder = {}

    def forward():
        with torch.no_grad():
            fn(q, k, cos, sin)

    def backward():
        if "out" not in holder:
            holder["inputs"] = (q[...], k[...])
            holder["out"] = fn(*holder["inputs"], cos, sin)
        torch.autograd.grad(holder["out"], holder["inputs"], (d_q, d_k), retain_graph=True)

    return forward, backward, holder


def peak_gib(fn, q, k, cos, sin, device):
    """Peak memory above the inputs during one forward + backward (outputs, saved tensors, gradients)."""
    if device != "cuda":
        return None
    d_q, d_k = torch.randn(q.shape, device=device, dtype=q.dtype), torch.randn(k.shape, device=device, dtype=k.dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(q, k, cos, sin)
    torch.autograd.grad(out, (q, k), (d_q, d_k))
    del out
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def measure(fn, layout, shape, device):
    q, k, cos, sin = make_inputs(layout, **shape, device=device)
    traffic = 2 * nbytes(q, k) + nbytes(cos, sin)  # read q, k, cos, sin; write two outputs (likewise backward)
    row = {"fwd_bytes": traffic, "bwd_bytes": traffic}
    forward, backward, holder = phases(fn, q, k, cos, sin)
    if device == "cuda" and GRAPH:
        row["fwd_graph_ms"] = graph_ms(forward)
        row["bwd_graph_ms"] = graph_ms(backward)
        holder.clear()
    row["fwd_eager_ms"] = back_to_back_ms(forward, device)
    row["bwd_eager_ms"] = back_to_back_ms(backward, device)
    holder.clear()
    row["peak_gib"] = peak_gib(fn, q, k, cos, sin, device)
    del q, k, cos, sin, forward, backward
    tq, tk, tcos, tsin = make_inputs(layout, **HOST_SHAPE, device=device)
    d_q = torch.randn(tq.shape, device=device, dtype=tq.dtype)
    d_k = torch.randn(tk.shape, device=device, dtype=tk.dtype)
    row["host_fwd_us"] = host_us(lambda: fn(tq, tk, tcos, tsin), device)
    row["host_fwd_bwd_us"] = host_us(lambda: torch.autograd.grad(fn(tq, tk, tcos, tsin), (tq, tk), (d_q, d_k)), device)
    return row


def percentages(row, copy_bytes_per_s):
    for phase in ("fwd", "bwd"):
        for timing in ("graph", "eager"):
            ms = row.get(f"{phase}_{timing}_ms")
            if ms is not None and copy_bytes_per_s:
                row[f"{phase}_{timing}_pct"] = 100 * row[f"{phase}_bytes"] / (ms * 1e-3) / copy_bytes_per_s
    return row


def run(copy_bytes_per_s: float, device: str = "cuda", shape=None, layouts=LAYOUTS) -> list:
    """One row per (layout, implementation): ms, % of ``copy_bytes_per_s`` (bytes read + written per second by
    a device copy), peak GiB, host us per call."""
    shape = dict(SHAPE if shape is None else shape)
    rows = []
    for layout in layouts:
        for name, fn in implementations().items():
            try:
                row = percentages(measure(fn, layout, shape, device), copy_bytes_per_s)
            except Exception as error:  # noqa: BLE001 (one implementation failing must not lose the others' rows)
                print(f"rotary {layout:<10} {name:<20} failed: {type(error).__name__}: {error}")
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append({"op": "rotary", "shape": shape, "layout": layout, "variant": name, "dtype": "bfloat16", **row})
    return rows


def table(rows) -> str:
    def fmt(row, key, spec):
        value = row.get(key)
        return format(value, spec) if value is not None else "–"

    columns = [  # (title, key, format)
        ("graph fwd ms", "fwd_graph_ms", ".3f"), ("graph bwd ms", "bwd_graph_ms", ".3f"),
        ("graph fwd %", "fwd_graph_pct", ".1f"), ("graph bwd %", "bwd_graph_pct", ".1f"),
        ("eager fwd ms", "fwd_eager_ms", ".3f"), ("eager bwd ms", "bwd_eager_ms", ".3f"),
        ("eager fwd %", "fwd_eager_pct", ".1f"), ("eager bwd %", "bwd_eager_pct", ".1f"),
        ("peak GiB", "peak_gib", ".2f"), ("host fwd us", "host_fwd_us", ".1f"),
        ("host f+b us", "host_fwd_bwd_us", ".1f"),
    ]  # fmt: skip
    lines = [" ".join([f"{'layout':<10}", f"{'variant':<20}", *(f"{title:>12}" for title, _, _ in columns)])]
    for r in rows:
        cells = [fmt(r, key, spec) for _, key, spec in columns]
        lines.append(" ".join([f"{r['layout']:<10}", f"{r['variant']:<20}", *(f"{c:>12}" for c in cells)]))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="write the rows (and the copy ceiling) as JSON here")
    parser.add_argument("--seq", type=int, default=SHAPE["seq"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the code")
    args = parser.parse_args()
    suite_settings()
    shape = dict(SHAPE, seq=args.seq)
    if args.device == "cpu":
        shape = dict(HOST_SHAPE, seq=args.seq if args.seq != SHAPE["seq"] else 64)
    copy = copy_bytes_per_s("cuda") if args.device == "cuda" else 0.0
    if copy:
        print(f"copy bandwidth: {copy / 1e12:.2f} TB/s (read + write)")
    rows = run(copy, args.device, shape)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
        args.out.write_text(json.dumps({**meta, "copy_bytes_per_s": copy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
