"""What a transformers CausalLM's forward computes around its decoder, read before ``causal_lm_loss`` stands in
for it.

``causal_lm_loss`` runs the model's decoder, then the fused linear cross-entropy on the head's weight: it
gives ``model(...).loss`` only for a model whose forward is exactly that. The forward of the model's class is
read once (its syntax tree, as ``_hosts`` reads the layers' hosts) and must be, in order:

* flags resolved from the config (``flag = flag if flag is not None else self.config.flag``);
* the decoder call ``outputs = self.<decoder>(...)``, each argument one of the forward's own names;
* the hidden states: ``outputs.last_hidden_state`` or ``outputs[0]``, sliced to ``logits_to_keep``, cast to
  the head's dtype, multiplied or divided by numbers the model holds (MiniCPM3);
* ``logits = self.<head>(hidden)``, multiplied or divided by numbers the model holds (Cohere's
  ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``), upcast, then Gemma's
  softcapping block (``if <cap> is not None:`` divide, tanh, multiply);
* ``loss = self.loss_function(logits, labels, ...)`` alone under ``if labels is not None:``, the model's
  ``loss_function`` being transformers' ``ForCausalLMLoss`` at call time;
* blocks under a resolved flag (an MoE's router loss under ``output_router_logits``), which the call allows
  where the flag is false and refuses where it is true; branches that only return (tuple outputs).

Anything else (another loss term, a head that is more than the Linear, labels the model does not shift, a
vocabulary cut after the head) refuses the model, quoting the statement, instead of a loss that is not the
model's.
"""

import ast
import inspect
import os
import textwrap
import types
from typing import NamedTuple

import torch


class Factor(NamedTuple):
    divide: bool  # x / value (else x * value)
    path: tuple  # attribute chain from the model to the number: ("config", "logits_scaling")


class Form(NamedTuple):
    decoder: tuple | None = None  # the attribute chain the forward calls for the decoder: ("model",)
    head: str | None = None  # the attribute it calls on the hidden states
    hidden_cast: bool = False  # hidden states cast to the head's dtype first (Mamba)
    hidden_factors: tuple = ()  # Factors on the hidden states, before the head
    logit_factors: tuple = ()  # Factors on the logits, after the head
    softcap: tuple | None = None  # attribute chain of the softcapping value, applied when it is not None
    guards: tuple = ()  # (flag, config chain or None): blocks that run where the flag is true
    loss_takes_kwargs: bool = True  # the loss call passes **kwargs on (num_items_in_batch, shift_labels...)
    # the forward's parameters it hands the decoder by name (a tuple: a compiled call asks `in` of it, and dynamo
    # guards a set's membership where it cannot guard a constant's)
    decoder_parameters: tuple = ()
    decoder_takes_kwargs: bool = True  # it hands the decoder its **kwargs too
    vocab_size: tuple | None = None  # attribute chain of the vocab_size the loss is told (None: the logits' own)
    problem: str | None = None  # why the model is refused


class _Unknown(Exception):
    """The forward holds something this reading does not follow."""


def value_at(model, path):
    """The value at attribute chain ``path`` from ``model`` (None where a link is missing); a link "name()" is
    the method called without arguments."""
    value = model
    for name in path:
        if name.endswith("()"):
            method = getattr(value, name[:-2], None)
            value = method() if callable(method) else None
        else:
            value = getattr(value, name, None)
        if value is None:
            return None
    return value


class _Reader:
    def __init__(self, function: ast.FunctionDef):
        args = function.args
        self.self_name = args.args[0].arg
        self.params = {a.arg for a in args.args[1:] + args.kwonlyargs}
        self.kwargs = args.kwarg.arg if args.kwarg else None
        self.flags = {}  # name -> config chain
        self.env = {}  # name -> term: ("outputs",), ("hidden", cast, factors), ("logits", ...), ("none",)
        self.form = {"guards": []}
        self.loss_found = False

    # --- expressions ---------------------------------------------------------------------------------------
    def path(self, node):
        """``self.a.b`` -> ("a", "b"); None for anything else."""
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == self.self_name and names:
            return tuple(reversed(names))
        return None

    def term(self, node):
        env = self.env
        if isinstance(node, ast.Name) and node.id in env:
            return env[node.id]
        if isinstance(node, ast.Attribute) and node.attr == "last_hidden_state":
            if self.term(node.value)[0] == "outputs":
                return ("hidden", False, ())
        if isinstance(node, ast.Subscript):
            inner = self.term(node.value)
            if inner[0] == "outputs" and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
                return ("hidden", False, ())
            if inner[0] == "hidden" and self._is_token_slice(node.slice):
                return inner
        if isinstance(node, ast.Call):
            return self.call_term(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            divide = isinstance(node.op, ast.Div)
            orders = [(node.left, node.right)] if divide else [(node.left, node.right), (node.right, node.left)]
            for operand, number in orders:
                path = self.path(number)
                if path is None:
                    continue
                inner = self.term(operand)
                if inner[0] == "hidden":
                    return ("hidden", inner[1], inner[2] + (Factor(divide, path),))
                if inner[0] == "logits" and inner[4] is None:  # a factor after the softcapping: not followed
                    return inner[:3] + (inner[3] + (Factor(divide, path),), None)
                break
        raise _Unknown(f"the expression `{ast.unparse(node)}`")

    def _is_token_slice(self, node) -> bool:
        """``[:, slice_indices, :]``: the tokens logits_to_keep keeps (all of them when it is 0)."""
        return (
            isinstance(node, ast.Tuple)
            and len(node.elts) == 3
            and all(isinstance(e, ast.Slice) and e.lower is e.upper is e.step is None for e in node.elts[::2])
            and isinstance(node.elts[1], ast.Name)
            and node.elts[1].id == "slice_indices"
        )

    def call_term(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "slice_logits_to_keep" and len(node.args) == 2:
            inner = self.term(node.args[0])
            if inner[0] == "hidden" and isinstance(node.args[1], ast.Name) and node.args[1].id in self.params:
                return inner
        if isinstance(func, ast.Attribute) and not node.keywords:
            head = self.path(func)
            if head is not None and len(head) == 1 and len(node.args) == 1:
                inner = self.term(node.args[0])
                if inner[0] == "hidden":
                    return ("logits", head[0], inner, (), None)
            if func.attr in ("float", "contiguous") and not node.args:  # an upcast or a copy: the same values
                inner = self.term(func.value)
                if inner[0] == "logits":
                    return inner
        if isinstance(func, ast.Attribute) and func.attr == "to":
            dtype = [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]
            if len(dtype) == 1 and len(node.args) + len(node.keywords) == 1:
                inner = self.term(func.value)
                target = self.path(dtype[0])
                if inner[0] == "hidden" and target and len(target) == 3 and target[1:] == ("weight", "dtype"):
                    return ("hidden", target[0], inner[2])  # cast: checked against the head below
        raise _Unknown(f"the call `{ast.unparse(node)}`")

    # --- statements ----------------------------------------------------------------------------------------
    def read(self, body) -> Form:
        for statement in body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # docstring
            if isinstance(statement, ast.Return):
                self.check_return(statement)
                break
            if isinstance(statement, (ast.Assign, ast.AnnAssign)):
                self.assign(statement)
            elif isinstance(statement, ast.If):
                self.branch(statement)
            else:
                raise _Unknown(f"the statement `{_first_line(statement)}`")
        if "decoder" not in self.form or not self.loss_found:
            raise _Unknown("no decoder call followed by `loss = self.loss_function(logits, labels, ...)`")
        logits = self.form.pop("logits")
        _, head, hidden, factors, softcap = logits
        if hidden[1] not in (False, head):
            raise _Unknown(f"hidden states cast to `self.{hidden[1]}`'s dtype before `self.{head}` runs")
        return Form(
            decoder=self.form["decoder"],
            head=head,
            hidden_cast=hidden[1] is not False,
            hidden_factors=hidden[2],
            logit_factors=factors,
            softcap=softcap,
            guards=tuple(self.form["guards"]),
            loss_takes_kwargs=self.form["loss_takes_kwargs"],
            decoder_parameters=self.form["decoder_parameters"],
            decoder_takes_kwargs=self.form["decoder_takes_kwargs"],
            vocab_size=self.form.get("vocab_size"),
        )

    def check_return(self, statement: ast.Return):
        """The output's ``loss=`` must be the loss computed above, as it is: ``return Output(loss=loss, ...)``."""
        value = statement.value
        if isinstance(value, ast.Call):
            given = [k.value for k in value.keywords if k.arg == "loss"]
            if len(given) == 1 and isinstance(given[0], ast.Name) and given[0].id == "loss":
                return
        raise _Unknown(f"the return `{_first_line(statement)}`")

    def assign(self, statement):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        if len(targets) != 1 or not isinstance(targets[0], ast.Name) or statement.value is None:
            raise _Unknown(f"the statement `{_first_line(statement)}`")
        name, value = targets[0].id, statement.value
        if "decoder" not in self.form:
            if self._is_flag(name, value):
                return
            decoder = self.path(value.func) if isinstance(value, ast.Call) else None
            if decoder is None:
                raise _Unknown(f"the statement `{_first_line(statement)}` before the decoder call")
            self._check_decoder_arguments(value)
            self.form["decoder"] = decoder
            self.env[name] = ("outputs",)
            return
        if isinstance(value, ast.Constant) and value.value is None:
            self.env[name] = ("none",)
            return
        if name == "slice_indices" and not any(isinstance(n, ast.Name) and n.id in self.env for n in ast.walk(value)):
            return  # which tokens logits_to_keep keeps
        self.env[name] = self.term(value)

    def _is_flag(self, name, value) -> bool:
        """``name = name if name is not None else self.config.<chain>``."""
        if not (isinstance(value, ast.IfExp) and name in self.params):
            return False
        chain = self.path(value.orelse)
        if _is_not_none(value.test, name) and isinstance(value.body, ast.Name) and value.body.id == name and chain:
            self.flags[name] = chain
            return True
        return False

    def _check_decoder_arguments(self, call):
        """The decoder gets what causal_lm_loss hands it: ``input_ids`` (as the first positional argument or by
        name), ``attention_mask``, the forward's other parameters each under its own name, and ``**kwargs`` or
        not (recorded: the call then passes only what the model's call would). A parameter renamed or computed
        would change the decoder's inputs between the model's call and this one."""
        given = set()
        for i, arg in enumerate(call.args):
            if not (i == 0 and isinstance(arg, ast.Name) and arg.id == "input_ids"):
                raise _Unknown(f"the decoder argument `{ast.unparse(arg)}`")
            given.add("input_ids")
        passes_kwargs = False
        for keyword in call.keywords:
            value = keyword.value
            if keyword.arg is None:
                if not (isinstance(value, ast.Name) and value.id == self.kwargs):
                    raise _Unknown(f"the decoder argument `**{ast.unparse(value)}`")
                passes_kwargs = True
            elif not (isinstance(value, ast.Name) and value.id == keyword.arg and value.id in self.params):
                raise _Unknown(f"the decoder argument `{keyword.arg}={ast.unparse(value)}`")
            else:
                given.add(keyword.arg)
        missing = [n for n in ("input_ids", "attention_mask") if n not in given]
        if missing:
            raise _Unknown(f"the decoder call without `{missing[0]}`")
        self.form["decoder_parameters"] = tuple(sorted(set(given)))
        self.form["decoder_takes_kwargs"] = passes_kwargs

    def branch(self, statement: ast.If):
        test = statement.test
        if _is_not_return_dict(test) and isinstance(statement.body[-1], ast.Return) and not statement.orelse:
            return  # the tuple outputs (return_dict=False): the loss in them is the one computed above
        if statement.orelse:
            raise _Unknown(f"the branch `{_first_line(statement)}` with an else")
        if isinstance(test, ast.Name) and test.id in self.params:
            # A block under a flag (an MoE's router loss): skipped where the flag is false, which the call checks.
            self.form["guards"].append((test.id, self.flags.get(test.id)))
            return
        if _is_not_none(test, "labels"):
            self.loss_call(statement.body)
            return
        cap = self.path(test.left) if isinstance(test, ast.Compare) and _is_not_none(test, None) else None
        if cap is not None and self._is_softcap(statement.body, cap):
            return
        raise _Unknown(f"the branch `{_first_line(statement)}`")

    def loss_call(self, body):
        if self.loss_found or len(body) != 1:
            statement = body[1] if len(body) > 1 else body[0]
            raise _Unknown(
                f"`{_first_line(statement)}` under `if labels is not None:`, where only "
                "`loss = self.loss_function(logits, labels, ...)` is followed"
            )
        statement = body[0]
        value = statement.value if isinstance(statement, ast.Assign) else None
        if not (
            isinstance(value, ast.Call)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and self.path(value.func) == ("loss_function",)
        ):
            raise _Unknown(f"the loss `{_first_line(statement)}`")
        given = dict(zip(("logits", "labels", "vocab_size"), value.args))
        if len(value.args) > 3:
            raise _Unknown(f"the loss `{_first_line(statement)}`")
        self.form["loss_takes_kwargs"] = False
        for keyword in value.keywords:
            if keyword.arg is None:
                if not (isinstance(keyword.value, ast.Name) and keyword.value.id == self.kwargs):
                    raise _Unknown(f"the loss argument `**{ast.unparse(keyword.value)}`")
                self.form["loss_takes_kwargs"] = True
            elif keyword.arg in ("logits", "labels", "vocab_size"):
                given[keyword.arg] = keyword.value
            else:
                raise _Unknown(f"the loss argument `{keyword.arg}={ast.unparse(keyword.value)}`")
        logits, labels = given.get("logits"), given.get("labels")
        if not (isinstance(labels, ast.Name) and labels.id == "labels" and logits is not None):
            raise _Unknown(f"the loss `{_first_line(statement)}`")
        term = self.term(logits)
        if term[0] != "logits":
            raise _Unknown(f"the loss on `{ast.unparse(logits)}`")
        self.form["logits"] = term
        # transformers' loss views the logits as rows of vocab_size: a head of another width is not its loss
        vocab = given.get("vocab_size")
        if vocab is not None and self.path(vocab) is not None:
            self.form["vocab_size"] = self.path(vocab)
        elif (  # self.config.get_text_config().vocab_size
            isinstance(vocab, ast.Attribute)
            and isinstance(vocab.value, ast.Call)
            and not vocab.value.args
            and not vocab.value.keywords
            and self.path(vocab.value.func) == ("config", "get_text_config")
        ):
            self.form["vocab_size"] = ("config", "get_text_config()", vocab.attr)
        elif not (
            vocab is not None
            and isinstance(vocab, ast.Subscript)
            and ast.unparse(vocab) in (f"{ast.unparse(logits)}.shape[-1]", "logits.shape[-1]")
        ):
            raise _Unknown(f"the loss's vocab_size in `{_first_line(statement)}`")
        self.loss_found = True

    def _is_softcap(self, body, cap) -> bool:
        """``logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap`` (upcasts allowed)."""
        if len(body) != 3 or not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in body):
            return False
        names = {s.targets[0].id for s in body if isinstance(s.targets[0], ast.Name)}
        if len(names) != 1:
            return False
        (name,) = names
        before = self.env.get(name)
        if before is None or before[0] != "logits" or before[4] is not None:
            return False
        divide, tanh, multiply = (s.value for s in body)
        ok = (
            isinstance(divide, ast.BinOp)
            and isinstance(divide.op, ast.Div)
            and self.path(divide.right) == cap
            and self._is_logits(divide.left, name)
            and isinstance(tanh, ast.Call)
            and ast.unparse(tanh.func) == "torch.tanh"
            and len(tanh.args) == 1
            and not tanh.keywords
            and self._is_logits(tanh.args[0], name)
            and isinstance(multiply, ast.BinOp)
            and isinstance(multiply.op, ast.Mult)
            and self._is_logits(multiply.left, name)
            and self.path(multiply.right) == cap
        )
        if ok:
            self.env[name] = before[:4] + (cap,)
        return ok

    def _is_logits(self, node, name) -> bool:
        """``name`` or ``name.float()``."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "float":
            if node.args or node.keywords:
                return False
            node = node.func.value
        return isinstance(node, ast.Name) and node.id == name


def _is_not_none(test, name) -> bool:
    """``<name> is not None`` (any left side when name is None)."""
    return (
        isinstance(test, ast.Compare)
        and (name is None or (isinstance(test.left, ast.Name) and test.left.id == name))
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _is_not_return_dict(test) -> bool:
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Name)
        and test.operand.id == "return_dict"
    )


def _first_line(node) -> str:
    return ast.unparse(node).splitlines()[0]


_FORMS = {}  # the forward's code object -> Form


def form_of(cls) -> Form:
    """How the CausalLM class ``cls`` computes its loss, read once per forward's code (an edited forward, as
    IPython's autoreload swaps code objects, is read again)."""
    if torch.compiler.is_compiling():
        # Read as a constant of the trace, the map neither read nor written: dynamo guards a map it reads by its
        # keys, and its guard code cannot spell a code object (an internal SyntaxError at the first recompile, or
        # at any compile after an eager call: NOTES.md §39). Handed the class and, where it is a plain function,
        # the forward, both guarded by identity, so that a forward replaced after compiling is read again (a
        # forward that is no plain function, a partialmethod's, may be a new object at each lookup: a guard on it
        # failed inside dynamo)
        forward = getattr(cls, "forward", None)
        return _read_form(cls, forward if type(forward) is types.FunctionType else None)
    try:
        code = getattr(_unwrapped(getattr(cls, "forward", None)), "__code__", None)
    except _Unknown:
        code = None
    known = _FORMS.get(code) if code is not None else None
    if known is None:
        known = _read_form(cls, None)
        if code is not None:
            _FORMS[code] = known
    return known


def _read_form(cls, guarded) -> Form:
    """``cls``'s form; ``guarded``: its forward or None, an argument only for dynamo to guard."""
    forward = getattr(cls, "forward", None)
    try:
        function = _unwrapped(forward)
    except _Unknown as error:
        return Form(problem=f"its forward is {error}, which causal_lm_loss would not read through")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        node = tree.body[0]
        if not isinstance(node, ast.FunctionDef) or not node.args.args:
            raise _Unknown("a forward that is not a plain method")
        for decorator in node.decorator_list:
            if ast.unparse(decorator) not in _HARMLESS_DECORATORS:
                raise _Unknown(f"the decorator `@{ast.unparse(decorator)}`")
        known = _Reader(node).read(node.body)
    except _Unknown as error:
        known = Form(problem=f"its forward holds {error}, which causal_lm_loss would not reproduce")
    except (OSError, TypeError, SyntaxError, ValueError) as error:  # no source to read, or an odd one
        known = Form(problem=f"its forward could not be read ({type(error).__name__}: {error})")
    return known


_read_form._dynamo_marked_constant = True


def _unwrapped(function):
    """The function under transformers' own decorators (``functools.wraps`` wrappers whose code is in
    transformers); a wrapper from anywhere else (a patch that copies the original's name) is not read through."""
    try:
        import transformers

        home = os.path.dirname(transformers.__file__) + os.sep
    except ImportError:  # then no wrapper is transformers' own
        home = None
    while hasattr(function, "__wrapped__"):
        code = getattr(function, "__code__", None)
        if code is None or home is None or not code.co_filename.startswith(home):
            where = code.co_filename if code is not None else type(function).__name__
            raise _Unknown(f"wrapped by a function from {where}")
        function = function.__wrapped__
    return function


# transformers' decorators on CausalLM forwards that change how outputs are packed or documented, not the loss.
_HARMLESS_DECORATORS = {"can_return_tuple", "auto_docstring", "check_model_inputs", "merge_with_config_defaults"}
