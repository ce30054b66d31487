"""DeepSpeed ZeRO-2/ZeRO-3 on 2 CPU gloo ranks with tiled MLPs: gradient and weight parity with an untiled
single-process run on the global batch (fp32, max abs error <= 1e-6)."""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the README's test command")

from dist_workers import zero_cases  # noqa: E402
from harness import launch  # noqa: E402

# DeepSpeed JIT-builds a small communication op on first use; keep it inside the environment.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

CASES = {
    "ZeRO-3, gated MLP stack": {"model": "mlps", "stage": 3},
    "ZeRO-3, reduce_bucket_size 4096": {"model": "mlps", "stage": 3, "bucket": 4096},
    "ZeRO-3, gradient_accumulation_steps 2": {"model": "mlps", "stage": 3, "accumulation": 2},
    "ZeRO-3, zero.Init": {"model": "mlps", "stage": 3, "zero_init": True},
    "ZeRO-3, S not divisible by the shards": {"model": "mlps", "stage": 3, "seq": 250},
    "ZeRO-3, llama, embeddings and norms frozen": {"model": "llama", "stage": 3, "freeze": "embed_norm"},
    "ZeRO-3, llama, everything outside the MLPs frozen": {"model": "llama", "stage": 3, "freeze": "non_mlp"},
    "ZeRO-3, llama, fused loss (causal_lm_loss)": {"model": "llama_fused_loss", "stage": 3},
    "ZeRO-3, ranks with different shard counts (1 and 8)": {"model": "mlps", "stage": 3, "seq_by_rank": [48, 512]},
    "ZeRO-3, MLPs as ZeRO-3 leaves, different shard counts": {
        "model": "mlps",
        "stage": 3,
        "leaf": True,
        "seq_by_rank": [128, 512],
    },
    "ZeRO-3, a user's fn, MLPs as ZeRO-3 leaves": {"model": "mlps_generic", "stage": 3, "leaf": True},
    "ZeRO-3, one MLP called twice": {"model": "mlps", "stage": 3, "share": "twice"},
    "ZeRO-3, MLPs called outside the engine's forward (the call gathers)": {"model": "mlps", "stage": 3, "direct": 1},
    "ZeRO-3, a gate weight tied between two MLPs, small reduce buckets": {
        "model": "mlps",
        "stage": 3,
        "share": "tied",
        "bucket": 1000,
    },
    "ZeRO-3, a user's fn gathered per shard": {"model": "mlps_generic", "stage": 3, "seq": 250},
    "ZeRO-3, llama, MLPs as ZeRO-3 leaves": {"model": "llama", "stage": 3, "leaf": True},
    # ZeRO-3 hooks every submodule to gather its weights, and a tiled layer whose submodules have hooks runs its
    # own forward (README Limits): correct, untiled (no tiled call). ZeRO-2 hooks no module: tiled.
    "ZeRO-3, llama with its decoder layers tiled (tile_decoder_layers)": {
        "model": "llama",
        "stage": 3,
        "tile_layers": True,
    },
    "ZeRO-2, llama with its decoder layers tiled (tile_decoder_layers)": {
        "model": "llama",
        "stage": 2,
        "tile_layers": True,
    },
    "ZeRO-2, gated MLP stack": {"model": "mlps", "stage": 2},
    "ZeRO-2, llama, reduce_bucket_size 4096": {"model": "llama", "stage": 2, "bucket": 4096},
}


COLLECTIVE_CASES = {  # name: (options, whether the count may grow with the shards)
    "the package's layer: gathered once around the call by DeepSpeed": ({"model": "mlps"}, False),
    "the package's layer called outside the engine's forward: gathered once by the call": (
        {"model": "mlps", "direct": 1},
        False,
    ),
    "a user's fn, MLP a ZeRO-3 leaf: gathered once by DeepSpeed": ({"model": "mlps_generic", "leaf": True}, False),
    "a user's fn on hooked projections: gathered per shard": ({"model": "mlps_generic"}, True),
}


COUNTED = "collectives counted: "


@pytest.fixture(scope="module")
def zero_results(variant_root, tmp_path_factory):
    """Every case of CASES and COLLECTIVE_CASES, run in one pair of ranks (starting DeepSpeed costs more than a
    case): per rank, {case: result}. ZeRO-2 first: a ZeRO-3 engine replaces F.linear for the rest of its
    process, which a ZeRO-2 process never sees."""
    counted = {
        COUNTED + name: {**options, "stage": 3, "count_collectives": True}
        for name, (options, _) in COLLECTIVE_CASES.items()
    }
    cases = dict(sorted({**CASES, **counted}.items(), key=lambda item: item[1]["stage"]))
    return launch(zero_cases, 2, variant_root, {"cases": cases}, tmp_path_factory.mktemp("zero"), timeout_s=900)


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero_matches_untiled_reference(zero_results, case):
    errors = [f"rank {rank}: {results[case]['error']}" for rank, results in enumerate(zero_results)
              if "error" in results[case]]  # fmt: skip
    assert not errors, "\n".join(errors)
    for results in zero_results:
        result = results[case]
        assert result["partitioned"], "stage3_param_persistence_threshold 0: every weight must be partitioned"
        assert result["missing"] == [], result
        assert result["grad_diff"] <= 1e-6, result
        assert result["weight_diff"] <= 1e-6, result
        # one forward of two layers on each rank: tiled under ZeRO-2, each layer's own forward under ZeRO-3
        layers = 2 if CASES[case].get("tile_layers") else 0
        assert result["layer_calls"] == layers, result
        assert result["tiled_calls"] == (layers if CASES[case]["stage"] == 2 else 0), result


@pytest.mark.parametrize("case", sorted(COLLECTIVE_CASES))
def test_no_collective_runs_per_shard(zero_results, case):
    """The collectives in a ZeRO-3 forward and backward of three tiled MLPs, at 2 and at 8 shards: the same
    count, so none runs inside the shard loop, and no tiled call agrees its shard count across ranks. The
    per-shard layout (a user's fn calling projections that DeepSpeed hooks) is the control: there the count
    grows with the shards, so the counter sees them, and the shard count is agreed."""
    grows = COLLECTIVE_CASES[case][1]
    for result in (results[COUNTED + case] for results in zero_results):
        assert "error" not in result, result["error"]
        (engine_two, c10d_two), (engine_eight, c10d_eight) = result["collectives"]["128"], result["collectives"]["512"]
        assert engine_two > 0, result  # the engine's own gathers and reductions are counted
        if grows:
            assert engine_eight > engine_two and result["agreed"] > 0, result
        else:  # and no all-reduce of the shard count
            assert (engine_eight, c10d_eight) == (engine_two, c10d_two) and result["agreed"] == 0, result
