"""The causal-LM loss: LigerForCausalLMLoss against transformers' ForCausalLMLoss (logits and fused paths), the
kernelize layer as transformers' mapping uses it, and causal_lm_loss on stock transformers models (padding,
num_items_in_batch, shift_labels, gradient checkpointing, tied embeddings, final-logit softcapping, DDP; each
form of forward it serves, from Cohere's logit scale to Mamba's cast, and the models it refuses)."""

import copy
import functools
import types

import kernels
import pytest
import torch
import transformers
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

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


@pytest.mark.parametrize("shape", [(1, 9), (3, 1), (2, 0), (9,), (2, 2, 5)])
def test_labels_are_shifted_as_transformers_shifts_them(lk, shape, backend_name):
    """Each position's next label, the last ignored, for one and several sequences, sequences of one position and of
    none, and 1-D and 3-D labels: the loss and its gradient against transformers' own shift (pad, then slice)."""
    labels = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))
    if labels.numel():
        labels.view(-1)[0] = -100
    logits = torch.randn(*shape, V, requires_grad=True)
    got = lk.LigerForCausalLMLoss(logits, labels, V, num_items_in_batch=3)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    want = _causal_loss64(logits.double(), None, num_items_in_batch=3, shift_labels=shifted)
    (d_got,) = torch.autograd.grad(got, logits)
    (d_want,) = torch.autograd.grad(want, logits)
    for out, ref in ((got, want), (d_got, d_want)):
        # (every label ignored, or none at all: a loss and a gradient of exact zeros)
        assert rel_err(out, ref) <= FP32_BOUND if ref.count_nonzero() else torch.equal(out.double(), ref)


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


def tiny(config_class, model_class, **overrides):
    """A tiny model of any family in float64, dropout off (the loss is compared in training mode)."""
    torch.manual_seed(0)
    sizes = {**SIZES, "head_dim": 8, "max_position_embeddings": 64}
    return model_class(config_class(**{**sizes, **overrides})).double()


def _head_bias(model):
    """The model's head given a bias: a scale on the logits scales it too, one on the hidden states does not."""
    torch.manual_seed(1)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, dtype=torch.float64)
    model.lm_head = head
    return model


def _mixed_mamba():
    model = tiny(T.MambaConfig, T.MambaForCausalLM, state_size=4, tie_word_embeddings=False)
    model.backbone.float()
    return model


def _llava():
    """A multimodal model on text alone: the decoder at model, the loss told text_config.vocab_size."""
    torch.manual_seed(0)
    vision = T.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)  # fmt: skip
    text = T.LlamaConfig(**SIZES)
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(text_config=text, vision_config=vision, image_token_id=3))
    for module in (model.model.vision_tower, model.model.multi_modal_projector):  # unused on text
        module.requires_grad_(False)
    return model.double()


def _retied_llama():
    """A tied head re-tied to a larger input embedding: transformers' tie_weights shares the weight but leaves the
    head's out_features stale; the logits are the weight's rows, and so is the model's loss."""
    model = llama(tie_word_embeddings=True)
    torch.manual_seed(1)
    model.set_input_embeddings(torch.nn.Embedding(SIZES["vocab_size"] + 23, SIZES["hidden_size"], dtype=torch.float64))
    model.config.vocab_size = SIZES["vocab_size"] + 23
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.out_features == SIZES["vocab_size"]
    return model


T = transformers
MODEL_CASES = {
    "llama": (llama, {}),
    "cohere: logits times logit_scale": (lambda: tiny(T.CohereConfig, T.CohereForCausalLM, logit_scale=0.37), {}),
    "granite: logits divided by logits_scaling": (
        lambda: tiny(T.GraniteConfig, T.GraniteForCausalLM, logits_scaling=3.0),
        {},
    ),
    "hyperclovax: logits times logits_scaling": (
        lambda: tiny(T.HyperCLOVAXConfig, T.HyperCLOVAXForCausalLM, logits_scaling=0.25),
        {},
    ),
    "minicpm3: hidden states divided by logits_scaling": (
        lambda: tiny(
            T.MiniCPM3Config,
            T.MiniCPM3ForCausalLM,
            num_key_value_heads=4,
            dim_model_base=8,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        ),
        {},
    ),  # fmt: skip
    "falcon_h1: logits times model.lm_head_multiplier": (
        lambda: tiny(T.FalconH1Config, T.FalconH1ForCausalLM, lm_head_multiplier=0.5, mamba_d_state=4),
        {},
    ),
    "granite: logits divided, a head with a bias": (
        lambda: _head_bias(tiny(T.GraniteConfig, T.GraniteForCausalLM, logits_scaling=3.0)),
        {},
    ),
    "minicpm3: hidden states divided, a head with a bias": (
        lambda: _head_bias(
            tiny(
                T.MiniCPM3Config,
                T.MiniCPM3ForCausalLM,
                num_key_value_heads=4,
                dim_model_base=8,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
            )
        ),
        {},
    ),  # fmt: skip
    "mamba: a float32 backbone, its hidden states cast to the float64 head": (
        _mixed_mamba,
        {},
    ),
    "mamba: hidden states cast to the head's dtype": (
        lambda: tiny(T.MambaConfig, T.MambaForCausalLM, state_size=4),
        {},
    ),
    "opt: the decoder at model.decoder": (
        lambda: tiny(T.OPTConfig, T.OPTForCausalLM, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
        {},
    ),
    "bloom: a decoder call without **kwargs": (
        lambda: tiny(T.BloomConfig, T.BloomForCausalLM, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
        {},
    ),
    "gpt2: the decoder at transformer": (
        lambda: tiny(
            T.GPT2Config,
            T.GPT2LMHeadModel,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        {},
    ),  # fmt: skip
    "llama tied embeddings": (lambda: llama(tie_word_embeddings=True), {}),
    "llama num_items_in_batch": (llama, {"num_items_in_batch": torch.tensor(25)}),
    "llama shift_labels": (llama, {"shift_labels": True}),
    "llama gradient checkpointing": (llama, {"checkpointing": True}),
    "gemma2 final_logit_softcapping": (gemma2, {}),
    "llava: a multimodal model on text": (_llava, {}),
    "llama re-tied to a larger embedding, out_features stale": (_retied_llama, {}),
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
    # the same loss in float64 from the model's logits (which include its softcapping and scaling); a model that
    # upcasts its logits to float32 itself (Mamba) has them in float32 only
    logits = model(input_ids=ids, attention_mask=mask).logits
    want = _causal_loss64(logits.double(), labels, **options)
    want_grads = grads_of(model, want)
    got, outputs = lk.causal_lm_loss(model, ids, labels, attention_mask=mask, return_outputs=True, **options)
    got_grads = grads_of(model, got)
    loss_bound, grad_bound = (1e-12, 1e-10) if logits.dtype == torch.float64 else (FP32_BOUND, 1e-5)
    assert got.dtype == torch.float64 and abs(got.item() - want.item()) <= loss_bound * abs(want.item())
    if labels is not None:
        assert rel_err(got, model_loss) <= FP32_BOUND
    assert outputs.last_hidden_state.shape == (2, 12, 32)
    # (a gradient that is zero but for rounding, OPT's key bias under the softmax, is compared at the scale of all)
    scale = max(w.abs().max() for w in want_grads)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= grad_bound or (g - w).abs().max() <= 1e-6 * grad_bound * scale


# What causal_lm_loss refuses: forwards whose loss is not "decoder, head, ForCausalLMLoss" (written here as
# transformers writes them, each with the one statement that makes it differ), heads that are more than their
# Linear, and a router loss turned on.


class ZLossLlama(LlamaForCausalLM):
    """Bamba's extra term: the loss plus a z-loss on the logits."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            loss = loss + 0.1 * logits.logsumexp(-1).pow(2).mean()
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class CutVocabularyLlama(LlamaForCausalLM):
    """Inkling's padded vocabulary: the logits cut after the head."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits[..., :90]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, 90, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class NormedHeadLlama(LlamaForCausalLM):
    """Clvp's head: another layer between the hidden states and the projection."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(self.model.norm(hidden_states))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class UnshiftedLlama(LlamaForCausalLM):
    """Bart's causal LM: a loss on unshifted labels, not ForCausalLMLoss."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.view(-1, self.vocab_size), labels.view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class ScaledAfterCapLlama(LlamaForCausalLM):
    """A scale after the softcapping (no model has one; the order matters): not followed."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        logits = logits * self.config.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class EarlyReturnLlama(LlamaForCausalLM):
    """A branch that returns another loss (here in training): not the tuple outputs, so not skipped."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if self.training:
            return CausalLMOutputWithPast(loss=loss + logits.logsumexp(-1).pow(2).mean(), logits=logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class ReturnedSumLlama(LlamaForCausalLM):
    """The output's loss is not the loss computed above."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss * 2, logits=logits)


class NoKwargsLossLlama(LlamaForCausalLM):
    """A loss call that passes nothing on: the model's loss is the mean whatever num_items_in_batch says."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class LiteralVocabLlama(LlamaForCausalLM):
    """The loss told a vocabulary size the reading cannot check against the head."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, 100, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _vocab_told(model, vocab_size):
    model.config.vocab_size = vocab_size  # the head keeps its rows: model(...).loss views the logits otherwise
    return model


def _doubled_loss(self, *args, **kwargs):
    output = LlamaForCausalLM.forward(self, *args, **kwargs)
    output.loss = output.loss * 2
    return output


def _patched_with_wraps():
    """A class-level patch that copies the original's names (functools.wraps): inspect would read the original."""
    cls = type("PatchedLlama", (LlamaForCausalLM,), {})
    cls.forward = functools.wraps(LlamaForCausalLM.forward)(_doubled_loss)
    return cls(llama().config).double()


class CalledLlama(LlamaForCausalLM):
    def __call__(self, *args, **kwargs):
        output = super().__call__(*args, **kwargs)
        output.loss = output.loss * 2
        return output


def _model_pre_hook(model):
    model.register_forward_pre_hook(lambda module, args, kwargs: (args, {**kwargs, "labels": None}), with_kwargs=True)
    return model


def _accelerate_model_hook(model):
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Halve(ModelHook):
        def post_forward(self, module, output):
            output.loss = output.loss / 2
            return output

    add_hook_to_module(model, Halve())
    return model


class UnmaskedDecoderLlama(LlamaForCausalLM):
    """A decoder call that leaves the attention mask out."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class RenamedArgumentLlama(LlamaForCausalLM):
    """A decoder argument under another parameter's name."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class KwargsToLossOnlyLlama(LlamaForCausalLM):
    """``**kwargs`` handed to the loss but not the decoder: a keyword the call is given must not reach it."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class CalledHead(torch.nn.Linear):
    def __call__(self, x):
        return super().__call__(x) * 2


def _called_head(model):
    head = CalledHead(32, 97, bias=False, dtype=torch.float64)
    head.weight = model.lm_head.weight
    model.lm_head = head
    return model


def _hooked_peft(model):
    peft_model = _lora(model, target_modules=["q_proj"])
    peft_model.register_forward_pre_hook(lambda module, args, kwargs: (args, kwargs), with_kwargs=True)
    return peft_model


def _hooked_compiled(model):
    compiled = torch.compile(model)
    compiled.register_forward_hook(lambda module, args, out: out)
    return compiled


def _lora(model, **config):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))


def _prompt_tuning(model):
    from peft import PromptTuningConfig, TaskType, get_peft_model

    return get_peft_model(model, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2))


def _hooked_head(model):
    model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    return model


def _head_with_own_forward(model):
    head = model.lm_head
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight) * 2
    return model


def _patched_model_forward(model):
    model.forward = types.MethodType(lambda self, **kwargs: LlamaForCausalLM.forward(self, **kwargs), model)
    return model


def _accelerate_hooked(model):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(model, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    return model


def _own_loss_function(model):
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: ForCausalLMLoss(logits, labels, vocab_size) * 2
    return model


REFUSED = {
    "a z-loss added to the loss": (lambda: ZLossLlama(llama().config).double(), "under `if labels is not None:`"),
    "logits cut after the head": (lambda: CutVocabularyLlama(llama().config).double(), "logits\\[..., :90\\]"),
    "a layer between hidden states and head": (lambda: NormedHeadLlama(llama().config).double(), "self.model.norm"),
    "unshifted labels, no loss_function": (lambda: UnshiftedLlama(llama().config).double(), "the loss `loss ="),
    "a scale after the softcapping": (
        lambda: ScaledAfterCapLlama(llama(final_logit_softcapping=5.0, logit_scale=0.5).config).double(),
        "logits \\* self.config.logit_scale",
    ),
    "LoRA on the head": (lambda: _lora(llama(), target_modules=["lm_head"]), "is not called as a plain nn.Linear"),
    "the head in modules_to_save": (
        lambda: _lora(llama(), target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "is not called as a plain nn.Linear",
    ),
    "prompt tuning": (lambda: _prompt_tuning(llama()), "prompt learning"),
    "a forward hook on the head": (lambda: _hooked_head(llama()), "module hooks"),
    "a forward set on the head (accelerate's offload)": (lambda: _head_with_own_forward(llama()), "plain nn.Linear"),
    "the model's own loss_function": (lambda: _own_loss_function(llama()), "loss_function is <lambda>"),
    "a forward set on the model": (lambda: _patched_model_forward(llama()), "a forward of its own"),
    "a router loss on (config)": (lambda: mixtral(output_router_logits=True), "if output_router_logits:"),
    "a branch returning another loss": (lambda: EarlyReturnLlama(llama().config).double(), "the branch `if self"),
    "a returned loss other than the loss": (lambda: ReturnedSumLlama(llama().config).double(), "the return `return"),
    "a class-level patch made with functools.wraps": (_patched_with_wraps, "wrapped by a function from"),
    "the model's own __call__": (lambda: CalledLlama(llama().config).double(), "not torch's Module.__call__"),
    "a pre-hook on the model": (lambda: _model_pre_hook(llama()), "it has module hooks"),
    "an accelerate hook other than the device hook": (lambda: _accelerate_model_hook(llama()), "forward of its own"),
    "num_items_in_batch to a loss call without **kwargs": (
        lambda: NoKwargsLossLlama(llama().config).double(),
        "does not pass on num_items_in_batch",
        {"num_items_in_batch": 7},
    ),
    "a decoder call without the attention mask": (
        lambda: UnmaskedDecoderLlama(llama().config).double(),
        "without `attention_mask`",
    ),
    "a decoder argument renamed": (lambda: RenamedArgumentLlama(llama().config).double(), "position_ids=attention"),
    "a keyword the forward keeps from its decoder": (
        lambda: KwargsToLossOnlyLlama(llama().config).double(),
        "does not hand `position_ids` to its decoder",
        {"position_ids": torch.arange(12).expand(2, 12)},
    ),
    "logits_to_keep": (llama, "uses `logits_to_keep` itself", {"logits_to_keep": 4}),
    "a loss told another vocab_size than the head's": (
        lambda: _vocab_told(llama(), SIZES["vocab_size"] // 2),
        "vocab_size `self.config.vocab_size` = .* while its head has",
    ),
    "a loss told a vocab_size the reading cannot check": (
        lambda: LiteralVocabLlama(llama().config).double(),
        "the loss's vocab_size",
    ),
    "a head with its own __call__": (lambda: _called_head(llama()), "not called as a plain nn.Linear"),
    "a hook on the PEFT model": (lambda: _hooked_peft(llama()), "it has module hooks"),
    "a hook on the compiled model": (lambda: _hooked_compiled(llama()), "it has module hooks"),
    "activated LoRA": (
        lambda: _lora(llama(), target_modules=["q_proj"], alora_invocation_tokens=[5]),
        "activated LoRA",
    ),
    "PEFT adapter_names": (
        lambda: _lora(llama(), target_modules=["q_proj"]),
        "adapter_names",
        {"adapter_names": ["default", "default"]},
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_causal_lm_loss_refuses_what_it_would_not_reproduce(lk, case):
    """Each of these models' losses differs from the fused loss on the head's weight: a ValueError naming why,
    raised before the decoder runs."""
    make, match, *call = REFUSED[case]
    model = make()
    ids, mask, labels = model_inputs()
    calls = []
    decoder = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=match):
        lk.causal_lm_loss(model, ids, labels, attention_mask=mask, **(call[0] if call else {}))
    assert calls == []


def test_causal_lm_loss_serves_a_loss_call_without_kwargs_when_nothing_is_passed_on(lk):
    model = NoKwargsLossLlama(llama().config).double()
    ids, mask, labels = model_inputs()
    want = _causal_loss64(model(input_ids=ids, attention_mask=mask).logits, labels)
    assert rel_err(lk.causal_lm_loss(model, ids, labels, attention_mask=mask), want) <= 1e-12


def _reads_as_llama(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden_states = outputs.last_hidden_state
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _edited(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden_states = outputs.last_hidden_state
    logits = self.lm_head(hidden_states) * 2
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_an_edited_forward_is_read_again(lk):
    """The reading is kept per code object: a forward whose code is swapped in place (IPython's autoreload does
    that on a file edit) is read again, and refused here (its new factor is a number, not a model attribute)."""
    cls = type("EditedLlama", (LlamaForCausalLM,), {"forward": types.FunctionType(_reads_as_llama.__code__, {})})
    assert lk._causal_lm.form_of(cls).problem is None
    cls.forward.__code__ = _edited.__code__
    assert "* 2" in lk._causal_lm.form_of(cls).problem


def test_causal_lm_loss_refuses_under_a_global_module_hook(lk):
    model = llama()
    ids, mask, labels = model_inputs()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.raises(ValueError, match="module hooks"):
            lk.causal_lm_loss(model, ids, labels, attention_mask=mask)
    finally:
        handle.remove()
    lk.causal_lm_loss(model, ids, labels, attention_mask=mask)  # served again once the hook is gone


def mixtral(**overrides):
    config = dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, **overrides)
    return tiny(T.MixtralConfig, T.MixtralForCausalLM, **config).float()  # (grouped GEMMs: no float64)


def test_causal_lm_loss_serves_an_moe_without_its_router_loss(lk):
    """Mixtral adds its router's load-balancing loss under `output_router_logits`: with it off (the config's
    default, or passed False over a config that turns it on) the fused loss is the model's; passed True, refused."""
    ids, mask, labels = model_inputs()
    model = mixtral().eval()
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert rel_err(lk.causal_lm_loss(model, ids, labels, attention_mask=mask), want) <= FP32_BOUND
    with pytest.raises(ValueError, match="output_router_logits=False"):
        lk.causal_lm_loss(model, ids, labels, attention_mask=mask, output_router_logits=True)
    on = mixtral(output_router_logits=True).eval()
    want_off = on(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False).loss
    got = lk.causal_lm_loss(on, ids, labels, attention_mask=mask, output_router_logits=False)
    assert rel_err(got, want_off) <= FP32_BOUND
    assert rel_err(want_off, on(input_ids=ids, attention_mask=mask, labels=labels).loss) > 1e-4  # the term is real


def _scale_rows(weight):
    return weight * torch.linspace(0.5, 1.5, weight.shape[0], dtype=weight.dtype)[:, None]


class RowScale(torch.nn.Module):
    def forward(self, weight):
        return _scale_rows(weight)


WRAPPED = {
    "LoRA on the attention (PEFT)": lambda: _lora(llama(), target_modules=["q_proj", "v_proj"]),
    "a parametrized head": lambda: _parametrized_head(llama()),
    "torch.compile": lambda: torch.compile(llama()),
    "accelerate's device hook on the model": lambda: _accelerate_hooked(llama()),
}


def _parametrized_head(model):
    torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", RowScale())
    return model


@pytest.mark.parametrize("case", sorted(WRAPPED))
def test_causal_lm_loss_through_wrappers_equals_their_loss(lk, case):
    """A PEFT model (LoRA layers run in its decoder), a parametrized head (its weight is the parametrization's)
    and a compiled model (its original module serves): the loss and gradients equal the wrapped model's own."""
    model = WRAPPED[case]()
    ids, mask, labels = model_inputs()
    reference = getattr(model, "_orig_mod", model)  # (the compiled forward rounds float64 sums in its own order)
    logits = reference(input_ids=ids, attention_mask=mask).logits
    want = _causal_loss64(logits, labels)
    want_grads = grads_of(model, want)
    got = lk.causal_lm_loss(model, ids, labels, attention_mask=mask)
    assert rel_err(got, want) <= 1e-12
    for g, w in zip(grads_of(model, got), want_grads):
        assert rel_err(g, w) <= 1e-10


def test_forms_read_from_transformers_classes(lk):
    """The reading of transformers' own forwards: what each serves with, and what it refuses."""
    form_of = lk._causal_lm.form_of
    llama_form = form_of(LlamaForCausalLM)
    assert (llama_form.decoder, llama_form.head, llama_form.problem) == (("model",), "lm_head", None)
    assert llama_form.vocab_size == ("config", "vocab_size")  # checked against the head's outputs at the call
    # a link "name()" is called: `self.config.get_text_config().vocab_size`, as two multimodal forwards tell it
    assert lk._causal_lm.value_at(llama(), ("config", "get_text_config()", "vocab_size")) == SIZES["vocab_size"]
    assert form_of(Gemma2ForCausalLM).softcap == ("config", "final_logit_softcapping")
    assert form_of(T.MixtralForCausalLM).guards == (("output_router_logits", ("config", "output_router_logits")),)
    assert form_of(T.OPTForCausalLM).decoder == ("model", "decoder")
    for refused in (T.BambaForCausalLM, T.BartForCausalLM, T.ClvpForCausalLM, T.InklingForCausalLM):
        assert form_of(refused).problem, refused
    assert form_of(ZLossLlama) is form_of(ZLossLlama)  # read once


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


MISSHAPEN = {  # case: (logits or hidden states, message)
    "hidden size": (lambda: {"hidden_states": torch.randn(B, S, H + 1)}, "`hidden_states` must end in the head's"),
    "hidden positions": (lambda: {"hidden_states": torch.randn(B, S + 1, H)}, "`hidden_states` must hold one"),
    "logits width": (lambda: {"logits": torch.randn(B, S, V + 2)}, "`logits` must end in `vocab_size`"),
    "logits positions": (lambda: {"logits": torch.randn(B, S - 1, V)}, "`logits` must hold one position"),
}


@pytest.mark.parametrize("case", sorted(MISSHAPEN))
def test_misshapen_inputs_are_named(lk, case):
    """Hidden states or logits that do not end in the head's width, or hold another number of positions than the
    labels: a ValueError naming them (it was a reshape's RuntimeError, or an error about the loss's `target`)."""
    make, message = MISSHAPEN[case]
    inputs = {"logits": None, **make()}
    if "hidden_states" in inputs:
        inputs["lm_head_weight"] = torch.randn(V, H)
    with pytest.raises(ValueError, match=message.replace("`", "`")):
        lk.LigerForCausalLMLoss(labels=batch(), vocab_size=V, **inputs)


def test_causal_lm_loss_compiles_and_exports_after_eager_calls(lk):
    """The model's form is read once per class and kept; a compiled call reads it as a constant of the trace and
    leaves the kept map alone: dynamo's guard on a map keyed by code objects failed to compile (an internal
    SyntaxError) at the first recompile and at any compile after an eager call, strict export too."""
    torch._dynamo.reset()
    model = llama()
    step = torch.compile(lambda model, ids: lk.causal_lm_loss(model, ids, labels=ids), backend="eager")
    for length in (9, 13):  # an eager call first, then a recompile for the second length
        ids = torch.randint(0, SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(length))
        want = lk.causal_lm_loss(model, ids, labels=ids)
        torch.testing.assert_close(step(model, ids), want, rtol=1e-12, atol=0)
    module = lk.CausalLMWithFusedLoss(model)
    exported = torch.export.export(module, (ids,), {"labels": ids}, strict=True)
    torch.testing.assert_close(exported.module()(ids, labels=ids), want, rtol=1e-12, atol=0)
    torch._dynamo.reset()


def test_causal_lm_loss_runs_the_decoder_without_a_cache_unless_asked(lk):
    """No KV cache is built for the loss (the tiled decoder layers need none): with packed sequences (position_ids
    that restart at 0, no mask) transformers then keeps them apart with a block-diagonal mask, as
    ``model(..., use_cache=False)`` does, where ``model(...)`` under the config's ``use_cache=True`` builds a cache
    and a plain causal mask over the pack; ``use_cache=True`` passed gives that one. Unpacked, every form agrees."""
    model = llama()
    assert model.config.use_cache
    ids = torch.randint(0, SIZES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2)
    apart = model(input_ids=ids, labels=ids, position_ids=packed, use_cache=False).loss
    across = model(input_ids=ids, labels=ids, position_ids=packed).loss
    # (transformers' loss casts the logits to fp32: its losses are fp32-accurate)
    assert rel_err(apart, across) > 1000 * FP32_BOUND  # the two masks differ, or this test would prove nothing
    assert rel_err(lk.causal_lm_loss(model, ids, labels=ids, position_ids=packed), apart) <= FP32_BOUND
    assert rel_err(lk.causal_lm_loss(model, ids, labels=ids, position_ids=packed, use_cache=True), across) <= FP32_BOUND
    assert rel_err(lk.causal_lm_loss(model, ids, labels=ids), model(input_ids=ids, labels=ids).loss) <= FP32_BOUND


def test_the_loss_exports_and_compiles_with_a_dynamic_sequence_length(lk):
    """Non-strict export with a dynamic sequence dimension, and compile with an unbacked one: the label shift guards
    no length (another spelling, the slice padded, guarded S - 1 != 1 and failed both)."""

    class Loss(torch.nn.Module):
        def forward(self, logits, labels):
            return lk.LigerForCausalLMLoss(logits, labels, V)

    length = torch.export.Dim("S")
    example = (torch.randn(2, 6, V), torch.randint(0, V, (2, 6)))
    exported = torch.export.export(Loss(), example, dynamic_shapes=({1: length}, {1: length}), strict=False)
    logits, labels = torch.randn(2, 9, V), batch()[:, :9]
    torch.testing.assert_close(exported.module()(logits, labels), lk.LigerForCausalLMLoss(logits, labels, V))
    torch._dynamo.reset()
    compiled = torch.compile(lambda logits, labels: lk.LigerForCausalLMLoss(logits, labels, V), backend="eager")
    labels = labels.clone()
    torch._dynamo.decorators.mark_unbacked(labels, 1)
    torch.testing.assert_close(compiled(logits, labels), lk.LigerForCausalLMLoss(logits, labels, V))
    torch._dynamo.reset()


def test_a_forward_replaced_after_compiling_is_read_again(lk):
    """The compiled call's reading of the model's forward is guarded by the forward itself: replaced by one the loss
    would not reproduce (here a wrapper that doubles the loss), the compiled call refuses it as the eager one does,
    instead of the old reading's loss."""
    torch._dynamo.reset()

    class Model(LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    model = Model(LlamaConfig(**SIZES)).double()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))
    step = torch.compile(lambda model, ids: lk.causal_lm_loss(model, ids, labels=ids), backend="eager")
    assert rel_err(step(model, ids), model(input_ids=ids, labels=ids).loss) <= FP32_BOUND
    original = Model.forward

    def doubled(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.loss = out.loss * 2
        return out

    Model.forward = doubled
    for call in (lambda: lk.causal_lm_loss(model, ids, labels=ids), lambda: step(model, ids)):
        with pytest.raises(ValueError, match="cannot be served"):
            call()
    # a forward that is a new object at each lookup (a partialmethod): refused when compiled as in eager, not a
    # guard failure inside dynamo (a guard on the forward's identity)
    Model.forward = functools.partialmethod(LlamaForCausalLM.forward)
    torch._dynamo.reset()
    for call in (lambda: lk.causal_lm_loss(model, ids, labels=ids), lambda: step(model, ids)):
        with pytest.raises(ValueError, match="cannot be served"):
            call()
    torch._dynamo.reset()
