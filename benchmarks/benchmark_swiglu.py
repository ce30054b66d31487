"""`kernels benchmark` workloads for the fused SwiGLU, at Llama-3-8B's intermediate width (bf16).

Self-contained: the runner sets `self.kernel` (the loaded liger-kernels) and `self.device`. Inputs are scaled
so that bf16 outputs stay below 2, where one bf16 ulp is within the runner's atol of 1e-2; the references
compute in fp32 and round once, as the kernels do.
"""

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


class SwiGLU(Benchmark):
    seed = 0
    rows, cols, dtype = 32768, 14336, torch.bfloat16

    def setup(self):
        shape = (self.rows, self.cols)
        self.a = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype).requires_grad_()
        self.b = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype).requires_grad_()
        self.d_out = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype)
        self.c = self.kernel.silu_mul(self.a, self.b)

    def benchmark_forward(self):
        self.out = self.kernel.silu_mul(self.a, self.b)

    def verify_forward(self):
        return (F.silu(self.a.float()) * self.b.float()).to(self.dtype)

    def benchmark_backward(self):
        self.out = torch.autograd.grad(self.c, self.a, self.d_out, retain_graph=True)[0]

    def verify_backward(self):
        a, b, d_out = self.a.detach().float(), self.b.float(), self.d_out.float()
        s = torch.sigmoid(a)
        return (d_out * b * s * (1 + a * (1 - s))).to(self.dtype)


class SwiGLUSmall(SwiGLU):
    rows, cols = 8192, 4096
