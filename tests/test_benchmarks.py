"""The `kernels benchmark` scripts run and verify, at small shapes on the CPU (the GPU runs the real ones)."""

import importlib.util
import inspect

import pytest
import torch
from kernels.benchmark import Benchmark

from conftest import ROOT

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
    workloads = [name[len("benchmark_"):] for name in dir(small) if name.startswith("benchmark_")]
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
