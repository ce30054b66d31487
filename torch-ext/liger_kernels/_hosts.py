"""What a host module computes, read before a layer stands in for it.

``kernelize`` binds a layer's forward to any module tagged with the layer's name, so a layer may only
serve hosts whose own forward it reproduces exactly. Two things are read from the host:

* its activation: the ``act_fn`` / ``activation_fn`` it calls, else its config's ``hidden_act`` /
  ``hidden_activation``;
* the form of its class ``forward``, parsed once per class: a gated MLP's forward must be
  ``down_proj(act(gate_proj(x)) * up_proj(x))`` (separate projections) or, with a fused projection,
  ``gate, up = gate_up_proj(x).chunk(2, dim=-1); down_proj(up * act(gate))`` (Phi-3). Straight-line
  assignments are followed; any other statement (a branch, a loop, a call to another helper) means the
  host does something the layer would drop (Gemma3n's activation sparsity is such a branch), and the
  layer refuses it with a message instead of silently computing something else.

This module is over 300 lines because it holds the two host readers (gated MLPs, RMSNorms) that share the
same method: a syntax-tree reading of the host's forward, once per class.
"""

import ast
import functools
import inspect
import math
import os
import sys
import textwrap
import types
from typing import NamedTuple

import torch
from torch import nn

from . import _zero3
from . import rms_norm as _rms_norm
from .activations import REGISTRY

# How hosts announce an activation, read from the registry: class names of activation modules, and config
# strings.
_BY_CLASS = {cls: a.name for a in REGISTRY.values() for cls in a.host_classes}
_BY_CONFIG = {name: a.name for a in REGISTRY.values() for name in a.config_names}
_ACTIVATION_ATTRIBUTES = ("act_fn", "activation_fn")


def host_activation(module: nn.Module, attributes=_ACTIVATION_ATTRIBUTES) -> str | None:
    """The registry name of the gated activation ``module`` computes (read from the first of ``attributes``
    it has, else from its config), None when the module does not say, or a string describing an activation
    this package lacks."""
    for attribute in attributes:
        act_fn = getattr(module, attribute, None)
        if act_fn is not None:
            return activation_of(act_fn, attribute)
    config = getattr(module, "config", None)
    for key in ("hidden_act", "hidden_activation"):
        name = getattr(config, key, None)
        if isinstance(name, str):
            return _BY_CONFIG.get(name, f"config.{key}={name!r}")
    return None


def activation_of(act_fn, attribute: str) -> str:
    """The registry name of the activation ``act_fn`` (a host's ``attribute``), or a string describing one this
    package lacks."""
    cls = type(act_fn)
    if "forward" in getattr(act_fn, "__dict__", ()) and not _kernelized(act_fn, cls):
        return f"{attribute} {cls.__name__} with a forward set on the instance"
    if isinstance(act_fn, nn.GELU) and cls.forward is nn.GELU.forward:  # a subclass may compute another
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    if act_fn is torch.nn.functional.silu:
        return "silu"
    if act_fn is torch.nn.functional.gelu:
        return "gelu"
    forward = getattr(cls, "forward", None)
    known = _ACTIVATION_CLASSES.get(id(cls))
    if known is None or known[0] is not cls or known[1] is not forward:
        if len(_ACTIVATION_CLASSES) >= MAX_FORMS:
            _ACTIVATION_CLASSES.clear()
        known = _ACTIVATION_CLASSES[id(cls)] = (cls, forward, _library_activation(cls, forward))
    if known[2] is not None:
        state = act_fn.__dict__
        if ("act" in state or "precomputed_constant" in state) and not _class_state(act_fn, known[2]):
            return f"{attribute} {cls.__name__} with its `act` or constant replaced on the instance"
        return known[2]
    if cls.__name__ in _BY_CLASS:  # a name the registry lists, on another class (or the class's forward patched)
        return f"{attribute} {cls.__module__}.{cls.__qualname__}, not torch's or transformers' own {cls.__name__}"
    return f"{attribute} {cls.__name__}"


def _kernelized(act_fn, cls) -> bool:
    """Whether ``act_fn``'s own forward is what ``kernels.kernelize`` installs on a module of a class it may extend
    (``kernel_layer_name``): a forward bound to the module, the class's own (no kernel mapped) or a kernel layer's,
    which the kernel mapping declares to compute the class's activation (transformers maps "SiLU", "GeluTanh"...
    to such kernels in inference). That is trusted as kernelize trusts it; any other forward set on an instance
    (a patch of the module's call) is not."""
    forward = act_fn.__dict__["forward"]
    if not (isinstance(forward, types.MethodType) and forward.__self__ is act_fn):
        return False
    function = forward.__func__
    if function is getattr(cls, "forward", None):
        return True
    # a layer class's forward (kernelize binds `layer.forward`), not a function of its own bound as one
    qualname = getattr(function, "__qualname__", "")
    owner, _, name = qualname.rpartition(".")
    layer = getattr(sys.modules.get(getattr(function, "__module__", None)), owner, None) if owner else None
    return (
        getattr(cls, "kernel_layer_name", None) is not None
        and name == "forward"
        and isinstance(layer, type)
        and issubclass(layer, nn.Module)
        and layer.__dict__.get("forward") is function
    )


# The instance state transformers' activation classes read in forward (asked in activation_of): GELUTanh's and
# GELUActivation's `act` (PyTorch's op, or the class's own Python form, as __init__ chooses), AccurateGELUActivation's
# `precomputed_constant`.
_GELU_TANH = functools.partial(torch.nn.functional.gelu, approximate="tanh")


def _class_state(act_fn, name: str) -> bool:
    """Whether the state ``act_fn``'s forward reads is what its class's ``__init__`` sets for activation ``name``."""
    state = act_fn.__dict__
    if "precomputed_constant" in state and state["precomputed_constant"] != math.sqrt(2 / math.pi):
        return False
    act = state.get("act", _MISSING_STATE)
    if act is _MISSING_STATE:
        return True
    if isinstance(act, types.MethodType):  # the class's own Python form (use_gelu_python and kin)
        function = act.__func__
        own = type(act_fn).__dict__.get(getattr(function, "__name__", None))
        return (
            act.__self__ is act_fn and own is function and _torchs_own(function, sys.modules[type(act_fn).__module__])
        )
    if name == "gelu_tanh":
        return (
            isinstance(act, functools.partial)
            and act.func is _GELU_TANH.func
            and act.args == _GELU_TANH.args
            and act.keywords == _GELU_TANH.keywords
        )
    return act is {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}.get(name, _MISSING_STATE)


_MISSING_STATE = object()


# id(activation class) -> (the class, its forward, its registry name or None), as _GATED_FORMS.
_ACTIVATION_CLASSES = {}
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def _library_activation(cls, forward) -> str | None:
    """The registry name of ``cls`` where it is torch's or transformers' own activation class of a name the
    registry lists, with the forward defined there; else None. A class of the same name elsewhere (a model's
    own ``SiLU`` computing another curve) or a forward patched onto the class is not taken for it."""
    name = _BY_CLASS.get(cls.__name__)
    module = sys.modules.get(cls.__module__) if cls.__module__ in _ACTIVATION_MODULES else None
    if name is None or module is None or getattr(module, cls.__name__, None) is not cls:
        return None
    return name if _torchs_own(forward, module) else None


def describe(found: str) -> str:
    return REGISTRY[found].description if found in REGISTRY else found


# ----------------------------------------------------------------------------------------------------------
# The form of a host's forward.

SEPARATE, FUSED = "separate", "fused"  # gate_proj + up_proj, or one gate_up_proj


class _Unknown(Exception):
    """The forward holds something the symbolic reading below does not follow."""


def _evaluate(node, env, self_name):
    """A symbolic term for expression ``node``: ("x",), ("call", attribute, term), ("mul", a, b) or
    ("chunk", i, term)."""
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return ("mul", _evaluate(node.left, env, self_name), _evaluate(node.right, env, self_name))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == self_name
        and len(node.args) == 1
        and not node.keywords
    ):
        return ("call", node.func.attr, _evaluate(node.args[0], env, self_name))
    raise _Unknown(f"the expression `{ast.unparse(node)}`")


def _is_chunk_in_two(node) -> bool:
    """``<expr>.chunk(2, dim=-1)`` or ``<expr>.chunk(2, -1)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
        return False
    values = [ast.literal_eval(a) for a in node.args] + [ast.literal_eval(k.value) for k in node.keywords]
    names = [None] * len(node.args) + [k.arg for k in node.keywords]
    return values[:1] == [2] and values[1:] == [-1] and names[1:] in ([None], ["dim"])


def _return_term(function: ast.FunctionDef):
    params = [a.arg for a in function.args.args]
    if len(params) != 2 or function.args.vararg or function.args.kwarg or function.args.kwonlyargs:
        raise _Unknown("a signature other than forward(self, x)")
    self_name, x_name = params
    env = {x_name: ("x",)}
    for statement in function.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        if isinstance(statement, ast.Return) and statement.value is not None:
            return _evaluate(statement.value, env, self_name)
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
            if isinstance(target, ast.Name):
                env[target.id] = _evaluate(value, env, self_name)
                continue
            if isinstance(target, ast.Tuple) and len(target.elts) == 2 and _is_chunk_in_two(value):
                whole = _evaluate(value.func.value, env, self_name)
                for i, element in enumerate(target.elts):
                    if not isinstance(element, ast.Name):
                        raise _Unknown(f"the assignment `{ast.unparse(statement)}`")
                    env[element.id] = ("chunk", i, whole)
                continue
        raise _Unknown(f"the statement `{ast.unparse(statement).splitlines()[0]}`")
    raise _Unknown("no return statement")


def _match_gated(term) -> tuple[str | None, str | None]:
    """(form, the activation attribute the forward calls), or (None, None)."""
    x = ("x",)
    if term[0] != "call" or term[1] != "down_proj" or term[2][0] != "mul":
        return None, None
    factors = {term[2][1], term[2][2]}
    for act in _ACTIVATION_ATTRIBUTES:
        if factors == {("call", act, ("call", "gate_proj", x)), ("call", "up_proj", x)}:
            return SEPARATE, act
        fused = ("call", "gate_up_proj", x)
        if factors == {("call", act, ("chunk", 0, fused)), ("chunk", 1, fused)}:
            return FUSED, act
    return None, None


class HostForm(NamedTuple):
    form: str | None  # SEPARATE / FUSED for a gated MLP; None for a host without a forward of its own
    problem: str | None  # why the host is refused, or None
    act_attribute: str | None = None  # the activation the forward calls: "act_fn" or "activation_fn"


# id(host class) -> (the class, the forward read, its HostForm). Keyed by id, not by the class: torch.compile's
# dynamo, compiling gated_form as a frame of its own (after a graph break, such as a refused host's error), guarded
# this map's entries but not the class looked up, and served a later class an earlier one's form; id() makes it
# guard the class. The forward too: a class whose forward is replaced after a call is read again, not served the
# form of the forward it had. Bounded: parametrize makes a class per parametrized module.
_GATED_FORMS = {}
MAX_FORMS = 1024


def hook_bypassed(module: nn.Module, forward) -> bool:
    """For a host that carries accelerate's hook (``_hf_hook``; the layers ask only then): whether the layer's
    ``forward`` runs as the instance's own forward, which accelerate had wrapped to run the hook around it.
    kernelize sets the instance's ``forward``: after accelerate's hooks (or again after them, as transformers
    does on ``model.train()`` / ``eval()`` of a kernelized model) it replaces that wrapper. Where kernelize ran
    first, the wrapper calls the layer's forward and runs the hook itself."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is forward


def run_hook(module: nn.Module, compute, *args):
    """``compute(module, *args)`` with accelerate's hook around it, as accelerate's wrapper runs a module's forward:
    the hook's ``pre_forward`` (moving the inputs to the execution device, loading offloaded weights, a user's
    ``ModelHook``), under no_grad where the hook asks it, then its ``post_forward``."""
    hook = module.__dict__["_hf_hook"]
    args, kwargs = hook.pre_forward(module, *args)
    if getattr(hook, "no_grad", False):
        with torch.no_grad():
            output = compute(module, *args, **kwargs)
    else:
        output = compute(module, *args, **kwargs)
    return hook.post_forward(module, output)


def own_source(function) -> str:
    """The source of ``function``'s own code, dedented (``inspect.getsource`` of the function itself follows
    ``__wrapped__`` to the function a ``functools.wraps`` wrapper wraps: a wrapper assigned in a class body,
    ``forward = clamp(LlamaRMSNorm.forward)`` or ``forward = torch.no_grad()(...)``, would read as the form it wraps,
    and what it adds would be dropped). Raises TypeError for a wrapper or a callable without code of its own,
    OSError where the source cannot be found."""
    code = getattr(function, "__code__", None)
    if code is None:
        raise TypeError(f"{type(function).__name__} has no code of its own")
    if hasattr(function, "__wrapped__"):
        raise TypeError(f"it wraps another function ({code.co_name} in {code.co_filename})")
    return textwrap.dedent(inspect.getsource(code))


def _wrapper(forward) -> str:
    """What wraps a forward that has ``__wrapped__``: its decorator as the source names it, else a wrapper
    assigned in the class body."""
    try:
        decorators = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0].decorator_list
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        decorators = ()
    if decorators:
        return f"the decorator `@{ast.unparse(decorators[0])}`"
    return "a wrapper of another function (functools.wraps) assigned in the class body"


def gated_form(cls) -> HostForm:
    """How the gated-MLP host class ``cls`` computes, read once per class and forward."""
    forward = cls.forward
    known = _GATED_FORMS.get(id(cls))
    if known is not None and known[0] is cls and known[1] is forward:
        return known[2]
    if torch.compiler.is_compiling():
        # Read while dynamo traces, as a constant of the trace (the source reading cannot be traced: a model compiled
        # before any eager call broke its graph here once per MLP call), and not cached: the trace guards the map
        # as it found it (an entry written now would fail that guard), and the class and forward read above.
        return _read_gated_form(forward)
    known = _read_gated_form(forward)
    if len(_GATED_FORMS) >= MAX_FORMS:
        _GATED_FORMS.clear()
    _GATED_FORMS[id(cls)] = (cls, forward, known)
    return known


def _read_gated_form(forward) -> HostForm:
    if forward is nn.Module.forward:  # no forward of its own: nothing to reproduce but the projections
        return HostForm(None, None)
    try:
        if hasattr(forward, "__wrapped__"):
            raise _Unknown(_wrapper(forward))
        tree = ast.parse(own_source(forward))
        function = tree.body[0]
        if not isinstance(function, ast.FunctionDef):
            raise _Unknown("a forward that is not a plain def")
        if function.decorator_list:  # a decorator may change what the call computes (or its grad mode)
            raise _Unknown(f"the decorator `@{ast.unparse(function.decorator_list[0])}`")
        form, act = _match_gated(_return_term(function))
        problem = None if form else "its forward returns something other than that"
    except _Unknown as error:
        form, problem = None, f"its forward holds {error}, which the layer would not reproduce"
    except (OSError, TypeError, SyntaxError, ValueError) as error:  # no source to read, or an odd one
        form, problem = None, f"its forward could not be read ({type(error).__name__}: {error})"
    return HostForm(form, problem, act if form else None)


_read_gated_form._dynamo_marked_constant = True


def global_hooks() -> bool:
    """Whether a global module hook is registered (``nn.modules.module.register_module_forward_hook`` and its
    kin): it fires on every module call."""
    hooks = nn.modules.module
    return bool(
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def _hooks_anywhere(module: nn.Module, ignore=None) -> bool:
    """Any module hook on ``module`` or a global one; ``ignore(hook)`` True leaves a hook of the module's own
    out of the count."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return any(not (ignore and ignore(hook)) for table in own for hook in table.values()) or global_hooks()


def _torchs_own(function, module) -> bool:
    """Whether ``function`` is defined in ``module`` itself (torch's, or transformers' activations): a patch, even
    one that copies the original's names with ``functools.wraps``, has its code elsewhere."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == module.__file__ and not hasattr(function, "__wrapped__")


# torch's own nn.Linear forward and module call, as this import found them (None: patched already, never direct).
_LINEAR_FORWARD = nn.Linear.forward if _torchs_own(nn.Linear.forward, torch.nn.modules.linear) else None
_MODULE_CALL = (nn.Module.__call__, nn.Module._call_impl)
if not all(_torchs_own(f, torch.nn.modules.module) for f in _MODULE_CALL):
    _MODULE_CALL = None


def linear_operands(module):
    """``(weight, bias)`` such that ``F.linear(x, weight, bias)`` is exactly the eager call ``module(x)``, else
    None. torch's ``Module.__call__`` runs ``forward`` alone when the module has no hook of its own, no global
    hook is registered, it is not compiled (``Module.compile``) and no jit trace records it; torch's
    ``nn.Linear.forward`` is ``F.linear(input, self.weight, self.bias)``, and ``self.weight`` is the entry of
    ``_parameters`` when the instance holds no attribute of that name (FSDP1 sets plain tensors there,
    accelerate's offload sets a forward, and a wrapper of the call may set ``_call_impl``, which
    ``Module.__call__`` looks up on the instance). The caller checks the global hooks and that the call is
    eager; this checks the rest."""
    if (
        type(module) is not nn.Linear
        or nn.Linear.forward is not _LINEAR_FORWARD  # patched since
        or _MODULE_CALL is None
        or nn.Linear.__call__ is not _MODULE_CALL[0]
        or nn.Linear._call_impl is not _MODULE_CALL[1]
        or module._compiled_call_impl is not None
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        return None
    instance, parameters = module.__dict__, module._parameters
    if "forward" in instance or "_call_impl" in instance or "weight" in instance or "bias" in instance:
        return None
    if "weight" not in parameters or "bias" not in parameters:  # registered as buffers: left to getattr's order
        return None
    return parameters["weight"], parameters["bias"]


def is_plain_linear(module, engine_gathers: bool = False) -> bool:
    """A module whose call is exactly ``F.linear(x, weight, bias)`` with weights that hold values: the class
    is nn.Linear itself (not a subclass, not a parametrization's or a LoRA wrapper's class), no hook of any
    kind, no forward set on the instance (accelerate's offload hooks do that), no meta weights.

    engine_gathers: the caller gathers DeepSpeed ZeRO-3 weights itself (the tiled MLP, see _zero3), so the
    hooks ZeRO-3 put on the module to gather and release them do not count."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and not _hooks_anywhere(module, _zero3.is_engine_hook if engine_gathers else None)
        and not module.weight.is_meta
    )


# ----------------------------------------------------------------------------------------------------------
# RMSNorm hosts.
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
    (
        """
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return self.weight * x.to(dtype)
""",
        "llama",
        0.0,
    ),
    # The product in fp32, rounded once (OLMo hybrid, FlexOlmo, DeepSeek-V4, NemotronH, ...): rms_norm's
    # "gemma" casting with offset 0.
    (
        """
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return (self.weight * x).to(dtype)
""",
        "gemma",
        0.0,
    ),
    (
        """
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    mean_square = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(mean_square + self.eps)
    return (self.weight.to(torch.float32) * x).to(dtype)
""",
        "gemma",
        0.0,
    ),
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


def _normalized(source: str, decorators: bool = True):
    """(normalized dump of the function in ``source``, epsilon attributes it reads), or None. ``decorators``: whether
    the dump holds the function's decorators."""
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
    if not decorators:
        function.decorator_list = []
    arguments = function.args
    local_names = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
    local_names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    local_names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    names = _CanonicalNames(local_names)
    names.visit(function)
    return ast.dump(function), names.eps_attributes


_KNOWN_FORMS = {_normalized(source)[0]: (casting, offset) for source, casting, offset in _RMS_NORM_FORMS}
# host class -> (the forward read or declared, (casting, offset, epsilon attribute, "" or why it is refused),
# whether declared, the class it is parametrize's class of or None): a class whose forward is replaced after a call
# is read again. Bounded, as _GATED_FORMS (the classes read; declarations stay).
_RMS_NORM_HOSTS = {}


def _classify_rms_norm_host(cls) -> tuple:
    def refused(why):
        return (
            None,
            0.0,
            None,
            (
                f"LigerRMSNorm reproduces LlamaRMSNorm's weight * x_normed.to(x.dtype) and the fp32 product "
                f"(weight * x_normed).to(x.dtype), but the host {cls.__module__}.{cls.__qualname__} {why}; "
                f"leave this module unmapped (do not kernelize its "
                f'"RMSNorm" layer), or, if its forward is one of rms_norm\'s castings, declare it with '
                f"layers.declare_rms_norm_host({cls.__qualname__}, casting=..., offset=..., eps_attribute=...)"
            ),
        )

    if hasattr(cls.forward, "__wrapped__"):
        return refused(f"has a wrapped forward ({_wrapper(cls.forward)}), whose additions it would not reproduce")
    try:
        source = own_source(cls.forward)
    except (OSError, TypeError) as error:
        return refused(f"has a forward whose source cannot be read to confirm what it computes ({error})")
    normalized = _normalized(source)
    form = _KNOWN_FORMS.get(normalized[0]) if normalized is not None else None
    if form is None:
        return refused("has a forward of another form (a (1 + weight) scale, a bias, other casts, ...)")
    return (*form, normalized[1].pop(), "")


def rms_norm_host(cls) -> tuple:
    """``(casting, offset, eps attribute, refusal)`` for a host class, cached. Under torch.compile it is
    evaluated while tracing and its result used as a constant (the mark torch.compiler.assume_constant_result
    sets, set here without importing dynamo when the package loads)."""
    forward = cls.forward
    known = _RMS_NORM_HOSTS.get(cls)
    if known is None or known[0] is not forward:
        if len(_RMS_NORM_HOSTS) >= MAX_FORMS:
            for read in [c for c, entry in _RMS_NORM_HOSTS.items() if not entry[2]]:
                del _RMS_NORM_HOSTS[read]
        known = _RMS_NORM_HOSTS[cls] = (forward, _classify_rms_norm_host(cls), False, _parametrized_base(cls))
    if known[3] is not None:
        # parametrize's class for a declared host computes what the host does (it adds the parametrized tensors'
        # properties, nothing else): the host's declaration holds for it, as it stands now (declared, or declared
        # again, before or after this class was first seen)
        declared = _RMS_NORM_HOSTS.get(known[3])
        if declared is not None and declared[2] and declared[0] is forward:
            return declared[1]
    return known[1]


def _parametrized_base(cls):
    """The class ``torch.nn.utils.parametrize`` made ``cls`` from (a subclass named "Parametrized" + its name, with
    ``__getstate__`` and ``__deepcopy__`` of its own and a property per parametrized tensor), or None."""
    bases = cls.__bases__
    if len(bases) != 1 or cls.__name__ != f"Parametrized{bases[0].__name__}":
        return None
    own = {name: value for name, value in vars(cls).items() if name not in _PARAMETRIZED_OWN}
    if not all(isinstance(value, property) and value.fget.__module__ == _PARAMETRIZE for value in own.values()):
        return None
    return bases[0]


_PARAMETRIZE = "torch.nn.utils.parametrize"
_PARAMETRIZED_OWN = {"__getstate__", "__deepcopy__", "__module__", "__doc__", "__dict__", "__weakref__"}


rms_norm_host._dynamo_marked_constant = True


def declare_rms_norm_host(host_class, casting="llama", offset=0.0, eps_attribute="variance_epsilon") -> None:
    """Declare that ``host_class.forward`` computes ``rms_norm(x, self.weight, self.<eps_attribute>, offset,
    casting)``, for a host LigerRMSNorm does not recognize (e.g. ``GemmaRMSNorm``: ``casting="gemma",
    offset=1.0, eps_attribute="eps"``). The declaration is trusted, not checked, for the forward the class has
    when declared: a forward assigned to the class later is read as any host's."""
    if not isinstance(host_class, type):
        raise TypeError(f"declare_rms_norm_host: `host_class` must be a class, got {type(host_class).__name__}")
    if casting not in _rms_norm.CASTINGS:
        raise ValueError(f"declare_rms_norm_host: `casting` must be one of {_rms_norm.CASTINGS}, got {casting!r}")
    if not isinstance(eps_attribute, str):
        raise TypeError(f"declare_rms_norm_host: `eps_attribute` must be a str, got {type(eps_attribute).__name__}")
    offset = _rms_norm._check_real(offset, "offset")
    _RMS_NORM_HOSTS[host_class] = (host_class.forward, (casting, offset, eps_attribute, ""), True, None)


def has_hooks(module: nn.Module) -> bool:
    """Any module hook of the module's own (forward, pre-forward, backward, pre-backward), other than the ones
    DeepSpeed ZeRO-3 puts on every module it manages: on a module without parameters (an activation) they
    gather and release nothing."""
    tables = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    if not any(tables):  # the common case (once per layer and token when decoding): no list, no parameters walked
        return False
    hooks = [hook for table in tables for hook in table.values()]
    engine_only = next(module.parameters(), None) is None
    return any(not (engine_only and _zero3.is_engine_hook(hook)) for hook in hooks)


# ----------------------------------------------------------------------------------------------------------
# Rotary hosts. transformers tags ``apply_rotary_pos_emb`` with "rotary_pos_emb" in over a hundred modeling files,
# and kernels makes each tagged function a module (its ``Func`` class) to which kernelize binds the rotary layer.
# Most are Llama's; others cast the result back to the inputs' dtype, rotate the other way, or rotate interleaved
# pairs. The layer reads the function (and the helper it calls) as the RMSNorm reader reads a forward, and serves
# the forms below; anything else is refused. Decorators in a function's source do not count: they made the module,
# and the module runs the function itself.

ROTARY_PROMOTED, ROTARY_Q_K_DTYPES, ROTARY_Q_DTYPE = "promoted", "q and k dtypes", "q dtype"

_ROTATE_HALF = """
def f(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
_ROTATE_HALF_THE_OTHER_WAY = _ROTATE_HALF.replace("(-x2, x1)", "(x2, -x1)")  # the rotation by -sin
_CHUNKED_HALVES = """
def f(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)
"""
_ROTARY_FORMS = (  # (function, the helper it calls by name, the helper, the result's dtype, sin's sign)
    # Llama's (and a hundred others'): the result in the promoted dtype
    (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed, k_embed
""",
        "rotate_half",
        ((_ROTATE_HALF, 1.0), (_ROTATE_HALF_THE_OTHER_WAY, -1.0)),
        ROTARY_PROMOTED,
    ),
    # OLMo's: cast back to q's and k's dtypes
    (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed.to(q_type), k_embed.to(k_type)
""",
        "rotate_half",
        ((_ROTATE_HALF, 1.0),),
        ROTARY_Q_K_DTYPES,
    ),
    # ESM's and ModernBERT's: in fp32 (or finer), cast back to q's dtype
    (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = q.float() * cos + rotate_half(q.float()) * sin
    k_embed = k.float() * cos + rotate_half(k.float()) * sin
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
""",
        "rotate_half",
        ((_ROTATE_HALF, 1.0),),
        ROTARY_Q_DTYPE,
    ),
    # HunYuan-VL's: the same with cos and sin in fp32 too
    (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    origin_dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed.to(origin_dtype), k_embed.to(origin_dtype)
""",
        "rotate_half",
        ((_ROTATE_HALF, 1.0),),
        ROTARY_Q_DTYPE,
    ),
    # gpt-oss's: half-width cos and sin for the two halves, which the rotary function takes as such
    (
        """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed
""",
        "_apply_rotary_emb",
        ((_CHUNKED_HALVES, 1.0),),
        ROTARY_PROMOTED,
    ),
)


def _dump(source: str):
    """``_normalized``'s dump of a function's source, its decorators left out (None where it is not one)."""
    normalized = _normalized(source, decorators=False)
    return normalized[0] if normalized is not None else None


# function dump -> (helper name, {helper dump: sin's sign}, the result's dtype)
_KNOWN_ROTARY = {
    _dump(function): (helper, {_dump(source): sign for source, sign in helpers}, result)
    for function, helper, helpers, result in _ROTARY_FORMS
}


def kernels_function(cls):
    """The function a kernels ``Func`` module class wraps (what ``use_kernel_func_from_hub`` makes of a function),
    else None."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if (
        cls.__name__ != "Func"
        or code is None
        or not code.co_filename.endswith(os.path.join("kernels", "layer", "layer.py"))
    ):
        return None
    wrapped = [c.cell_contents for c in forward.__closure__ or ()]
    return wrapped[0] if len(wrapped) == 1 and isinstance(wrapped[0], types.FunctionType) else None


_ROTARY_HOSTS = {}  # host class -> (its function, the helper's name, the helper, (result dtype, sin's sign, refusal))


def rotary_host(cls) -> tuple:
    """``(result dtype, sin's sign, refusal)`` for the module class the rotary layer is bound to: the result's dtype
    (``ROTARY_PROMOTED``, ``ROTARY_Q_K_DTYPES`` or ``ROTARY_Q_DTYPE``), -1.0 for a function that rotates by -sin,
    and "" or why the host is refused. Cached per class, read again where the function's helper was replaced.
    Under torch.compile it is evaluated while tracing and used as a constant (as ``rms_norm_host``)."""
    known = _ROTARY_HOSTS.get(cls)
    if known is not None and known[0] is not None and known[0].__globals__.get(known[1]) is known[2]:
        return known[3]
    function = kernels_function(cls)
    helper_name = helper = None
    if function is None:
        why = f"its class {cls.__qualname__} is no function transformers tags (kernels' module of one)"
        result = (None, 1.0, _rotary_refusal(None, why))
    else:
        try:
            form = _KNOWN_ROTARY.get(_dump(own_source(function)))
        except (OSError, TypeError) as error:
            form, why = None, f"its source cannot be read ({error})"
        else:
            why = "it computes another form (interleaved pairs, other casts, ...)"
        if form is not None:
            helper_name, helpers, dtype = form
            helper = function.__globals__.get(helper_name)
            try:
                sign = helpers.get(_dump(own_source(helper)))
            except (OSError, TypeError) as error:
                sign, why = None, f"its `{helper_name}` cannot be read ({error})"
            else:
                why = f"its `{helper_name}` computes another form"
        result = (
            (dtype, sign, "") if form is not None and sign is not None else (None, 1.0, _rotary_refusal(function, why))
        )
    if len(_ROTARY_HOSTS) >= MAX_FORMS:
        _ROTARY_HOSTS.clear()
    _ROTARY_HOSTS[cls] = (function, helper_name, helper, result)
    return result


rotary_host._dynamo_marked_constant = True


def _rotary_refusal(function, why: str) -> str:
    name = (
        f"{getattr(function, '__module__', None) or '<no module>'}.{function.__qualname__}" if function else "the host"
    )
    return (
        f"liger_rotary_pos_emb_layer reproduces transformers' apply_rotary_pos_emb (x * cos + rotate_half(x) * sin, "
        f"and the forms that cast it back to q's dtype), but {name} cannot be served: {why}; leave "
        '"rotary_pos_emb" unmapped for this model (lk.kernel_mapping(layers=[...]) without it)'
    )
