"""Tables (markdown) and the PNG plot of a bench_all.py JSON, with issue #5's targets beside the figures.

    python benchmarks/plot.py benchmarks/results/h200_2026-11-29.json   # prints the tables, writes the .png
"""

import json
import sys
from pathlib import Path

GIB = 2**30
# Issue #5's targets: activations as % of copy bandwidth (fwd, bwd) by shape; the tiled MLP's time over the
# faster untiled MLP of the same run, and its extra peak memory in GiB, by sequence length.
ACTIVATION_TARGET = {(32768, 14336): 95.0, (8192, 4096): 80.0}
RATIO_TARGET = {8192: 1.30, 32768: 1.20, 65536: 1.20, 131072: 1.20}
MEMORY_TARGET = {32768: 1.73, 65536: 2.23, 131072: 3.23, 1048576: 40.0}
ACTIVATION_IMPLS = ["liger-kernels", "liger-kernel 0.8.5", "torch.compile", "eager"]
MLP_IMPLS = ["eager", "torch.compile", "fused", "peer fused", "tiled", "peer tiled"]


def _activation_rows(results):
    rows = {}
    for row in results["activations"]["rows"]:
        rows[(row["op"], tuple(row["shape"]), row["impl"])] = row
    return rows


def _mlp_rows(results):
    return {(row["seq"], row["impl"]): row for row in results["mlp"]["rows"]}


def tiled_ratio(mlp, seq):
    """Tiled time over the faster untiled MLP (fused or peer fused); past 65,536 tokens, over twice the
    65,536-token one, as issue #5 defines it. None where a figure is missing."""
    tiled = mlp.get((seq, "tiled"))
    base_seq, factor = (seq, 1) if seq <= 65536 else (65536, seq // 65536)
    untiled = [mlp[(base_seq, k)]["ms"] for k in ("fused", "peer fused") if (base_seq, k) in mlp]
    if tiled is None or not untiled:
        return None
    return tiled["ms"] / (factor * min(untiled))


def _table(title, header, rows):
    """A markdown table under a title line."""
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def _activation_table(results):
    rows = _activation_rows(results)
    body = []
    for op in ("swiglu", "geglu_tanh", "geglu_exact"):
        for shape, target in ACTIVATION_TARGET.items():
            cells = [op, f"{shape[0]}×{shape[1]}"]
            for impl in ACTIVATION_IMPLS:
                row = rows.get((op, shape, impl))
                cells.append("–" if row is None else f"{row['fwd_graph_pct']:.0f}% / {row['bwd_graph_pct']:.0f}%")
            body.append(cells + [f"≥{target:.0f}%"])
    return _table(
        "Fused activations, bf16, % of copy bandwidth (forward / backward; CUDA-graph timing):",
        ["op", "shape", *ACTIVATION_IMPLS, "target"],
        body,
    )


def _mlp_table(results):
    mlp = _mlp_rows(results)
    body = []
    for seq in sorted({s for s, _ in mlp}):
        cells = [f"{seq:,}"]
        for impl in MLP_IMPLS:
            row = mlp.get((seq, impl))
            cells.append("–" if row is None else f"{row['ms']:.1f} ms, {row['peak_bytes'] / GIB:.2f} GiB")
        ratio = tiled_ratio(mlp, seq)
        target = [f"≤{RATIO_TARGET[seq]:.2f}×"] if seq in RATIO_TARGET else []
        target += [f"≤{MEMORY_TARGET[seq]:.2f} GiB"] if seq in MEMORY_TARGET else []
        body.append(cells + ["–" if ratio is None else f"{ratio:.3f}×", ", ".join(target) or "–"])
    return _table(
        "Llama-8B MLP (H 4096, I 14336), forward + backward, bf16: median ms, extra peak GiB:",
        ["S", *MLP_IMPLS, "tiled ÷ faster untiled", "target"],
        body,
    )


def summary(results):
    ceiling = results["activations"]["copy_bytes_per_s"]
    head = (
        f"Copy bandwidth {ceiling['graph'] / 1e12:.2f} TB/s; bf16 GEMM {results['mlp']['gemm_tflops']:.0f} TFLOP/s "
        f"({results.get('device', '?')}, torch {results.get('versions', {}).get('torch', '?')})."
    )
    return "\n".join([head, "", *_activation_table(results), *_mlp_table(results)])


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem, ax_bw) = plt.subplots(1, 3, figsize=(18, 5.5))
    mlp = _mlp_rows(results)
    for impl in MLP_IMPLS:
        points = sorted((s, r) for (s, i), r in mlp.items() if i == impl)
        if not points:
            continue
        seqs = [s for s, _ in points]
        ax_time.plot(seqs, [r["ms"] / s * 1024 for s, r in points], marker="o", label=impl)
        ax_mem.plot(seqs, [r["peak_bytes"] / GIB for _, r in points], marker="o", label=impl)
    targets = sorted(MEMORY_TARGET.items())
    ax_mem.plot([s for s, _ in targets], [g for _, g in targets], "k--", linewidth=1, label="issue #5 target")
    for ax, label in ((ax_time, "ms per 1024 tokens, forward + backward"), (ax_mem, "extra peak memory, GiB")):
        ax.set_xscale("log", base=2)
        if ax is ax_mem:
            ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_time.set_title("Llama-8B MLP, bf16, time")
    ax_mem.set_title("Llama-8B MLP, bf16, memory")

    rows = _activation_rows(results)
    groups = [(op, shape) for op in ("swiglu", "geglu_tanh", "geglu_exact") for shape in ACTIVATION_TARGET]
    width = 0.8 / (2 * len(ACTIVATION_IMPLS))
    for k, impl in enumerate(ACTIVATION_IMPLS):
        for phase_index, phase in enumerate(("fwd", "bwd")):
            xs, ys = [], []
            for g, (op, shape) in enumerate(groups):
                row = rows.get((op, shape, impl))
                if row is not None:
                    xs.append(g - 0.4 + (2 * k + phase_index + 0.5) * width)
                    ys.append(row[f"{phase}_graph_pct"])
            ax_bw.bar(xs, ys, width, label=f"{impl} {phase}", color=f"C{k}", alpha=1.0 if phase == "fwd" else 0.55)
    for g, (op, shape) in enumerate(groups):
        target = ACTIVATION_TARGET[shape]
        ax_bw.hlines(target, g - 0.45, g + 0.45, colors="k", linestyles="--", linewidth=1)
    ax_bw.set_xticks(range(len(groups)))
    ax_bw.set_xticklabels([f"{op}\n{s[0]}×{s[1]}" for op, s in groups], fontsize=7)
    ax_bw.set_ylabel("% of copy bandwidth (CUDA graph)")
    ax_bw.set_ylim(0, 140)
    ax_bw.set_title("Fused activations, bf16 (fwd solid, bwd light; -- target)")
    ax_bw.legend(fontsize=6, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    path = Path(sys.argv[1])
    results = json.loads(path.read_text())
    print(summary(results))
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
