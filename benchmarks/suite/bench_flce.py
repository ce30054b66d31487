"""Fused linear cross-entropy on the GPU: a Llama-3-8B head (N = 32768 tokens, H = 4096, V = 128256, bf16, mean
over the non-ignored tokens), forward and forward + backward, for this package, eager PyTorch
(``F.cross_entropy((x @ W.T).float(), target)``), torch.compile of that, and the peer liger-kernel 0.8.5's
``LigerFusedLinearCrossEntropyLoss`` when its wheel is importable. This package runs twice: with its default fp32
weight-gradient sums, and with ``accum_dtype=torch.bfloat16``, the peer's own precision (it sums the weight
gradient in the weight's dtype), the like-for-like row against the peer.

    python benchmarks/suite/bench_flce.py --out flce.json [--tokens 32768]
    python benchmarks/suite/bench_flce.py --device cpu --quick     # smoke test of the code, no GPU

Per variant:
- ``*_graph_ms``: GPU time per call from CUDA-graph replays of 20 captured calls (no host cost). A variant
  that synchronizes with the host (the peer reads the token count with ``.item()``) cannot be captured: None.
- ``*_launch_ms``: ``triton.testing.do_bench`` of back-to-back calls (host cost included).
- ``*_host_us``: CPU wall time per call on tiny inputs (N 64, H 64, V 256), 300 calls after 50 warm-up.
- ``peak_gib``: peak memory allocated during forward + backward beyond what was allocated before (the
  gradients of x and W included), and ``tflops``: the three GEMMs (6 N H V flops) per fwd+bwd graph time.
The ceilings measured in the same run: a 1 GiB device copy (bytes/s) and a bf16 8192^3 GEMM (TFLOP/s).
On the CPU (the smoke test) the timings are wall-clock, back to back, and graphs, peaks and ceilings are None.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import liger_kernels as lk
import timing

N, H, V = 32768, 4096, 128256
TINY = (64, 64, 256)
HOST_CALLS, HOST_WARMUP = 300, 50  # read per call (the smoke test lowers them)
QUICK = (48, 32, 80)


def synchronizes(fn) -> bool:
    """True when ``fn`` waits for the GPU somewhere (``.item()``, ...): such a call cannot be captured."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def graph_ms(fn):
    """``timing.graph_ms`` of ``fn`` (3 replays: each call is tens of ms), or None when ``fn`` synchronizes
    with the host."""
    fn()  # compilation, autotuning
    torch.cuda.synchronize()
    if synchronizes(fn):
        print("    (synchronizes with the host: no CUDA-graph timing)")
        return None
    return timing.graph_ms(fn, replays=3, warm_replays=1)


def eager(x, weight, target):
    return F.cross_entropy((x @ weight.T).float(), target)


def variants():
    """{name: loss(x, weight, target)}."""
    found = {
        "liger-kernels": lambda x, w, t: lk.liger_fused_linear_cross_entropy(x, w, t),
        # the peer's precision: its weight gradient is summed in the weight's dtype, chunk after chunk
        "liger-kernels, accum bf16": lambda x, w, t: lk.liger_fused_linear_cross_entropy(
            x, w, t, accum_dtype=torch.bfloat16
        ),
        "eager": eager,
        "torch.compile": torch.compile(eager),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        peer = LigerFusedLinearCrossEntropyLoss()
        found["liger-kernel 0.8.5"] = lambda x, w, t: peer(w, x, t)
    except ImportError as error:
        print(f"(peer liger-kernel not importable: {error})")
    return found


def inputs(n, hidden, vocab, device="cuda"):
    torch.manual_seed(0)
    x = (torch.randn(n, hidden, device=device) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (n,), device=device)
    target[::8] = -100
    return x, weight, target


def host_us(loss_fn, backward, device="cuda"):
    x, weight, target = inputs(*TINY, device=device)

    def call():
        loss = loss_fn(x, weight, target)
        if backward:
            torch.autograd.grad(loss, (x, weight))

    for _ in range(HOST_WARMUP):
        call()
    timing.sync(device)
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        call()
    elapsed = time.perf_counter() - start
    timing.sync(device)
    return elapsed / HOST_CALLS * 1e6


def measure(loss_fn, n, hidden, vocab, device="cuda"):
    x, weight, target = inputs(n, hidden, vocab, device)

    def forward():
        return loss_fn(x, weight, target)

    def forward_backward():
        return torch.autograd.grad(loss_fn(x, weight, target), (x, weight))

    row = {}
    if device != "cuda":  # the smoke test: every code path, wall-clock timings
        row.update(peak_gib=None, fwd_graph_ms=None, fwdbwd_graph_ms=None)
        row["fwd_launch_ms"] = timing.back_to_back_ms(forward, device, repeats=2)
        row["fwdbwd_launch_ms"] = timing.back_to_back_ms(forward_backward, device, repeats=2)
        row["tflops"] = 6 * n * hidden * vocab / (row["fwdbwd_launch_ms"] * 1e-3) / 1e12
        row["fwd_host_us"] = host_us(loss_fn, False, device)
        row["fwdbwd_host_us"] = host_us(loss_fn, True, device)
        return row
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = forward_backward()
    torch.cuda.synchronize()
    row["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    del grads
    torch.cuda.empty_cache()
    row["fwd_graph_ms"] = graph_ms(forward)
    torch.cuda.empty_cache()
    row["fwdbwd_graph_ms"] = graph_ms(forward_backward)
    torch.cuda.empty_cache()
    row["fwd_launch_ms"] = do_bench(forward, warmup=2, rep=1000, return_mode="median")
    row["fwdbwd_launch_ms"] = do_bench(forward_backward, warmup=2, rep=2000, return_mode="median")
    best = row["fwdbwd_graph_ms"] or row["fwdbwd_launch_ms"]
    row["tflops"] = 6 * n * hidden * vocab / (best * 1e-3) / 1e12
    row["fwd_host_us"] = host_us(loss_fn, backward=False)
    row["fwdbwd_host_us"] = host_us(loss_fn, backward=True)
    return row


def run(copy_bytes_per_s: float, n: int = N, hidden: int = H, vocab: int = V, device: str = "cuda") -> list:
    """One row per variant: op, shape, variant, timings (ms), host cost (us), peak GiB, TFLOP/s and the share
    of the measured bf16 GEMM peak. (The op is GEMM-bound: the copy ceiling is recorded, not divided by.)"""
    peak = timing.gemm_tflops(device) if device == "cuda" else None
    rows = []
    for name, loss_fn in variants().items():
        print(f"  {name} ...", flush=True)
        try:
            row = measure(loss_fn, n, hidden, vocab, device)
        except Exception as error:  # noqa: BLE001  (one variant failing, e.g. out of memory, keeps the others)
            print(f"  {name}: failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            rows.append({"op": "flce", "shape": [n, hidden, vocab], "variant": name, "error": repr(error)[:500]})
            timing.free(device)
            continue
        row.update(op="flce", shape=[n, hidden, vocab], variant=name, gemm_tflops=peak,
                   pct_gemm=peak and 100 * row["tflops"] / peak, copy_bytes_per_s=copy_bytes_per_s)  # fmt: skip
        rows.append(row)
        timing.free(device)
    return rows


def table(rows) -> str:
    def fmt(value, spec):
        return "–" if value is None else format(value, spec)

    lines = [
        "| variant | fwd ms (graph / launch) | fwd+bwd ms (graph / launch) | host us fwd / fwd+bwd "
        "| peak GiB | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:60]} | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {fmt(r['fwd_graph_ms'], '.1f')} / {r['fwd_launch_ms']:.1f} "
            f"| {fmt(r['fwdbwd_graph_ms'], '.1f')} / {r['fwdbwd_launch_ms']:.1f} "
            f"| {r['fwd_host_us']:.0f} / {r['fwdbwd_host_us']:.0f} | {fmt(r['peak_gib'], '.2f')} | {r['tflops']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--tokens", type=int, default=N)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the device given: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        timing.quick_mode()
        global HOST_CALLS, HOST_WARMUP
        HOST_CALLS, HOST_WARMUP = 5, 1
    cuda = args.device == "cuda"
    ceiling = timing.copy_bytes_per_s("cuda") if cuda else 0.0
    n, hidden, vocab = QUICK if args.quick else (args.tokens, H, V)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}: copy {ceiling / 1e12:.2f} TB/s; FLCE N {n}, H {hidden}, V {vocab}, bf16")
    rows = run(ceiling, n, hidden, vocab, args.device)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
