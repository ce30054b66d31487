"""Layers for kernelize: parity with transformers' MLPs, activation checks, in-place backward, kernelize."""

import copy
import functools
import sys
import types

import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
from transformers import GemmaConfig, LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP

from harness import INTERPRETED, backend, compute_eps, rel_err

HIDDEN, INTERMEDIATE = 64, 160


def llama_mlp(act="silu", bias=False, hidden=HIDDEN, intermediate=INTERMEDIATE):
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act=act, mlp_bias=bias)
    return LlamaMLP(config)


def gemma_mlp():
    return GemmaMLP(GemmaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="gelu_pytorch_tanh"))


HOSTS = {  # host, layer that serves it
    "llama_silu": (llama_mlp, "LigerSwiGLUMLP"),
    "llama_silu_bias": (lambda: llama_mlp(bias=True), "LigerSwiGLUMLP"),
    "gemma_gelu_tanh": (gemma_mlp, "LigerGEGLUMLP"),
    "gelu_exact": (lambda: llama_mlp(act="gelu"), "LigerGEGLUMLP"),
}


ACTIVATIONS = {"llama_silu": "silu", "llama_silu_bias": "silu", "gemma_gelu_tanh": "gelu_tanh", "gelu_exact": "gelu"}


def bind(layer_cls, host):
    """What kernelize does: the layer's forward, bound to the host module."""
    host.forward = types.MethodType(layer_cls.forward, host)
    return host


def run(module, x, d_out):
    x = x.detach().requires_grad_()
    out = module(x)
    grads = torch.autograd.grad(out, [x, *(p for p in module.parameters() if p.requires_grad)], d_out)
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("host_name", sorted(HOSTS))
def test_parity_with_transformers_mlp(lk, host_name, dtype, backend_name):
    """Output, input and weight gradients against the float64 host, no worse than the eager host in the
    same dtype (1.5x, plus fp32 arithmetic slack)."""
    make_host, layer = HOSTS[host_name]
    torch.manual_seed(0)
    host64 = make_host().double()
    eager = copy.deepcopy(host64).to(dtype)
    fused = bind(getattr(lk, layer), copy.deepcopy(host64).to(dtype))
    x = torch.randn(3, 17, HIDDEN, dtype=torch.float64)
    d_out = torch.randn(3, 17, HIDDEN, dtype=torch.float64)
    want = run(host64, x, d_out)
    got_eager = run(eager, x.to(dtype), d_out.to(dtype))
    got_fused = run(fused, x.to(dtype), d_out.to(dtype))
    names = ["out", "x", *[n for n, _ in host64.named_parameters()]]
    flat = lambda r: [r[0], *r[1]]  # noqa: E731
    for name, w, e, f in zip(names, flat(want), flat(got_eager), flat(got_fused)):
        bound = 1.5 * rel_err(e, w) + 4 * compute_eps(dtype)
        assert rel_err(f, w) <= bound, f"{host_name} {name}: {rel_err(f, w):.3e} > {bound:.3e}"


def test_swiglu_layer_refuses_a_non_silu_host(lk):
    host = bind(lk.LigerSwiGLUMLP, llama_mlp(act="gelu"))
    with pytest.raises(
        ValueError,
        match="LigerSwiGLUMLP computes .* act = SiLU, but the host LlamaMLP cannot be served: it uses exact GELU",
    ):
        host(torch.randn(2, HIDDEN))
    host = bind(lk.LigerSwiGLUMLP, llama_mlp(act="relu"))
    with pytest.raises(ValueError, match="LigerSwiGLUMLP computes .*ReLU"):
        host(torch.randn(2, HIDDEN))


@pytest.mark.parametrize("act", ["silu", "relu", "quick_gelu"])
def test_geglu_layer_refuses_a_non_gelu_host(lk, act):
    host = bind(lk.LigerGEGLUMLP, llama_mlp(act=act))
    with pytest.raises(ValueError, match="LigerGEGLUMLP computes .* act = tanh-approximated GELU or exact GELU"):
        host(torch.randn(2, HIDDEN))


class ConfigOnlyHost(torch.nn.Module):
    """A host without act_fn: the activation comes from its config."""

    def __init__(self, **config):
        super().__init__()
        self.config = types.SimpleNamespace(**config)
        self.gate_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)


@pytest.mark.parametrize(
    "config, approximate",
    [({"hidden_act": "gelu"}, "none"), ({"hidden_activation": "gelu_pytorch_tanh"}, "tanh"), ({}, "tanh")],
)
def test_geglu_form_follows_the_host_config(lk, config, approximate):
    host = bind(lk.LigerGEGLUMLP, ConfigOnlyHost(**config))
    x = torch.randn(5, HIDDEN)
    gelu = torch.nn.functional.gelu(host.gate_proj(x).double(), approximate=approximate)
    ref = host.down_proj.weight.double() @ (gelu * host.up_proj(x).double()).T
    assert rel_err(host(x), ref.T) < 1e-5


def test_swiglu_layer_takes_a_host_that_does_not_say(lk):
    host = bind(lk.LigerSwiGLUMLP, ConfigOnlyHost())
    x = torch.randn(5, HIDDEN)
    ref = host.down_proj(torch.nn.functional.silu(host.gate_proj(x)) * host.up_proj(x))
    assert rel_err(host(x), ref) < 1e-5


class HostCallingAMissingActivation(ConfigOnlyHost):
    """A forward that calls ``self.act_fn``, an instance that lacks it but has ``activation_fn``: the config
    names the activation, as for any host whose forward's activation attribute is missing."""

    def __init__(self):
        super().__init__(hidden_act="gelu_pytorch_tanh")
        self.activation_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_a_missing_activation_attribute_defers_to_the_config(lk):
    assert lk.gated_mlp.geglu_mlp.check(HostCallingAMissingActivation())[0].name == "gelu_tanh"
    with pytest.raises(ValueError, match="LigerSwiGLUMLP computes .* it uses tanh-approximated GELU"):
        lk.gated_mlp.swiglu_mlp.check(HostCallingAMissingActivation())


def _call_the_projections_exactly_as_modules(host, case, monkeypatch):
    """Make one projection's module call differ from F.linear with its parameters, as ``case`` says."""
    F = torch.nn.functional
    if case == "hook on down_proj":
        host.down_proj.register_forward_hook(lambda module, args, out: out * 1.5)
    elif case == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: out + 0.25 if isinstance(module, torch.nn.Linear) else None
        )
        del host.act_fn  # a function, not a module: the hook fires on the projections only
        host.act_fn = F.silu
        return handle
    elif case == "compiled up_proj":  # what Module.compile sets; compiled, the call may round otherwise
        host.up_proj._compiled_call_impl = lambda *args: host.up_proj._call_impl(*args) * 0.5
    elif case == "forward on the instance":  # accelerate's offload hooks
        up = host.up_proj
        up.forward = lambda x: F.linear(x, up.weight * 2, up.bias)
    elif case == "pre-hook on gate_proj":
        host.gate_proj.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    elif case == "_call_impl on the instance":  # a wrapper of one module's call (Module.__call__ looks it up there)
        inner = host.up_proj._call_impl
        host.up_proj._call_impl = lambda *args, **kwargs: inner(*args, **kwargs) * 0.5
    elif case == "weight on the instance":  # FSDP1's unsharded views
        weight = host.gate_proj.weight.detach() * 0.5
        del host.gate_proj.weight
        host.gate_proj.weight = weight
    elif case == "weight shadowing the parameter":  # in the instance's dict beside _parameters
        host.gate_proj.weight.requires_grad_(False)  # (the shadow holds no graph to differentiate twice)
        object.__setattr__(host.gate_proj, "weight", host.gate_proj.weight.detach() * 0.5)
    elif case == "weight as a buffer":
        weight = host.gate_proj.weight.detach() * 0.5
        del host.gate_proj.weight
        host.gate_proj.register_buffer("weight", weight)
    elif case == "Linear subclass":
        host.down_proj.__class__ = type(
            "Shifted", (torch.nn.Linear,), {"forward": lambda self, x: x @ self.weight.T + self.bias + 1}
        )
    elif case == "nn.Linear.forward patched":
        monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: F.linear(x, self.weight, self.bias) - 1)
    elif case == "nn.Module.__call__ patched":  # a profiler's wrapper
        call = torch.nn.Module.__call__
        monkeypatch.setattr(torch.nn.Linear, "__call__", lambda self, *args: call(self, *args) * 3)
    elif case == "nn.Module._call_impl patched":
        call_impl = torch.nn.Module._call_impl
        monkeypatch.setattr(torch.nn.Linear, "_call_impl", lambda self, *args, **kw: call_impl(self, *args, **kw) * 3)
    return None


DIRECT_CASES = [
    "plain",
    "hook on down_proj",
    "global hook",
    "pre-hook on gate_proj",
    "compiled up_proj",
    "_call_impl on the instance",
    "forward on the instance",
    "weight on the instance",
    "weight shadowing the parameter",
    "weight as a buffer",
    "Linear subclass",
    "nn.Linear.forward patched",
    "nn.Module.__call__ patched",
    "nn.Module._call_impl patched",
]


def test_a_patch_of_nn_linear_made_before_the_import_is_seen(lk):
    """The direct path compares nn.Linear's forward and Module's call with the functions this import found;
    a patch made before it, even one that copies the original's names with functools.wraps, must not pass for
    torch's own."""
    import functools

    torch_module = torch.nn.modules.linear
    assert lk._hosts._torchs_own(torch.nn.Linear.forward, torch_module)
    wrapped = functools.wraps(torch.nn.Linear.forward)(lambda self, x: torch.nn.Linear.forward(self, x) * 2)
    assert wrapped.__module__ == torch.nn.Linear.forward.__module__  # what a check of the names would accept
    assert not lk._hosts._torchs_own(wrapped, torch_module)
    assert not lk._hosts._torchs_own(lambda self, x: None, torch_module)


@pytest.mark.parametrize("case", DIRECT_CASES)
def test_layer_calls_f_linear_directly_only_where_the_module_call_is_exactly_that(lk, case, monkeypatch):
    """The untiled layer runs F.linear on the projections' parameters instead of calling the modules only
    where each call is exactly that (``_hosts.linear_operands``): a hook, a compiled module, an instance's own
    call, forward or weight, a weight that is no parameter, a subclass, or a patched nn.Linear keeps the module
    calls. Each case changes what its
    projection computes, so a wrongly taken direct path gives another result than the host's own forward."""
    torch.manual_seed(0)
    host = llama_mlp(bias=True).double()
    handle = _call_the_projections_exactly_as_modules(host, case, monkeypatch)
    module_path = []
    inner = lk._gated.gated_apply
    monkeypatch.setattr(lk._gated, "gated_apply", lambda *args, **kw: module_path.append(1) or inner(*args, **kw))
    try:
        x, d_out = torch.randn(2, 5, HIDDEN, dtype=torch.float64), torch.randn(2, 5, HIDDEN, dtype=torch.float64)
        want = run(host, x, d_out)
        layer = bind(lk.LigerSwiGLUMLP, host)
        module_calls = []

        def profile(frame, event, arg):  # a projection's module call
            if event == "call" and frame.f_code.co_name == "_call_impl":
                module_calls.append(1) if isinstance(frame.f_locals.get("self"), torch.nn.Linear) else None

        sys.setprofile(profile)
        try:
            got = run(layer, x, d_out)
        finally:
            sys.setprofile(None)
    finally:
        if handle is not None:
            handle.remove()
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert rel_err(g, w) < 1e-12
    # the direct path calls no projection as a module and does not go through gated_apply's checks
    if case == "plain":
        assert not module_calls and not module_path
    else:
        assert module_calls


class HostWithHookedGate(torch.nn.Module):
    """Someone keeps the gate projection's output (an activation-capturing hook)."""

    def __init__(self, host):
        super().__init__()
        self.kept = []
        host.gate_proj.register_forward_hook(lambda module, args, out: self.kept.append(out))


@pytest.mark.parametrize("layer, make_host", [("LigerSwiGLUMLP", llama_mlp), ("LigerGEGLUMLP", gemma_mlp)])
def test_layer_backward_allocates_no_gate_or_up_buffers(lk, layer, make_host, monkeypatch):
    """Through the layer (plain nn.Linear projections) backward writes the gradients over gate and up; a
    host whose gate output someone else keeps gets fresh gradient buffers and its kept tensor is intact."""
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter; test_gpu.py covers CUDA")
    from test_gated import CountingAllocator

    x = torch.randn(4, 9, HIDDEN, requires_grad=True)
    with backend("triton"):
        host = bind(getattr(lk, layer), make_host())
        out = host(x)
        allocations = CountingAllocator(lk, monkeypatch)
        out.sum().backward()
        assert allocations.count == 0

        hooked = bind(getattr(lk, layer), make_host())
        keeper = HostWithHookedGate(hooked)
        out = hooked(x)
        kept = keeper.kept[0].detach().clone()
        allocations.count = 0
        out.sum().backward()
        assert allocations.count == 2
        assert torch.equal(keeper.kept[0].detach(), kept)


@pytest.mark.parametrize("wrap", ["checkpoint", "save_on_cpu", "a user's hook that keeps what it packs"])
@pytest.mark.parametrize("layer, make_host", [("LigerSwiGLUMLP", llama_mlp), ("LigerGEGLUMLP", gemma_mlp)])
def test_layer_backward_under_saved_tensor_hooks(lk, layer, make_host, wrap, monkeypatch):
    """The layer's gate and up are its own (no other node saves them): under gradient checkpointing and CPU
    offloading backward still writes over them. Under a user's saved-tensor hook that keeps what it packs, it
    writes fresh gradients and the kept tensors are intact. The gradients equal the host's in every case."""
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter; test_gpu.py covers CUDA")
    from test_gated import CountingAllocator

    torch.manual_seed(0)
    plain = make_host()
    x = torch.randn(4, 9, HIDDEN)
    with backend("triton"):
        host = bind(getattr(lk, layer), copy.deepcopy(plain))
        leaves = [x.clone().requires_grad_(), *host.parameters()]
        kept = []
        allocations = CountingAllocator(lk, monkeypatch)
        if wrap == "checkpoint":
            out = torch.utils.checkpoint.checkpoint(host, leaves[0], use_reentrant=False)
        elif wrap == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                out = host(leaves[0])
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
                out = host(leaves[0])
        values = [t.detach().clone() for t in kept]
        allocations.count = 0
        got = torch.autograd.grad(out.sum(), leaves)
    reference = [x.clone().requires_grad_(), *plain.parameters()]
    want = torch.autograd.grad(plain(reference[0]).sum(), reference)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    assert all(torch.equal(t, v) for t, v in zip(kept, values)), "a kept tensor was written"
    forwards = 1 if wrap == "checkpoint" else 0  # the recompute allocates the activation's output once more
    assert allocations.count == forwards + (2 if kept else 0)


class TaggedLinear(torch.nn.Linear):
    """A Linear tagged "Linear" for kernelize (transformers tags none of its own)."""


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.swiglu = llama_mlp()
        self.geglu = gemma_mlp()
        self.head = TaggedLinear(HIDDEN, 11)

    def forward(self, x):
        return self.head(self.geglu(self.swiglu(x)))


def kernelize_block(model, variant_root, mode, layers):
    """Tag the hosts as transformers' default mapping names them, map `layers` for `mode`, kernelize."""
    tags = ((LlamaMLP, "SwiGLUMLP"), (GemmaMLP, "GeGLUMLP"), (TaggedLinear, "Linear"))
    mapping = {
        name: {"cpu": {mode: LocalLayerRepository(variant_root, layer_name=layer)}} for name, layer in layers.items()
    }
    for cls, name in tags:
        replace_kernel_forward_from_hub(cls, name)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(model, mode=mode, device="cpu")
    finally:
        for cls, _ in tags:
            del cls.kernel_layer_name, cls.kernel_condition
    return model


def assert_block_matches(model, reference):
    x = torch.randn(2, 3 * HIDDEN, HIDDEN, dtype=torch.float64)
    d_out = torch.randn(2, 3 * HIDDEN, 11, dtype=torch.float64)
    (out, grads), (ref, ref_grads) = run(model, x, d_out), run(reference, x, d_out)
    for got, want in zip([out, *grads], [ref, *ref_grads]):
        assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING"])
def test_kernelize_with_local_layer_repository(lk, variant_root, mode):
    """kernels itself loads, validates and swaps in the fused layers (mapped here for either mode)."""
    torch.manual_seed(0)
    model = Block().double()
    reference = copy.deepcopy(model)
    kernelize_block(
        model, variant_root, getattr(Mode, mode), {"SwiGLUMLP": "LigerSwiGLUMLP", "GeGLUMLP": "LigerGEGLUMLP"}
    )
    assert model.swiglu.forward.__func__.__qualname__ == "LigerSwiGLUMLP.forward"
    assert model.geglu.forward.__func__.__qualname__ == "LigerGEGLUMLP.forward"
    assert model.swiglu.forward.__func__.__module__.startswith(lk.__name__)
    assert_block_matches(model, reference)


TILED_HOSTS = {  # host, tiled layer
    "llama_silu": (llama_mlp, "LigerTiledSwiGLUMLP"),
    "llama_silu_bias": (lambda: llama_mlp(bias=True), "LigerTiledSwiGLUMLP"),
    "gemma_gelu_tanh": (gemma_mlp, "LigerTiledGEGLUMLP"),
    "gelu_exact": (lambda: llama_mlp(act="gelu"), "LigerTiledGEGLUMLP"),
    "linear": (lambda: torch.nn.Linear(HIDDEN, 3 * HIDDEN), "LigerLinear"),
}


@pytest.mark.parametrize("num_shards", [None, 5])
@pytest.mark.parametrize("host_name", sorted(TILED_HOSTS))
def test_tiled_layers_equal_their_host_in_float64(lk, host_name, num_shards):
    make_host, layer = TILED_HOSTS[host_name]
    torch.manual_seed(0)
    host = make_host().double()
    tiled = bind(getattr(lk, layer), copy.deepcopy(host))
    if num_shards is not None:
        tiled.num_shards = num_shards
    x = torch.randn(2, 3 * HIDDEN + 7, HIDDEN, dtype=torch.float64)
    d_out = torch.randn(2, 3 * HIDDEN + 7, host(x).shape[-1], dtype=torch.float64)
    (out_h, grads_h), (out_t, grads_t) = run(host, x, d_out), run(tiled, x, d_out)
    for want, got in zip([out_h, *grads_h], [out_t, *grads_t]):
        assert (want - got).abs().max().item() < 1e-12


def test_tiled_swiglu_layer_refuses_a_non_silu_host(lk):
    host = bind(lk.LigerTiledSwiGLUMLP, llama_mlp(act="gelu"))
    with pytest.raises(ValueError, match="LigerSwiGLUMLP computes .* act = SiLU"):
        host(torch.randn(1, 8, HIDDEN))


def test_liger_linear_takes_1d_input(lk):
    host = torch.nn.Linear(HIDDEN, 7)
    x = torch.randn(HIDDEN)
    assert torch.allclose(bind(lk.LigerLinear, copy.deepcopy(host))(x), host(x))


def test_kernelize_training_maps_the_tiled_layers(lk, variant_root):
    """TRAINING: SwiGLUMLP -> LigerTiledSwiGLUMLP, GeGLUMLP -> LigerTiledGEGLUMLP, Linear -> LigerLinear."""
    torch.manual_seed(0)
    model = Block().double()
    reference = copy.deepcopy(model)
    layers = {"SwiGLUMLP": "LigerTiledSwiGLUMLP", "GeGLUMLP": "LigerTiledGEGLUMLP", "Linear": "LigerLinear"}
    kernelize_block(model, variant_root, Mode.TRAINING, layers)
    for module, layer in (
        (model.swiglu, "LigerTiledSwiGLUMLP"),
        (model.geglu, "LigerTiledGEGLUMLP"),
        (model.head, "LigerLinear"),
    ):
        assert module.forward.__func__.__qualname__ == f"{layer}.forward"
    assert_block_matches(model, reference)


@pytest.mark.parametrize("case", ["plain", "autocast", "hooked gate", "frozen gate"])
def test_tiled_layers_take_the_gated_backward_only_where_it_is_exact(lk, case, monkeypatch):
    """The tiled gated layers recompute only gate and up (no down_proj forward) when the projections are
    plain Linears without autocast; otherwise the generic recompute runs. Either way the gradients match."""
    calls = []
    inner = lk.tiled_mlp.gated_mlp_backward
    monkeypatch.setattr(lk.tiled_mlp, "gated_mlp_backward", lambda *a: calls.append(1) or inner(*a))
    torch.manual_seed(0)
    host = llama_mlp(bias=True).double()
    if case == "hooked gate":
        host.gate_proj.register_forward_hook(lambda module, args, out: None)
    if case == "frozen gate":
        host.gate_proj.weight.requires_grad_(False)
    tiled = bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(host))
    x = torch.randn(2, 3 * HIDDEN, HIDDEN, dtype=torch.float64)
    d_out = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        (out_t, grads_t), (out_h, grads_h) = run(tiled, x, d_out), run(host, x, d_out)
    assert len(calls) == (0 if case in ("autocast", "hooked gate") else 1)
    tolerance = 1e-2 if case == "autocast" else 1e-12
    for got, want in zip([out_t, *grads_t], [out_h, *grads_h]):
        assert rel_err(got, want) < tolerance


def test_tiled_layer_bf16_weight_gradients_within_untiled_error(lk):
    """The gated backward sums 64 shards' weight gradients in fp32: within 1.5x the untiled bf16 error."""
    torch.manual_seed(0)
    host64 = llama_mlp().double()
    eager = copy.deepcopy(host64).bfloat16()
    tiled = bind(lk.LigerTiledSwiGLUMLP, copy.deepcopy(host64).bfloat16())
    tiled.num_shards = 64
    x = torch.randn(1, 4096, HIDDEN, dtype=torch.float64)
    d_out = torch.randn_like(x)
    (_, want), (_, got_e), (_, got_t) = (
        run(host64, x, d_out),
        run(eager, x.bfloat16(), d_out.bfloat16()),
        run(tiled, x.bfloat16(), d_out.bfloat16()),
    )
    for w, e, t in zip(want[1:], got_e[1:], got_t[1:]):
        assert t.dtype == torch.bfloat16
        assert rel_err(t, w) <= 1.5 * rel_err(e, w)


@pytest.mark.parametrize("host_name", ["llama_silu_bias", "gemma_gelu_tanh", "gelu_exact"])
def test_tiled_gated_backward_through_triton_kernels(lk, host_name):
    """The gated backward's fused pass (gradients over the strided gate|up halves, hidden over d_hidden) on
    the Triton kernels, fp32, against the float64 host: no worse than the eager fp32 host (1.5x)."""
    if not INTERPRETED:
        pytest.skip("runs the Triton path on CPU tensors through the interpreter; test_gpu.py covers CUDA")
    make_host, _ = HOSTS[host_name]
    layer = TILED_HOSTS[host_name][1]
    torch.manual_seed(0)
    host64 = make_host().double()
    eager = copy.deepcopy(host64).float()
    tiled = bind(getattr(lk, layer), copy.deepcopy(host64).float())
    x = torch.randn(2, 3 * HIDDEN + 5, HIDDEN, dtype=torch.float64)
    d_out = torch.randn_like(x)
    with backend("triton"):
        got = run(tiled, x.float(), d_out.float())
    want, got_eager = run(host64, x, d_out), run(eager, x.float(), d_out.float())
    for w, e, t in zip([want[0], *want[1]], [got_eager[0], *got_eager[1]], [got[0], *got[1]]):
        assert rel_err(t, w) <= 1.5 * rel_err(e, w) + 4 * compute_eps(torch.float32)


class HostWithSettingsOfItsOwn(LlamaMLP):
    """Tiling settings a host may carry other than as instance attributes."""

    num_shards = 3  # a class attribute

    @property
    def tile(self):  # a property (a data descriptor: it comes before the instance's dict)
        return True


class HostWithItsOwnLookup(LlamaMLP):
    def __getattr__(self, name):  # a lookup of its own
        return 4 if name == "num_shards" else super().__getattr__(name)


@pytest.mark.parametrize("name", ["tile", "num_shards", "missing", "gate_proj", "scale", "extra"])
def test_tiled_layers_read_host_settings_as_getattr_does(lk, name):
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    hosts = [HostWithSettingsOfItsOwn(config), HostWithItsOwnLookup(config), llama_mlp()]
    for i, host in enumerate(hosts):
        host.register_buffer("scale", torch.ones(1))
        host.extra = 5 + i
        assert lk.layers._host_setting(host, name) is getattr(host, name, None)


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_layer_tangents_under_forward_ad(lk, grad_mode, backend_name):
    """Inside a forward-AD dual level the layer's direct path still runs the differentiable form of the gated
    op: the tangent of the output equals the host's own, with and without grad mode."""
    torch.manual_seed(0)
    host = llama_mlp(bias=True)
    x, tangent = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    forward_ad = torch.autograd.forward_ad
    with torch.set_grad_enabled(grad_mode), forward_ad.dual_level():
        want = forward_ad.unpack_dual(host(forward_ad.make_dual(x, tangent))).tangent
        layer = bind(lk.LigerSwiGLUMLP, host)
        got = forward_ad.unpack_dual(layer(forward_ad.make_dual(x, tangent))).tangent
    assert got is not None, "the tangent was dropped"
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("inference", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("host_name", sorted(HOSTS))
def test_small_inference_calls_compute_as_the_host_does(lk, host_name, dtype, inference, backend_name, monkeypatch):
    """Decoding-sized calls that record nothing take the host's own arithmetic (its activation, then the
    product, each rounded to the dtype): bit for bit the host module's output, and no fused-op call. Above
    ``SMALL_CALL_ELEMENTS`` the fused op runs. The input and the projections' parameters stay as they were."""
    make_host, layer = HOSTS[host_name]
    torch.manual_seed(0)
    host = make_host().to(dtype)
    x = torch.randn(3, 1, HIDDEN, dtype=dtype)
    kept = x.clone()
    fused_calls = []
    inner = lk._gated.gated_apply_eager
    monkeypatch.setattr(lk._gated, "gated_apply_eager", lambda *a, **k: fused_calls.append(1) or inner(*a, **k))
    with inference():
        want = host(x)
        got = bind(getattr(lk, layer), host)(x)
        assert torch.equal(got, want) and not fused_calls
        assert torch.equal(x, kept)
        monkeypatch.setattr(lk.gated_mlp, "SMALL_CALL_ELEMENTS", 3 * INTERMEDIATE - 1)
        fused = host(x)
        linear = lambda name, t: torch.nn.functional.linear(t, getattr(host, name).weight, getattr(host, name).bias)  # noqa: E731
        act = lk.activations.REGISTRY[ACTIVATIONS[host_name]]
        hidden = lk._gated.gated_forward(linear("gate_proj", x), linear("up_proj", x), act)
        assert fused_calls == [1] and torch.equal(fused, linear("down_proj", hidden))


def test_small_inference_calls_leave_a_hooked_projections_output_alone(lk):
    """A hook that keeps the gate projection's output sees it unchanged after a decoding call: the activation
    is written over the gate buffer only where the projections run as plain F.linear calls (no hooks)."""
    torch.manual_seed(0)
    host = llama_mlp()
    keeper = HostWithHookedGate(host)
    x = torch.randn(2, 1, HIDDEN)
    with torch.no_grad():
        out = bind(lk.LigerSwiGLUMLP, host)(x)
        want = torch.nn.functional.linear(x, host.gate_proj.weight)
        assert torch.equal(keeper.kept[0], want)
        assert rel_err(out, LlamaMLP.forward(host, x)) < 1e-6


class _KeepLinearOutputs(torch.overrides.TorchFunctionMode):
    """Activation capture through a mode: keeps every F.linear output."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            self.kept.append(out)
        return out


class _KeepMatmulOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.kept.append(out)
        return out


@pytest.mark.parametrize("mode", [_KeepLinearOutputs, _KeepMatmulOutputs])
@pytest.mark.parametrize("layer, make_host", [("LigerSwiGLUMLP", llama_mlp), ("LigerGEGLUMLP", gemma_mlp)])
def test_projection_outputs_a_mode_kept_are_left_alone(lk, layer, make_host, mode, backend_name):
    """Under a torch-function or dispatch mode that keeps the projections' outputs, backward writes fresh gradients
    (it wrote them over gate and up, which the mode found changed after the step); the gradients equal the
    host's."""
    torch.manual_seed(0)
    plain = make_host()
    host = bind(getattr(lk, layer), copy.deepcopy(plain))
    x = torch.randn(2, 5, HIDDEN)
    leaves = [x.clone().requires_grad_(), *host.parameters()]
    with mode() as keeper:
        out = host(leaves[0])
    values = [t.detach().clone() for t in keeper.kept]
    got = torch.autograd.grad(out.sum(), leaves)
    assert len(keeper.kept) == 3 and all(torch.equal(t, v) for t, v in zip(keeper.kept, values))
    reference = [x.clone().requires_grad_(), *plain.parameters()]
    want = torch.autograd.grad(plain(reference[0]).sum(), reference)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("mode", [_KeepLinearOutputs, _KeepMatmulOutputs], ids=["torch_function", "dispatch"])
def test_small_inference_calls_leave_what_a_mode_keeps_alone(lk, mode):
    """A torch-function or dispatch mode may keep the gate projection's output: the layer does not write over
    it (the fused op runs, as before the small-call path)."""
    torch.manual_seed(0)
    host = llama_mlp()
    x = torch.randn(2, 1, HIDDEN)
    with torch.no_grad(), mode() as keeper:
        out = bind(lk.LigerSwiGLUMLP, host)(x)
    gate = torch.nn.functional.linear(x, host.gate_proj.weight)
    assert torch.equal(keeper.kept[0].reshape(gate.shape), gate)
    assert rel_err(out, LlamaMLP.forward(host, x)) < 1e-6


def test_calls_under_grad_mode_keep_the_fused_op_under_selective_checkpointing(lk):
    """Gate and up frozen, down_proj trained, inside a selective checkpoint that keeps the matmuls' outputs
    for backward: nothing may be written over the gate buffer, although gate and up record no graph."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    torch.manual_seed(0)
    host = llama_mlp(bias=True)
    host.gate_proj.requires_grad_(False)
    host.up_proj.requires_grad_(False)
    x = torch.randn(2, 3, HIDDEN)
    keep = partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default])

    def step(module):
        out = checkpoint(module, x, use_reentrant=False, context_fn=keep)
        return out, torch.autograd.grad(out.sum(), module.down_proj.weight)[0]

    want = step(copy.deepcopy(host))
    got = step(bind(lk.LigerSwiGLUMLP, host))
    assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6


def test_a_broadcasting_host_product_is_served_in_inference(lk):
    """A gate projection of one output broadcasts against up in the host's product: no in-place form."""
    torch.manual_seed(0)
    host = llama_mlp()
    host.gate_proj = torch.nn.Linear(HIDDEN, 1, bias=False)
    x = torch.randn(2, HIDDEN)
    with torch.no_grad():
        want = LlamaMLP.forward(host, x)
        got = bind(lk.LigerSwiGLUMLP, host)(x)
    assert rel_err(got, want) < 1e-6


def test_a_gelu_subclass_with_its_own_forward_is_not_taken_for_gelu(lk):
    """An nn.GELU subclass that computes something else is not the GELU the layer computes: refused."""

    class HalfGELU(torch.nn.GELU):
        def forward(self, z):
            return super().forward(z) * 0.5

    host = llama_mlp(act="gelu")
    host.act_fn = HalfGELU()
    with pytest.raises(ValueError, match="HalfGELU"):
        bind(lk.LigerGEGLUMLP, host)(torch.randn(2, HIDDEN))


def test_a_compiled_call_reads_each_host_class_its_own_form(lk):
    """Under torch.compile a refused host's error makes dynamo compile the host-form lookup as a frame of its own;
    its guards must tell one host class from another: a later class whose forward differs (here it doubles the
    output) is refused, not served with an earlier class's form (it was, silently, with the map keyed by class)."""

    class DoublingMLP(LlamaMLP):
        def forward(self, x):
            return 2 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    torch._dynamo.reset()
    try:
        x = torch.randn(2, 8, HIDDEN)
        bind(lk.LigerSwiGLUMLP, LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)))(x)
        relu = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="relu"))
        with pytest.raises(ValueError, match="cannot be served"):
            torch.compile(bind(lk.LigerSwiGLUMLP, relu), backend="eager")(x)
        doubling = bind(lk.LigerSwiGLUMLP, DoublingMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)))
        with pytest.raises(ValueError, match="DoublingMLP cannot be served: its forward"):
            torch.compile(doubling, backend="eager")(x)
    finally:
        torch._dynamo.reset()


class SiLU(torch.nn.Module):
    """A model's own activation that shares torch's class name and computes another curve (swish, beta 2)."""

    def forward(self, z):
        return z * torch.sigmoid(2.0 * z)


class PatchedSiLU(torch.nn.SiLU):
    pass


def _instance_forward(act_fn):
    act_fn.forward = lambda z: 2 * torch.nn.functional.silu(z)
    return act_fn


def _forward_method(act_fn):
    """A patch in the usual style: a def named `forward` bound to the module (as kernelize binds a layer's)."""

    def forward(self, z):
        return 2 * torch.nn.functional.silu(z)

    act_fn.forward = types.MethodType(forward, act_fn)
    return act_fn


def _replaced_act():
    from transformers.activations import GELUTanh

    act_fn = GELUTanh()
    act_fn.act = torch.nn.functional.silu  # what GELUTanh.forward calls
    return act_fn


NOT_THE_ACTIVATION = {  # an act_fn the layer must not take for the activation its class name says, what it says
    "same name": (SiLU, "act_fn test_layers.SiLU, not torch's or transformers' own SiLU"),
    "instance forward": (lambda: _instance_forward(torch.nn.SiLU()), "SiLU with a forward set on the instance"),
    "gelu instance forward": (lambda: _instance_forward(torch.nn.GELU()), "GELU with a forward set on the instance"),
    "forward method": (lambda: _forward_method(llama_mlp().act_fn), "SiLUActivation with a forward set on the"),
    "gelu act replaced": (_replaced_act, "GELUTanh with its `act` or constant replaced on the instance"),
}


class HubSilu(torch.nn.Module):
    """A kernel layer for transformers' "SiLU" (kernels-community/activation's ``Silu`` in transformers' mapping)."""

    def forward(self, z):
        return torch.nn.functional.silu(z)


def test_an_activation_kernelized_by_its_mapping_is_still_taken_for_it(lk):
    """transformers maps "SiLU" to a hub kernel in inference: kernelize binds that layer's forward to each
    SiLUActivation (kernels' ``_replace_forward``). The MLP layer trusts it as kernelize does and serves the host;
    a forward set on the instance otherwise is refused (test below)."""
    host, x = llama_mlp(), torch.randn(2, 3, HIDDEN)
    assert type(host.act_fn).kernel_layer_name == "SiLU"
    host.act_fn.forward = types.MethodType(HubSilu.forward, host.act_fn)
    with torch.no_grad():
        assert rel_err(bind(lk.LigerSwiGLUMLP, copy.deepcopy(host))(x), LlamaMLP.forward(host, x)) < 1e-6


@pytest.mark.parametrize("case", sorted(NOT_THE_ACTIVATION))
def test_an_activation_is_known_by_its_class_and_code_not_its_name(lk, case):
    """The activation is read from the act_fn's class itself, torch's or transformers' own, with the forward
    written there: a same-named class of a model's own, or a forward set on the instance, is refused (both were
    served as SiLU / GELU, silently computing another curve); the stock modules are served."""
    make, message = NOT_THE_ACTIVATION[case]
    host, x = llama_mlp(), torch.randn(2, 3, HIDDEN)
    layer = lk.LigerGEGLUMLP if "gelu" in case else lk.LigerSwiGLUMLP
    with torch.no_grad():
        for stock in (torch.nn.GELU(), torch.nn.GELU("tanh")) if "gelu" in case else (torch.nn.SiLU(), host.act_fn):
            host.act_fn = stock
            assert rel_err(bind(layer, copy.deepcopy(host))(x), LlamaMLP.forward(host, x)) < 1e-6
        host.act_fn = make()
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            bind(layer, host)(x)


@pytest.mark.parametrize("layer", ["LigerSwiGLUMLP", "LigerTiledSwiGLUMLP", "LigerRMSNorm"])
def test_a_host_class_whose_forward_is_replaced_after_a_call_is_read_again(lk, layer):
    """A host class served once and then given another forward (here one that doubles the output) is read again
    and refused: the host reader's cache was keyed by the class alone and served the old forward's math."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = layer == "LigerRMSNorm"
    host_class = type("Host", (LlamaRMSNorm if norm else LlamaMLP,), {})
    stock = host_class.forward
    host = host_class(HIDDEN) if norm else host_class(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE))
    x = torch.randn(2, 3, HIDDEN)
    served = bind(getattr(lk, layer), copy.deepcopy(host))
    with torch.no_grad():
        assert rel_err(served(x), stock(host, x)) < 1e-6
        host_class.forward = lambda self, hidden: 2 * stock(self, hidden)
        with pytest.raises(ValueError, match="Host"):
            served(x)
        host_class.forward = stock  # the form it was read with: served again
        assert rel_err(served(x), stock(host, x)) < 1e-6


def test_a_wrapped_host_forward_is_not_read_as_the_one_it_wraps(lk):
    """A functools.wraps wrapper assigned in the class body (no decorator line): inspect.getsource of the forward
    follows ``__wrapped__`` to LlamaMLP's, so the host was served without what the wrapper adds."""

    def doubled(forward):
        @functools.wraps(forward)
        def twice(self, x):
            return 2 * forward(self, x)

        return twice

    class WrappedMLP(LlamaMLP):
        forward = doubled(LlamaMLP.forward)

    host = WrappedMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE))
    with pytest.raises(
        ValueError, match="WrappedMLP cannot be served: its forward holds a wrapper of another function"
    ):
        bind(lk.LigerSwiGLUMLP, host)(torch.randn(2, HIDDEN))


def test_a_host_class_first_met_under_compile_traces_without_a_graph_break(lk):
    """The host reader runs while dynamo traces (its result a constant of the trace, as the RMSNorm reader's): a
    Llama compiled before any eager call of its MLP class broke the graph at the reader's source parsing, once per
    MLP call (7 graphs for 2 layers in inference instead of 1)."""
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config).eval()
    cold = type("ColdMLP", (LlamaMLP,), {})  # a class the reader has not met
    for layer in model.model.layers:
        layer.mlp.__class__ = cold
        bind(lk.LigerSwiGLUMLP, layer.mlp)
    ids = torch.randint(0, 97, (2, 9))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(lambda ids: model(input_ids=ids).logits)(ids)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_a_compiled_layer_reads_a_host_forward_replaced_after_compiling(lk):
    """Compiled, the host reader's answer is a constant of the trace, which guards the class's forward: one given
    another forward after compiling (here one that doubles the output) is read again and refused."""
    host_class = type("Host", (LlamaMLP,), {})
    stock = host_class.forward
    host = bind(lk.LigerSwiGLUMLP, host_class(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)))
    x = torch.randn(2, 5, HIDDEN)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(host, backend="eager")
        with torch.no_grad():
            assert rel_err(compiled(x), stock(host, x)) < 1e-6
            host_class.forward = lambda self, hidden: 2 * stock(self, hidden)
            with pytest.raises(ValueError, match="Host cannot be served"):
                compiled(x)
    finally:
        torch._dynamo.reset()
