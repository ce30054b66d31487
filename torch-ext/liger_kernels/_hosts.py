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
"""

import ast
import inspect
import textwrap
from typing import NamedTuple, Optional

import torch
from torch import nn

from .activations import REGISTRY

# How hosts announce an activation, read from the registry: class names of activation modules, and config
# strings.
_BY_CLASS = {cls: a.name for a in REGISTRY.values() for cls in a.host_classes}
_BY_CONFIG = {name: a.name for a in REGISTRY.values() for name in a.config_names}
_ACTIVATION_ATTRIBUTES = ("act_fn", "activation_fn")


def host_activation(module: nn.Module) -> Optional[str]:
    """The registry name of the gated activation ``module`` computes, None when the module does not say, or
    a string describing an activation this package lacks."""
    for attribute in _ACTIVATION_ATTRIBUTES:
        act_fn = getattr(module, attribute, None)
        if act_fn is None:
            continue
        if isinstance(act_fn, nn.GELU):
            return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
        if act_fn is torch.nn.functional.silu:
            return "silu"
        if act_fn is torch.nn.functional.gelu:
            return "gelu"
        name = type(act_fn).__name__
        return _BY_CLASS.get(name, f"{attribute} {name}")
    config = getattr(module, "config", None)
    for key in ("hidden_act", "hidden_activation"):
        name = getattr(config, key, None)
        if isinstance(name, str):
            return _BY_CONFIG.get(name, f"config.{key}={name!r}")
    return None


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


def _match_gated(term) -> Optional[str]:
    x = ("x",)
    if term[0] != "call" or term[1] != "down_proj" or term[2][0] != "mul":
        return None
    factors = {term[2][1], term[2][2]}
    for act in _ACTIVATION_ATTRIBUTES:
        if factors == {("call", act, ("call", "gate_proj", x)), ("call", "up_proj", x)}:
            return SEPARATE
        fused = ("call", "gate_up_proj", x)
        if factors == {("call", act, ("chunk", 0, fused)), ("chunk", 1, fused)}:
            return FUSED
    return None


class HostForm(NamedTuple):
    form: Optional[str]  # SEPARATE / FUSED for a gated MLP; None for a host without a forward of its own
    problem: Optional[str]  # why the host is refused, or None


_GATED_FORMS = {}  # host class -> HostForm


def gated_form(cls) -> HostForm:
    """How the gated-MLP host class ``cls`` computes, read once per class."""
    known = _GATED_FORMS.get(cls)
    if known is not None:
        return known
    forward = cls.forward
    if forward is nn.Module.forward:  # no forward of its own: nothing to reproduce but the projections
        known = HostForm(None, None)
    else:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
            function = tree.body[0]
            if not isinstance(function, ast.FunctionDef):
                raise _Unknown("a forward that is not a plain def")
            form = _match_gated(_return_term(function))
            problem = None if form else "its forward returns something other than that"
        except _Unknown as error:
            form, problem = None, f"its forward holds {error}, which the layer would not reproduce"
        except (OSError, TypeError, SyntaxError, ValueError) as error:  # no source to read, or an odd one
            form, problem = None, f"its forward could not be read ({type(error).__name__}: {error})"
        known = HostForm(form, problem)
    _GATED_FORMS[cls] = known
    return known


def _hooks_anywhere(module: nn.Module) -> bool:
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def is_plain_linear(module) -> bool:
    """A module whose call is exactly ``F.linear(x, weight, bias)`` with weights that hold values: the class
    is nn.Linear itself (not a subclass, not a parametrization's or a LoRA wrapper's class), no hook of any
    kind, no forward set on the instance (accelerate's offload hooks do that), no meta weights."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and not _hooks_anywhere(module)
        and not module.weight.is_meta
    )
