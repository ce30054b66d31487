"""RMSNorm on the GPU, bf16: time and share of the measured copy bandwidth for this package's LigerRMSNorm
(bound to a LlamaRMSNorm host, as kernelize binds it), eager LlamaRMSNorm, torch.compile of it, and the peer
liger-kernel 0.8.5's LigerRMSNorm when importable; and the host's time per call on a tiny input.

    python benchmarks/suite/bench_rms_norm.py --out rms_norm.json [--sweep]

Bytes counted are the ideal ones: forward reads x and the weight and writes y; backward reads x and d_y,
writes d_x, and reads the weight (the weight gradient, H elements, is not counted).

Two timings per row, both medians:
- ``graph``: 20 calls captured in one CUDA graph and replayed: the GPU's time per call without the host's
  cost (what a training step whose host runs ahead sees). The headline figure.
- ``eager``: 20 calls launched back to back between two events: the host's cost shows where it exceeds the
  GPU's time.
Host time: CPU wall time per call of a 16x4096 input (so the GPU never holds the host back), 300 calls after
50 warm-up calls, forward (inputs requiring grad) and forward + backward.

``--sweep`` also times this package's kernels under other launch parameters (tile sizes, elements per
thread, backward programs per multiprocessor), to choose the defaults in rms_norm.py.
"""

import argparse
import copy
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
import liger_kernels as lk
from timing import back_to_back_ms, copy_bytes_per_s, graph_ms, suite_settings  # noqa: E402  (the suite's shared timings)

RMS = sys.modules["liger_kernels.rms_norm"]  # the module (the package's `rms_norm` is the function)
SHAPES = [(32768, 4096), (8192, 8192)]
HOST_SHAPE = (16, 4096)
EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------
# The implementations, each a module whose weight is the norm's: fn(x) -> y.


class _LlamaForm(torch.nn.Module):
    """LlamaRMSNorm's forward, for machines without transformers (LigerRMSNorm recognizes the form)."""

    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _llama_norm(hidden, device, dtype):
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        LlamaRMSNorm = _LlamaForm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(hidden, eps=EPS)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    return norm.to(device=device, dtype=dtype)


def implementations(hidden, device="cuda", dtype=torch.bfloat16) -> dict:
    """{name: module}; every module holds the same weight."""
    eager = _llama_norm(hidden, device, dtype)
    ours = copy.deepcopy(eager)
    ours.forward = types.MethodType(lk.LigerRMSNorm.forward, ours)
    impls = {"liger-kernels": ours, "eager": eager, "torch.compile": torch.compile(copy.deepcopy(eager))}
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm as PeerRMSNorm

        peer = PeerRMSNorm(hidden, eps=EPS).to(device=device, dtype=dtype)  # its defaults: llama casting, in place
        with torch.no_grad():
            peer.weight.copy_(eager.weight)
        impls["liger-kernel 0.8.5"] = peer
    except ImportError as error:
        print(f"(peer liger-kernel not importable: {error})")
    return impls


def check_implementations(impls, hidden, device="cuda", dtype=torch.bfloat16):
    """Each implementation's output and input gradient against eager before it is timed (a broken variant
    must not produce a figure). Returns the names that pass."""
    x = torch.randn(64, hidden, device=device, dtype=dtype, requires_grad=True)
    d_out = torch.randn(64, hidden, device=device, dtype=dtype)
    want = impls["eager"](x)
    (want_d_x,) = torch.autograd.grad(want, (x,), d_out)
    good = []
    for name, fn in impls.items():
        out = fn(x)
        (d_x,) = torch.autograd.grad(out, (x,), d_out.clone())  # the peer writes d_x over d_out
        errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in ((out, want), (d_x, want_d_x))]
        if max(errors) < 2e-2:
            good.append(name)
        else:
            print(f"{name}: differs from eager (relative error {errors}); not timed")
    return good


# ----------------------------------------------------------------------------------------------------------
# Timing


def measure(module, rows, hidden, dtype=torch.bfloat16) -> dict:
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    d_out = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    element = x.element_size()
    weight_bytes = hidden * module.weight.element_size()
    result = {"fwd_bytes": 2 * x.numel() * element + weight_bytes, "bwd_bytes": 3 * x.numel() * element + weight_bytes}
    with torch.no_grad():
        result["fwd_graph_ms"] = graph_ms(lambda: module(x))
        result["fwd_eager_ms"] = back_to_back_ms(lambda: module(x), "cuda")
    holder = {}

    def backward():
        if "out" not in holder:  # the forward, once, on the stream backward will run on
            holder["out"] = module(x)
        torch.autograd.grad(holder["out"], (x, module.weight), d_out, retain_graph=True)

    result["bwd_graph_ms"] = graph_ms(backward)
    holder.clear()
    result["bwd_eager_ms"] = back_to_back_ms(backward, "cuda")
    holder.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.autograd.grad(module(x), (x, module.weight), d_out)
    torch.cuda.synchronize()
    result["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return result


def percentages(row, ceiling):
    for phase in ("fwd", "bwd"):
        for timing in ("graph", "eager"):
            row[f"{phase}_{timing}_pct"] = 100 * row[f"{phase}_bytes"] / (row[f"{phase}_{timing}_ms"] * 1e-3) / ceiling
    return row


def host_us(fn, calls=300, warm=50):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_rows() -> list:
    rows, hidden = HOST_SHAPE
    impls = implementations(hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d_out = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = impls["liger-kernels"].weight
    calls = {name: (module, module.weight) for name, module in impls.items()}
    calls["liger-kernels rms_norm()"] = (lambda x: lk.rms_norm(x, weight, EPS), weight)
    results = []
    for name, (fn, w) in calls.items():
        forward = host_us(lambda fn=fn: fn(x))
        with torch.no_grad():
            no_grad = host_us(lambda fn=fn: fn(x))
        both = host_us(lambda fn=fn, w=w: torch.autograd.grad(fn(x), (x, w), d_out))
        results.append({"op": "rms_norm host", "shape": list(HOST_SHAPE), "variant": name, "host_fwd_us": forward,
                        "host_fwd_no_grad_us": no_grad, "host_fwd_bwd_us": both})  # fmt: skip
    return results


# ----------------------------------------------------------------------------------------------------------
# The sweep: this package's kernels under other launch parameters.

SWEEP_NAMES = ("FORWARD_TILE", "BACKWARD_TILE", "ELEMENTS_PER_THREAD", "BACKWARD_THREADS_PER_SM",
               "BACKWARD_STAGES", "BACKWARD_SHARED_BYTES")  # fmt: skip
SWEEP = [
    {"ELEMENTS_PER_THREAD": 8},
    {"ELEMENTS_PER_THREAD": 32},
    {"FORWARD_TILE": 4096},
    {"FORWARD_TILE": 16384},
    {"BACKWARD_TILE": 2048},
    {"BACKWARD_TILE": 8192},
    {"BACKWARD_THREADS_PER_SM": 256},
    {"BACKWARD_THREADS_PER_SM": 1024},
    {"BACKWARD_STAGES": 1},
    {"BACKWARD_STAGES": 2},
    {"BACKWARD_STAGES": 3},
    {"BACKWARD_STAGES": 6, "BACKWARD_SHARED_BYTES": 160 * 1024},
]


def with_parameters(parameters: dict):
    saved = {name: getattr(RMS, name) for name in SWEEP_NAMES}
    for name, value in parameters.items():
        setattr(RMS, name, value)
    RMS.clear_launch_cache()
    return saved


def run(copy_bytes_per_s: float, sweep: bool = False, shapes=SHAPES) -> list:
    rows_out = []
    print(f"copy bandwidth: {copy_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'shape':<12} {'variant':<44} {'fwd %':>6} {'bwd %':>6}  {'fwd ms':>7} {'bwd ms':>7}  "
          f"(eager: fwd % bwd %)  peak GiB")  # fmt: skip
    for rows, hidden in shapes:
        impls = implementations(hidden)
        good = check_implementations(impls, hidden)
        todo = [(name, impls[name], None) for name in good]
        if sweep and "liger-kernels" in good:
            todo += [(f"liger-kernels {p}", impls["liger-kernels"], p) for p in SWEEP]
        for name, module, parameters in todo:
            saved = with_parameters(parameters or {})
            try:
                row = percentages(measure(module, rows, hidden), copy_bytes_per_s)
            except Exception as error:  # noqa: BLE001  (one variant failing must not lose the others' rows)
                print(f"{rows}x{hidden:<6} {name:<44} failed: {type(error).__name__}: {error}")
                continue
            finally:
                with_parameters(saved)
            rows_out.append({"op": "rms_norm", "shape": [rows, hidden], "variant": name, "dtype": "bfloat16", **row})
            print(
                f"{rows}x{hidden:<6} {name:<44} {row['fwd_graph_pct']:6.1f} {row['bwd_graph_pct']:6.1f}  "
                f"{row['fwd_graph_ms']:7.3f} {row['bwd_graph_ms']:7.3f}  "
                f"({row['fwd_eager_pct']:5.1f} {row['bwd_eager_pct']:5.1f})  {row['peak_gib']:.2f}"
            )
            torch.cuda.empty_cache()
    print(f"\nhost time per call, {HOST_SHAPE[0]}x{HOST_SHAPE[1]} bf16 (us): forward, forward without grad, "
          f"forward + backward")  # fmt: skip
    for row in host_rows():
        rows_out.append(row)
        print(f"  {row['variant']:<28} {row['host_fwd_us']:8.1f} {row['host_fwd_no_grad_us']:8.1f} "
              f"{row['host_fwd_bwd_us']:8.1f}")  # fmt: skip
    return rows_out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="JSON file for the rows")
    parser.add_argument("--sweep", action="store_true", help="also time other launch parameters of ours")
    args = parser.parse_args()
    suite_settings()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bytes_per_s": copy_bytes_per_s("cuda"),
    }
    results["rows"] = run(results["copy_bytes_per_s"], sweep=args.sweep)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
