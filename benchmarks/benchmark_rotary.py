"""`kernels benchmark` workloads for rotary position embedding at Llama-3-8B's attention shapes (32 query heads,
8 key/value heads, head dim 128, bf16), forward and backward, with q and k as transformers' attention hands
them over: [B, H, S, D] views of [B, S, H, D] projections; cos and sin [B, S, D].

Self-contained: the runner sets `self.kernel` (the loaded liger-kernels) and `self.device`. The runner compares
one tensor, so each workload verifies the queries' result (the keys go through the same kernel). Inputs are
scaled so that outputs stay below 2, where one bf16 ulp is within the runner's atol of 1e-2; the references
compute in fp32 and round once, as the kernel does.
"""

import torch
from kernels.benchmark import Benchmark


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(Benchmark):
    seed = 0
    batch, seq, heads, kv_heads, head_dim, dtype = 1, 8192, 32, 8, 128, torch.bfloat16

    def setup(self):
        b, s, d = self.batch, self.seq, self.head_dim
        q = (0.25 * torch.randn(b, s, self.heads, d, device=self.device)).to(self.dtype).requires_grad_()
        k = (0.25 * torch.randn(b, s, self.kv_heads, d, device=self.device)).to(self.dtype).requires_grad_()
        self.q, self.k = q.transpose(1, 2), k.transpose(1, 2)
        inv_freq = 500000.0 ** (-torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d)
        angles = torch.arange(s, device=self.device, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1).expand(b, s, d)
        self.cos, self.sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        self.d_q = (0.25 * torch.randn(self.q.shape, device=self.device)).to(self.dtype)
        self.d_k = (0.25 * torch.randn(self.k.shape, device=self.device)).to(self.dtype)
        self.q_embed, self.k_embed = self.kernel.liger_rotary_pos_emb(self.q, self.k, self.cos, self.sin)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.liger_rotary_pos_emb(self.q, self.k, self.cos, self.sin)[0]

    def verify_forward(self):
        q, cos, sin = self.q.detach().float(), self.cos.float()[:, None], self.sin.float()[:, None]
        return (q * cos + _rotate_half(q) * sin).to(self.dtype)

    def benchmark_backward(self):
        grads = torch.autograd.grad(
            (self.q_embed, self.k_embed), (self.q, self.k), (self.d_q, self.d_k), retain_graph=True
        )
        self.out = grads[0]

    def verify_backward(self):
        q = self.q.detach().float().requires_grad_()
        cos, sin = self.cos.float()[:, None], self.sin.float()[:, None]
        q_embed = q * cos + _rotate_half(q) * sin
        return torch.autograd.grad(q_embed, q, self.d_q.float())[0].to(self.dtype)


class RotaryLong(Rotary):
    seq = 32768
