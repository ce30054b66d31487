"""FSDP2 (fully_shard) on 2 CPU gloo ranks with tiled MLPs: gradient and weight parity with an untiled
single-process run on the global batch (fp32, max abs error <= 1e-6)."""

import pytest

from dist_workers import engine_cases, fsdp2_stale_compute_params
from harness import launch

CASES = {
    "llama, each decoder layer + root": {"model": "llama", "wrap": "layers"},
    "llama, each MLP + root": {"model": "llama", "wrap": "mlp"},
    "llama, root only": {"model": "llama", "wrap": "root"},
    "llama, reshard_after_forward=False": {"model": "llama", "wrap": "layers", "reshard": False},
    "llama, accumulation without gradient sync": {"model": "llama", "wrap": "layers", "micro_batches": 2},
    "llama, embeddings and norms frozen": {"model": "llama", "wrap": "layers", "freeze": True},
    # the frozen weight saved for the tiled backward's version check across FSDP2's reshard and all-gather
    "llama, each MLP's up_proj frozen": {"model": "llama", "wrap": "layers", "freeze": ["up_proj"]},
    "llama, fused loss (causal_lm_loss), layers and lm_head sharded": {"model": "llama_fused_loss", "wrap": "layers"},
    "llama, decoder layers tiled (tile_decoder_layers), each layer + root": {
        "model": "llama",
        "wrap": "layers",
        "tile_layers": True,
    },
    "gated MLP stack, each MLP + root": {"model": "mlps", "wrap": "mlp"},
    "gated MLP stack, each projection + each MLP + root (runs untiled)": {"model": "mlps", "wrap": "projections"},
    "gated MLP stack, accumulation": {"model": "mlps", "wrap": "mlp", "micro_batches": 2},
}


@pytest.fixture(scope="module")
def fsdp2_results(variant_root, tmp_path_factory):
    """Every case of CASES in one pair of ranks (starting them costs more than a case): per rank, {case: result}."""
    cases = {name: {"engine": "fsdp2", **options} for name, options in CASES.items()}
    return launch(engine_cases, 2, variant_root, {"cases": cases}, tmp_path_factory.mktemp("fsdp2"), timeout_s=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_matches_untiled_reference(fsdp2_results, case):
    for results in fsdp2_results:
        result = results[case]
        assert "error" not in result, result.get("error")
        assert result["missing"] == [], result
        assert result["grad_diff"] <= 1e-6, result
        assert result["weight_diff"] <= 1e-6, result
        # the tiled layers' case: both layers of each of the rank's forwards (its own and none of the reference's)
        assert result["tiled_calls"] == (2 if CASES[case].get("tile_layers") else 0), result
        assert result["layer_calls"] == result["tiled_calls"], result  # every layer call counted ran tiled


def test_fsdp2_stale_compute_params_raise(variant_root, tmp_path):
    for result in launch(fsdp2_stale_compute_params, 2, variant_root, {}, tmp_path):
        assert "its gradient would be lost" in result["error"]
