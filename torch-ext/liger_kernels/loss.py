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

import inspect
import numbers
import types

import torch
import torch.nn.functional as F
from torch import nn

from . import _causal_lm, _hosts, _zero3
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
        # (for one sequence a view 8 bytes into its storage: its launches are bound as aligned ones, _launch)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    fused = hidden_states is not None and lm_head_weight is not None
    options = {k: kwargs[k] for k in (_FUSED_OPTIONS if fused else _LOGITS_OPTIONS) if kwargs.get(k) is not None}
    if fused:
        hidden_size = kwargs.get("hidden_size") or lm_head_weight.shape[-1]
        _check_positions(hidden_states, "hidden_states", hidden_size, "the head's hidden size", shift_labels)
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
        _check_positions(logits, "logits", vocab_size, "`vocab_size`", shift_labels)
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


def _check_positions(tensor, arg: str, width, what: str, labels) -> None:
    """``tensor`` [..., width] with one position per label: a clear error before the reshape to rows (which would
    raise its own, or make a row count that the loss then blames on its target)."""
    try:
        if tensor.shape[-1] == width and tensor.numel() == width * labels.numel():
            return
    except (AttributeError, IndexError, TypeError):
        return  # not tensors, or 0-d: the loss's own checks name the argument
    if tensor.shape[-1] != width:
        raise ValueError(f"LigerForCausalLMLoss: `{arg}` must end in {what}, {width}, got shape {tuple(tensor.shape)}")
    raise ValueError(
        f"LigerForCausalLMLoss: `{arg}` must hold one position per label, got shape {tuple(tensor.shape)} for labels "
        f"of shape {tuple(labels.shape)}"
    )


def _served(model: nn.Module) -> nn.Module:
    """The CausalLM whose forward is read: a ``torch.compile``d model's original, a PEFT model's base model (its
    LoRA layers stay in place, so the decoder runs them); prompt learning is refused (it changes the inputs)."""
    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # (its forward is the compiled call of the original: only hooks on it would run around that)
            if _hosts._hooks_anywhere(model, _engine_hook):
                _refuse(model, "it has module hooks, which run around model(...) and not here")
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "active_peft_config"):
            config = model.active_peft_config
            if getattr(config, "is_prompt_learning", False):
                _refuse(model, "the PEFT model uses prompt learning, which changes the decoder's inputs")
            if getattr(config, "alora_invocation_tokens", None) is not None:
                _refuse(model, "its activated LoRA starts where the PEFT model's own forward finds it in input_ids")
            _check_call(model)  # (accelerate's mixed-precision forward, for one, is set on the PEFT model)
            model = model.get_base_model()
        elif isinstance(model, CausalLMWithFusedLoss):
            _check_call(model)
            model = model.model
        else:
            return model


def _distributed_wrapper(model) -> str | None:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return "FullyShardedDataParallel" if isinstance(model, FullyShardedDataParallel) else None


def _check_call(model) -> None:
    """``model(...)`` must be the class's forward and nothing around it: no hook of the model's own (but the
    engines' gathering ones), no global hook, no ``__call__`` of its own, no forward on the instance other than
    accelerate's device hook, which moves tensors between devices around the class forward."""
    if _own_call(model):
        _refuse(model, "its call is not torch's Module.__call__ (a subclass or instance overrides it)")
    if _hosts._hooks_anywhere(model, _engine_hook):
        _refuse(model, "it has module hooks (or global ones), which run around model(...) and not here")
    if "forward" in vars(model) and not _accelerate_device_hook(model):
        _refuse(model, "its instance has a forward of its own (a patch of this model's call), which would not run")


def _own_call(module) -> bool:
    """Whether calling ``module`` is something other than torch's ``Module.__call__`` running its forward."""
    cls = type(module)
    return (
        cls.__call__ is not nn.Module.__call__
        or cls._call_impl is not nn.Module._call_impl
        or "_call_impl" in vars(module)
    )


def _accelerate_device_hook(model) -> bool:
    """accelerate's ``AlignDevicesHook`` (``device_map``, offload) on the model: its forward is the class's own,
    with the inputs and outputs moved between devices."""
    old = getattr(model, "_old_forward", None)
    hook = getattr(model, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or (hook,)  # a SequentialHook holds several
    if getattr(old, "__func__", None) is not type(model).forward or hook is None:
        return False
    return all(type(h).__name__ == "AlignDevicesHook" and type(h).__module__ == "accelerate.hooks" for h in hooks)


def _refuse(model, why: str):
    raise ValueError(
        f"causal_lm_loss: {type(model).__name__} cannot be served: {why}. Compute model(...).loss for this model "
        "(its logits are then built)"
    )


def _is_one(value) -> bool:
    return isinstance(value, float) and value == 1.0


def _number(model, path, what: str, tensors: bool = True):
    """The number at ``path``: a float, or (``tensors``) a 0-d tensor, which then multiplies inside the graph."""
    value = _causal_lm.value_at(model, path)
    if tensors and isinstance(value, torch.Tensor) and value.dim() == 0:
        return value
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        _refuse(model, f"its {what} `self.{'.'.join(path)}` is {type(value).__name__}, not a number")
    return float(value)


def _check_guards(model, form, kwargs) -> None:
    """A block the forward runs under a flag (an MoE's router loss) must not run: the fused loss leaves it out.
    The flag is resolved as the forward resolves it: the call's value, else the config's, else its default."""
    for flag, config_path in form.guards:
        value = kwargs.get(flag)
        if value is None and config_path is not None:
            value = _causal_lm.value_at(model, config_path)
        if value is None:
            parameter = inspect.signature(type(model).forward).parameters.get(flag)
            value = None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
        if value:
            _refuse(
                model,
                f"its forward runs a block under `if {flag}:` (an MoE's router loss, for one), which the fused loss "
                f"would leave out; pass {flag}=False (and add that term from the decoder's outputs, "
                "return_outputs=True)",
            )


def _decoder_kwargs(model, form, kwargs) -> dict:
    """What the model's forward hands its decoder of ``kwargs``: a parameter it passes by name, the rest where it
    passes ``**kwargs`` on. A parameter it keeps for itself (``logits_to_keep``) must be at its default, and a
    keyword it would not hand the decoder is refused: either would make this decoder call differ from the model's."""
    parameters = inspect.signature(type(model).forward).parameters
    passed = {}
    for name, value in kwargs.items():
        kept = parameters.get(name)
        if name in form.decoder_parameters:
            passed[name] = value
        elif kept is not None and kept.kind is not inspect.Parameter.VAR_KEYWORD:
            if value is not None and not (kept.default is not inspect.Parameter.empty and _same(value, kept.default)):
                _refuse(model, f"its forward uses `{name}` itself, not in the decoder (pass it at its default)")
        elif form.decoder_takes_kwargs:
            passed[name] = value
        else:
            _refuse(model, f"its forward does not hand `{name}` to its decoder")
    if "use_cache" in form.decoder_parameters or form.decoder_takes_kwargs:
        # No cache is built for a loss unless asked (the tiled decoder layers run untiled with one). The loss is the
        # model's own but for packed sequences without a mask, where transformers then keeps them apart (README)
        passed.setdefault("use_cache", False)
    return passed


def _same(value, default) -> bool:
    return type(value) is type(default) and not isinstance(value, torch.Tensor) and value == default


def _check_loss_function(model) -> None:
    loss_function = getattr(model, "loss_function", None)
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # no transformers: the model cannot be one of its CausalLMs
        ForCausalLMLoss = None
    if loss_function is LigerForCausalLMLoss or (ForCausalLMLoss is not None and loss_function is ForCausalLMLoss):
        return
    name = getattr(loss_function, "__name__", type(loss_function).__name__)
    _refuse(model, f"its loss_function is {name}, not transformers' ForCausalLMLoss")


def _engine_hook(hook) -> bool:
    """A hook DeepSpeed ZeRO-3 or FSDP2 put on the head to gather its weight around its calls: the fused loss's
    read of the weight is served too (ZeRO-3 inside the engine's forward, FSDP2 through ``_fsdp_head_call``)."""
    owner = getattr(hook, "__self__", None)
    return _zero3.is_engine_hook(hook) or type(owner).__module__.startswith("torch.distributed.fsdp")


def _check_head(model, head, name: str) -> None:
    """The head's call must be exactly ``F.linear(hidden, weight, bias)``: what the fused loss computes."""
    if (
        not isinstance(head, nn.Linear)
        or type(head).forward is not nn.Linear.forward
        or _own_call(head)
        or "forward" in vars(head)
    ):
        _refuse(
            model,
            f"its head `self.{name}` ({type(head).__name__}) is not called as a plain nn.Linear (an adapter, layers "
            "around the projection, or a forward set on it, as accelerate's device hooks set one, would be skipped: "
            "the fused loss reads the weight and bias alone)",
        )
    if _hosts._hooks_anywhere(head, _engine_hook):
        _refuse(model, f"its head `self.{name}` has module hooks (or global ones), which the fused loss would not call")


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
    CausalLM, without the logits: the decoder the model's forward calls runs on the inputs (``kwargs`` go to it
    as the model's forward hands them on, e.g. ``position_ids`` or ``inputs_embeds``; ``use_cache`` defaults to
    False), then the fused linear
    cross-entropy on its last hidden state and the head's weight and bias, with the scaling and softcapping the
    forward applies to the logits. The model's forward is read first (``_causal_lm``); a model whose loss is
    something else (another loss term, a head that is not a plain nn.Linear, a router loss turned on) is refused
    with a ValueError. ``num_items_in_batch`` as the Trainer passes it (tokens of the whole accumulated batch:
    "sum" divided by it). Returns the loss, or ``(loss, decoder outputs)`` with ``return_outputs``. Plain
    PyTorch: works with gradient checkpointing, tied embeddings, PEFT LoRA and ``torch.compile``d models (their
    decoders run as they are); under DDP/FSDP2 call it inside the wrapped module's forward
    (:class:`CausalLMWithFusedLoss`)."""
    wrapper = _distributed_wrapper(model)
    if wrapper is not None:
        raise TypeError(
            f"causal_lm_loss: `model` is wrapped in {wrapper}, which gathers and synchronizes only around its own "
            f"forward; wrap CausalLMWithFusedLoss(model) in {wrapper} instead"
        )
    if labels is None and shift_labels is None:
        raise ValueError("causal_lm_loss: pass `labels` or `shift_labels`")
    model = _served(model)
    _check_call(model)
    form = _causal_lm.form_of(type(model))
    if form.problem:
        _refuse(model, form.problem)
    if not form.loss_takes_kwargs and (
        num_items_in_batch is not None or shift_labels is not None or ignore_index != -100
    ):
        _refuse(model, "its forward's loss_function call does not pass on num_items_in_batch, shift_labels or "
                       "ignore_index (no **kwargs), so the model's loss ignores them")  # fmt: skip
    for name in ("adapter_names", "alora_offsets"):
        if kwargs.get(name) is not None:
            _refuse(model, f"PEFT's {name} is applied by the PEFT model's own forward")
    _check_guards(model, form, kwargs)
    _check_loss_function(model)
    kwargs = _decoder_kwargs(model, form, kwargs)
    head = _causal_lm.value_at(model, (form.head,))
    _check_head(model, head, form.head)
    vocab = _causal_lm.value_at(model, form.vocab_size) if form.vocab_size else None
    if isinstance(vocab, torch.Tensor) and vocab.numel() == 1:
        vocab = vocab.item()
    # the logits' width is the weight's rows (out_features may be stale after a re-tie); out_features for a
    # weight an engine has partitioned away (ZeRO-3's empty placeholder)
    rows = head.weight.shape[0] if head.weight.numel() else head.out_features
    if type(vocab) is int and vocab != rows:  # (anything else: the model's own loss raises on it)
        told = f"`self.{'.'.join(form.vocab_size)}` = {vocab!r}"
        _refuse(model, f"its loss is told vocab_size {told} while its head has {rows} outputs: the model's loss "
                       "views the logits as rows of vocab_size")  # fmt: skip
    # (h s) W^T + b, then times t: (h s t) W^T + b t, with s the factors on the hidden states, t those on the logits
    hidden_scale = bias_scale = 1.0
    for on_logits, factors in ((False, form.hidden_factors), (True, form.logit_factors)):
        for factor in factors:
            value = _number(model, factor.path, "scale")
            if factor.divide and isinstance(value, float) and value == 0.0:
                _refuse(model, f"its logits are divided by `self.{'.'.join(factor.path)}`, which is 0")
            value = 1.0 / value if factor.divide else value
            hidden_scale = hidden_scale * value
            if on_logits:
                bias_scale = bias_scale * value
    softcap = None
    if form.softcap is not None and _causal_lm.value_at(model, form.softcap) is not None:
        softcap = _number(model, form.softcap, "softcapping", tensors=False)
    outputs = _causal_lm.value_at(model, form.decoder)(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    if form.hidden_cast:
        hidden = hidden.to(head.weight.dtype)
    options = dict(
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        hidden_scale=hidden_scale,
        bias_scale=bias_scale,
        final_logit_softcapping=softcap,
    )
    loss = (
        _fsdp_head_call(head, hidden, labels, options)
        if _is_fsdp_unit(head)
        else _head_loss(head, hidden, labels, options)
    )
    return (loss, outputs) if return_outputs else loss


def _head_loss(head, hidden, labels, options):
    """The fused loss on ``head``'s weight and bias (never its forward: that would build the logits)."""
    weight, bias = head.weight, head.bias
    if not _is_one(options["hidden_scale"]):
        hidden = hidden * options["hidden_scale"]
    if bias is not None and not _is_one(options["bias_scale"]):
        bias = bias * options["bias_scale"]
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
