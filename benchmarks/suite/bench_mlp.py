"""Llama-8B MLP (H 4096, I 14336, bf16, batch 1), forward + backward, on the GPU: time and extra peak memory
over what was allocated before the step (weight and input gradients included), for eager PyTorch,
torch.compile of it, this package's fused and tiled layers, and the peer liger-kernel's (when its wheel is
importable). Beyond 131,072 tokens only the tiled MLPs run (the point of tiling).

    python benchmarks/suite/bench_mlp.py [--seqs 8192,32768,65536,131072,1048576] [--out OUT.json]
    python benchmarks/suite/bench_mlp.py --device cpu --quick     # smoke test of the code, no GPU

The tiled/untiled ratio is against the faster untiled MLP in the same run (this package's or the peer's).
"""

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing

HIDDEN, INTERMEDIATE = 4096, 14336
SEQS = (8192, 32768, 65536, 131072, 1048576)
UNTILED_MAX_SEQ = 131072
# The smoke test's MLP is far below the automatic count's minimum shard: its tiled rows ask for 2 shards.
QUICK = {"hidden": 32, "intermediate": 64, "seqs": (64, 256), "untiled_max_seq": 64, "num_shards": 2}


class Host(torch.nn.Module):
    """The Llama MLP's form, as kernelize finds it: the layers' forwards are bound to this module."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def implementations(host):
    lk = timing.package()
    impls = {"eager": host.forward, "torch.compile": torch.compile(host.forward)}
    for name, layer in (("fused", lk.LigerSwiGLUMLP), ("tiled", lk.LigerTiledSwiGLUMLP)):
        impls[name] = types.MethodType(layer.forward, host)
    peer_silu_mul = timing.peer("liger_kernel.ops:LigerSiLUMulFunction")
    peer_tiled = timing.peer("liger_kernel.ops:apply_tiled_mlp")
    if peer_silu_mul is not None:

        def peer_mlp(module, x):
            return module.down_proj(peer_silu_mul.apply(module.gate_proj(x), module.up_proj(x)))

        impls["peer fused"] = lambda x: peer_mlp(host, x)
        if peer_tiled is not None:
            impls["peer tiled"] = lambda x: peer_tiled(
                fn=peer_mlp, mlp_module=host, x=x, num_shards=None, compute_params=list(host.parameters())
            )
    return impls


def step(forward, x, d_out, host):
    out = forward(x)
    out.backward(d_out)
    x.grad = None
    for p in host.parameters():
        p.grad = None


def first_steps(forward, x, d_out, host, device) -> tuple:
    """(peak bytes of a first step above what was allocated before it, None on the CPU; the wall-clock ms of a
    second step, past any compilation)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    step(forward, x, d_out, host)
    timing.sync(device)
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    start = time.perf_counter()
    step(forward, x, d_out, host)
    timing.sync(device)
    return peak, (time.perf_counter() - start) * 1e3


# Each implementation's steps are timed in ROUNDS rounds that alternate between the implementations (the order
# reversed every other round), ~1 s of steps each in all: the GPU's clocks under a sustained GEMM load and the
# host's speed drift over seconds (NOTES.md §20), and back-to-back measurements would hand the drift to whichever
# implementation ran at the worse moment. A round is one warm step (the allocator's blocks back from the other
# implementations' steps), then enough steps for ROUND_MS (from a second step's time) between two CUDA events;
# a step of over COLD_MS (a million tokens) is its round alone. A row's ms is the median of its rounds.
ROUNDS = 5
ROUND_MS = 200
COLD_MS = 1000


def interleaved_ms(steps: dict, estimates: dict, device) -> dict:
    """{name: [ms per step, per round]} for ``steps`` ({name: a step function}), in alternating rounds;
    ``estimates``: {name: ms of one step}, which sets each round's step count. An implementation that fails in
    a round (out of memory, say) is reported and leaves the rounds; the others go on."""
    rounds = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(ROUNDS):
        for name in names if round_index % 2 == 0 else names[::-1]:
            if name not in rounds:
                continue
            calls = max(1, round(ROUND_MS / max(estimates[name], 1e-3)))
            warm = 0 if estimates[name] > COLD_MS else 1
            try:
                rounds[name].append(timing.back_to_back_ms(steps[name], device, calls=calls, repeats=1, warm=warm))
            except Exception as error:  # noqa: BLE001 (one implementation failing must not lose the others)
                print(f"{name} failed in round {round_index}: {type(error).__name__}: {str(error)[:200]}")
                del rounds[name]
                timing.free(device)
    return rounds


# MLP shapes where tiling is a close call (the adaptive choice, the shard count, the gradient sums), with the
# targets the tiled layer is held to against the fused MLP of the same run: (H, I, S): (time ratio, memory).
# Memory: "fused" (at most the fused MLP's peak), "below fused" (strictly less) or a bound in GiB.
SHAPES = {
    (1024, 2816, 8192): (1.30, "fused"),
    (2048, 8192, 16384): (1.25, 0.5),
    (4096, 14336, 4096): (1.02, "fused"),
    (8192, 28672, 16384): (1.25, "below fused"),
}
SHAPE_IMPLS = ("fused", "peer fused", "tiled", "peer tiled")
QUICK_SHAPES = {(32, 64, 256): (1.30, "fused"), (48, 96, 128): (1.02, "fused")}


def run_shapes(shapes=SHAPES, device: str = "cuda", names=SHAPE_IMPLS, num_shards=None) -> list:
    """``run`` for each (H, I, S) of ``shapes``, with only ``names`` (no eager or torch.compile: their figures
    add nothing to these questions); rows also carry hidden, intermediate, the automatic shard count of this
    package and the targets. ``num_shards``: the host attribute for the tiled layers (None: automatic)."""
    lk = timing.package()
    rows = []
    for (hidden, intermediate, seq), (time_target, memory_target) in shapes.items():
        shards = lk._tiling.auto_num_shards(torch.empty(1, seq, hidden, device="meta"), intermediate)
        for row in run([seq], device, hidden, intermediate, untiled_max_seq=seq, names=names, num_shards=num_shards):
            row.update(hidden=hidden, intermediate=intermediate, auto_shards=shards)
            row.update(time_target=time_target, memory_target=memory_target)
            rows.append(row)
    return rows


def run(
    seqs=SEQS,
    device: str = "cuda",
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    untiled_max_seq: int = UNTILED_MAX_SEQ,
    names=None,
    num_shards=None,
) -> list:
    """One row per (S, implementation): ms per forward + backward and peak bytes above the step's start (None
    on the CPU). Past ``untiled_max_seq`` tokens only the tiled MLPs run; ``names`` limits the implementations;
    ``num_shards`` is the host attribute the tiled layers read (None: their automatic count)."""
    torch.manual_seed(0)
    host = Host(hidden, intermediate).to(device, torch.bfloat16)
    if num_shards is not None:
        host.num_shards = num_shards
    rows = []
    print(f"{'S':>8} {'impl':<13} {'ms':>9} {'peak GiB':>9} {'TFLOP/s (9 units)':>18}  (H {hidden}, I {intermediate})")
    impls = implementations(host)
    if names is not None:
        impls = {name: impl for name, impl in impls.items() if name in names}
    for seq in seqs:
        x = torch.randn(1, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        d_out = torch.randn(1, seq, hidden, device=device, dtype=torch.bfloat16)
        flops = 2 * seq * hidden * intermediate * 9  # 3 GEMMs forward, 6 backward
        peaks, estimates, steps = {}, {}, {}
        for name, forward in impls.items():
            if seq > untiled_max_seq and "tiled" not in name:
                continue
            try:  # the peak of a first step, which also shows whether the implementation runs at all here
                peaks[name], estimates[name] = first_steps(forward, x, d_out, host, device)
            except torch.OutOfMemoryError:
                print(f"{seq:>8} {name:<13} out of memory")
                timing.free(device)
                continue
            except Exception as error:  # noqa: BLE001 (one implementation failing must not lose the others)
                print(f"{seq:>8} {name:<13} failed: {type(error).__name__}: {str(error)[:200]}")
                timing.free(device)
                continue
            steps[name] = lambda forward=forward, x=x, d_out=d_out: step(forward, x, d_out, host)
            timing.free(device)
        rounds = interleaved_ms(steps, estimates, device)
        timings = {name: statistics.median(per_round) for name, per_round in rounds.items()}
        for name, ms in timings.items():
            peak = peaks[name]
            rows.append({"seq": seq, "impl": name, "ms": ms, "ms_rounds": rounds[name], "peak_bytes": peak})
            peak_text = "–" if peak is None else f"{peak / 2**30:.2f}"
            print(f"{seq:>8} {name:<13} {ms:9.2f} {peak_text:>9} {flops / (ms * 1e-3) / 1e12:18.0f}")
        untiled = [k for k in ("fused", "peer fused") if k in timings]
        if untiled and "tiled" in timings:
            faster = min(untiled, key=timings.get)
            per_round = [t / u for t, u in zip(rounds["tiled"], rounds[faster])]
            print(
                f"{seq:>8} tiled / faster untiled = {timings['tiled'] / timings[faster]:.3f}"
                f" (per round {min(per_round):.3f}-{max(per_round):.3f})"
            )
        del x, d_out, steps
        timing.free(device)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a tiny MLP, torch.compile off: a smoke test")
    args = parser.parse_args(argv)
    timing.suite_settings()
    if args.quick:
        timing.quick_mode()
        rows = run(
            QUICK["seqs"], args.device, QUICK["hidden"], QUICK["intermediate"], QUICK["untiled_max_seq"],
            num_shards=QUICK["num_shards"],
        )  # fmt: skip
    else:
        rows = run([int(s) for s in args.seqs.split(",")], args.device)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
