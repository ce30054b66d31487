"""The tiled layers combined with what training code combines them with: each case equals the plain
transformers module in float64 (or gives a clear error). Single process; the distributed cases are in
test_tiled_distributed.py."""

import copy
import types

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from harness import INTERPRETED, backend

HIDDEN, INTERMEDIATE, SEQ = 32, 80, 96  # 3 automatic shards


def llama_mlp(bias=False):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="silu", mlp_bias=bias)
    return LlamaMLP(config).double()


def bind(layer_cls, host):
    host.forward = types.MethodType(layer_cls.forward, host)
    return host


def tiled_and_plain(lk, host, layer="LigerTiledSwiGLUMLP"):
    return bind(getattr(lk, layer), copy.deepcopy(host)), copy.deepcopy(host)


def grads_of(module, x, d_out, extra=()):
    """(out, d_x, grads of every trainable parameter, grads of ``extra``)."""
    x = x.detach().requires_grad_()
    out = module(x)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [x, *params, *extra], d_out, allow_unused=True)
    return [out, *grads]


def assert_same(got, want, tolerance=1e-12):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"item {i}: a gradient is None on one side only"
        if g is not None:
            assert (g - w).abs().max().item() < tolerance, f"item {i}: {(g - w).abs().max().item():.3e}"


def inputs():
    torch.manual_seed(1)
    return torch.randn(2, SEQ, HIDDEN, dtype=torch.float64), torch.randn(2, SEQ, HIDDEN, dtype=torch.float64)


class LowRank(nn.Module):
    """W + B A: a LoRA written as a parametrization (minLoRA's recipe)."""

    def __init__(self, out_features, in_features, rank=4):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features, dtype=torch.float64) * 0.1)
        self.B = nn.Parameter(torch.randn(out_features, rank, dtype=torch.float64) * 0.1)

    def forward(self, weight):
        return weight + self.B @ self.A


@pytest.mark.parametrize("kind", ["lora", "weight_norm", "orthogonal"])
def test_parametrized_projections(lk, kind):
    """Gradients reach the parametrization's own parameters, as in the plain module."""
    from torch.nn.utils import parametrizations, parametrize

    host = llama_mlp()
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(host, name)
        if kind == "lora":
            parametrize.register_parametrization(proj, "weight", LowRank(*proj.weight.shape))
        elif kind == "weight_norm":
            parametrizations.weight_norm(proj)
        elif name == "gate_proj":
            parametrizations.orthogonal(proj)
    tiled, plain = tiled_and_plain(lk, host)
    x, d_out = inputs()
    got, want = grads_of(tiled, x, d_out), grads_of(plain, x, d_out)
    assert all(g is not None for g in got)
    assert_same(got, want)


def test_functional_call_fast_weights(lk):
    """MAML's inner step: substituted (non-leaf) weights get their gradients, and the input gradient uses them."""
    host = llama_mlp()
    tiled, plain = tiled_and_plain(lk, host)
    x, d_out = inputs()
    results = []
    for module in (tiled, plain):
        base = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
        fast = {n: p * 0.5 + 0.01 for n, p in base.items()}  # different from the module's own weights
        leaf = x.detach().requires_grad_()
        out = torch.func.functional_call(module, fast, (leaf,))
        results.append([out, *torch.autograd.grad(out, [leaf, *base.values()], d_out)])
    assert_same(*results)


def test_stacked_ensemble_with_vmap(lk):
    """torch.func.stack_module_state + vmap(functional_call): per-member outputs and gradients."""
    members = [llama_mlp() for _ in range(3)]
    for i, m in enumerate(members):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 + 0.1 * i)
    x, _ = inputs()
    results = []
    for tiled in (True, False):
        modules = [bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(m)) if tiled else copy.deepcopy(m) for m in members]
        params, buffers = torch.func.stack_module_state(modules)
        skeleton = copy.deepcopy(modules[0]).to("meta")

        def loss(p, b, x_, skeleton=skeleton):
            return (torch.func.functional_call(skeleton, (p, b), (x_,)) ** 2).sum()

        grads, value = torch.func.vmap(torch.func.grad_and_value(loss, argnums=0), in_dims=(0, 0, None))(
            params, buffers, x
        )
        results.append([grads[n] for n in sorted(grads)] + [value])
    assert_same(*results)


def test_per_sample_gradients(lk):
    """Opacus' recipe: vmap(grad(functional_call)) over the batch."""
    host = llama_mlp()
    x, d_out = inputs()
    results = []
    for module in tiled_and_plain(lk, host):
        params = {n: p.detach() for n, p in module.named_parameters()}

        def loss(p, sample, d, module=module):
            return (torch.func.functional_call(module, p, (sample.unsqueeze(0),)) * d).sum()

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, d_out)
        results.append([grads[n] for n in sorted(grads)])
    assert_same(*results)


@pytest.mark.parametrize("hook", ["full_backward_hook", "full_backward_pre_hook"])
def test_backward_hooks_on_projections_fire_as_in_the_plain_module(lk, hook):
    """Gradient monitors, per-layer clipping: the hooks see what they see in the plain module, once per backward,
    and what they return (here: gradients scaled by 0.5) is used."""
    host = llama_mlp()
    x, d_out = inputs()
    results = []
    for module in tiled_and_plain(lk, host):
        seen = []

        def record(mod, *grads, seen=seen):  # (grad_input, grad_output) or (grad_output,): records grad_output
            seen.append([g.clone() for g in grads[-1] if g is not None])
            return tuple(None if g is None else g * 0.5 for g in grads[0])

        getattr(module.gate_proj, f"register_{hook}")(record)
        results.append((grads_of(module, x, d_out), seen))
    (got, seen_tiled), (want, seen_plain) = results
    assert len(seen_tiled) == len(seen_plain) == 1
    assert_same(seen_tiled[0], seen_plain[0])
    assert_same(got, want)


def test_forward_hooks_on_projections_keep_the_gradients_exact(lk):
    """A forward hook that changes a projection's output (activation steering): the call runs untiled, so the
    hook fires once, as in the plain module, and the gradients are exact."""
    host = llama_mlp()
    x, d_out = inputs()
    results = []
    for module in tiled_and_plain(lk, host):
        module.up_proj.register_forward_hook(lambda mod, args, out: out * 1.5 + 0.25)
        results.append(grads_of(module, x, d_out))
    assert_same(*results)


def test_peft_lora_on_the_projections(lk):
    """peft's LoRA (its own Linear wrappers) on gate/up/down: every gradient, the adapters' included."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = llama_mlp()

    holder = inject_adapter_in_model(config, Holder()).double()
    tiled, plain = tiled_and_plain(lk, holder.mlp)
    x, d_out = inputs()
    got, want = grads_of(tiled, x, d_out), grads_of(plain, x, d_out)
    assert len(want) > 2 and all(g is not None for g in got)
    assert_same(got, want)


@pytest.mark.parametrize("case", ["cpu_offload", "disk_offload"])
def test_accelerate_offload(lk, tmp_path, case):
    """accelerate's offload hooks keep the weights on the meta device between calls and load them in their own
    forward: the tiled layer calls the projections (no fast path on meta weights) and equals the plain module."""
    import accelerate

    host = llama_mlp()
    x, _ = inputs()
    outs, modules = [], tiled_and_plain(lk, host)
    for module in modules:
        if case == "cpu_offload":
            accelerate.cpu_offload(module, execution_device=torch.device("cpu"))
        else:
            accelerate.disk_offload(module, str(tmp_path / str(len(outs))), execution_device=torch.device("cpu"))
        assert module.gate_proj.weight.is_meta
        with torch.no_grad():
            outs.append(module(x))
    assert torch.isfinite(outs[0]).all()
    assert_same([outs[0]], [outs[1]])
    # Training through offloaded weights: the plain module silently drops their gradients; the tiled one says so.
    with pytest.raises(RuntimeError, match="liger-kernels apply_tiled_mlp: .*gradient would be lost"):
        modules[0](x.requires_grad_()).sum().backward()


def test_compiled_tiled_layer_with_lora_dropout_is_exact(lk):
    """torch.compile around a tiled layer whose projections carry dropout (peft LoRA with lora_dropout): the
    tiled call runs outside the compiled graph, so the recompute replays the masks the forward drew. The
    compiled run equals the eager run with the same seed, outputs and gradients."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["gate_proj", "up_proj"], init_lora_weights=False
    )

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = llama_mlp()

    holder = inject_adapter_in_model(config, Holder()).double().train()
    tiled = bind(lk.LigerTiledSwiGLUMLP, holder.mlp)
    x, d_out = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(tiled, backend="inductor")
    results = []
    for module in (tiled, compiled):
        torch.manual_seed(7)
        results.append(grads_of(module, x, d_out))
    assert_same(*results)


@pytest.mark.parametrize("name", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_meta_tensors(lk, name, dtype):
    """Shape propagation on the meta device (deferred init, memory planning) through forward and backward, also
    with the Triton backend forced (a meta tensor has no data for a kernel)."""
    with torch.device("meta"):
        host = llama_mlp().to("meta", dtype)
        x = torch.empty(2, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
    for layer in ("LigerTiledSwiGLUMLP", "LigerSwiGLUMLP"):
        module = bind(getattr(lk, layer), copy.deepcopy(host))
        with backend(name):
            out = module(x)
            assert out.shape == (2, SEQ, HIDDEN) and out.is_meta
            out.sum().backward()
        assert x.grad.shape == x.shape and module.gate_proj.weight.grad.is_meta
        x.grad = None


@pytest.mark.parametrize("layer", ["LigerTiledSwiGLUMLP", "LigerSwiGLUMLP"])
def test_export(lk, layer, tmp_path):
    """torch.export of a kernelized module: the program holds only aten ops (no per-build op namespace), so it
    saves and loads where the package is not loaded, and it equals the plain module."""
    host = llama_mlp()
    module, plain = tiled_and_plain(lk, host, layer)
    x, _ = inputs()
    program = torch.export.export(module, (x,))
    assert "liger" not in str(program.graph)
    path = tmp_path / "mlp.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path)
    assert_same([loaded.module()(x)], [plain(x)])


def test_direct_function_call_with_automatic_shards(lk):
    host = llama_mlp()
    x, d_out = inputs()
    x = x.requires_grad_()
    params = list(host.parameters())
    out = lk.LigerTiledMLPFunction.apply(lambda m, s: m(s), host, x, None, [], None, *params)
    got = [out, *torch.autograd.grad(out, [x, *params], d_out)]
    want = grads_of(host, x, d_out)
    assert_same(got, want)


def test_automatic_shard_count_is_capped(lk):
    """H = 2 and S = 100,000 would be 50,000 shards of 2 tokens: capped, and still exact."""
    calls = []
    module = nn.Linear(2, 2).double()

    def counting(mlp, shard):
        calls.append(shard.shape[-2])
        return mlp(shard)

    x = torch.randn(100_000, 2, dtype=torch.float64)
    out = lk.apply_tiled_mlp(counting, module, x)
    assert len(calls) <= 100 and sum(calls) == 100_000
    assert (out - module(x)).abs().max().item() < 1e-12


# ----------------------------------------------------------------------------------------------------------
# Hosts the layers must reproduce or refuse.


def test_host_with_activation_sparsity_is_refused(lk):
    """Gemma3n's first layers sparsify the gate before the activation: a GeGLU layer would drop that."""
    from transformers import Gemma3nTextConfig
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    config = Gemma3nTextConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2, activation_sparsity_pattern=[0.95, 0.0]
    )
    for layer in ("LigerGEGLUMLP", "LigerTiledGEGLUMLP"):
        host = bind(getattr(lk, layer), Gemma3nTextMLP(config, layer_idx=0))
        with pytest.raises(
            ValueError, match="liger-kernels .*Gemma3nTextMLP cannot be served: .*if self.activation_sparsity"
        ):
            host(torch.randn(2, 5, HIDDEN))


def test_host_whose_forward_differs_is_refused(lk):
    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    for layer in ("LigerSwiGLUMLP", "LigerTiledSwiGLUMLP"):
        host = bind(getattr(lk, layer), ScaledMLP(config))
        with pytest.raises(ValueError, match="ScaledMLP cannot be served: its forward"):
            host(torch.randn(2, 5, HIDDEN))


SETTINGS = [{}, {"tile": True}, {"tile": False}, {"num_shards": 2}, {"tile": True, "compile": True}, {"compile": True}]


@pytest.mark.parametrize("seq", [5, SEQ])  # one automatic shard; three
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("layer", ["LigerTiledSwiGLUMLP", "LigerTiledGEGLUMLP"])
def test_a_refused_host_fails_before_anything_runs(lk, layer, setting, seq, monkeypatch):
    """A tiled layer's refused host raises the layer's ValueError before a projection runs or the module is
    walked: on the plain call (fn's own call) and wherever the call may tile (the layer math's ``tiled_check``,
    asked first), under torch.compile too."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    host_class, config = (
        (LlamaMLP, LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE))
        if layer == "LigerTiledSwiGLUMLP"
        else (GemmaMLP, GemmaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE))
    )

    class ScaledMLP(host_class):
        def forward(self, x):
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    module = ScaledMLP(config)
    setting = dict(setting)
    compiled = setting.pop("compile", False)
    for name, value in setting.items():
        setattr(module, name, value)
    ran = []
    for projection in (module.gate_proj, module.up_proj, module.down_proj):
        projection.register_forward_pre_hook(lambda *args: ran.append(args))
    walked = []
    structure = lk._tiling.structure
    monkeypatch.setattr(lk._tiling, "structure", lambda m: walked.append(m) or structure(m))
    host = bind(getattr(lk, layer), module)
    call = torch.compile(host, backend="eager") if compiled else host
    with pytest.raises(ValueError, match="ScaledMLP cannot be served: its forward"):
        call(torch.randn(2, seq, HIDDEN, requires_grad=True))
    assert ran == [] and walked == []


def test_the_tiled_check_reads_no_parameter(lk):
    """The refusal the tiled MLP asks for first reads no parameter of a served host: inside DeepSpeed's forward,
    reading a partitioned ZeRO-3 weight gathers it (a collective) and registers it with the running module."""

    class Reads(dict):
        def __getitem__(self, key):
            read.append(key)
            return super().__getitem__(key)

    read = []
    module = llama_mlp()
    for child in module.children():
        child._parameters = Reads(child._parameters)
    module._parameters = Reads(module._parameters)
    lk.gated_mlp.swiglu_mlp.tiled_check(module)
    assert read == []
    lk.gated_mlp.swiglu_mlp.tiled_fast_path(module)
    assert read  # (the fast path's declaration does read the weights: the dict counts reads)


@pytest.mark.parametrize("layer", ["LigerSwiGLUMLP", "LigerTiledSwiGLUMLP"])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_phi3_fused_gate_up_host(lk, layer, name):
    """Phi-3's gate_up_proj (one projection, chunked): served, equal to the plain module."""
    if name == "triton" and not INTERPRETED:
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    torch.manual_seed(0)
    config = Phi3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="silu")
    dtype = torch.float64 if name == "torch" else torch.float32
    host = Phi3MLP(config).to(dtype)
    module, plain = bind(getattr(lk, layer), copy.deepcopy(host)), copy.deepcopy(host)
    x, d_out = (t.to(dtype) for t in inputs())
    with backend(name):
        got = grads_of(module, x, d_out)
    want = grads_of(plain, x, d_out)
    assert_same(got, want, 1e-12 if dtype == torch.float64 else 1e-4)


# ----------------------------------------------------------------------------------------------------------
# State carried from call to call, and what the host's own modules do.


@pytest.mark.parametrize("layer", ["LigerSwiGLUMLP", "LigerTiledSwiGLUMLP"])
def test_hooks_on_the_activation_module_fire_as_in_the_plain_module(lk, layer):
    """A hook on the host's act_fn (reading, ablating or steering neurons) sees the activation called once and
    its change is kept: the layer runs the host's own forward then."""
    host = llama_mlp()
    x, d_out = inputs()
    results = []
    for module in (bind(getattr(lk, layer), copy.deepcopy(host)), copy.deepcopy(host)):
        calls = []
        module.act_fn.register_forward_hook(lambda mod, args, out, calls=calls: calls.append(1) or out * 0.5)
        results.append((grads_of(module, x, d_out), len(calls)))
    (got, got_calls), (want, want_calls) = results
    assert got_calls == want_calls == 1  # grads_of calls the module once
    assert_same(got, want)


@pytest.mark.parametrize("layer", ["LigerSwiGLUMLP", "LigerTiledSwiGLUMLP"])
def test_a_global_module_hook_steering_the_activation_applies_as_in_the_plain_module(lk, layer):
    """A global forward hook (``register_module_forward_hook``) fires on every module call, the host's act_fn
    included: where it changes the activation's output, the layer's result and gradients are the host's."""
    host = llama_mlp()
    x, d_out = inputs()

    def steer(module, args, out):
        return out * 0.5 if isinstance(module, type(host.act_fn)) else None

    handle = torch.nn.modules.module.register_module_forward_hook(steer)
    try:
        got = grads_of(bind(getattr(lk, layer), copy.deepcopy(host)), x, d_out)
        want = grads_of(copy.deepcopy(host), x, d_out)
    finally:
        handle.remove()
    assert_same(got, want)


@pytest.mark.parametrize("changed", ["trainable", "frozen"])
@pytest.mark.parametrize("path", ["fast", "generic", "apply_tiled_mlp", "LigerTiledMLPFunction"])
def test_a_weight_changed_in_place_before_backward_raises_as_in_the_plain_module(lk, path, changed):
    """An optimizer or EMA step between forward and backward, on a trainable weight or a frozen one (a base weight
    under LoRA, merged or requantized): autograd's own error, as for the plain module's saved weights, never
    gradients silently computed with the new values (a frozen one was read anew: d_x off by 280%)."""
    host = llama_mlp()
    module = host if path in ("apply_tiled_mlp", "LigerTiledMLPFunction") else bind(lk.LigerTiledSwiGLUMLP, host)
    module.num_shards = 3
    if path == "generic":
        module.up_proj.weight.requires_grad_(False)  # a frozen up_proj, not delivered: the generic recompute
    if changed == "frozen":
        module.gate_proj.weight.requires_grad_(False)
    x, _ = inputs()
    forward = lambda m, shard: type(m).forward(m, shard)  # noqa: E731
    if path == "apply_tiled_mlp":
        out = lk.apply_tiled_mlp(forward, module, x.requires_grad_(), num_shards=3)
    elif path == "LigerTiledMLPFunction":  # called directly, it saves the parameters itself
        trainable = [p for p in module.parameters() if p.requires_grad]
        out = lk.tiled_mlp.LigerTiledMLPFunction.apply(forward, module, x.requires_grad_(), 3, [], None, *trainable)
    else:
        out = module(x.requires_grad_())
    with torch.no_grad():
        module.gate_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("kind", ["parametrizations.spectral_norm", "spectral_norm hook", "stateful hook"])
def test_state_that_changes_per_call_runs_untiled(lk, kind):
    """spectral_norm's power iteration (buffers), or a forward hook that counts its calls: a tiled call would run
    them once per shard and again in the recompute, so the layer runs untiled and equals the plain module, its
    final state included."""
    from torch.nn.utils import parametrizations, spectral_norm

    host = llama_mlp()
    x, d_out = inputs()
    results = []
    for module in (bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(host)), copy.deepcopy(host)):
        module.num_shards = 3
        torch.manual_seed(3)  # the power iteration's starting vectors
        if kind == "parametrizations.spectral_norm":
            parametrizations.spectral_norm(module.gate_proj)
        elif kind == "spectral_norm hook":
            spectral_norm(module.gate_proj)
        else:
            calls = []
            module.up_proj.register_forward_hook(
                lambda mod, args, out, calls=calls: calls.append(1) or out * len(calls)
            )
        torch.manual_seed(3)
        results.append([*grads_of(module, x, d_out), *module.buffers()])
    assert_same(*results)


def test_a_decorated_or_ambiguous_host_forward_is_refused(lk):
    import functools

    def doubled(forward):
        @functools.wraps(forward)
        def wrapper(self, x):
            return 2 * forward(self, x)

        return wrapper

    class DecoratedMLP(LlamaMLP):
        @doubled
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class TwoActivations(LlamaMLP):
        def __init__(self, config):
            super().__init__(config)
            self.activation_fn = nn.GELU(approximate="tanh")  # what the forward calls; act_fn stays SiLU

        def forward(self, x):
            return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    with pytest.raises(ValueError, match="DecoratedMLP cannot be served: its forward holds the decorator `@doubled`"):
        bind(lk.LigerSwiGLUMLP, DecoratedMLP(config))(torch.randn(2, 5, HIDDEN))
    with pytest.raises(ValueError, match="TwoActivations cannot be served: it uses tanh-approximated GELU"):
        bind(lk.LigerSwiGLUMLP, TwoActivations(config))(torch.randn(2, 5, HIDDEN))
    two = TwoActivations(config).double()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    assert_same([bind(lk.LigerGEGLUMLP, copy.deepcopy(two))(x)], [two(x)])


@pytest.mark.parametrize("layer", ["LigerTiledSwiGLUMLP", "LigerLinear", "apply_tiled_mlp"])
def test_a_gradient_hook_on_a_parameter_runs_once(lk, layer, monkeypatch):
    """A hook on a weight's gradient (``p.register_hook``; here one that scales it by 3): the generic recompute's
    per-shard autograd.grad ran it once per shard and again on the sum (3 shards: 4 calls, the gradient 3x the
    plain module's), so those calls run untiled; the gated layers write the gradients themselves, run it once,
    and still tile."""
    x, d_out = inputs()
    torch.manual_seed(0)
    if layer == "LigerTiledSwiGLUMLP":
        host = llama_mlp()
    elif layer == "LigerLinear":
        host = nn.Linear(HIDDEN, INTERMEDIATE).double()
        d_out = torch.randn(2, SEQ, INTERMEDIATE, dtype=torch.float64)
    else:
        host = nn.Sequential(nn.Linear(HIDDEN, INTERMEDIATE), nn.GELU(), nn.Linear(INTERMEDIATE, HIDDEN)).double()
    tiled, plain = copy.deepcopy(host), copy.deepcopy(host)
    counts = []
    for module in (tiled, plain):
        count = []
        weight = next(p for name, p in module.named_parameters() if name.endswith("weight"))
        weight.register_hook(lambda g, count=count: count.append(1) or g * 3)
        counts.append(count)
    if layer == "apply_tiled_mlp":
        call = lambda x: lk.apply_tiled_mlp(lambda m, s: m(s), tiled, x, num_shards=3)  # noqa: E731
    else:
        call = bind(getattr(lk, layer), tiled)
        tiled.num_shards = 3
    calls = []
    inner = lk.LigerTiledMLPFunction.apply
    monkeypatch.setattr(lk.LigerTiledMLPFunction, "apply", lambda *a: calls.append(1) or inner(*a))
    x_ = x.detach().requires_grad_()
    got = torch.autograd.grad(call(x_), [x_, *tiled.parameters()], d_out)
    want = grads_of(plain, x, d_out)[1:]
    assert len(counts[0]) == len(counts[1]) == 1
    assert_same(list(got), want)
    assert len(calls) == (1 if layer == "LigerTiledSwiGLUMLP" else 0)
