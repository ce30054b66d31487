"""The `kernels benchmark` scripts run and verify, at small shapes on the CPU (the GPU runs the real ones)."""

import importlib.util
import inspect

import pytest
import torch
from kernels.benchmark import Benchmark

from harness import ROOT

SCRIPTS = sorted((ROOT / "benchmarks").glob("benchmark*.py"))
SMALL = {"rows": 64, "cols": 96, "seq": 200, "hidden": 32, "intermediate": 48}


def benchmark_classes():
    for script in SCRIPTS:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Benchmark) and cls is not Benchmark and cls.__module__ == script.stem:
                yield pytest.param(cls, id=f"{script.stem}.{cls.__name__}")


def test_scripts_cover_every_op():
    assert {s.stem for s in SCRIPTS} == {"benchmark_swiglu", "benchmark_geglu", "benchmark_mlp"}


@pytest.mark.parametrize("cls", list(benchmark_classes()))
def test_benchmark_workloads_verify(lk, cls):
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
        assert instance.out is not None
        if verify is not None:
            ref = verify()
            assert instance.out.shape == ref.shape and instance.out.dtype == ref.dtype
            assert torch.allclose(instance.out, ref, atol=1e-2), workload


def test_plot_tables_use_issue_5_ratio_definition():
    """benchmarks/plot.py: tiled ÷ the faster untiled MLP of the same S; past 65,536 tokens, ÷ the faster
    untiled 65,536-token MLP times S / 65,536. The tables carry each figure and target."""
    spec = importlib.util.spec_from_file_location("plot", ROOT / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = [
        {"seq": 65536, "impl": "fused", "ms": 100.0, "peak_bytes": 7 * 2**30},
        {"seq": 65536, "impl": "peer fused", "ms": 80.0, "peak_bytes": 7 * 2**30},
        {"seq": 65536, "impl": "tiled", "ms": 96.0, "peak_bytes": 2 * 2**30},
        {"seq": 131072, "impl": "tiled", "ms": 200.0, "peak_bytes": 3 * 2**30},
        {"seq": 8192, "impl": "tiled", "ms": 1.0, "peak_bytes": 0},
    ]
    mlp = {(r["seq"], r["impl"]): r for r in rows}
    assert plot.tiled_ratio(mlp, 65536) == pytest.approx(96.0 / 80.0)
    assert plot.tiled_ratio(mlp, 131072) == pytest.approx(200.0 / (2 * 80.0))
    assert plot.tiled_ratio(mlp, 8192) is None  # no untiled run at that length
    activations = {"copy_bytes_per_s": {"graph": 4e12, "launch": 4e12}, "rows": [
        {"op": "swiglu", "shape": [8192, 4096], "impl": "liger-kernels", "fwd_graph_pct": 97.4, "bwd_graph_pct": 98.6}
    ]}  # fmt: skip
    text = plot.summary({"activations": activations, "mlp": {"gemm_tflops": 700.0, "rows": rows}})
    assert "| swiglu | 8192×4096 | 97% / 99% | – | – | – | ≥80% |" in text
    assert "| 131,072 | – | – | – | – | 200.0 ms, 3.00 GiB | – | 1.250× | ≤1.20×, ≤3.23 GiB |" in text
