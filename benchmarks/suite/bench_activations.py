"""Fused gated activations on the GPU: time and share of the measured copy bandwidth, one op per entry of
``activations.REGISTRY``, for this package (``gated_mul(a, b, name)``), eager PyTorch (the entry's reference
activation times ``b``, in the input dtype, as a host model computes it), torch.compile of that, and the peer
liger-kernel 0.8.5 where it has the activation (SiLU and tanh-GELU; when its wheel is importable).

    python benchmarks/suite/bench_activations.py [--sweep] [--ops silu,gelu] [--out OUT.json]
    python benchmarks/suite/bench_activations.py --device cpu --quick     # smoke test of the code, no GPU

Bytes counted are the ideal ones: forward reads a, b and writes c (3 tensors); backward reads d_out, a, b
and writes both gradients (5 tensors). bf16.

Two timings per row, both medians (timing.py):
- ``graph``: 20 calls captured in one CUDA graph and replayed: the GPU's time per call without the host's
  launch and dispatch cost. The headline figure.
- ``launch``: ``triton.testing.do_bench``: includes the host cost, which dominates below ~100 us.
(Back-to-back launches and the host's cost per call are bench_host.py's.)

``--sweep`` also times this package's kernels under other BLOCK x num_warps (``_gated.BLOCK`` and
``_gated.NUM_WARPS`` are read at each launch).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing

SHAPES = [(32768, 14336), (8192, 4096)]
QUICK_SHAPES = [(4, 64)]
PEER = {"silu": "liger_kernel.ops:LigerSiLUMulFunction", "gelu_tanh": "liger_kernel.ops:LigerGELUMulFunction"}
OURS = "liger-kernels"


def implementations(lk):
    """{activation name: {impl: fn(a, b)}}, in the registry's order."""
    impls = {}
    for name, activation in lk.activations.REGISTRY.items():

        def ours(a, b, name=name):
            return lk.gated_mul(a, b, name)

        def eager(a, b, reference=activation.reference):
            return reference(a) * b

        impls[name] = {OURS: ours, "eager": eager, "torch.compile": torch.compile(eager)}
        peer = timing.peer(PEER[name]) if name in PEER else None
        if peer is not None:
            impls[name]["liger-kernel 0.8.5"] = peer.apply
    return impls


def measure(fn, rows, cols, device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    a = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    d_out = torch.randn(rows, cols, device=device, dtype=dtype)
    nbytes = a.numel() * a.element_size()
    cuda = torch.device(device).type == "cuda"
    result = {"fwd_bytes": 3 * nbytes, "bwd_bytes": 5 * nbytes}
    with torch.no_grad():
        if cuda:
            result["fwd_graph_ms"] = timing.graph_ms(lambda: fn(a, b))
        result["fwd_launch_ms"] = timing.launch_ms(lambda: fn(a, b), device)
    holder = {}

    def backward():
        if "out" not in holder:  # the forward, once, on the stream that backward will run on
            holder["out"] = fn(a, b)
        torch.autograd.grad(holder["out"], (a, b), d_out, retain_graph=True)

    if cuda:
        result["bwd_graph_ms"] = timing.graph_ms(backward)
        holder.clear()
    result["bwd_launch_ms"] = timing.launch_ms(backward, device)
    return result


def percentages(row, copy_bytes_per_s):
    for phase in ("fwd", "bwd"):
        for kind in ("graph", "launch"):
            ms = row.get(f"{phase}_{kind}_ms")
            if ms and copy_bytes_per_s:
                row[f"{phase}_{kind}_pct"] = 100 * row[f"{phase}_bytes"] / (ms * 1e-3) / copy_bytes_per_s
    return row


def _sweep_configs():
    return [(blk, w) for blk in (1024, 2048, 4096, 8192) for w in (4, 8, 16) if 4 <= blk // (32 * w) <= 32]


def run(copy_bytes_per_s: float, sweep: bool = False, shapes=SHAPES, device: str = "cuda", ops=None) -> list:
    """One row per (activation, shape, implementation): ms and % of ``copy_bytes_per_s``."""
    lk = timing.package()
    gated = lk._gated
    rows_out = []
    print(f"{'op':<10} {'shape':<12} {'impl':<22} {'fwd %':>6} {'bwd %':>6}  (graph; launch: fwd % bwd %)")
    for op, impls in implementations(lk).items():
        if ops and op not in ops:
            continue
        for rows, cols in shapes:
            todo = [(name, fn, None) for name, fn in impls.items()]
            if sweep:
                todo += [(f"{OURS} b{blk} w{w}", impls[OURS], (blk, w)) for blk, w in _sweep_configs()]
            default = (gated.BLOCK, gated.NUM_WARPS)
            for name, fn, config in todo:
                gated.BLOCK, gated.NUM_WARPS = config or default
                try:
                    row = percentages(measure(fn, rows, cols, device), copy_bytes_per_s)
                except Exception as error:  # noqa: BLE001 (one implementation failing must not lose the others)
                    print(f"{op:<10} {rows}x{cols:<6} {name:<22} failed: {type(error).__name__}: {error}")
                    continue
                finally:
                    gated.BLOCK, gated.NUM_WARPS = default
                    timing.free(device)
                rows_out.append({"op": op, "shape": [rows, cols], "impl": name, "dtype": "bfloat16", **row})
                pct = {
                    k: row.get(k, float("nan"))
                    for k in ("fwd_graph_pct", "bwd_graph_pct", "fwd_launch_pct", "bwd_launch_pct")
                }
                print(
                    f"{op:<10} {rows}x{cols:<6} {name:<22} {pct['fwd_graph_pct']:6.1f} {pct['bwd_graph_pct']:6.1f}"
                    f"  ({pct['fwd_launch_pct']:5.1f} {pct['bwd_launch_pct']:5.1f})"
                )
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also sweep BLOCK x num_warps for this package")
    parser.add_argument("--ops", help="comma-separated subset of the registry's names")
    parser.add_argument("--out", type=Path, help="write the rows (and the copy ceiling) as JSON here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, torch.compile off: a smoke test")
    args = parser.parse_args(argv)
    timing.suite_settings()
    if args.quick:
        timing.quick_mode()
    copy = timing.copy_bytes_per_s(args.device, 2**20 if args.quick else 2**30)
    print(f"copy bandwidth: {copy / 1e12:.3f} TB/s")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows = run(copy, args.sweep, shapes, args.device, args.ops.split(",") if args.ops else None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "copy_bytes_per_s": copy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
