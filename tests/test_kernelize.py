"""kernelize with transformers: tiny Llama and Gemma models, the shipped mapping, train/eval switching."""

import copy

import pytest
import torch
from kernels import Mode, kernelize, use_kernel_mapping
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP

SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MLP_LAYERS = ("SwiGLUMLP", "GeGLUMLP")  # only the MLPs: the rest of the mapping is test_mapping.py's
MODELS = {
    "llama": (lambda: LlamaForCausalLM(LlamaConfig(**SIZES)), LlamaMLP, "SwiGLU"),
    "gemma": (
        lambda: GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16, hidden_act="gelu_pytorch_tanh")),
        GemmaMLP,
        "GEGLU",
    ),
}


def mlp_layers(model, mlp_cls):
    return {m.forward.__func__.__qualname__.split(".")[0] for m in model.modules() if isinstance(m, mlp_cls)}


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernelized_model_matches_and_switches_modes(lk, variant_root, tagged, name):
    make, mlp_cls, kind = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 3 * 64 + 5))
    with use_kernel_mapping(lk.kernel_mapping(variant_root, layers=MLP_LAYERS), inherit_mapping=False):
        kernelize(model.train(), mode=Mode.TRAINING, device="cpu")
        assert mlp_layers(model, mlp_cls) == {f"LigerTiled{kind}MLP"}
        (loss, grads), (ref_loss, ref_grads) = loss_and_grads(model, ids), loss_and_grads(reference, ids)
        assert abs(loss.item() - ref_loss.item()) < 1e-12
        assert max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)) < 1e-12

        kernelize(model.eval(), mode=Mode.INFERENCE, device="cpu")
        assert mlp_layers(model, mlp_cls) == {f"Liger{kind}MLP"}
        with torch.no_grad():
            assert (model(input_ids=ids).logits - reference.eval()(input_ids=ids).logits).abs().max().item() < 1e-12

        kernelize(model.train(), mode=Mode.TRAINING, device="cpu")
        assert mlp_layers(model, mlp_cls) == {f"LigerTiled{kind}MLP"}


@pytest.mark.parametrize("hook", ["a ModelHook of the user's", "cpu_offload"])
@pytest.mark.parametrize("order", ["kernelize first", "hook first", "kernelize, hook, kernelize again"])
def test_accelerate_hooks_run_whatever_the_order(lk, variant_root, hook, order):
    """accelerate wraps a module's forward to run its hook; kernelize replaces the instance's forward. Kernelized
    first, the hook wraps the layer. Hooked first, or kernelized again after the hook (as transformers does on
    ``train()`` / ``eval()`` of a kernelized model), the wrapper is gone: the hook no longer ran (a ModelHook's
    change of the input silently lost; offloaded weights left on the meta device, an error naming neither). The
    layer now runs the hook around its math itself: the hooked host's output in every order."""
    from accelerate import cpu_offload
    from accelerate.hooks import ModelHook, add_hook_to_module
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class AddOne(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] + 1.0, *args[1:]), kwargs

    def attach(module):
        if hook == "cpu_offload":
            cpu_offload(module, execution_device="cpu")
        else:
            add_hook_to_module(module, AddOne())

    def kernelized(module):
        with use_kernel_mapping(lk.kernel_mapping(variant_root, layers=["RMSNorm"]), inherit_mapping=False):
            kernelize(module, mode=Mode.INFERENCE, device="cpu")

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    reference = LlamaRMSNorm(8)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    host = copy.deepcopy(reference)
    attach(reference)
    want = reference(x)
    steps = {
        "kernelize first": (kernelized, attach),
        "hook first": (attach, kernelized),
        "kernelize, hook, kernelize again": (kernelized, attach, kernelized),
    }[order]
    for step in steps:
        step(host)
    runs = getattr(host.forward, "__func__", None) or host._old_forward.__func__  # the layer, or accelerate's around it
    assert runs.__qualname__ == "LigerRMSNorm.forward"
    torch.testing.assert_close(host(x), want, rtol=1e-6, atol=1e-6)  # (the ModelHook adds 1 to every input)
