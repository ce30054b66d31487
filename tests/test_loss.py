"""The causal-LM loss: LigerForCausalLMLoss against transformers' ForCausalLMLoss (logits and fused paths), the
kernelize layer as transformers' mapping uses it, and causal_lm_loss on stock transformers models (padding,
num_items_in_batch, shift_labels, gradient checkpointing, tied embeddings, final-logit softcapping, DDP)."""

import copy

import kernels
import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from harness import rel_err

FP32_BOUND = 16 * torch.finfo(torch.float32).eps
B, S, H, V = 2, 9, 16, 40
SIZES = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def batch(seed=0, pad=3):
    """Labels with the last `pad` positions of the second row ignored (right padding)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, S), generator=generator)
    labels[1, S - pad :] = -100
    return labels


LOSS_CASES = {
    "mean": {},
    "num_items_in_batch": {"num_items_in_batch": torch.tensor(11)},
    "num_items_in_batch int": {"num_items_in_batch": 11},
    "shift_labels": {"shift_labels": True},
}


def loss_kwargs(case, labels):
    kwargs = dict(LOSS_CASES[case])
    if kwargs.pop("shift_labels", False):
        shifted = torch.roll(labels, -1, dims=1)
        shifted[:, -1] = -100
        return None, {**kwargs, "shift_labels": shifted}
    return labels, kwargs


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_logits_path_equals_transformers(lk, case, backend_name):
    labels, kwargs = loss_kwargs(case, batch())
    logits = torch.randn(B, S, V, requires_grad=True)
    got = lk.LigerForCausalLMLoss(logits, labels, V, **kwargs)
    want = ForCausalLMLoss(logits.double(), labels, V, **kwargs)
    (d_got,) = torch.autograd.grad(got, logits)
    (d_want,) = torch.autograd.grad(want, logits)
    assert got.dtype == torch.float32 and rel_err(got, want) <= FP32_BOUND
    assert rel_err(d_got, d_want) <= FP32_BOUND


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_fused_path_equals_transformers_on_the_logits(lk, case, softcap, backend_name):
    labels, kwargs = loss_kwargs(case, batch())
    hidden = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, requires_grad=True)
    dtype = torch.float32 if backend_name == "triton" else torch.float64
    got = lk.LigerForCausalLMLoss(
        None,
        labels,
        V,
        hidden_states=hidden.to(dtype),
        lm_head_weight=weight.to(dtype),
        lm_head_bias=bias.to(dtype),
        hidden_size=H,
        final_logit_softcapping=softcap,
        **kwargs,
    )
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:  # what Gemma-2 does to its logits before calling the loss
        logits = softcap * torch.tanh(logits / softcap)
    want = ForCausalLMLoss(logits.double(), labels, V, **kwargs)  # (transformers' own fp32 upcast: `.float()`)
    grads = torch.autograd.grad(got, (hidden, weight, bias))
    logits64 = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        logits64 = softcap * torch.tanh(logits64 / softcap)
    exact = _causal_loss64(logits64, labels, **kwargs)
    want_grads = torch.autograd.grad(exact, (hidden, weight, bias))
    bound = FP32_BOUND if dtype == torch.float32 else 1e-12
    assert rel_err(got, exact) <= bound and rel_err(want, exact) <= FP32_BOUND
    for g, w in zip(grads, want_grads):
        assert rel_err(g, w) <= bound


def _causal_loss64(logits, labels, num_items_in_batch=None, shift_labels=None):
    """transformers' ForCausalLMLoss in float64 (its own upcasts to float32)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), reduction=reduction
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def test_token_accuracy_passes_through(lk):
    labels = batch()
    hidden, weight = torch.randn(B, S, H), torch.randn(V, H)
    out = lk.LigerForCausalLMLoss(
        None, labels, V, hidden_states=hidden, lm_head_weight=weight, return_token_accuracy=True, num_items_in_batch=4
    )
    plain = lk.LigerForCausalLMLoss(None, labels, V, hidden_states=hidden, lm_head_weight=weight, num_items_in_batch=4)
    assert isinstance(out, lk.CrossEntropyOutput) and out.token_accuracy is not None
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=0)


def test_layer_fits_kernelize_as_transformers_maps_it(lk, variant_root):
    """transformers maps "ForCausalLMLoss" (its loss function, made a layer by use_kernel_forward_from_hub) to
    LigerForCausalLMLossLayer in Mode.TRAINING | Mode.TORCH_COMPILE: kernels accepts the layer (same forward
    parameters, no state), and the kernelized function computes transformers' loss."""
    loss_layer = kernels.use_kernel_forward_from_hub("ForCausalLMLoss")(ForCausalLMLoss)

    @kernels.use_kernelized_func(loss_layer)
    class Head(torch.nn.Module):
        def forward(self, logits, labels):
            return loss_layer(logits, labels, V)

    host = Head()
    repo = LocalLayerRepository(variant_root, layer_name="LigerForCausalLMLossLayer")
    mapping = {"ForCausalLMLoss": {"cpu": {Mode.TRAINING | Mode.TORCH_COMPILE: repo, Mode.TRAINING: repo}}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(host, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu", use_fallback=False)
    assert loss_layer.forward.__func__.__qualname__ == "LigerForCausalLMLossLayer.forward"
    labels = batch()
    logits = torch.randn(B, S, V, requires_grad=True)
    got = host(logits, labels)
    want = ForCausalLMLoss(logits, labels, V)
    assert rel_err(got, want) <= FP32_BOUND
    # the fused path through the same layer: hidden states and head weight ride in kwargs
    hidden, weight = torch.randn(B, S, H), torch.randn(V, H)
    fused = loss_layer(None, labels, V, hidden_states=hidden, lm_head_weight=weight, hidden_size=H)
    assert rel_err(fused, ForCausalLMLoss(hidden @ weight.T, labels, V)) <= FP32_BOUND


# ----------------------------------------------------------------------------------------------------------
# causal_lm_loss on stock models (float64, so that the comparison is exact to rounding)


def llama(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(**{**SIZES, **overrides})
    return LlamaForCausalLM(config).double()


def gemma2():
    torch.manual_seed(0)
    config = Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=5.0, attn_implementation="eager")
    return Gemma2ForCausalLM(config).double()


def model_inputs(seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def grads_of(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


MODEL_CASES = {
    "llama": (llama, {}),
    "llama tied embeddings": (lambda: llama(tie_word_embeddings=True), {}),
    "llama num_items_in_batch": (llama, {"num_items_in_batch": torch.tensor(25)}),
    "llama shift_labels": (llama, {"shift_labels": True}),
    "llama gradient checkpointing": (llama, {"checkpointing": True}),
    "gemma2 final_logit_softcapping": (gemma2, {}),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_causal_lm_loss_equals_the_model_loss(lk, case):
    make, options = MODEL_CASES[case]
    options = dict(options)
    model = make().train()
    if options.pop("checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "tied" in case:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask, labels = model_inputs()
    if options.pop("shift_labels", False):
        options["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        labels = None
    else:  # the model's own loss (transformers computes it in fp32)
        model_loss = model(input_ids=ids, attention_mask=mask, labels=labels, **options).loss
    # the same loss in float64 from the model's logits (which include its softcapping)
    want = _causal_loss64(model(input_ids=ids, attention_mask=mask).logits, labels, **options)
    want_grads = grads_of(model, want)
    got, outputs = lk.causal_lm_loss(model, ids, labels, attention_mask=mask, return_outputs=True, **options)
    got_grads = grads_of(model, got)
    assert got.dtype == torch.float64 and abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    if labels is not None:
        assert rel_err(got, model_loss) <= FP32_BOUND
    assert outputs.last_hidden_state.shape == (2, 12, 32)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= 1e-10


def test_wrapper_module_and_ddp_refusal(lk):
    model = llama()
    ids, mask, labels = model_inputs()
    wrapped = lk.CausalLMWithFusedLoss(model)
    got = wrapped(ids, labels=labels, attention_mask=mask)
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # computed in fp32 by transformers
    assert rel_err(got, want) <= FP32_BOUND
    assert list(wrapped.parameters()) == list(model.parameters())
    with pytest.raises(ValueError, match="labels"):
        lk.causal_lm_loss(model, ids)


def test_ddp_two_ranks_equal_single_process(variant_root, tmp_path):
    """CausalLMWithFusedLoss(LlamaForCausalLM) wrapped in DDP on 2 gloo ranks: every gradient equals a
    single-process run over both ranks' batches of the loss on the model's logits (float64). 60 s watchdog."""
    from dist_workers import ddp_fused_loss
    from harness import launch

    results = launch(ddp_fused_loss, 2, variant_root, {}, tmp_path, timeout_s=60)
    for result in results:
        assert result["missing"] == [] and result["grad_diff"] < 1e-12, result


@pytest.mark.gpu
def test_cuda_causal_lm_loss_bf16_llama(lk):
    """A bf16 Llama on the GPU (Triton kernels): causal_lm_loss's loss and gradients no worse than the model's
    own bf16 loss, both against the float64 model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    model64 = LlamaForCausalLM(config).double().cuda()
    model = copy.deepcopy(model64).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (4, 1024), device="cuda")
    labels = ids.clone()
    labels[:, :100] = -100
    want = model64(input_ids=ids, labels=labels).loss
    want_grads = grads_of(model64, want)
    eager = model(input_ids=ids, labels=labels).loss
    eager_grads = grads_of(model, eager)
    got = lk.causal_lm_loss(model, ids, labels)
    got_grads = grads_of(model, got)
    assert rel_err(got, want) <= 1.5 * rel_err(eager, want) + 1e-6
    head = next(i for i, p in enumerate(model.parameters()) if p is model.lm_head.weight)
    assert rel_err(got_grads[head], want_grads[head]) <= 1.5 * rel_err(eager_grads[head], want_grads[head]) + 1e-6
    total = sum(rel_err(g, w) for g, w in zip(got_grads, want_grads))
    assert total <= 1.5 * sum(rel_err(g, w) for g, w in zip(eager_grads, want_grads)) + 1e-6


def test_loss_compiles_without_graph_break(lk):
    """Both paths of the loss (what the kernelized layer runs under Mode.TORCH_COMPILE) trace as one graph and
    compiled equals eager."""
    torch._dynamo.reset()
    labels = batch()
    logits = torch.randn(B, S, V, requires_grad=True)
    hidden, weight = torch.randn(B, S, H, requires_grad=True), torch.randn(V, H, requires_grad=True)

    def both(logits, hidden, weight):
        from_logits = lk.LigerForCausalLMLoss(logits, labels, V)
        fused = lk.LigerForCausalLMLoss(
            None,
            labels,
            V,
            num_items_in_batch=torch.tensor(7),
            hidden_states=hidden,
            lm_head_weight=weight,
            final_logit_softcapping=3.0,
        )
        return from_logits + fused

    explained = torch._dynamo.explain(both)(logits, hidden, weight)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    got = torch.compile(both, backend="aot_eager")(logits, hidden, weight)
    want = both(logits, hidden, weight)
    got_grads = torch.autograd.grad(got, (logits, hidden, weight))
    want_grads = torch.autograd.grad(want, (logits, hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)
    torch._dynamo.reset()
