"""`kernels benchmark` workloads for the Llama-3-8B MLP (hidden 4096, intermediate 14336, bf16), forward and
backward: the fused layer (LigerSwiGLUMLP) and the tiled one (LigerTiledSwiGLUMLP) bound to a plain host
module, as kernelize binds them. Self-contained; each verifies its output against the eager MLP."""

import types

import torch
from kernels.benchmark import Benchmark


class _Host(torch.nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaMLP(Benchmark):
    seed = 0
    seq, hidden, intermediate, dtype = 8192, 4096, 14336, torch.bfloat16

    def setup(self):
        self.host = _Host(self.hidden, self.intermediate).to(self.device, self.dtype)
        self.x = torch.randn(1, self.seq, self.hidden, device=self.device, dtype=self.dtype, requires_grad=True)
        self.d_out = torch.randn(1, self.seq, self.hidden, device=self.device, dtype=self.dtype)

    def _step(self, layer):
        module = self.host
        forward = types.MethodType(getattr(self.kernel.layers, layer).forward, module)
        out = forward(self.x)
        out.backward(self.d_out)
        self.host.zero_grad(set_to_none=True)
        self.x.grad = None
        self.out = out.detach()

    def _reference(self):
        with torch.no_grad():
            return self.host(self.x)

    def benchmark_fused(self):
        self._step("LigerSwiGLUMLP")

    def verify_fused(self):
        return self._reference()

    def benchmark_tiled(self):
        self._step("LigerTiledSwiGLUMLP")

    def verify_tiled(self):
        return self._reference()

    def benchmark_eager(self):
        out = self.host(self.x)
        out.backward(self.d_out)
        self.host.zero_grad(set_to_none=True)
        self.x.grad = None
        self.out = out.detach()


class LlamaMLPLong(LlamaMLP):
    seq = 32768
