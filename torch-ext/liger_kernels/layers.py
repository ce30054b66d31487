"""Layers for ``kernels.kernelize``: the fused MLPs, their tiled forms, a tiled Linear, and RMSNorm.

``kernelize`` binds a layer's ``forward`` to the host module (a ``LlamaMLP``, a ``GemmaMLP``, ...), so
``self`` is the host: the layers read its ``gate_proj``, ``up_proj`` and ``down_proj`` and hold no state of
their own. ``kernels`` rejects a layer with a constructor or members other than ``forward``,
``can_torch_compile`` and ``has_backward``, so the math lives in the module-level functions below.
"""

import ast
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from . import geglu as _geglu
from . import rms_norm as _rms_norm
from . import swiglu as _swiglu
from .tiled_mlp import apply_tiled_mlp, is_plain_linear

# How a host's activation is recognized: its ``act_fn`` (module or function) first, since that is what the
# host computes, else its config's ``hidden_act`` / ``hidden_activation``.
_SILU = "silu"
_GELU_TANH = "tanh"
_GELU_EXACT = "none"
_ACTIVATION_CLASSES = {
    "SiLU": _SILU,
    "SiLUActivation": _SILU,
    "GELUActivation": _GELU_EXACT,  # erf form (also with use_gelu_python)
    "GELUTanh": _GELU_TANH,
    "PytorchGELUTanh": _GELU_TANH,
    "NewGELUActivation": _GELU_TANH,
    "FastGELUActivation": _GELU_TANH,
    "AccurateGELUActivation": _GELU_TANH,
}
_ACTIVATION_NAMES = {
    "silu": _SILU,
    "swish": _SILU,
    "gelu": _GELU_EXACT,
    "gelu_python": _GELU_EXACT,
    "gelu_pytorch_tanh": _GELU_TANH,
    "gelu_python_tanh": _GELU_TANH,
    "gelu_new": _GELU_TANH,
    "gelu_fast": _GELU_TANH,
    "gelu_accurate": _GELU_TANH,
}


def host_activation(module: nn.Module):
    """The gated activation ``module`` computes: "silu", "tanh" (tanh-approximated GELU), "none" (exact
    GELU), None when the module does not say, or a string describing an activation this package lacks."""
    act_fn = getattr(module, "act_fn", None)
    if act_fn is not None:
        if isinstance(act_fn, nn.GELU):
            return _GELU_TANH if act_fn.approximate == "tanh" else _GELU_EXACT
        if act_fn is torch.nn.functional.silu:
            return _SILU
        if act_fn is torch.nn.functional.gelu:
            return _GELU_EXACT
        name = type(act_fn).__name__
        return _ACTIVATION_CLASSES.get(name, f"act_fn {name}")
    config = getattr(module, "config", None)
    for key in ("hidden_act", "hidden_activation"):
        name = getattr(config, key, None)
        if isinstance(name, str):
            return _ACTIVATION_NAMES.get(name, f"config.{key}={name!r}")
    return None


def _check_silu_host(module: nn.Module, layer: str) -> None:
    found = host_activation(module)
    if found not in (None, _SILU):
        raise ValueError(
            f"{layer} computes silu(gate_proj(x)) * up_proj(x), but the host {type(module).__name__} uses "
            f"{_describe(found)}; map this module to a layer with its own activation instead"
        )


def _gelu_form(module: nn.Module, layer: str) -> str:
    found = host_activation(module)
    if found is None:
        return _GELU_TANH
    if found not in (_GELU_TANH, _GELU_EXACT):
        raise ValueError(
            f"{layer} computes gelu(gate_proj(x)) * up_proj(x) (tanh or exact GELU), but the host "
            f"{type(module).__name__} uses {_describe(found)}"
        )
    return found


def _describe(found: str) -> str:
    return {_SILU: "SiLU", _GELU_TANH: "tanh-approximated GELU", _GELU_EXACT: "exact GELU"}.get(found, found)


def _in_place_ok(module: nn.Module) -> bool:
    """True when gate_proj(x) and up_proj(x) return fresh tensors nobody else keeps (plain nn.Linear calls
    without hooks): only then may backward write gradients over them."""
    return is_plain_linear(module.gate_proj) and is_plain_linear(module.up_proj)


def swiglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused SwiGLU."""
    _check_silu_host(module, "LigerSwiGLUMLP")
    gate, up = module.gate_proj(x), module.up_proj(x)
    return module.down_proj(_swiglu.silu_mul(gate, up, 1.0, 1.0, _in_place_ok(module)))


def geglu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` with the fused GeGLU, in the host's GELU form."""
    approximate = _gelu_form(module, "LigerGEGLUMLP")
    gate, up = module.gate_proj(x), module.up_proj(x)
    return module.down_proj(_geglu.gelu_mul(gate, up, approximate, _in_place_ok(module)))


class LigerSwiGLUMLP(nn.Module):
    """SwiGLU MLP (Llama, Mistral, Qwen): ``down_proj(silu(gate_proj(x)) * up_proj(x))``, fused activation."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(self, x)


class LigerGEGLUMLP(nn.Module):
    """GeGLU MLP (Gemma): ``down_proj(gelu(gate_proj(x)) * up_proj(x))``, tanh or exact GELU as the host."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu_mlp(self, x)


# The tiled layers' fns say which gated activation they compute (checking the host as fn itself would), so
# the tiled MLP can run the math directly and recompute only gate and up (see tiled_mlp._gated_plan).
def _swiglu_activation(module: nn.Module):
    _check_silu_host(module, "LigerSwiGLUMLP")
    return _swiglu.SILU


swiglu_mlp.gated_activation = _swiglu_activation
geglu_mlp.gated_activation = lambda module: _geglu.ACTIVATIONS[_gelu_form(module, "LigerGEGLUMLP")]


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def tiled(fn, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``fn(module, x)`` through the tiled MLP; a host attribute ``num_shards`` overrides ceil(S / H)."""
    return apply_tiled_mlp(fn, module, x, num_shards=getattr(module, "num_shards", None))


class LigerTiledSwiGLUMLP(nn.Module):
    """:class:`LigerSwiGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(swiglu_mlp, self, x)


class LigerTiledGEGLUMLP(nn.Module):
    """:class:`LigerGEGLUMLP` run over sequence shards and recomputed in backward (long sequences)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(geglu_mlp, self, x)


class LigerLinear(nn.Module):
    """A host ``nn.Linear`` run over sequence shards and recomputed in backward; 1-D input runs untiled."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(self, input) if input.dim() < 2 else tiled(linear, self, input)


# ----------------------------------------------------------------------------------------------------------
# RMSNorm.
#
# LigerRMSNorm serves every module transformers tags "RMSNorm", so it must be sure to compute what the
# host's own forward computes. It reads the host class's ``forward`` source once (cached per class) and
# compares its syntax tree, normalized, with the forms below: argument and local names, annotations and the
# docstring do not matter; every operation, its order and the dtypes it casts to do. That is cheap (one
# parse per class, then a dict lookup) and robust where the alternatives are not: the class name says
# nothing about a subclass or a user's own module; a numeric probe would run the host's forward (on its
# device, possibly under torch.compile) and can miss a cast that changes nothing on the probe's values.
# Anything else (Gemma's ``(1 + weight)``, a bias, a decorated forward, source that cannot be read) is
# refused with a ValueError, unless declared with :func:`declare_rms_norm_host`.

_EPS_ATTRIBUTES = ("variance_epsilon", "eps")
_RMS_NORM_FORMS = (  # (forward, casting, offset). `self.eps` stands for either attribute above.
    # LlamaRMSNorm (Mistral, Qwen2/3, Phi-3, ...): the weight times x_normed rounded to the input dtype.
    ("""
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return self.weight * x.to(dtype)
""", "llama", 0.0),
    # The product in fp32, rounded once (OLMo hybrid, FlexOlmo, DeepSeek-V4, NemotronH, ...): rms_norm's
    # "gemma" casting with offset 0.
    ("""
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return (self.weight * x).to(dtype)
""", "gemma", 0.0),
    ("""
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return (self.weight.to(torch.float32) * x).to(dtype)
""", "gemma", 0.0),
)


class _CanonicalNames(ast.NodeTransformer):
    """Renames arguments and locals by order of appearance and the epsilon attribute of the first argument
    (self) to ``EPS``, recording which one it was."""

    def __init__(self, local_names):
        self.local_names = local_names
        self.names = {}
        self.eps_attributes = set()

    def _canonical(self, name):
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_arg(self, node):
        node.arg, node.annotation, node.type_comment = self._canonical(node.arg), None, None
        return node

    def visit_AnnAssign(self, node):  # `name: type = value` assigns as `name = value` does
        if node.value is None:
            return node
        return self.visit(ast.Assign(targets=[node.target], value=node.value, type_comment=None))

    def visit_Name(self, node):
        if node.id in self.local_names:
            node.id = self._canonical(node.id)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "v0" and node.attr in _EPS_ATTRIBUTES:
            self.eps_attributes.add(node.attr)
            node.attr = "EPS"
        return node


def _normalized(source: str):
    """(normalized dump of the function in ``source``, epsilon attributes it reads), or None."""
    try:
        function = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(function, ast.FunctionDef):
        return None
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
        body = body[1:]  # the docstring
    function.name, function.returns, function.type_comment, function.body = "forward", None, None, body
    arguments = function.args
    local_names = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
    local_names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    local_names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    names = _CanonicalNames(local_names)
    names.visit(function)
    return ast.dump(function), names.eps_attributes


_KNOWN_FORMS = {_normalized(source)[0]: (casting, offset) for source, casting, offset in _RMS_NORM_FORMS}
_RMS_NORM_HOSTS = {}  # host class -> (casting, offset, epsilon attribute, "" or why it is refused)


def _classify_rms_norm_host(cls) -> tuple:
    def refused(why):
        return (None, 0.0, None, (
            f"LigerRMSNorm reproduces LlamaRMSNorm's weight * x_normed.to(x.dtype) and the fp32 product "
            f"(weight * x_normed).to(x.dtype), but the host {cls.__module__}.{cls.__qualname__} {why}; "
            f"leave this module unmapped (do not kernelize its "
            f"\"RMSNorm\" layer), or, if its forward is one of rms_norm's castings, declare it with "
            f"layers.declare_rms_norm_host({cls.__qualname__}, casting=..., offset=..., eps_attribute=...)"
        ))  # fmt: skip

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return refused("has a forward whose source cannot be read to confirm what it computes")
    normalized = _normalized(source)
    form = _KNOWN_FORMS.get(normalized[0]) if normalized is not None else None
    if form is None:
        return refused("has a forward of another form (a (1 + weight) scale, a bias, other casts, ...)")
    return (*form, normalized[1].pop(), "")


def rms_norm_host(cls) -> tuple:
    """``(casting, offset, eps attribute, refusal)`` for a host class, cached. Under torch.compile it is
    evaluated while tracing and its result used as a constant (the mark torch.compiler.assume_constant_result
    sets, set here without importing dynamo when the package loads)."""
    form = _RMS_NORM_HOSTS.get(cls)
    if form is None:
        form = _RMS_NORM_HOSTS[cls] = _classify_rms_norm_host(cls)
    return form


rms_norm_host._dynamo_marked_constant = True


def declare_rms_norm_host(host_class, casting="llama", offset=0.0, eps_attribute="variance_epsilon") -> None:
    """Declare that ``host_class.forward`` computes ``rms_norm(x, self.weight, self.<eps_attribute>, offset,
    casting)``, for a host LigerRMSNorm does not recognize (e.g. ``GemmaRMSNorm``: ``casting="gemma",
    offset=1.0, eps_attribute="eps"``). The declaration is trusted, not checked."""
    if not isinstance(host_class, type):
        raise TypeError(f"declare_rms_norm_host: `host_class` must be a class, got {type(host_class).__name__}")
    if casting not in _rms_norm.CASTINGS:
        raise ValueError(f"declare_rms_norm_host: `casting` must be one of {_rms_norm.CASTINGS}, got {casting!r}")
    if not isinstance(eps_attribute, str):
        raise TypeError(f"declare_rms_norm_host: `eps_attribute` must be a str, got {type(eps_attribute).__name__}")
    offset = _rms_norm._check_real(offset, "offset")
    _RMS_NORM_HOSTS[host_class] = (casting, offset, eps_attribute, "")


def rms_norm_layer(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The host's RMSNorm of ``hidden_states`` with its ``weight`` and epsilon, after checking its form."""
    casting, offset, eps_attribute, refusal = rms_norm_host(type(module))
    if refusal:
        raise ValueError(refusal)
    return _rms_norm.rms_norm(hidden_states, module.weight, getattr(module, eps_attribute), offset, casting)


class LigerRMSNorm(nn.Module):
    """RMSNorm for hosts of the ``LlamaRMSNorm`` form (``weight * x_normed.to(x.dtype)``) and of the fp32-product
    form (``(weight * x_normed).to(x.dtype)``), reading the host's ``weight`` and ``variance_epsilon`` (or
    ``eps``); other hosts are refused with a ValueError (see :func:`declare_rms_norm_host`)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_layer(self, hidden_states)
