"""Error report (`make ops`): load liger-kernels the way users do and run its ops and layers on the CPU.

Builds the variant tree into a temporary directory, loads it with ``kernels.get_local_kernel``, then runs
SwiGLU, GeGLU (tanh and exact) and the two kernelize layers, and prints each one's relative error against a
float64 PyTorch reference, output and gradients. On the CPU the default backend is the PyTorch path; the
Triton kernels also run, through Triton's interpreter.
"""

import copy
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import kernels  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import GemmaConfig, LlamaConfig  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaMLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import build_variants  # noqa: E402


def rel_err(out, ref):
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm()).item()


def op_errors(apply, reference, dtype):
    a = torch.randn(4, 256, 512).to(dtype).requires_grad_()
    b = torch.randn(4, 256, 512).to(dtype).requires_grad_()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    out, ref = apply(a, b), reference(a64, b64)
    d_out = torch.randn(out.shape).to(dtype)
    got = torch.autograd.grad(out, (a, b), d_out)
    want = torch.autograd.grad(ref, (a64, b64), d_out.double())
    return [rel_err(out, ref), rel_err(got[0], want[0]), rel_err(got[1], want[1])]


def layer_errors(layer, host):
    host64 = host.double()
    fused = copy.deepcopy(host64).float()
    fused.forward = types.MethodType(layer.forward, fused)  # what kernelize does
    x = torch.randn(4, 256, host64.hidden_size, dtype=torch.float64, requires_grad=True)
    x32 = x.detach().float().requires_grad_()
    out, ref = fused(x32), host64(x)
    d_out = torch.randn_like(ref)
    out.backward(d_out.float())
    ref.backward(d_out)
    weight = "gate_proj"
    return [
        rel_err(out, ref),
        rel_err(x32.grad, x.grad),
        rel_err(getattr(fused, weight).weight.grad, getattr(host64, weight).weight.grad),
    ]


def main():
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        build_variants.build(Path(root) / "build")
        lk = kernels.get_local_kernel(Path(root))
        print(f"loaded {lk.__name__} through kernels {kernels.__version__} (torch {torch.__version__})\n")
        ops = [
            ("SwiGLU", lk.silu_mul, lambda a, b: F.silu(a) * b),
            ("GeGLU tanh", lambda a, b: lk.gelu_mul(a, b, "tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b),
            ("GeGLU exact", lambda a, b: lk.gelu_mul(a, b, "none"), lambda a, b: F.gelu(a) * b),
        ]
        print("relative error against float64, ||out - ref|| / ||ref||, shape [4, 256, 512]")
        print(f"{'op':<12} {'backend':<20} {'dtype':<9} {'out':>9} {'d_a':>9} {'d_b':>9}")
        for backend, label in (("auto", "pytorch (default)"), ("triton", "triton (interpreted)")):
            if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
                continue
            os.environ["LIGER_KERNELS_BACKEND"] = backend
            for name, apply, reference in ops:
                for dtype in (torch.float32, torch.bfloat16):
                    errors = op_errors(apply, reference, dtype)
                    print(f"{name:<12} {label:<20} {str(dtype)[6:]:<9} " + " ".join(f"{e:9.2e}" for e in errors))
        os.environ["LIGER_KERNELS_BACKEND"] = "auto"
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("(Triton's interpreter casts fp32 to bf16 by truncation; compiled Triton rounds to nearest,")
            print(" which halves the interpreted bf16 errors above: see tests/test_gpu.py on a GPU.)")

        print("\nlayers bound to transformers MLPs (fp32) against the same MLP in float64")
        print(f"{'layer':<15} {'host':<24} {'out':>9} {'d_x':>9} {'d_gate_w':>9}")
        hosts = [
            ("LigerSwiGLUMLP", "LlamaMLP (silu)", LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=688))),
            ("LigerGEGLUMLP", "GemmaMLP (gelu tanh)", GemmaMLP(GemmaConfig(hidden_size=256, intermediate_size=688))),
            (
                "LigerGEGLUMLP",
                "LlamaMLP (exact gelu)",
                LlamaMLP(LlamaConfig(hidden_size=256, intermediate_size=688, hidden_act="gelu")),
            ),
        ]
        for layer, label, host in hosts:
            errors = layer_errors(getattr(lk, layer), host)
            print(f"{layer:<15} {label:<24} " + " ".join(f"{e:9.2e}" for e in errors))


if __name__ == "__main__":
    main()
