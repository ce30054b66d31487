"""The maintainers' benchmark suite in one run on the GPU. Writes OUT.json after every section (a run cut short
keeps what it measured), then prints plot.py's tables and draws OUT.png when matplotlib is importable
(plot.py redraws both from the JSON on any machine, and merges the JSONs of runs of different sections).

    python benchmarks/suite/bench_all.py --out benchmarks/results/h200_DATE [--budget-s 570]
    python benchmarks/suite/bench_all.py --out /tmp/smoke --device cpu --quick      # smoke test, no GPU

Sections, in this order (``--sections`` picks some; ``--append`` adds them to an existing OUT.json):

  ceilings     copy bandwidth (1 GiB, do_bench) and bf16 GEMM 8192^3: every other section is quoted against
               these (measured even when not asked for, unless OUT.json already has them with --append)
  host         bench_host.py: host cost per call of every public entry point next to eager PyTorch and the
               peer; silu_mul / gelu_mul launched back to back at 8192 x 4096
  activations  bench_activations.py: every registry activation, % of copy (CUDA graphs and do_bench)
  rms_norm     bench_rms_norm.py (CUDA only)
  rotary       bench_rotary.py
  flce         bench_flce.py at --flce-tokens tokens
  mlp          bench_mlp.py: the Llama-8B MLP at --seqs, time and peak memory
  mlp_shapes   bench_mlp.run_shapes: MLP shapes where tiling is a close call, ours and the peer's fused and
               tiled layers against the targets (time over the fused MLP, peak memory)
  model        bench_model.py, given what is left of --budget-s (at most --model-budget-s; skipped under 45 s
               and with --quick, its own smoke test being bench_model.py --device cpu --quick); its progress
               is also written to OUT_model.json as it goes. Run alone, it gets expandable segments.

A section still to start after --budget-s seconds is skipped; each section's status and seconds are in
OUT.json's "sections". One section failing is recorded there and the others still run. On an H200 the
sections before the model take about 8 minutes; to give the model its full budget, run it separately and
merge: ``--sections model --out OUT_B``, then ``plot.py OUT.json OUT_B.json --out MERGED.json``.
"""

import argparse
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

SUITE = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE))
import plot  # noqa: E402
import timing  # noqa: E402

SECTIONS = ("ceilings", "host", "activations", "rms_norm", "rotary", "flce", "mlp", "mlp_shapes", "model")
SEQS = "8192,32768,65536,131072,1048576"
MIN_MODEL_BUDGET_S = 45
QUICK_HOST_CALLS = (5, 1)  # --quick: host calls and warm-up calls in the modules that fix their own


class Absent(Exception):
    """A section whose module is not in this checkout."""


def _module(name):
    """The suite's module ``name``, imported when its section runs (so a section's import failure is its own)."""
    if name not in sys.modules and not (SUITE / f"{name}.py").exists():
        raise Absent(f"benchmarks/suite/{name}.py is not in this checkout")
    return import_module(name)


# Each section: fn(args, results) -> what goes under results[name]. The modules are imported lazily.


def section_ceilings(args, results):
    if args.quick:
        return {
            "copy_bytes_per_s": timing.copy_bytes_per_s(args.device, 2**20),
            "gemm_tflops": timing.gemm_tflops(args.device, 64),
        }
    return {"copy_bytes_per_s": timing.copy_bytes_per_s(args.device), "gemm_tflops": timing.gemm_tflops(args.device)}


def section_host(args, results):
    return _module("bench_host").run(_copy(results), args.device, args.quick)


def section_activations(args, results):
    module = _module("bench_activations")
    shapes = module.QUICK_SHAPES if args.quick else module.SHAPES
    return module.run(_copy(results), args.sweep, shapes, args.device)


def section_rms_norm(args, results):
    module = _module("bench_rms_norm")
    if args.device != "cuda":
        raise Absent("bench_rms_norm runs on CUDA only")
    return module.run(_copy(results))


def section_rotary(args, results):
    module = _module("bench_rotary")
    shape = None
    if args.quick:
        shape = dict(module.HOST_SHAPE, seq=64)
        module.HOST_CALLS, module.HOST_WARMUP = QUICK_HOST_CALLS
    return module.run(_copy(results), args.device, shape)


def section_flce(args, results):
    module = _module("bench_flce")
    if args.quick:
        module.HOST_CALLS, module.HOST_WARMUP = QUICK_HOST_CALLS
        return module.run(_copy(results), *module.QUICK, device=args.device)
    return module.run(_copy(results), n=args.flce_tokens, device=args.device)


def section_mlp(args, results):
    module = _module("bench_mlp")
    if args.quick:
        quick = module.QUICK
        return module.run(
            quick["seqs"], args.device, quick["hidden"], quick["intermediate"], quick["untiled_max_seq"],
            num_shards=quick["num_shards"],
        )  # fmt: skip
    return module.run([int(s) for s in args.seqs.split(",")], args.device)


def section_mlp_shapes(args, results):
    module = _module("bench_mlp")
    if args.quick:
        return module.run_shapes(module.QUICK_SHAPES, args.device, num_shards=module.QUICK["num_shards"])
    return module.run_shapes(module.SHAPES, args.device)


def section_model(args, results, budget_s):
    module = _module("bench_model")
    partial = _PATHS["json"].with_name(_PATHS["json"].stem + "_model.json")  # its own progress, kept if cut short
    return module.run(budget_s, device=args.device, quick=args.quick, out_path=partial)


RUNNERS = {name: globals()[f"section_{name}"] for name in SECTIONS}
_PATHS = {"json": Path("bench_all.json")}  # set by main()


def _copy(results) -> float:
    return results["ceilings"]["copy_bytes_per_s"]


def header(args) -> dict:
    cuda = args.device == "cuda"
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for package in ("triton", "transformers", "kernels", "liger-kernel"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            pass
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": versions,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "sections": {},
    }


def save(results, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=2, default=str))
    os.replace(partial, path)


def run_section(name, args, results, start, budget_s) -> None:
    """Runs one section into ``results`` and records its status; never raises (but on KeyboardInterrupt)."""
    elapsed = time.perf_counter() - start
    t0 = time.perf_counter()
    status = "ok"
    try:
        if name == "model":
            model_budget = min(args.model_budget_s, budget_s - elapsed - 15)
            if model_budget < MIN_MODEL_BUDGET_S and not args.quick:
                raise TimeoutError(f"{max(model_budget, 0):.0f} s left of --budget-s, under {MIN_MODEL_BUDGET_S} s")
            if args.quick:  # its own smoke test takes half a minute: bench_model.py --device cpu --quick
                raise Absent("bench_model is not run with --quick")
            print(f"\n=== model (budget {model_budget:.0f} s)", flush=True)
            results[name] = RUNNERS[name](args, results, model_budget)
        else:
            if elapsed > budget_s:
                raise TimeoutError(f"{elapsed:.0f} s elapsed, past --budget-s {budget_s:.0f}")
            print(f"\n=== {name} ({elapsed:.0f} s elapsed)", flush=True)
            results[name] = RUNNERS[name](args, results)
    except (Absent, TimeoutError) as reason:
        status = f"skipped: {reason}"
    except Exception as error:  # noqa: BLE001 (one section failing must not lose the others)
        traceback.print_exc()
        status = f"failed: {type(error).__name__}: {str(error)[:500]}"
    results["sections"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"=== {name}: {status} ({results['sections'][name]['seconds']} s)", flush=True)
    timing.free(args.device, collect=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="path prefix for OUT.json and OUT.png")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--append", action="store_true", help="add the sections to an existing OUT.json")
    parser.add_argument("--budget-s", type=float, default=570.0, help="no section starts after this many seconds")
    parser.add_argument("--model-budget-s", type=float, default=300.0, help="most seconds given to bench_model")
    parser.add_argument("--seqs", default=SEQS, help="the MLP's sequence lengths")
    parser.add_argument("--flce-tokens", type=int, default=16384, help="tokens of the FLCE head (H 4096, V 128256)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the activations' BLOCK x num_warps")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few calls, torch.compile off: smoke test")
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def output_paths(out: Path):
    """(OUT.json, OUT.png) for a prefix OUT (dots in its name are kept) or for OUT.json itself."""
    if out.suffix == ".json":
        return out, out.with_suffix(".png")
    return out.parent / f"{out.name}.json", out.parent / f"{out.name}.png"


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    wanted = [name for name in SECTIONS if name in args.sections.split(",")]
    if args.device == "cuda" and set(wanted) <= {"ceilings", "model"}:
        # What bench_model.py runs under on its own (less fragmentation at its largest S); read when CUDA starts,
        # so only for a run of the model alone: the other sections' CUDA graphs keep the default allocator.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    timing.suite_settings()
    if args.quick:
        timing.quick_mode()
    path, png = output_paths(args.out)
    _PATHS["json"] = path
    results = json.loads(path.read_text()) if args.append and path.exists() else header(args)
    results.setdefault("sections", {})
    if "ceilings" not in wanted and "ceilings" not in results:
        wanted.insert(0, "ceilings")
    for name in wanted:
        run_section(name, args, results, start, args.budget_s)
        if name == "ceilings" and "ceilings" not in results:
            print("no ceilings: the other sections cannot be quoted; stopping")
            save(results, path)
            return results
        save(results, path)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    save(results, path)
    print(f"\nwrote {path} ({results['wall_s']} s)\n")
    try:  # the JSON is written: a report failing here loses nothing (plot.py redraws it from the JSON)
        print(plot.summary(results))
        plot.plot(results, png)
        print(f"wrote {png}")
    except ImportError as error:
        print(f"(no PNG: {error}; run benchmarks/suite/plot.py on the JSON where matplotlib is installed)")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("(the report failed; the JSON is complete: benchmarks/suite/plot.py reads it)")
    return results


if __name__ == "__main__":
    main()
