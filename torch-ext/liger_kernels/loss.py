"""The causal-LM loss: transformers' ``ForCausalLMLoss`` contract, computed by this package's kernels.

* :func:`LigerForCausalLMLoss` takes transformers' arguments (``logits, labels, vocab_size,
  num_items_in_batch, ignore_index, shift_labels``) and, when given ``hidden_states`` and ``lm_head_weight``
  (and ``lm_head_bias``), runs the fused linear cross-entropy instead of reading logits; without them it
  computes the loss from ``logits`` with the cross-entropy kernels (in fp32, the logits never upcast in
  memory). Labels are shifted (padded with ``ignore_index``) unless ``shift_labels`` is given; "sum" divided
  by ``num_items_in_batch`` when it is given, else "mean" over the non-ignored tokens.
* :func:`causal_lm_loss` does the whole forward of a stock transformers CausalLM this way: its decoder, then
  the fused loss on the decoder's last hidden state and the model's output embedding, with the model's
  final-logit softcapping and logit scaling; the logits never exist.
* :class:`CausalLMWithFusedLoss` wraps a model so that one ``forward`` computes that loss: the module to hand
  to DDP or FSDP2, which only synchronize what runs inside the forward of the module they wrap.
"""

import numbers
import types

import torch
import torch.nn.functional as F
from torch import nn

from .cross_entropy import CrossEntropyOutput, cross_entropy
from .fused_linear_cross_entropy import liger_fused_linear_cross_entropy

# Options of the fused function that may ride along in ``**kwargs`` (transformers passes the model's other
# keyword arguments to the loss too; those are ignored).
_FUSED_OPTIONS = (
    "ce_weight",
    "lse_square_scale",
    "label_smoothing",
    "accum_dtype",
    "use_token_scaling",
    "return_token_accuracy",
    "return_predicted_tokens",
)
_LOGITS_OPTIONS = tuple(name for name in _FUSED_OPTIONS if name != "accum_dtype")


def LigerForCausalLMLoss(
    logits,
    labels,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    hidden_states=None,
    lm_head_weight=None,
    lm_head_bias=None,
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` (same arguments, same result), fused when ``hidden_states`` and
    ``lm_head_weight`` are given. ``kwargs``: ``hidden_size``, ``final_logit_softcapping`` (applied on the
    fused path; on the logits path the model has already applied it) and the fused function's options
    (``ce_weight``, ``lse_square_scale``, ``label_smoothing``, ``accum_dtype``, ``use_token_scaling``,
    ``return_token_accuracy``, ``return_predicted_tokens``); any other keyword is ignored. Returns the loss,
    or a ``CrossEntropyOutput`` when token accuracy or predicted tokens are asked for."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("LigerForCausalLMLoss: pass `labels` or `shift_labels`")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    fused = hidden_states is not None and lm_head_weight is not None
    options = {k: kwargs[k] for k in (_FUSED_OPTIONS if fused else _LOGITS_OPTIONS) if kwargs.get(k) is not None}
    if fused:
        hidden_size = kwargs.get("hidden_size") or lm_head_weight.shape[-1]
        hidden = hidden_states.reshape(-1, hidden_size)
        target = shift_labels.reshape(-1).to(hidden.device)
        result = liger_fused_linear_cross_entropy(
            hidden,
            lm_head_weight,
            target,
            bias=lm_head_bias,
            ignore_index=ignore_index,
            reduction=reduction,
            softcap=kwargs.get("final_logit_softcapping"),
            **options,
        )
    else:
        if logits is None:
            raise ValueError("LigerForCausalLMLoss: pass `logits`, or `hidden_states` and `lm_head_weight`")
        rows = logits.reshape(-1, vocab_size)
        target = shift_labels.reshape(-1).to(rows.device)
        result = cross_entropy(rows, target, ignore_index=ignore_index, reduction=reduction, **options)
    loss = result.loss if isinstance(result, CrossEntropyOutput) else result
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    if isinstance(result, CrossEntropyOutput):
        return CrossEntropyOutput(loss, None, result.token_accuracy, result.predicted_tokens)
    return loss


def _decoder(model: nn.Module) -> nn.Module:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", None)
    if decoder is None or decoder is model:
        raise ValueError(f"causal_lm_loss: cannot find the decoder of {type(model).__name__} (get_decoder() / .model)")
    return decoder


def _logit_scale(model: nn.Module, config) -> float:
    """The factor the model multiplies its logits by: Cohere's ``logit_scale``, Granite's ``1/logits_scaling``."""
    scale = 1.0
    model_scale = getattr(model, "logit_scale", None)
    if isinstance(model_scale, numbers.Real) and not isinstance(model_scale, bool):
        scale *= float(model_scale)
    scaling = getattr(config, "logits_scaling", None)
    if isinstance(scaling, numbers.Real) and not isinstance(scaling, bool):
        scale /= float(scaling)
    return scale


def causal_lm_loss(
    model,
    input_ids=None,
    labels=None,
    attention_mask=None,
    num_items_in_batch=None,
    shift_labels=None,
    return_outputs: bool = False,
    ignore_index: int = -100,
    **kwargs,
):
    """The loss ``model(input_ids, attention_mask=..., labels=...).loss`` computes, for a stock transformers
    CausalLM, without the logits: ``model.get_decoder()`` runs on the inputs (``kwargs`` go to it too, e.g.
    ``position_ids`` or ``inputs_embeds``; ``use_cache`` defaults to False), then the fused linear cross-entropy
    on its last hidden state and ``model.get_output_embeddings()``'s weight and bias, with the config's
    ``final_logit_softcapping`` and the model's logit scaling. ``num_items_in_batch`` as the Trainer passes it
    (tokens of the whole accumulated batch: "sum" divided by it). Returns the loss, or ``(loss, decoder
    outputs)`` with ``return_outputs``. Plain PyTorch: works with gradient checkpointing and tied embeddings;
    under DDP/FSDP2 call it inside the wrapped module's forward (:class:`CausalLMWithFusedLoss`)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "causal_lm_loss: `model` is wrapped in DistributedDataParallel, whose gradient synchronization only "
            "covers its own forward; wrap CausalLMWithFusedLoss(model) in DDP instead"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"causal_lm_loss: {type(model).__name__} has no output embedding with a weight")
    if labels is None and shift_labels is None:
        raise ValueError("causal_lm_loss: pass `labels` or `shift_labels`")
    kwargs.setdefault("use_cache", False)
    outputs = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    options = dict(
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        scale=_logit_scale(model, config),
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
    )
    loss = (
        _fsdp_head_call(head, hidden, labels, options)
        if _is_fsdp_unit(head)
        else _head_loss(head, hidden, labels, options)
    )
    return (loss, outputs) if return_outputs else loss


def _head_loss(head, hidden, labels, options):
    """The fused loss on ``head``'s weight and bias (never its forward: that would build the logits)."""
    weight, bias = head.weight, getattr(head, "bias", None)
    scale = options["scale"]
    if scale != 1.0:  # (h W^T + b) s = (s h) W^T + s b
        hidden = hidden * scale
        bias = bias * scale if bias is not None else None
    return LigerForCausalLMLoss(
        None,
        labels,
        weight.shape[0],
        num_items_in_batch=options["num_items_in_batch"],
        ignore_index=options["ignore_index"],
        shift_labels=options["shift_labels"],
        hidden_states=hidden,
        lm_head_weight=weight,
        lm_head_bias=bias,
        hidden_size=hidden.shape[-1],
        final_logit_softcapping=options["final_logit_softcapping"],
    )


def _is_fsdp_unit(module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


_FSDP_METHOD = "_liger_kernels_fused_loss"


def _fsdp_head_call(head, hidden, labels, options):
    """An lm_head that is its own FSDP2 unit holds sharded weights until its forward runs. The fused loss runs
    as a method FSDP2 treats as a forward (``register_fsdp_forward_method``): the weight is gathered for it and
    resharded after, and the weight's gradient is reduce-scattered in backward, as after the head's forward."""
    if _FSDP_METHOD not in vars(head):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(head, _FSDP_METHOD, types.MethodType(_head_loss, head))
        register_fsdp_forward_method(head, _FSDP_METHOD)
    return getattr(head, _FSDP_METHOD)(hidden, labels, options)


class CausalLMWithFusedLoss(nn.Module):
    """``CausalLMWithFusedLoss(model)(input_ids, labels=..., ...)`` is ``causal_lm_loss(model, ...)``: a module
    whose forward computes the fused loss, to be wrapped by DDP or ``fully_shard`` (FSDP2)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids=None,
        labels=None,
        attention_mask=None,
        num_items_in_batch=None,
        shift_labels=None,
        return_outputs: bool = False,
        **kwargs,
    ):
        return causal_lm_loss(
            self.model, input_ids, labels, attention_mask, num_items_in_batch, shift_labels, return_outputs, **kwargs
        )
