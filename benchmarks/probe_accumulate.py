"""Extra memory and time of the ways to add a bf16 GEMM into an fp32 sum (Llama-8B weight shape), on the GPU."""

import torch
from triton.testing import do_bench

a = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)  # d_gate^T: [I, rows]
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # x rows: [rows, H]
total = torch.zeros(14336, 4096, device="cuda")
ways = {
    "addmm(out_dtype, out=total)": lambda: torch.addmm(total, a, b, out_dtype=torch.float32, out=total),
    "total.add_(a @ b)": lambda: total.add_(a @ b),
    "total.add_(mm(out_dtype))": lambda: total.add_(torch.mm(a, b, out_dtype=torch.float32)),
}
for name, way in ways.items():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    way()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    print(f"{name:<30} extra {extra / 2**20:8.1f} MiB  {do_bench(way, warmup=10, rep=100):.3f} ms")
