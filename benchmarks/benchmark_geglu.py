"""`kernels benchmark` workloads for the fused GeGLU, tanh and exact forms, at Llama-3-8B's intermediate
width (bf16). Self-contained; inputs scaled so bf16 outputs stay within the runner's atol per ulp."""

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


class GeGLU(Benchmark):
    seed = 0
    rows, cols, dtype = 32768, 14336, torch.bfloat16

    def setup(self):
        shape = (self.rows, self.cols)
        self.a = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype).requires_grad_()
        self.b = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype).requires_grad_()
        self.d_out = (0.25 * torch.randn(shape, device=self.device)).to(self.dtype)
        self.c = {form: self.kernel.gelu_mul(self.a, self.b, form) for form in ("tanh", "none")}

    def _forward_ref(self, form):
        return (F.gelu(self.a.float(), approximate=form) * self.b.float()).to(self.dtype)

    def _backward_ref(self, form):
        a = self.a.detach().float().requires_grad_()
        out = F.gelu(a, approximate=form) * self.b.float()
        return torch.autograd.grad(out, a, self.d_out.float())[0].to(self.dtype)

    def benchmark_tanh_forward(self):
        self.out = self.kernel.gelu_mul(self.a, self.b, "tanh")

    def verify_tanh_forward(self):
        return self._forward_ref("tanh")

    def benchmark_tanh_backward(self):
        self.out = torch.autograd.grad(self.c["tanh"], self.a, self.d_out, retain_graph=True)[0]

    def verify_tanh_backward(self):
        return self._backward_ref("tanh")

    def benchmark_exact_forward(self):
        self.out = self.kernel.gelu_mul(self.a, self.b, "none")

    def verify_exact_forward(self):
        return self._forward_ref("none")

    def benchmark_exact_backward(self):
        self.out = torch.autograd.grad(self.c["none"], self.a, self.d_out, retain_graph=True)[0]

    def verify_exact_backward(self):
        return self._backward_ref("none")


class GeGLUSmall(GeGLU):
    rows, cols = 8192, 4096
