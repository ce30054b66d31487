"""Markdown tables and the PNG of a bench_all.py JSON, with the targets beside the figures.

    python benchmarks/suite/plot.py benchmarks/results/h200_DATE.json   # prints the tables, writes the .png
    python benchmarks/suite/plot.py A.json B.json --out C.json          # merges runs of different sections

Reads the older layout too (results/bench_all_h200_2026-11-29.json: activations named swiglu / geglu_tanh /
geglu_exact, ceilings inside the activations and MLP sections).
"""

import argparse
import json
import math
from pathlib import Path

GIB = 2**30
# Targets: activations as % of copy bandwidth (forward and backward) by shape; the tiled MLP's time over the
# faster untiled MLP of the same run, and its extra peak memory in GiB, by sequence length.
ACTIVATION_TARGET = {(32768, 14336): 95.0, (8192, 4096): 80.0}
RATIO_TARGET = {8192: 1.30, 32768: 1.24, 65536: 1.24, 131072: 1.24}
MEMORY_TARGET = {32768: 1.59, 65536: 2.09, 131072: 3.09, 1048576: 40.0}
ACTIVATION_IMPLS = ["liger-kernels", "liger-kernel 0.8.5", "torch.compile", "eager"]
MLP_IMPLS = ["eager", "torch.compile", "fused", "peer fused", "tiled", "peer tiled"]
SHAPE_IMPLS = ["fused", "peer fused", "tiled", "peer tiled"]  # bench_mlp.SHAPE_IMPLS
OLD_OP_NAMES = {"swiglu": "silu", "geglu_tanh": "gelu_tanh", "geglu_exact": "gelu"}  # before the registry
GPU_BOUND = 1.1  # synced / host time per call above this: the GPU set the pace (bench_host.py)
GENERIC_SECTIONS = {
    "rms_norm": "RMSNorm, bf16 (bench_rms_norm.py)",
    "rotary": "Rotary position embedding, bf16 (bench_rotary.py)",
    "flce": "Fused linear cross-entropy, bf16 (bench_flce.py)",
}
IDENTITY = ("op", "shape", "layout", "seq", "entry", "inputs", "variant", "impl")
NOT_SHOWN = {"dtype", "fwd_bytes", "bwd_bytes", "copy_bytes_per_s", "gemm_tflops"}


def rows_of(section):
    """A section's rows: the section itself (a list) or its "rows" (the older layout); [] when absent."""
    if section is None:
        return []
    return section if isinstance(section, list) else section.get("rows", [])


def ceilings(results):
    """(copy bytes/s, bf16 GEMM TFLOP/s), None where not measured."""
    found = results.get("ceilings") or {}
    copy, gemm = found.get("copy_bytes_per_s"), found.get("gemm_tflops")
    activations, mlp = results.get("activations"), results.get("mlp")
    if copy is None and isinstance(activations, dict):
        copy = activations.get("copy_bytes_per_s", {}).get("graph")
    if gemm is None and isinstance(mlp, dict):
        gemm = mlp.get("gemm_tflops")
    return copy, gemm


def _activation_rows(results):
    rows = {}
    for row in rows_of(results.get("activations")):
        op = OLD_OP_NAMES.get(row["op"], row["op"])
        rows[(op, tuple(row["shape"]), row["impl"])] = row
    return rows


def _mlp_rows(results):
    return {(row["seq"], row["impl"]): row for row in rows_of(results.get("mlp"))}


def tiled_ratio(mlp, seq):
    """Tiled time over the faster untiled MLP (fused or peer fused) at the same S; where no untiled MLP ran
    at S (past 131,072 tokens; 65,536 in runs before 2026-12-01j), over the 65,536-token one times S / 65,536.
    None where a figure is missing."""
    tiled = mlp.get((seq, "tiled"))
    measured = any((seq, k) in mlp for k in ("fused", "peer fused"))
    base_seq, factor = (seq, 1) if measured or seq <= 65536 else (65536, seq // 65536)
    untiled = [mlp[(base_seq, k)]["ms"] for k in ("fused", "peer fused") if (base_seq, k) in mlp]
    if tiled is None or not untiled:
        return None
    return tiled["ms"] / (factor * min(untiled))


def host_ratios(rows):
    """{(entry, inputs): (fwd, fwd_bwd)}: this package's host time per call over the eager composite's, for
    the forward and for forward + backward; None where either figure is missing."""
    by_key = {}
    for row in rows:
        by_key.setdefault((row["entry"], row.get("inputs")), {})[row["variant"]] = row
    ratios = {}
    for key, variants in by_key.items():
        ours, eager = variants.get("ours", {}), variants.get("eager", {})
        pair = []
        for phase in ("fwd_us", "fwd_bwd_us"):
            a, b = ours.get(phase), eager.get(phase)
            pair.append(a / b if a is not None and b else None)
        ratios[key] = tuple(pair)
    return ratios


# ----------------------------------------------------------------------------------------------------------
# Tables


def _table(title, header, rows):
    """A markdown table under a title line."""
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def _number(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "×".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value).replace("|", "/").replace("\n", " ")


def _activation_table(results):
    rows = _activation_rows(results)
    body = []
    for op, shape in _activation_groups(rows):
        target = ACTIVATION_TARGET.get(shape)
        cells = [op, f"{shape[0]}×{shape[1]}"]
        for impl in ACTIVATION_IMPLS:
            row = rows.get((op, shape, impl))
            if row is None or "fwd_graph_pct" not in row:
                cells.append("–")
            else:
                cells.append(f"{row['fwd_graph_pct']:.0f}% / {row['bwd_graph_pct']:.0f}%")
        body.append(cells + ["–" if target is None else f"≥{target:.0f}%"])
    return _table(
        "Fused activations, bf16, % of copy bandwidth (forward / backward; CUDA-graph timing):",
        ["op", "shape", *ACTIVATION_IMPLS, "target"],
        body,
    )


def _activation_groups(rows):
    """(op, shape) in the order measured (the registry's)."""
    return list(dict.fromkeys((op, shape) for op, shape, _ in rows))


def _mlp_table(results):
    mlp = _mlp_rows(results)
    body = []
    for seq in sorted({s for s, _ in mlp}):
        cells = [f"{seq:,}"]
        for impl in MLP_IMPLS:
            row = mlp.get((seq, impl))
            if row is None:
                cells.append("–")
            else:
                peak = "–" if row.get("peak_bytes") is None else f"{row['peak_bytes'] / GIB:.2f} GiB"
                cells.append(f"{row['ms']:.1f} ms, {peak}")
        ratio = tiled_ratio(mlp, seq)
        target = [f"≤{RATIO_TARGET[seq]:.2f}×"] if seq in RATIO_TARGET else []
        target += [f"≤{MEMORY_TARGET[seq]:.2f} GiB"] if seq in MEMORY_TARGET else []
        body.append(cells + ["–" if ratio is None else f"{ratio:.3f}×", ", ".join(target) or "–"])
    return _table(
        "Llama-8B MLP (H 4096, I 14336), forward + backward, bf16: median ms, extra peak GiB:",
        ["S", *MLP_IMPLS, "tiled ÷ faster untiled", "target"],
        body,
    )


def _met(value, bound) -> str:
    return "" if value is None or bound is None else (" (met)" if value <= bound else " (missed)")


def _mlp_shapes_table(results):
    """bench_mlp.run_shapes: per (H, I, S), each implementation's ms and peak, and ours against the targets."""
    rows = rows_of(results.get("mlp_shapes"))
    shapes = list(dict.fromkeys((r["hidden"], r["intermediate"], r["seq"]) for r in rows))
    body = []
    for shape in shapes:
        by_impl = {r["impl"]: r for r in rows if (r["hidden"], r["intermediate"], r["seq"]) == shape}
        cells = ["{}, {}, {:,}".format(*shape)]
        for impl in SHAPE_IMPLS:
            row = by_impl.get(impl)
            peak = None if row is None or row.get("peak_bytes") is None else row["peak_bytes"] / GIB
            cells.append("–" if row is None else f"{row['ms']:.2f} ms" + ("" if peak is None else f", {peak:.2f} GiB"))
        tiled, fused = by_impl.get("tiled"), by_impl.get("fused")
        any_row = next(iter(by_impl.values()))
        ratio = tiled["ms"] / fused["ms"] if tiled and fused else None
        memory_target = any_row.get("memory_target")
        fused_peak = fused and fused.get("peak_bytes")
        tiled_peak = tiled and tiled.get("peak_bytes")
        if memory_target == "fused":
            bound, text = fused_peak, "≤ fused"
        elif memory_target == "below fused":
            bound, text = (fused_peak - 1 if fused_peak else None), "< fused"
        else:
            bound, text = (memory_target * GIB if memory_target is not None else None), f"≤{memory_target} GiB"
        time_text = f"≤{any_row.get('time_target')}×{_met(ratio, any_row.get('time_target'))}"
        cells += [
            str(any_row.get("auto_shards", "–")),
            "–" if ratio is None else f"{ratio:.3f}×",
            f"{time_text}, {text}{_met(tiled_peak, bound)}",
        ]
        body.append(cells)
    return _table(
        "MLP shapes where tiling is a close call, forward + backward, bf16 (bench_mlp.run_shapes): median ms, "
        "extra peak GiB; targets for the tiled layer against the fused MLP:",
        ["H, I, S", *SHAPE_IMPLS, "auto shards", "tiled ÷ fused", "target"],
        body,
    )


def _us_pair(row):
    """The forward and forward + backward us as "fwd / fwd+bwd", * where the GPU set the pace."""
    if not row:
        return "–"
    if "error" in row:
        return "failed"
    cells = []
    for phase in ("fwd", "fwd_bwd"):
        host, synced = row.get(f"{phase}_us"), row.get(f"{phase}_synced_us")
        if host is None:
            cells.append("–")
            continue
        cells.append(f"{host:.0f}" + ("*" if synced and synced > GPU_BOUND * host else ""))
    return " / ".join(cells)


def _host_table(results):
    rows = rows_of(results.get("host"))
    by_key = {}
    for row in rows:
        by_key.setdefault((row["entry"], row.get("inputs")), {})[row["variant"]] = row
    ratios = host_ratios(rows)
    body = []
    for (entry, inputs), variants in by_key.items():
        eager = variants.get("eager", {})
        ratio = " / ".join("–" if r is None else f"{r:.2f}×" for r in ratios[(entry, inputs)])
        body.append(
            [
                f"`{entry}`",
                _number(inputs),
                _us_pair(variants.get("ours")),
                _number(eager.get("impl")),
                _us_pair(eager),
                _us_pair(variants.get("peer")),
                ratio,
            ]
        )
    config = (results.get("host") or {}).get("config", {}) if isinstance(results.get("host"), dict) else {}
    counts = f"{config.get('calls', 300)} calls after {config.get('warmup', 50)}, median of {config.get('repeats', 5)}"
    if config.get("alternating"):  # runs from 2026-12-02q on
        counts += " rounds alternating between the variants"
    table = _table(
        f"Host time per call, µs (forward / forward + backward; tiny bf16 inputs, {counts}; inference entries "
        "forward only, under no_grad):",
        ["entry point", "inputs", "ours", "eager composite", "eager", "peer liger-kernel", "ours ÷ eager"],
        body,
    )
    return table[:-1] + [
        "\\* the GPU set the pace (time until the GPU finished > 1.1 × host time): not the host's cost.",
        "",
    ]


def _back_to_back_table(results):
    host = results.get("host")
    rows = host.get("back_to_back", []) if isinstance(host, dict) else []
    by_op = {}
    for row in rows:
        by_op.setdefault(row["op"], {})[row["variant"]] = row
    body = []
    for op, variants in by_op.items():
        cells = [f"`{op}`"]
        for role in ("ours", "eager", "peer"):
            row = variants.get(role)
            if row is None or "fwd_pct" not in row:
                cells.append("–" if row is None or "error" not in row else "failed")
            else:
                step = "".join(f" / {row[key]:.0f}%" for key in ("bwd_step_pct", "bwd_node_pct") if key in row)
                cells.append(f"{row['fwd_pct']:.0f}% / {row['bwd_pct']:.0f}%{step}")
        body.append(cells)
    shape = "×".join(str(s) for s in rows[0]["shape"]) if rows else "?"
    return _table(
        f"Back to back (20 launches between two events), {shape} bf16, % of copy (forward / backward, one "
        "autograd.grad per call / backward of the 20 calls in one pass, as a training step runs it / one more "
        "call's node in a step's pass):",
        ["op", "ours", "eager", "peer liger-kernel"],
        body,
    )


def generic_table(title, rows):
    """Every row's identity columns, then every other key in order of first appearance."""
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys and k not in NOT_SHOWN]
    keys = [k for k in IDENTITY if k in keys] + [k for k in keys if k not in IDENTITY and k != "error"]
    keys += ["error"] if any("error" in row for row in rows) else []
    return _table(title, keys, [[_number(row.get(k)) for k in keys] for row in rows])


def _model_report(model):
    try:
        import bench_model

        return bench_model.markdown(model)
    except Exception as error:  # noqa: BLE001 (not importable here, or a partial result its report does not read)
        print(f"(bench_model's report unavailable: {type(error).__name__}: {str(error)[:100]}; generic tables)")
        return None


def _model_lines(model):
    """bench_model.py's own report where it can be imported (the suite's directory on sys.path), else every
    scalar, every list of rows as a table, and the rest as JSON."""
    report = _model_report(model)
    if report is not None:
        return ["Model (bench_model.py):", "", report, ""]
    if not isinstance(model, dict):
        return ["Model (bench_model.py):", "", _number(model), ""]
    lines = []
    scalars = {k: v for k, v in model.items() if not isinstance(v, (list, dict))}
    if scalars:
        lines += _table("Model (bench_model.py):", list(scalars), [[_number(v) for v in scalars.values()]])
    for key, value in model.items():
        rows = value.get("rows") if isinstance(value, dict) else value
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            lines += generic_table(f"Model: {key}", rows)
        if isinstance(value, dict) or (isinstance(value, list) and rows is not value):
            rest = {k: v for k, v in value.items() if k != "rows"} if isinstance(value, dict) else value
            lines += [f"Model: {key}: `{json.dumps(rest, default=str)[:2000]}`", ""]
    return lines


def _sections_table(results):
    sections = results.get("sections") or {}
    body = [[name, _number(s.get("status")), _number(s.get("seconds"))] for name, s in sections.items()]
    return _table("Sections:", ["section", "status", "seconds"], body) if body else []


def summary(results):
    copy, gemm = ceilings(results)
    versions = results.get("versions", {})
    head = (
        f"Copy bandwidth {_number(copy and copy / 1e12)} TB/s; bf16 GEMM {_number(gemm)} TFLOP/s "
        f"({results.get('device', '?')}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")."
    )
    lines = [head, ""]
    if results.get("host"):
        lines += _host_table(results) + _back_to_back_table(results)
    if rows_of(results.get("activations")):
        lines += _activation_table(results)
    if rows_of(results.get("mlp")):
        lines += _mlp_table(results)
    if rows_of(results.get("mlp_shapes")):
        lines += _mlp_shapes_table(results)
    for name, title in GENERIC_SECTIONS.items():
        if rows_of(results.get(name)):
            lines += generic_table(title + ":", rows_of(results[name]))
    if results.get("model") is not None:
        lines += _model_lines(results["model"])
    lines += _sections_table(results)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The PNG: MLP time and memory, activation bandwidth, host cost (ours ÷ eager).


def _plot_mlp(ax_time, ax_mem, results):
    mlp = _mlp_rows(results)
    for impl in MLP_IMPLS:
        points = sorted((s, r) for (s, i), r in mlp.items() if i == impl)
        if not points:
            continue
        ax_time.plot([s for s, _ in points], [r["ms"] / s * 1024 for s, r in points], marker="o", label=impl)
        peaks = [(s, r["peak_bytes"] / GIB) for s, r in points if r.get("peak_bytes") is not None]
        if peaks:
            ax_mem.plot([s for s, _ in peaks], [g for _, g in peaks], marker="o", label=impl)
    targets = sorted(MEMORY_TARGET.items())
    ax_mem.plot([s for s, _ in targets], [g for _, g in targets], "k--", linewidth=1, label="target")
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


def _plot_activations(ax, results):
    rows = _activation_rows(results)
    groups = _activation_groups(rows)
    width = 0.8 / (2 * len(ACTIVATION_IMPLS))
    for k, impl in enumerate(ACTIVATION_IMPLS):
        for phase_index, phase in enumerate(("fwd", "bwd")):
            xs, ys = [], []
            for g, (op, shape) in enumerate(groups):
                row = rows.get((op, shape, impl))
                if row is not None and f"{phase}_graph_pct" in row:
                    xs.append(g - 0.4 + (2 * k + phase_index + 0.5) * width)
                    ys.append(row[f"{phase}_graph_pct"])
            ax.bar(xs, ys, width, label=f"{impl} {phase}", color=f"C{k}", alpha=1.0 if phase == "fwd" else 0.55)
    for g, (_, shape) in enumerate(groups):
        if shape in ACTIVATION_TARGET:
            ax.hlines(ACTIVATION_TARGET[shape], g - 0.45, g + 0.45, colors="k", linestyles="--", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{op}\n{s[0]}×{s[1]}" for op, s in groups], fontsize=7)
    ax.set_ylabel("% of copy bandwidth (CUDA graph)")
    ax.set_ylim(0, 140)
    ax.set_title("Fused activations, bf16 (fwd solid, bwd light; -- target)")
    ax.legend(fontsize=6, ncol=4, loc="upper center")


def _plot_host(ax, results):
    ratios = host_ratios(rows_of(results.get("host")))
    labels = [f"{entry}\n{inputs or ''}"[:60] for entry, inputs in ratios]
    ys = range(len(labels))
    for offset, (index, phase) in ((-0.2, (0, "forward")), (0.2, (1, "forward + backward"))):
        values = [r[index] if r[index] is not None else 0.0 for r in ratios.values()]
        ax.barh([y + offset for y in ys], values, 0.4, label=phase, color=f"C{index}")
    ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("host time per call, ours ÷ eager composite")
    ax.set_title("Host cost per call (tiny inputs)")
    ax.legend(fontsize=7)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(18, 12))
    (ax_time, ax_mem), (ax_bw, ax_host) = axes
    panels = ((_plot_mlp, (ax_time, ax_mem)), (_plot_activations, (ax_bw,)), (_plot_host, (ax_host,)))
    for draw, panel_axes in panels:
        try:
            draw(*panel_axes, results)
        except (KeyError, TypeError, ValueError) as error:  # a section missing or malformed: the others stay
            panel_axes[0].set_title(f"{draw.__name__}: {type(error).__name__}: {error}"[:80])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_model(model, path):
    """bench_model.py's 4-layer rows: ms per step and extra peak GiB against S, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in model.get("4layer", {}).get("rows", []) if r.get("status") == "ok"]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(14, 5))
    for index, variant in enumerate(sorted({r["variant"] for r in rows})):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["S"])
        lengths = [r["S"] for r in mine]
        style = {"marker": "o", "color": f"C{index}", "label": variant}
        ax_time.plot(lengths, [r["ms"] for r in mine], **style)
        ax_mem.plot(lengths, [r["extra_gib"] for r in mine], **style)
    for ax, label in ((ax_time, "ms per step"), (ax_mem, "extra peak GiB (gradients included)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax_time.set_yscale("log")
    ax_time.set_title("4 layers at Llama-3-8B width, bf16: forward + backward of the loss")
    ax_mem.set_title("Memory over the weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(parts):
    """One result from several bench_all.py JSONs (runs of different sections): later files' sections win."""
    merged = {}
    for part in parts:
        for key, value in part.items():
            if key == "sections":
                merged.setdefault("sections", {}).update(value)
            else:
                merged[key] = value
    return merged


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tables (stdout) and PNG of bench_all.py JSON files.")
    parser.add_argument("json", type=Path, nargs="+", help="one run, or runs of different sections to merge")
    parser.add_argument("--out", type=Path, help="write the merged JSON here (the PNG beside it)")
    args = parser.parse_args(argv)
    results = merge(json.loads(path.read_text()) for path in args.json)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(summary(results))
    png = (args.out or args.json[0]).with_suffix(".png")
    plot(results, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
