"""What the suite's bench_*.py share: the package from this checkout, the ceilings, and five ways to time a call.

- ``graph_ms``: GRAPH_CALLS calls captured in one CUDA graph and replayed: the GPU's own time per call, without
  the host's launch and dispatch cost (what a training step whose host runs ahead sees). CUDA only.
- ``back_to_back_ms``: GRAPH_CALLS calls launched back to back from the host between two CUDA events: the
  host's cost shows wherever it exceeds the GPU's time (what an eager loop sees).
- ``launch_ms``: ``triton.testing.do_bench``, one call per timing with L2 flushed in between.
- ``pass_ms``: one backward pass through a freshly recorded graph, the forward untimed (a training step's).
- ``host_us``: CPU wall time per call of tiny inputs, so the GPU never holds the host back: the host's own
  cost (checks, dispatch, launches).

On the CPU (``--device cpu --quick``, the smoke test of the code) every timing falls back to the wall clock,
and ``graph_ms`` is never called.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GRAPH_CALLS = 20


def package():
    """The package from this checkout's torch-ext/ (the suite measures the sources, not a Hub build)."""
    source = str(ROOT / "torch-ext")
    if source not in sys.path:
        sys.path.insert(0, source)
    import liger_kernels

    return liger_kernels


def suite_settings() -> None:
    """Room for every torch.compile variant: the suite compiles one eager function per op and runs it at several
    shapes, with and without grad; past dynamo's default of 8 recompiles a function would silently run eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # The suite times a backward many times over one retained graph; a compiled backward that donates its saved
    # buffers refuses that (RuntimeError on retain_graph), which cost the RMSNorm section its torch.compile rows.
    torch._functorch.config.donated_buffer = False


def quick_mode() -> None:
    """The smoke test's settings: torch.compile becomes a no-op (inductor's CPU compile takes minutes), so every
    torch.compile variant runs its eager function through the same code path; one CPU thread (tiny ops)."""
    torch._dynamo.config.disable = True
    torch.set_num_threads(1)


def peer(what: str):
    """Import ``what`` ("module:attribute") from the peer liger-kernel, or None with a note. Any error counts:
    a peer built against another transformers can fail on import with more than ImportError."""
    module, _, attribute = what.partition(":")
    try:
        imported = __import__(module, fromlist=[attribute])
        return getattr(imported, attribute)
    except Exception as error:  # noqa: BLE001
        print(f"(peer {what} not usable: {type(error).__name__}: {str(error)[:120]})")
        return None


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free(device, collect: bool = False) -> None:
    """Hands cached device memory back; with ``collect``, after a garbage collection (slow: between sections)."""
    if collect:
        import gc

        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def graph_ms(fn, replays=30, warm_replays=10) -> float:
    """Median GPU time of one ``fn()``, from CUDA-graph replays of GRAPH_CALLS calls. ``fn`` runs on a side
    stream, so autograd's backward (which runs on its forward's stream) is captured too."""
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
    torch.cuda.synchronize()
    return statistics.median(times)


def back_to_back_ms(fn, device, calls=GRAPH_CALLS, repeats=15, warm=3) -> float:
    """Median time per call of ``calls`` calls launched back to back (CUDA events around the batch; on the CPU,
    the smoke test's, the wall clock of a few calls), after ``warm`` calls."""
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        calls, repeats, warm = min(calls, 3), min(repeats, 2), min(warm, 1)
    for _ in range(warm):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times)


def pass_ms(record, backward, device, repeats=7, warm=2) -> float:
    """Median time of ``backward(record())`` with only the backward timed: ``record()``, the forward, makes a fresh
    graph before each pass, as every training step does, and finishes before the timing starts (CUDA events
    around the backward; on the CPU, the smoke test's, the wall clock)."""
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        repeats, warm = min(repeats, 2), min(warm, 1)
    times = []
    for i in range(warm + repeats):
        graph = record()
        sync(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            backward(graph)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            backward(graph)
            elapsed = (time.perf_counter() - began) * 1e3
        if i >= warm:
            times.append(elapsed)
        del graph
    return statistics.median(times)


def launch_ms(fn, device, rep=200, warmup=25) -> float:
    """``do_bench``'s median on the GPU (``warmup`` and ``rep`` in ms); back to back on the CPU."""
    if torch.device(device).type != "cuda":
        return back_to_back_ms(fn, device)
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_us(fns: dict, device, calls=300, warmup=50, repeats=5) -> dict:
    """{name: (host, synced)} for ``fns`` ({name: a call}): medians over ``repeats`` rounds of the CPU wall time
    per call of ``calls`` calls, measured when the last call returns (host) and after the device has finished
    them (synced). synced well above host means the GPU, not the host, set the pace: the host figure then holds
    waiting for a full launch queue. The rounds alternate between the calls (the order reversed every other
    round), because the host's speed drifts by tens of percent over seconds (NOTES.md §23): timed one after
    the other, whichever call ran at the slower moment carried the drift. A call that raises is reported as
    {name: error} and leaves the rounds; the others go on."""
    results, host, synced = {}, {name: [] for name in fns}, {name: [] for name in fns}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            sync(device)  # (an asynchronous error of this call surfaces here, charged to it)
        except Exception as error:  # noqa: BLE001 (one call failing must not lose the others)
            results[name] = error
    names = [name for name in fns if name not in results]
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            if name in results:
                continue
            fn = fns[name]
            try:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                returned = time.perf_counter()
                sync(device)
            except Exception as error:  # noqa: BLE001
                results[name] = error
                try:
                    sync(device)  # its queued work is not the next call's time
                except Exception:  # noqa: BLE001, S110 (a sticky device error: the next call reports it)
                    pass
                continue
            done = time.perf_counter()
            host[name].append((returned - start) / calls * 1e6)
            synced[name].append((done - start) / calls * 1e6)
    for name in names:
        if name not in results:
            results[name] = (statistics.median(host[name]), statistics.median(synced[name]))
    return results


def copy_bytes_per_s(device, nbytes=2**30) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``. On the GPU, do_bench: at 1 GiB
    the launch cost is negligible, while a copy captured in a CUDA graph becomes a memcpy node run by the copy
    engines (about 2.7 TB/s on an H200 against 4.2 for the SMs' copy kernel): every timing, graph or not,
    is quoted against this one ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = launch_ms(lambda: dst.copy_(src), device, rep=300, warmup=50)
    return 2 * nbytes / (ms * 1e-3)


def gemm_tflops(device, n=8192) -> float:
    """bf16 n x n x n GEMM, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = launch_ms(lambda: a @ a, device)
    return 2 * n**3 / (ms * 1e-3) / 1e12
