"""Train a tiny Llama under DDP on CPU ranks (gloo) with liger-kernels' tiled SwiGLU MLPs, the way a user
would: build the variant tree, load it through ``kernels``, tag LlamaMLP as "SwiGLUMLP" and kernelize it with
``LigerTiledSwiGLUMLP``. Every step is checked against an untiled single-process copy of the model that sees
the global batch: the largest gradient difference is printed with the loss.

    python scripts/train_ddp.py [--ranks 2] [--steps 4] [--seq 256] [--dtype float32]

The model and the loop are in tools/ddp_demo.py (the tests run the same loop with more options).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


def main():
    import logging

    logging.getLogger("kernels").setLevel(logging.ERROR)  # transformers tags RMSNorm etc. that we do not map
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()

    import kernels

    import build_variants
    from ddp_demo import HIDDEN, launch, run_rank

    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out_dir:
        build_variants.build(Path(root) / "build")
        lk = kernels.get_local_kernel(Path(root))
        # The automatic count keeps shards at least 2048 tokens long (MIN_SHARD_TOKENS): this demo's sequences are
        # shorter, so it asks for its shards through the tiled layers' host attribute, as a user would.
        shards = min(max(2, -(-args.seq // HIDDEN)), 100)
        print(f"liger-kernels loaded through kernels {kernels.__version__} as {lk.__name__}")
        print(
            f"tiny Llama (2 layers, hidden {HIDDEN}), LlamaMLP kernelized to LigerTiledSwiGLUMLP, loss through "
            "lk.causal_lm_loss (no logits), "
            f"{args.ranks} gloo ranks, seq {args.seq} per rank -> {shards} shards per MLP, {args.dtype}"
        )
        options = {"steps": args.steps, "seq": args.seq, "dtype": args.dtype, "fused_loss": True, "num_shards": shards}
        logs = launch(run_rank, args.ranks, root, options, out_dir)
        print(f"{'step':>4} {'loss':>10} {'max |grad - untiled grad|':>27} {'max |weight diff|':>18} ranks agree")
        for entry in logs[0]:
            worst = max(log[entry["step"]]["grad_diff"] for log in logs)
            agree = all(log[entry["step"]]["ranks_agree"] for log in logs)
            print(f"{entry['step']:>4} {entry['loss']:>10.5f} {worst:>27.3e} {entry['weight_diff']:>18.3e} {agree}")


if __name__ == "__main__":
    main()
