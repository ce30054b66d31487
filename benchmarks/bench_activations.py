"""Fused SwiGLU / GeGLU on the GPU: time and share of the measured copy bandwidth, for this package, eager
PyTorch, torch.compile and the peer liger-kernel (when its wheel is importable).

    python benchmarks/bench_activations.py [--sweep] [--json OUT.json]

Bytes counted are the ideal ones: forward reads a, b and writes c (3 tensors); backward reads d_out, a, b
and writes both gradients (5 tensors). bf16.

Two timings per row, both medians:
- ``graph``: 20 calls captured in one CUDA graph and replayed, so the figure is the GPU's time per call
  without the host's launch and dispatch cost (what a training step whose host runs ahead sees). This is
  the headline figure.
- ``launch``: ``triton.testing.do_bench`` (one call per timing, L2 flushed in between): includes the host
  cost, which dominates below ~100 us.
The ceiling is a device-to-device copy of 1 GiB measured in the same run (see copy_bandwidth).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
import liger_kernels as lk  # noqa: E402
from liger_kernels import _gated  # noqa: E402

SHAPES = [(32768, 14336), (8192, 4096)]
GRAPH_CALLS = 20


def graph_ms(fn, replays=30, warm_replays=10):
    """Median GPU time of one ``fn()`` call, from CUDA-graph replays of GRAPH_CALLS calls. ``fn`` runs on a
    side stream, so autograd's backward (which runs on its forward's stream) is captured too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for _ in range(warm_replays):  # clocks up before timing
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / GRAPH_CALLS)
    del graph
    return statistics.median(times)


def copy_bandwidth():
    """Bytes read + written per second by a 1 GiB device copy. Timed with do_bench only: at 1 GiB the launch
    cost is negligible, while a copy captured in a CUDA graph becomes a memcpy node that the copy engines run,
    at about 2.7 TB/s (measured) instead of the SMs' 4.2. Both timings are quoted against this one ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    launch = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    rate = 2 * src.numel() / (launch * 1e-3)
    return {"graph": rate, "launch": rate}


def _eager(activation):
    return lambda a, b: activation(a) * b


def implementations():
    """{op: {impl: fn(a, b)}}."""
    silu = _eager(F.silu)
    gelu_tanh = _eager(lambda a: F.gelu(a, approximate="tanh"))
    gelu = _eager(F.gelu)
    impls = {
        "swiglu": {"liger-kernels": lk.silu_mul, "eager": silu, "torch.compile": torch.compile(silu)},
        "geglu_tanh": {
            "liger-kernels": lambda a, b: lk.gelu_mul(a, b, "tanh"),
            "eager": gelu_tanh,
            "torch.compile": torch.compile(gelu_tanh),
        },
        "geglu_exact": {
            "liger-kernels": lambda a, b: lk.gelu_mul(a, b, "none"),
            "eager": gelu,
            "torch.compile": torch.compile(gelu),
        },
    }
    try:
        from liger_kernel.ops import LigerGELUMulFunction as PeerGELUMul
        from liger_kernel.ops import LigerSiLUMulFunction as PeerSiLUMul

        impls["swiglu"]["liger-kernel 0.8.5"] = PeerSiLUMul.apply
        impls["geglu_tanh"]["liger-kernel 0.8.5"] = PeerGELUMul.apply  # its GeGLU is the tanh form only
    except ImportError as error:
        print(f"(peer liger-kernel not importable: {error})")
    return impls


def libdevice_gelu():
    """The exact GeGLU with libdevice's erf in place of geglu.py's branch-free normal CDF (the sweep's A/B)."""
    from liger_kernels import geglu
    from liger_kernels._backend import jit, tl

    @jit
    def value(z):
        return 0.5 * z * (1.0 + tl.erf(z * geglu._R2))

    @jit
    def value_and_grad(z):
        cdf = 0.5 * (1.0 + tl.erf(z * geglu._R2))
        return z * cdf, cdf + z * geglu._R2PI * tl.exp(-0.5 * z * z)

    activation = _gated.GatedActivation("gelu", value, value_and_grad, None, None)
    return lambda a, b: _LibdeviceGelu.apply(a, b, activation)


class _LibdeviceGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, activation):
        ctx.save_for_backward(a, b)
        ctx.activation = activation
        return _gated.gated_forward(a, b, activation)

    @staticmethod
    def backward(ctx, d_out):
        a, b = ctx.saved_tensors
        return (*_gated.gated_backward(d_out, a, b, ctx.activation), None)


def measure(fn, rows, cols, dtype=torch.bfloat16):
    torch.manual_seed(0)
    a = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    d_out = torch.randn(rows, cols, device="cuda", dtype=dtype)
    nbytes = a.numel() * a.element_size()
    result = {"fwd_bytes": 3 * nbytes, "bwd_bytes": 5 * nbytes}
    with torch.no_grad():
        result["fwd_graph_ms"] = graph_ms(lambda: fn(a, b))
        result["fwd_launch_ms"] = do_bench(lambda: fn(a, b), warmup=25, rep=200, return_mode="median")
    holder = {}

    def backward():
        if "out" not in holder:  # the forward, once, on the stream that backward will run on
            holder["out"] = fn(a, b)
        torch.autograd.grad(holder["out"], (a, b), d_out, retain_graph=True)

    result["bwd_graph_ms"] = graph_ms(backward)
    holder.clear()
    result["bwd_launch_ms"] = do_bench(backward, warmup=25, rep=200, return_mode="median")
    return result


def percentages(row, ceiling):
    for phase in ("fwd", "bwd"):
        for timing in ("graph", "launch"):
            ms = row[f"{phase}_{timing}_ms"]
            row[f"{phase}_{timing}_pct"] = 100 * row[f"{phase}_bytes"] / (ms * 1e-3) / ceiling[timing]
    return row


def run(sweep=False, shapes=SHAPES, ops=None):
    ceiling = copy_bandwidth()
    print(f"copy bandwidth: {ceiling['launch'] / 1e12:.2f} TB/s")
    results = {"copy_bytes_per_s": ceiling, "rows": []}
    print(f"{'op':<12} {'shape':<12} {'impl':<22} {'fwd %':>6} {'bwd %':>6}  (graph; launch: fwd % bwd %)")
    for op, impls in implementations().items():
        if ops and op not in ops:
            continue
        for rows, cols in shapes:
            todo = [(name, fn, None) for name, fn in impls.items()]
            if sweep:
                todo += [
                    (f"liger-kernels b{blk} w{w}", impls["liger-kernels"], (blk, w))
                    for blk in (1024, 2048, 4096, 8192)
                    for w in (4, 8, 16)
                    if 4 <= blk // (32 * w) <= 32
                ]
                if op == "geglu_exact":
                    todo.append(("libdevice erf", libdevice_gelu(), None))
            default = (_gated.BLOCK, _gated.NUM_WARPS)
            for name, fn, config in todo:
                _gated.BLOCK, _gated.NUM_WARPS = config or default
                try:
                    row = percentages(measure(fn, rows, cols), ceiling)
                except Exception as error:  # one implementation failing must not lose the others' rows
                    print(f"{op:<12} {rows}x{cols:<6} {name:<22} failed: {type(error).__name__}: {error}")
                    continue
                finally:
                    _gated.BLOCK, _gated.NUM_WARPS = default
                results["rows"].append({"op": op, "shape": [rows, cols], "impl": name, **row})
                print(
                    f"{op:<12} {rows}x{cols:<6} {name:<22} {row['fwd_graph_pct']:6.1f} {row['bwd_graph_pct']:6.1f}"
                    f"  ({row['fwd_launch_pct']:5.1f} {row['bwd_launch_pct']:5.1f})"
                )
                torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also sweep BLOCK x num_warps for this package")
    parser.add_argument("--ops", help="comma-separated subset of swiglu,geglu_tanh,geglu_exact")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run(args.sweep, ops=args.ops.split(",") if args.ops else None)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
