"""SASS instructions per element of the gated kernels, compiled offline for an sm_90 GPU (no GPU needed: Triton's
bundled ptxas and cuobjdump do the work). The elementwise kernels are instruction-bound once the math is
heavy (exact GELU); this counts what each activation costs.

    python scripts/sass_count.py [--block 2048] [--warps 4] [--strided]
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
from liger_kernels import _gated, geglu, swiglu  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def signature(backward: bool):
    pointers = ["d_out_ptr", "gate_ptr", "up_ptr", "d_gate_ptr", "d_up_ptr", "out_ptr"] if backward else [
        "gate_ptr", "up_ptr", "out_ptr"]  # fmt: skip
    strides = ["d_out_row_stride", "gate_row_stride", "up_row_stride", "d_gate_row_stride", "d_up_row_stride"]
    strides = strides if backward else ["gate_row_stride", "up_row_stride", "out_row_stride"]
    sig = {p: "*bf16" for p in pointers}
    sig.update({"n_cols": "i64", **{s: "i64" for s in strides}, "gate_multiplier": "fp32", "down_multiplier": "fp32"})
    constexprs = ["ACTIVATION_AND_GRAD", "STORE_OUT"] if backward else ["ACTIVATION"]
    sig.update({c: "constexpr" for c in constexprs + ["ONE_ROW", "BLOCK"]})
    return sig


def sass_instructions(kernel, backward, activation, block, warps, one_row) -> int:
    sig = signature(backward)
    names = list(sig)
    # What the launcher specializes at run time: 16-byte aligned pointers, sizes and strides divisible by 16.
    aligned = [i for i, n in enumerate(names) if sig[n] == "*bf16" or sig[n] == "i64"]
    constexprs = {"ONE_ROW": one_row, "BLOCK": block}
    if backward:
        constexprs.update(ACTIVATION_AND_GRAD=activation.triton_value_and_grad, STORE_OUT=False)
    else:
        constexprs.update(ACTIVATION=activation.triton_value)
    source = ASTSource(
        fn=kernel, signature=sig, constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in aligned}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        listing = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return sum(1 for line in listing.splitlines() if line.strip().startswith("/*") and ";" in line)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", type=int, default=_gated.BLOCK)
    parser.add_argument("--warps", type=int, default=_gated.NUM_WARPS)
    parser.add_argument("--strided", action="store_true", help="rows through a stride (ONE_ROW=False)")
    args = parser.parse_args()
    per_thread = args.block // (32 * args.warps)
    print(f"BLOCK {args.block}, {args.warps} warps: {per_thread} elements per thread; SASS instructions per element")
    for name, activation in (("silu", swiglu.SILU), ("gelu tanh", geglu.GELU_TANH), ("gelu exact", geglu.GELU_ERF)):
        counts = [
            sass_instructions(kernel, backward, activation, args.block, args.warps, not args.strided) / per_thread
            for kernel, backward in ((_gated._gated_forward_kernel, False), (_gated._gated_backward_kernel, True))
        ]
        print(f"  {name:<11} forward {counts[0]:5.1f}   backward {counts[1]:5.1f}")


if __name__ == "__main__":
    main()
