"""The benchmarks, without a GPU: the `kernels benchmark` scripts run and verify at small shapes on the CPU; the
maintainers' suite runs end to end in its CPU smoke mode, and its tables compute the ratios they claim."""

import ast
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from kernels.benchmark import Benchmark

from harness import ROOT

SCRIPTS = sorted((ROOT / "benchmarks").glob("benchmark*.py"))
SUITE = ROOT / "benchmarks" / "suite"
SMALL = {
    "rows": 64,
    "cols": 96,
    "seq": 200,
    "hidden": 32,
    "intermediate": 48,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "tokens": 64,
    "vocab": 100,
}
NEEDS = {"benchmark_rms_norm": "rms_norm"}  # scripts for ops that arrive from other branches


def _load(path, name=None):
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_classes():
    for script in SCRIPTS:
        module = _load(script)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Benchmark) and cls is not Benchmark and cls.__module__ == script.stem:
                yield pytest.param(script.stem, cls, id=f"{script.stem}.{cls.__name__}")


def test_scripts_cover_every_op():
    expected = {"swiglu", "geglu", "mlp", "rms_norm", "rotary", "flce"}
    assert {s.stem for s in SCRIPTS} == {f"benchmark_{op}" for op in expected}


@pytest.mark.parametrize("script, cls", list(benchmark_classes()))
def test_benchmark_workloads_verify(lk, script, cls):
    if script in NEEDS and not hasattr(lk, NEEDS[script]):
        pytest.skip(f"this build has no {NEEDS[script]}")
    small = type(cls.__name__, (cls,), {k: v for k, v in SMALL.items() if hasattr(cls, k)})
    workloads = [name[len("benchmark_") :] for name in dir(small) if name.startswith("benchmark_")]
    assert workloads
    for workload in workloads:
        instance = small()
        instance.kernel, instance.device = lk, "cpu"
        torch.manual_seed(0)
        getattr(instance, f"setup_{workload}", instance.setup)()
        getattr(instance, f"benchmark_{workload}")()
        verify = getattr(instance, f"verify_{workload}", None)
        assert isinstance(instance.out, torch.Tensor), workload
        if verify is not None:
            ref = verify()
            assert instance.out.shape == ref.shape and instance.out.dtype == ref.dtype, workload
            assert torch.allclose(instance.out, ref, atol=1e-2), workload
            assert ref.abs().max() > 1e-2, f"{workload}: a reference this small makes atol=1e-2 vacuous"


def test_hub_scripts_import_nothing_from_the_repository():
    for script in SCRIPTS:
        imports = [line for line in script.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert all(line.split()[1].split(".")[0] in {"torch", "kernels", "types"} for line in imports), script


# ----------------------------------------------------------------------------------------------------------
# plot.py's tables, on a synthetic result


def synthetic_results():
    mlp = [
        {"seq": 65536, "impl": "fused", "ms": 100.0, "peak_bytes": 7 * 2**30},
        {"seq": 65536, "impl": "peer fused", "ms": 80.0, "peak_bytes": 7 * 2**30},
        {"seq": 65536, "impl": "tiled", "ms": 96.0, "peak_bytes": 2 * 2**30},
        {"seq": 131072, "impl": "tiled", "ms": 200.0, "peak_bytes": 3 * 2**30},
        {"seq": 8192, "impl": "tiled", "ms": 1.0, "peak_bytes": 0},
    ]
    activations = [
        {"op": "silu", "shape": [8192, 4096], "impl": "liger-kernels", "fwd_graph_pct": 97.4, "bwd_graph_pct": 98.6},
        {"op": "gelu", "shape": [4, 64], "impl": "eager", "fwd_graph_pct": 50.0, "bwd_graph_pct": 40.0},
    ]
    host = [
        {
            "entry": "silu_mul",
            "inputs": "16x4096",
            "variant": "ours",
            "fwd_us": 50.0,
            "fwd_synced_us": 51.0,
            "fwd_bwd_us": 200.0,
            "fwd_bwd_synced_us": 201.0,
        },
        {
            "entry": "silu_mul",
            "inputs": "16x4096",
            "variant": "eager",
            "impl": "F.silu(a) * b",
            "fwd_us": 25.0,
            "fwd_synced_us": 25.0,
            "fwd_bwd_us": 160.0,
            "fwd_bwd_synced_us": 161.0,
        },
        {
            "entry": "silu_mul",
            "inputs": "16x4096",
            "variant": "peer",
            "fwd_us": 40.0,
            "fwd_synced_us": 40.0,
            "fwd_bwd_us": 220.0,
            "fwd_bwd_synced_us": 221.0,
        },
        {
            "entry": "LigerSwiGLUMLP",
            "inputs": "decode, batch 1",
            "variant": "ours",
            "fwd_us": 90.0,
            "fwd_synced_us": 180.0,
        },
        {
            "entry": "LigerSwiGLUMLP",
            "inputs": "decode, batch 1",
            "variant": "eager",
            "impl": "LlamaMLP.forward",
            "fwd_us": 120.0,
            "fwd_synced_us": 180.0,
        },
        {"entry": "rms_norm", "inputs": "16x4096", "variant": "ours", "error": "RuntimeError: boom"},
    ]
    back_to_back = [
        {
            "op": "silu_mul",
            "shape": [8192, 4096],
            "variant": "ours",
            "fwd_pct": 88.6,
            "bwd_pct": 70.2,
            "bwd_step_pct": 93.1,
            "bwd_node_pct": 88.3,
        },
        {"op": "silu_mul", "shape": [8192, 4096], "variant": "eager", "fwd_pct": 50.0, "bwd_pct": 49.6},
    ]
    rotary = [
        {
            "op": "rotary",
            "shape": {"seq": 32768},
            "layout": "separate",
            "variant": "liger-kernels",
            "fwd_graph_pct": 91.23,
            "fwd_bytes": 123,
        }
    ]
    return {
        "device": "NVIDIA H200",
        "versions": {"torch": "2.11"},
        "ceilings": {"copy_bytes_per_s": 4.2e12, "gemm_tflops": 700.0},
        "host": {"config": {"calls": 300, "warmup": 50, "repeats": 5}, "rows": host, "back_to_back": back_to_back},
        "activations": activations,
        "mlp": mlp,
        "rotary": rotary,
        "model": {"tokens_per_s": 1234.5, "steps": [{"step": 1, "ms": 10.0}]},
        "sections": {"model": {"status": "ok", "seconds": 3.0}},
    }


@pytest.fixture
def suite_module():
    """Loads a suite module in this process, then takes the suite's modules and sys.path entry away again."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)

    def load(name):
        return _load(SUITE / f"{name}.py", name)

    yield load
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        if name in {"plot", "timing", "bench_all", "bench_model"}:
            del sys.modules[name]


def test_plot_tiled_ratio_definition(suite_module):
    """Tiled ÷ the faster untiled MLP of the same S; past 65,536 tokens, ÷ the faster untiled 65,536-token MLP
    times S / 65,536."""
    plot = suite_module("plot")
    mlp = {(r["seq"], r["impl"]): r for r in synthetic_results()["mlp"]}
    assert plot.tiled_ratio(mlp, 65536) == pytest.approx(96.0 / 80.0)
    assert plot.tiled_ratio(mlp, 131072) == pytest.approx(200.0 / (2 * 80.0))
    assert plot.tiled_ratio(mlp, 8192) is None  # no untiled run at that length


def test_plot_host_ratio_definition(suite_module):
    """Ours ÷ eager, per entry point and inputs, for the forward and for forward + backward."""
    plot = suite_module("plot")
    ratios = plot.host_ratios(synthetic_results()["host"]["rows"])
    assert ratios[("silu_mul", "16x4096")] == pytest.approx((2.0, 1.25))
    assert ratios[("LigerSwiGLUMLP", "decode, batch 1")] == (pytest.approx(0.75), None)  # inference: forward only
    assert ratios[("rms_norm", "16x4096")] == (None, None)  # failed, no eager row


def test_plot_tables(suite_module):
    plot = suite_module("plot")
    text = plot.summary(synthetic_results())
    assert text.startswith("Copy bandwidth 4.2 TB/s; bf16 GEMM 700 TFLOP/s (NVIDIA H200; torch 2.11).")
    assert "| silu | 8192×4096 | 97% / 99% | – | – | – | ≥80% |" in text
    assert "| gelu | 4×64 | – | – | – | 50% / 40% | – |" in text  # a shape without a target
    assert "| 131,072 | – | – | – | – | 200.0 ms, 3.00 GiB | – | 1.250× | ≤1.24×, ≤3.09 GiB |" in text
    assert "| `silu_mul` | 16x4096 | 50 / 200 | F.silu(a) * b | 25 / 160 | 40 / 220 | 2.00× / 1.25× |" in text
    # synced time twice the host's: the GPU set the pace, marked
    assert "| `LigerSwiGLUMLP` | decode, batch 1 | 90* / – | LlamaMLP.forward | 120* / – | – | 0.75× / – |" in text
    assert "| `rms_norm` | 16x4096 | failed | – | – | – | – / – |" in text
    assert "| `silu_mul` | 89% / 70% / 93% / 88% | 50% / 50% | – |" in text
    assert "| rotary | seq 32768 | separate | liger-kernels | 91.2 |" in text  # generic table, bytes not shown
    assert "| 1234 |" in text and "Model: steps" in text
    assert "| model | ok | 3 |" in text


def test_plot_reads_the_older_layout(suite_module):
    plot = suite_module("plot")
    results = json.loads((ROOT / "benchmarks" / "results" / "bench_all_h200_2026-11-29.json").read_text())
    text = plot.summary(results)
    assert "| silu | 32768×14336 | 104% / 102% |" in text  # "swiglu" then
    assert "1,048,576" in text


# ----------------------------------------------------------------------------------------------------------
# The suite, end to end on the CPU


def _plain_env():
    """The environment without the test harness's backend settings: the scripts pick their own paths."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_KERNELS_BACKEND")}


def test_suite_smoke_on_cpu(lk, tmp_path, suite_module):
    """bench_all.py --device cpu --quick: every section's code runs (tiny shapes, PyTorch path), the JSON holds
    every section, the host section covers the public entry points, and plot.py reads the JSON."""
    env = _plain_env()
    out = tmp_path / "smoke"
    done = subprocess.run(
        [sys.executable, str(SUITE / "bench_all.py"), "--device", "cpu", "--quick", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "smoke.json").read_text())
    statuses = {name: s["status"] for name, s in results["sections"].items()}
    bench_all = suite_module("bench_all")
    assert list(statuses) == list(bench_all.SECTIONS)
    for name, status in statuses.items():
        if name == "model":
            assert status.startswith("skipped"), status
        elif name == "rms_norm":
            assert status == "ok" or status.startswith("skipped"), status
        else:
            assert status == "ok", (name, status)
    host = results["host"]["rows"]
    assert not [row for row in host if "error" in row and row["variant"] != "peer"]  # the peer's Triton needs a GPU
    entries = {row["entry"] for row in host}
    expected = {
        "silu_mul",
        "gelu_mul",
        "LigerSiLUMulFunction.apply",
        "LigerGELUMulFunction.apply",
        "LigerSwiGLUMLP",
        "LigerTiledSwiGLUMLP",
        "liger_rotary_pos_emb",
        "liger_fused_linear_cross_entropy",
    }
    expected |= {f'gated_mul("{name}")' for name in lk.activations.REGISTRY}
    expected |= {"rms_norm", "LigerRMSNorm"} if hasattr(lk, "rms_norm") else set()
    assert expected <= entries
    for row in host:
        assert row["fwd_us"] > 0 and (row["mode"] == "inference") == ("fwd_bwd_us" not in row), row
    assert {row["variant"] for row in host} >= {"ours", "eager"}
    assert {row["op"] for row in results["activations"]} == set(lk.activations.REGISTRY)
    assert {row["variant"] for row in results["host"]["back_to_back"]} >= {"ours", "eager"}
    b2b = results["host"]["back_to_back"]
    assert all(row["bwd_step_ms"] > 0 and math.isfinite(row["bwd_node_ms"]) for row in b2b), b2b
    assert results["mlp"] and results["rotary"] and results["flce"]
    text = suite_module("plot").summary(results)
    assert "| `silu_mul` |" in text and "| ceilings | ok |" in text


def test_bench_all_model_section_gets_the_budget_left(suite_module, monkeypatch, tmp_path):
    """bench_model.run(budget_s, ...) gets what --budget-s leaves, at most --model-budget-s; with too little left
    it is skipped, and a failing section is recorded, not raised."""
    bench_all = suite_module("bench_all")
    calls = []
    fake = types.ModuleType("bench_model")
    fake.run = lambda budget_s, **kwargs: calls.append((budget_s, kwargs)) or {"tokens_per_s": 1.0}
    monkeypatch.setitem(sys.modules, "bench_model", fake)
    monkeypatch.setitem(bench_all._PATHS, "json", tmp_path / "run.json")
    args = bench_all.parse_args(["--out", "unused", "--device", "cpu", "--budget-s", "1000", "--model-budget-s", "300"])
    results = {"sections": {}}
    now = bench_all.time.perf_counter()
    bench_all.run_section("model", args, results, now, args.budget_s)
    assert results["model"] == {"tokens_per_s": 1.0} and results["sections"]["model"]["status"] == "ok"
    assert calls == [(300.0, {"device": "cpu", "quick": False, "out_path": tmp_path / "run_model.json"})]
    bench_all.run_section("model", args, results, now - 800, args.budget_s)  # 800 s gone: 185 s left
    assert calls[-1][0] == pytest.approx(185.0, abs=1.0)
    bench_all.run_section("model", args, results, now - 990, args.budget_s)
    assert len(calls) == 2 and results["sections"]["model"]["status"].startswith("skipped")
    bench_all.run_section("flce", args, results, now - 2000, args.budget_s)
    assert results["sections"]["flce"]["status"].startswith("skipped")
    fake.run = lambda budget_s, **kwargs: 1 / 0
    bench_all.run_section("model", args, results, now, args.budget_s)
    assert results["sections"]["model"]["status"].startswith("failed: ZeroDivisionError")


def test_bench_all_calls_the_section_modules_as_they_are():
    """The run(...) of each section module takes the arguments bench_all.py passes (read from the sources, so
    that no module is imported here)."""
    wanted = {
        "bench_model": {"budget_s", "device", "quick", "out_path"},
        "bench_rms_norm": {"copy_bytes_per_s"},
        "bench_rotary": {"copy_bytes_per_s", "device", "shape"},
        "bench_flce": {"copy_bytes_per_s", "device"},
        "bench_host": {"copy_bytes_per_s", "device", "quick"},
        "bench_mlp": {"seqs", "device", "hidden"},
        "bench_activations": {"copy_bytes_per_s", "sweep", "shapes", "device"},
    }
    for name, arguments in wanted.items():
        path = SUITE / f"{name}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        run = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run")
        assert arguments <= {a.arg for a in run.args.args + run.args.kwonlyargs}, name


def test_bench_all_output_paths(suite_module):
    bench_all = suite_module("bench_all")
    assert bench_all.output_paths(ROOT / "r" / "h200_v2.1") == (
        ROOT / "r" / "h200_v2.1.json",
        ROOT / "r" / "h200_v2.1.png",
    )
    assert bench_all.output_paths(ROOT / "r" / "x.json") == (ROOT / "r" / "x.json", ROOT / "r" / "x.png")


def test_sass_count_reads_kernel_signatures(lk):
    """scripts/sass_count.py types each kernel argument from its name and fills every constexpr for every
    registry activation (--dry-run: no compile; the sm_90 compiles run offline with the plain command)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sass_count.py"), "--dry-run"],
        check=False,
        capture_output=True,
        text=True,
        env=_plain_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    phases = [line for line in lines if not line.startswith(" ")]
    assert [p.split(":")[0] for p in phases] == ["forward", "backward"]
    for phase in phases:
        assert "'gate_ptr': '*bf16'" in phase and "'n_cols': 'i64'" in phase and "'BLOCK': 'constexpr'" in phase
        assert "'gate_multiplier': 'fp32'" in phase
    for name in lk.activations.REGISTRY:
        assert len([line for line in lines if line.startswith(f"  {name}: ")]) == 2, name
    assert sum("ACTIVATION_AND_GRAD=" in line and "STORE_OUT=False" in line for line in lines) == len(
        lk.activations.REGISTRY
    )


def test_mlp_shapes_table_judges_the_targets(suite_module):
    """plot.py's table of bench_mlp.run_shapes: tiled over fused against each shape's time and memory targets."""
    plot = suite_module("plot")

    def row(hidden, impl, ms, peak_gib, time_target, memory_target):
        return dict(hidden=hidden, intermediate=4 * hidden, seq=8192, impl=impl, ms=ms, peak_bytes=peak_gib * 2**30,
                    time_target=time_target, memory_target=memory_target, auto_shards=4)  # fmt: skip

    rows = [
        row(1024, "fused", 1.0, 1.0, 1.3, "fused"),
        row(1024, "tiled", 1.2, 0.5, 1.3, "fused"),
        row(2048, "fused", 1.0, 1.0, 1.25, 0.5),
        row(2048, "tiled", 1.3, 1.0, 1.25, 0.5),
        row(4096, "fused", 1.0, 1.0, 1.25, "below fused"),
        row(4096, "tiled", 1.0, 1.0, 1.25, "below fused"),
    ]
    text = "\n".join(plot._mlp_shapes_table({"mlp_shapes": rows}))
    assert "| 1.200× | ≤1.3× (met), ≤ fused (met) |" in text
    assert "| 1.300× | ≤1.25× (missed), ≤0.5 GiB (missed) |" in text
    assert "| 1.000× | ≤1.25× (met), < fused (missed) |" in text


def test_implied_max_tokens_draws_the_line_through_the_two_longest(suite_module):
    """Where the peak moves between lengths (the 32-layer model's does between 32k and 64k), only the longest
    points follow the largest S's memory: the line goes through the last two, and says which."""
    bench_model = suite_module("bench_model")
    gib = bench_model.GIB
    points = [(32768, 17 * gib), (65536, 23 * gib), (131072, 45 * gib)]
    implied = bench_model.implied_max_tokens(points, 140 * gib, 15 * gib, 4096)
    slope = 22 * gib / 65536
    assert implied["points"] == [65536, 131072] and implied["kib_per_token"] == pytest.approx(slope / 1024)
    assert implied["max_S"] == int((125 * gib - (23 * gib - slope * 65536)) / slope) // 4096 * 4096
    one = bench_model.implied_max_tokens(points[:1], 140 * gib, 15 * gib, 4096)
    assert one["points"] == [32768] and one["method"].startswith("one point")


def test_bench_model_interleaves_the_timed_steps(suite_module):
    """At one length every variant runs its warm-up and first step, then one step per variant and round in
    alternating order; a row's time is the median of its steps and its memory their maximum. A failing round
    is recorded without replacing the row's figures."""
    bench_model = suite_module("bench_model")
    bench = bench_model.Bench("cpu", quick=True, budget_s=1e6)
    bench.result = {"p": {"rows": []}}
    calls, ms = [], iter([10, 20, 11, 21, 12, 22, 13, 23, 30, 40])

    def attempt(model, phase, variant, seq, warmup, timed, free=True):
        calls.append((variant, seq, warmup, timed, free))
        if variant == "b" and seq == 2 and warmup == 0:
            return {"model": phase, "variant": variant, "S": seq, "status": "oom", "error": "x"}
        t = next(ms)
        bench.times.setdefault((phase, variant), []).append((seq, t / 1e3))
        row = {"model": phase, "variant": variant, "S": seq, "status": "ok", "steps": warmup + timed}
        return dict(row, warmup=warmup, ms=t, ms_steps=[t], extra_bytes=t, extra_gib=t, tokens_per_s=0)

    bench.attempt = attempt
    rows = bench.fixed_lengths(torch.nn.Linear(1, 1), "p", [1, 2], ["a", "b"])
    assert calls[:6] == [("a", 1, 1, 1, False), ("b", 1, 1, 1, False), ("b", 1, 0, 1, False), ("a", 1, 0, 1, False),
                         ("a", 1, 0, 1, True), ("b", 1, 0, 1, True)]  # fmt: skip
    a1, b1, a2, b2 = rows
    assert (a1["ms_steps"], a1["ms"], a1["extra_bytes"], a1["steps"]) == ([10, 21, 12], 12, 21, 4)
    assert (b1["ms_steps"], b1["ms"], b1["extra_bytes"], b1["steps"]) == ([20, 11, 22], 20, 22, 4)
    assert a2["ms_steps"] == [13, 30, 40] and b2["ms_steps"] == [23] and len(b2["failed_rounds"]) == 2
    assert bench.times[("p", "a")] == [(1, 0.012), (2, 0.030)]


def test_bench_model_searches_from_earlier_rows(suite_module, monkeypatch):
    """--search-from: only the 4-layer search runs, from an earlier run's fits and step times (here the quick
    model's simulated out-of-memory above 300 tokens: the search doubles from the seeded fit, then bisects)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # The variants register the package's attention under its default name, which another copy of the package
    # (the tests' build) may hold already: each registry without it for this test, restored after.
    for interface in (AttentionInterface, AttentionMaskInterface):
        mapping = {k: v for k, v in interface._global_mapping.items() if k != "liger_sdpa"}
        monkeypatch.setattr(interface, "_global_mapping", mapping)
    bench_model = suite_module("bench_model")
    row = {"model": "4layer", "variant": "ours_untiled", "status": "ok", "ms": 5.0}
    seed = {"4layer": {"rows": [dict(row, S=128), dict(row, S=256), dict(row, variant="vanilla", S=64)]}}
    result = bench_model.run(60.0, device="cpu", quick=True, variants=["ours_untiled"], search_from=[seed])
    search = result["4layer"]["search"]
    assert list(search) == ["ours_untiled"] and "verify" not in result
    assert (search["ours_untiled"]["max_S"], search["ours_untiled"]["oom_at"]) == (288, 304)
    assert search["ours_untiled"]["complete"] and search["ours_untiled"]["attempts"][0]["S"] == 512
    assert [r["S"] for r in result["4layer"]["seeded_rows"]] == [128, 256]


def _searched(bench_model, limits, usable, seeds, step=4096, cap=1 << 20):
    """Bench.search over stubbed steps: variant v fits up to limits[v] tokens and its peak is
    1 GiB + S * 64 KiB (what the rows and fits report); ``usable``: the bytes a step can get, or None."""
    gib = bench_model.GIB
    bench = bench_model.Bench("cpu", quick=False, budget_s=1e9)
    bench.result = {"4layer": {}}
    bench.usable_bytes = lambda: usable

    def attempt(model, phase, variant, seq, warmup, timed):
        if seq > limits[variant]:
            return {"variant": variant, "S": seq, "status": "oom"}
        peak = gib + seq * 65536
        return {"variant": variant, "S": seq, "status": "ok", "extra_bytes": peak, "extra_gib": peak / gib}

    bench.attempt = attempt
    rows = [{"variant": v, "S": s, "status": "ok", "extra_gib": 1 + s * 65536 / gib} for v in limits for s in seeds]
    return bench.search(None, "4layer", rows, list(limits), 16384, step, cap)


def test_bench_model_search_follows_the_memory_line(suite_module):
    """With peaks for two fits and the memory a step can get, the search tries the largest S the line allows
    and the step above it; a line that is off costs at most two tries over doubling and bisecting, and every
    search ends with the largest fit and the smallest length out of memory one step apart."""
    bench_model = suite_module("bench_model")
    gib, step = bench_model.GIB, 4096
    usable = 1 * gib + 700_000 * 65536  # the line allows 700,000 tokens: 696,320 on the grid
    seeds = (65536, 131072)

    exact = _searched(bench_model, {"a": 696_320}, usable, seeds)["a"]
    assert [t["S"] for t in exact["attempts"]] == [262144, 524288, 696320, 700416]
    assert [t["guided"] for t in exact["attempts"]] == [False, False, True, True]
    assert (exact["max_S"], exact["oom_at"], exact["complete"]) == (696320, 700416, True)
    assert exact["peaks_gib"]["696320"] == pytest.approx(1 + 696320 * 65536 / gib)

    # several variants at once, the line exact for "a", over and under for the others
    limits = {"a": 696_320, "over": 487_424, "under": 901_120, "just above the seeds": 135_168}
    guided = _searched(bench_model, limits, usable, seeds)
    plain = _searched(bench_model, limits, None, seeds)
    for variant, limit in limits.items():
        for result in (guided[variant], plain[variant]):
            assert (result["max_S"], result["oom_at"], result["complete"]) == (limit, limit + step, True), result
            tried = [t["S"] for t in result["attempts"]]
            assert len(set(tried)) == len(tried)
        assert len(guided[variant]["attempts"]) <= len(plain[variant]["attempts"]) + 2
        assert sum(t["guided"] for t in guided[variant]["attempts"]) <= 2
        assert not any(t["guided"] for t in plain[variant]["attempts"])
    assert len(guided["a"]["attempts"]) < len(plain["a"]["attempts"]) - 3

    # the line says the largest fit is the limit: the step above it, not a doubling
    at_limit = _searched(bench_model, {"a": 696_320}, usable, (131072, 696_320))["a"]
    assert [t["S"] for t in at_limit["attempts"]] == [700416]
    # a variant that fits everything stops at the cap
    capped = _searched(bench_model, {"a": 1 << 30}, 1000 * gib, seeds)["a"]
    assert (capped["max_S"], capped["at_cap"]) == (1 << 20, True)
    assert max(t["S"] for t in capped["attempts"]) == 1 << 20


def test_bench_model_confirms_from_an_earlier_run(tmp_path):
    """bench_model.py --quick --no-confirm runs the 32-layer phase's lengths without the step at the implied
    largest S; --confirm-from then runs that step alone, at 97% of the earlier run's implied S (a CPU run has
    no memory figures, so the test writes one in)."""
    first, second = tmp_path / "lengths.json", tmp_path / "confirm.json"
    command = [sys.executable, str(SUITE / "bench_model.py"), "--device", "cpu", "--quick"]
    run = dict(check=False, capture_output=True, text=True, env=_plain_env(), cwd=ROOT, timeout=300)
    done = subprocess.run([*command, "--only", "32layer", "--no-confirm", "--out", str(first)], **run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    earlier = json.loads(first.read_text())
    phase = earlier["32layer"]
    assert "confirm" not in phase and "4layer" not in earlier
    ran = {(r["variant"], r["S"]) for r in phase["rows"]}
    assert {("ours", s) for s in (128, 256, 384)} <= ran
    phase["implied"]["ours"] = {"method": "two points", "points": [256, 384], "max_S": 336}
    first.write_text(json.dumps(earlier))
    done = subprocess.run([*command, "--confirm-from", str(first), "--out", str(second)], **run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    confirm = json.loads(second.read_text())["32layer"]
    assert confirm["rows"] == [] and confirm["implied"]["ours"]["max_S"] == 336
    assert [(r["variant"], r["S"], r["status"]) for r in confirm["confirm"]] == [("ours", 320, "ok")]
