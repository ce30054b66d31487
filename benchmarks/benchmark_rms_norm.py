"""`kernels benchmark` workloads for RMSNorm at Llama-3-8B's hidden size (4096, bf16), forward and backward, as
transformers' LlamaRMSNorm computes it: ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``.

Self-contained: the runner sets `self.kernel` (the loaded liger-kernels) and `self.device`. The weight is
scaled so that outputs stay below 2, where one bf16 ulp is within the runner's atol of 1e-2; the references
compute in fp32 and round as LlamaRMSNorm does.
"""

import torch
from kernels.benchmark import Benchmark


class RMSNorm(Benchmark):
    seed = 0
    rows, cols, dtype, eps = 32768, 4096, torch.bfloat16, 1e-6

    def setup(self):
        self.x = torch.randn(self.rows, self.cols, device=self.device).to(self.dtype).requires_grad_()
        self.weight = (0.2 + 0.02 * torch.randn(self.cols, device=self.device)).to(self.dtype).requires_grad_()
        self.d_out = torch.randn(self.rows, self.cols, device=self.device).to(self.dtype)
        self.y = self.kernel.rms_norm(self.x, self.weight, self.eps)

    def _normed(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.rms_norm(self.x, self.weight, self.eps)

    def verify_forward(self):
        normed = self._normed(self.x.detach().float()).to(self.dtype)
        return self.weight.detach() * normed

    def benchmark_backward(self):
        self.out = torch.autograd.grad(self.y, self.x, self.d_out, retain_graph=True)[0]

    def verify_backward(self):
        # LlamaRMSNorm's rounding of the normalized x passes gradients straight through.
        x = self.x.detach().float().requires_grad_()
        y = self.weight.detach().float() * self._normed(x)
        return torch.autograd.grad(y, x, self.d_out.float())[0].to(self.dtype)


class RMSNormSmall(RMSNorm):
    rows = 8192
