"""SASS instructions per element of the gated kernels, for every activation in the registry, compiled offline for
an sm_90 GPU (no GPU needed: Triton's bundled ptxas and cuobjdump do the work). The elementwise kernels are
instruction-bound once the math is heavy (exact GELU); this counts what each activation costs.

    python scripts/sass_count.py [--block 2048] [--warps 4] [--strided] [--dry-run]

The kernels' signatures are read from their parameters: ``*_ptr`` arguments are bf16 pointers,
``*_multiplier`` arguments fp32 scalars, the other runtime arguments (sizes, strides) i64, as the launchers in
_gated.py pass them; the constexprs get the values below (an unknown one is an error, so that a new
parameter is noticed here).
"""

import argparse
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def package():
    """The package from this checkout's torch-ext/."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
    import liger_kernels

    return liger_kernels


def kernels(lk) -> dict:
    return {"forward": lk._gated._gated_forward_kernel, "backward": lk._gated._gated_backward_kernel}


def parameters(kernel):
    """(name, is_constexpr) of a @triton.jit function's parameters, from its Python signature."""
    for param in inspect.signature(kernel.fn).parameters.values():
        yield param.name, param.annotation in (triton.language.constexpr, "constexpr", "tl.constexpr")


def signature(kernel) -> dict:
    """{argument: Triton type} for ``kernel``'s parameters, in order."""
    sig = {}
    for name, is_constexpr in parameters(kernel):
        if is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name.endswith("_multiplier"):
            sig[name] = "fp32"
        else:
            sig[name] = "i64"
    return sig


def constexprs(kernel, activation, block: int, one_row: bool) -> dict:
    """The constexpr values of one launch: the activation's math, the launch shape, no extra output."""
    known = {
        "ACTIVATION": activation.triton_value,
        "ACTIVATION_AND_GRAD": activation.triton_value_and_grad,
        "STORE_OUT": False,
        "ONE_ROW": one_row,
        "BLOCK": block,
    }
    names = [name for name, is_constexpr in parameters(kernel) if is_constexpr]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{kernel.fn.__name__}: no value for the constexpr(s) {unknown}; add them to constexprs()")
    return {n: known[n] for n in names}


def sass_instructions(kernel, activation, block, warps, one_row) -> int:
    sig = signature(kernel)
    names = list(sig)
    # What the launcher specializes at run time: 16-byte aligned pointers, sizes and strides divisible by 16.
    aligned = [i for i, n in enumerate(names) if sig[n] in ("*bf16", "i64")]
    source = ASTSource(
        fn=kernel,
        signature=sig,
        constexprs=constexprs(kernel, activation, block, one_row),
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
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
    parser.add_argument("--block", type=int, help="default: _gated.BLOCK")
    parser.add_argument("--warps", type=int, help="default: _gated.NUM_WARPS")
    parser.add_argument("--strided", action="store_true", help="rows through a stride (ONE_ROW=False)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be compiled, compile nothing")
    args = parser.parse_args()
    lk = package()
    args.block, args.warps = args.block or lk._gated.BLOCK, args.warps or lk._gated.NUM_WARPS
    per_thread = args.block // (32 * args.warps)
    if args.dry_run:
        for phase, kernel in kernels(lk).items():
            print(f"{phase}: {signature(kernel)}")
            for name, activation in lk.activations.REGISTRY.items():
                values = constexprs(kernel, activation, args.block, not args.strided)
                print(f"  {name}: " + ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in values.items()))
        return
    print(f"BLOCK {args.block}, {args.warps} warps: {per_thread} elements per thread; SASS instructions per element")
    for name, activation in lk.activations.REGISTRY.items():
        counts = {
            phase: sass_instructions(kernel, activation, args.block, args.warps, not args.strided) / per_thread
            for phase, kernel in kernels(lk).items()
        }
        print(f"  {name:<11} " + "   ".join(f"{phase} {count:5.1f}" for phase, count in counts.items()))


if __name__ == "__main__":
    main()
