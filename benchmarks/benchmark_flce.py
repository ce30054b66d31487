"""`kernels benchmark` workloads for the fused linear cross-entropy of a Llama-3-8B head (hidden 4096, vocabulary
128256, bf16, 8192 tokens): the loss without materializing the logits, and the loss with its gradients.

Self-contained: the runner sets `self.kernel` (the loaded liger-kernels) and `self.device`. The forward
workload runs without grad and verifies the mean loss. The forward + backward workload computes the input and
weight gradients of the summed loss, so that each row's input gradient, ``(softmax(x W^T) - onehot(t)) W``,
is of the size of W's entries (scaled to stay below 2, where one bf16 ulp is within the runner's atol of
1e-2); it verifies the input gradient. The references compute the logits in fp32.
"""

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


class FusedLinearCrossEntropy(Benchmark):
    seed = 0
    tokens, hidden, vocab, dtype = 8192, 4096, 128256, torch.bfloat16

    def setup(self):
        self.x = (0.25 * torch.randn(self.tokens, self.hidden, device=self.device)).to(self.dtype).requires_grad_()
        self.weight = (0.1 * torch.randn(self.vocab, self.hidden, device=self.device)).to(self.dtype).requires_grad_()
        self.target = torch.randint(0, self.vocab, (self.tokens,), device=self.device)
        self.target[::16] = -100  # ignored rows, as padding gives

    def _reference_loss(self, x, reduction):
        return F.cross_entropy(x.float() @ self.weight.detach().float().T, self.target, reduction=reduction)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.liger_fused_linear_cross_entropy(self.x, self.weight, self.target)

    def verify_forward(self):
        with torch.no_grad():
            return self._reference_loss(self.x, "mean")

    def benchmark_forward_backward(self):
        loss = self.kernel.liger_fused_linear_cross_entropy(self.x, self.weight, self.target, reduction="sum")
        self.out = torch.autograd.grad(loss, (self.x, self.weight))[0]  # a training step needs both

    def verify_forward_backward(self):
        x = self.x.detach().requires_grad_()
        return torch.autograd.grad(self._reference_loss(x, "sum"), x)[0].to(self.dtype)
