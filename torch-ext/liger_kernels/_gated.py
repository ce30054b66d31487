"""Gated activations ``out = act(gate_multiplier * gate) * up * down_multiplier``: the kernels, their
launchers, the PyTorch path and the autograd contract that every activation in ``activations.REGISTRY``
shares (swiglu.py and geglu.py are the public faces of three of them).

This module validates inputs, lays tensors out as rows without copying, runs the Triton kernels or the
PyTorch path (as ``_backend.use_triton`` decides), and carries the autograd contract both backends share:
save ``gate`` and ``up``, recompute the activation in backward. It is over 300 lines because the kernels,
their launchers, the PyTorch path and the torch.library ops must change together.
"""

import inspect
import numbers

import torch

from . import _backend
from ._backend import constexpr, graph_is_retained, jit, tl, use_triton
from ._launch import Prepared, launch_prepared
from .activations import REGISTRY, GatedActivation

# ----------------------------------------------------------------------------------------------------------
# Validation: every check runs before any launch.

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float8 has no math here
_Tensor = torch.Tensor


def check_pair(a, b, op: str) -> None:
    # The common case in one expression (what the checks below accept, for plain tensors): an eager call's
    # host time matters as much as its kernel's.
    if (
        type(a) is _Tensor
        and type(b) is _Tensor
        and a.dtype is b.dtype
        and a.dtype in SUPPORTED_DTYPES
        and a.shape == b.shape
        and a.dim()
        and a.device == b.device
    ):
        return
    for arg, value in (("a", a), ("b", b)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: `{arg}` must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: `{arg}` must be float32, float16, bfloat16 or float64, got {value.dtype}")
        if value.dim() == 0:
            raise ValueError(f"{op}: `{arg}` must have at least one dimension, got a 0-d tensor")
    if a.shape != b.shape:
        raise ValueError(f"{op}: `a` and `b` must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: `a` and `b` must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: `a` and `b` must be on the same device, got {a.device} and {b.device}")


def check_multiplier(value, arg: str, op: str) -> float:
    if type(value) is float:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: `{arg}` must be a real number, got {type(value).__name__}")
    return float(value)


def check_activation(value, op: str) -> GatedActivation:
    if not isinstance(value, str) or value not in REGISTRY:
        raise ValueError(f"{op}: `activation` must be one of {sorted(REGISTRY)}, got {value!r}")
    return REGISTRY[value]


def check_flag(value, arg: str, op: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: `{arg}` must be a bool, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Triton kernels. One program handles BLOCK columns of one row. Contiguous tensors are seen as a single row
# of numel columns (pure streaming); tensors whose rows are strided (the halves of a fused gate_up output
# taken with .chunk(2, -1)) are read in place through their row stride. Offsets are int64 throughout, so
# tensors of more than 2**31 elements and rows of any width work.

# The launch shape: read at each launch, so the maintainers' sweep (benchmarks/suite/bench_activations.py
# --sweep) can set them per run; 16 elements per thread was best across shapes and activations (NOTES.md).
BLOCK = 2048
NUM_WARPS = 4


@jit
def _row_and_cols(n_cols, ONE_ROW: constexpr, BLOCK: constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if ONE_ROW:  # contiguous tensors: no division to find the row
        row = pid * 0
        col_block = pid
    else:
        n_col_blocks = tl.cdiv(n_cols, BLOCK)
        row = pid // n_col_blocks
        col_block = pid % n_col_blocks
    return row, col_block * BLOCK + tl.arange(0, BLOCK)


@jit
def _gated_forward_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    gate_multiplier,
    down_multiplier,
    ACTIVATION: constexpr,
    ONE_ROW: constexpr,
    BLOCK: constexpr,
):
    row, cols = _row_and_cols(n_cols, ONE_ROW, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask).to(tl.float32)
    out = ACTIVATION(gate * gate_multiplier) * up * down_multiplier
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _gated_backward_kernel(
    d_out_ptr,
    gate_ptr,
    up_ptr,
    d_gate_ptr,
    d_up_ptr,
    out_ptr,
    n_cols,
    d_out_row_stride,
    gate_row_stride,
    up_row_stride,
    d_gate_row_stride,
    d_up_row_stride,
    gate_multiplier,
    down_multiplier,
    ACTIVATION_AND_GRAD: constexpr,
    STORE_OUT: constexpr,
    ONE_ROW: constexpr,
    BLOCK: constexpr,
):
    row, cols = _row_and_cols(n_cols, ONE_ROW, BLOCK)
    mask = cols < n_cols
    d_out = tl.load(d_out_ptr + row * d_out_row_stride + cols, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask).to(tl.float32)
    # out = act(gm * gate) * up * dm  =>  d_up = d_out * dm * act(gm * gate),
    #                                     d_gate = d_out * dm * up * act'(gm * gate) * gm
    act, d_act = ACTIVATION_AND_GRAD(gate * gate_multiplier)
    d_out = d_out * down_multiplier
    d_up = d_out * act
    d_gate = d_out * up * d_act * gate_multiplier
    # d_gate/d_up may alias gate/up (in-place backward): each element is read and written by this program only.
    tl.store(d_gate_ptr + row * d_gate_row_stride + cols, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + row * d_up_row_stride + cols, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)
    if STORE_OUT:  # the forward output too (contiguous), for a caller that needs it to form a weight gradient
        out = act * up * down_multiplier
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_CONTIGUOUS = (0,) * 6  # the row strides of contiguous tensors, which the kernels never read


def _as_rows(tensors):
    """Same-shaped tensors as rows: ``(tensors, n_rows, n_cols, row strides)``. Contiguous tensors are one long
    row and are passed as they are (the kernels never read their row stride); the others are viewed as
    [-1, last dim] through their row stride, copied only when no such view exists."""
    for t in tensors:  # (a loop, not all() over a generator: this runs on every launch)
        if not t.is_contiguous():
            break
    else:
        return tensors, 1, tensors[0].numel(), _CONTIGUOUS[: len(tensors)]
    n_cols = tensors[0].shape[-1]
    rows = []
    for t in tensors:
        if t.stride(-1) != 1:
            t = t.contiguous()
        try:
            rows.append(t.view(-1, n_cols))
        except RuntimeError:  # leading dims that do not collapse into one stride
            rows.append(t.reshape(-1, n_cols))
    return rows, rows[0].shape[0], n_cols, [t.stride(0) for t in rows]


def _grid(n_rows: int, n_cols: int):
    # Plain integer arithmetic: triton.cdiv is a jit-aware function whose host-side call costs microseconds.
    return (n_rows * ((n_cols + BLOCK - 1) // BLOCK),)


# Launch plans (grid, the layout's scalar arguments, constexprs), one per layout, made once: at the sizes where
# the host sets the pace, keying each launch's 9-14 arguments afresh cost as much as the launch (NOTES.md §31).
# Every part of the key is an int, a bool or None, each always in the same place, so equal keys are equal
# launches; the activation's jit function by id (a jit function hashes in Python, behind a lock; the plan
# holds the function, so its id is not reused while the entry lives). The multipliers change from call to
# call: they follow the plan's scalars as ``launch_prepared``'s trailing arguments, keyed at each launch.
# Bounded: varying lengths meet many layouts.
_PLANS = {}
MAX_PLANS = 1024


def _plan(function, store_out, n_rows: int, n_cols: int, strides) -> Prepared:
    """``function``: the activation's jit function, ``triton_value`` (forward, ``store_out`` None) or
    ``triton_value_and_grad`` (backward)."""
    key = (id(function), store_out, n_rows, n_cols, *strides, BLOCK, NUM_WARPS)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        if store_out is None:
            role = {"ACTIVATION": function}
        else:
            role = {"ACTIVATION_AND_GRAD": function, "STORE_OUT": store_out}
        grid = _grid(n_rows, n_cols)
        role.update(ONE_ROW=n_rows == 1, BLOCK=BLOCK, num_warps=NUM_WARPS)
        plan = _PLANS[key] = Prepared(grid, (n_cols, *strides), **role)
    return plan


def _forward_triton(gate, up, activation: GatedActivation, gate_multiplier, down_multiplier):
    out = _backend.new_like(gate)
    rows, n_rows, n_cols, strides = _as_rows([gate, up, out])
    plan = _plan(activation.triton_value, None, n_rows, n_cols, strides)
    launch_prepared(_gated_forward_kernel, rows, plan, (gate_multiplier, down_multiplier))
    return out


def _backward_triton(d_out, gate, up, activation, gate_multiplier, down_multiplier, in_place, out=None):
    """``out``: where to write the forward output too (contiguous, like ``d_out`` then), or None."""
    if in_place:
        d_gate, d_up = gate, up
    else:
        d_gate, d_up = _backend.new_like(gate), _backend.new_like(up)
    rows, n_rows, n_cols, strides = _as_rows([d_out, gate, up, d_gate, d_up])
    d_gate_rows, d_up_rows = rows[3], rows[4]
    if in_place and (d_gate_rows.data_ptr() != gate.data_ptr() or d_up_rows.data_ptr() != up.data_ptr()):
        # _as_rows had to copy: write into the copies, which are the gradients.
        d_gate, d_up = d_gate_rows.view(gate.shape), d_up_rows.view(up.shape)
    plan = _plan(activation.triton_value_and_grad, out is not None, n_rows, n_cols, strides)
    tensors = (*rows, rows[0] if out is None else out)
    launch_prepared(_gated_backward_kernel, tensors, plan, (gate_multiplier, down_multiplier))
    return d_gate, d_up


# ----------------------------------------------------------------------------------------------------------
# PyTorch backend: the same math in fp32 (fp64 for fp64 inputs), one rounding to the input dtype at the end.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _forward_torch(gate, up, activation: GatedActivation, gate_multiplier, down_multiplier):
    compute = _compute_dtype(gate.dtype)
    out = activation.torch_value(gate.to(compute) * gate_multiplier) * up.to(compute) * down_multiplier
    return out.to(gate.dtype)


def _backward_torch(d_out, gate, up, activation, gate_multiplier, down_multiplier, differentiable=False):
    # Differentiated again (create_graph), the first derivative's formula is itself differentiated by autograd:
    # in fp64 its second derivative carries no more error than PyTorch's own double-backward kernels.
    compute = torch.float64 if differentiable else _compute_dtype(gate.dtype)
    act, d_act = activation.torch_value_and_grad(gate.to(compute) * gate_multiplier)
    d_out = d_out.to(compute) * down_multiplier
    d_up = d_out * act
    d_gate = d_out * up.to(compute) * d_act * gate_multiplier
    return d_gate.to(gate.dtype), d_up.to(up.dtype)


# ----------------------------------------------------------------------------------------------------------
# Dispatch and the shared autograd contract.


def gated_forward(gate, up, activation, gate_multiplier=1.0, down_multiplier=1.0) -> torch.Tensor:
    """``act(gate_multiplier * gate) * up * down_multiplier`` for validated inputs, without autograd."""
    n = gate.numel()
    if n == 0:
        return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if not use_triton(gate):
        return _forward_torch(gate, up, activation, gate_multiplier, down_multiplier)
    if gate.is_contiguous() and up.is_contiguous():
        # The common case in this frame: what _forward_triton does with contiguous tensors, which _as_rows passes
        # as one row of n columns (as backward_from_ctx does for the backward; NOTES.md §33). The plan by _plan's
        # key, made there on a miss.
        out = _backend.new_like(gate)
        function = activation.triton_value
        plan = _PLANS.get((id(function), None, 1, n, 0, 0, 0, BLOCK, NUM_WARPS)) or _plan(
            function, None, 1, n, _CONTIGUOUS[:3]
        )
        launch_prepared(_gated_forward_kernel, (gate, up, out), plan, (gate_multiplier, down_multiplier))
        return out
    return _forward_triton(gate, up, activation, gate_multiplier, down_multiplier)


def gated_backward(
    d_out, gate, up, activation, gate_multiplier=1.0, down_multiplier=1.0, in_place=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients for ``gate`` and ``up``. With ``in_place`` they are written into (and returned as) the
    ``gate`` and ``up`` buffers, which on the Triton path saves two activation-sized allocations; only for
    buffers nothing else reads."""
    if gate.numel() == 0:
        return (gate, up) if in_place else (torch.zeros_like(gate), torch.zeros_like(up))
    if d_out.shape != gate.shape:  # a broadcast or expanded gradient
        d_out = d_out.expand(gate.shape)
    if use_triton(gate):
        if d_out.dtype != gate.dtype:
            d_out = d_out.to(gate.dtype)
        # (a d_out whose last dimension is strided, an expanded one included, is copied by _as_rows)
        d_gate, d_up = _backward_triton(d_out, gate, up, activation, gate_multiplier, down_multiplier, in_place)
    else:
        d_gate, d_up = _backward_torch(d_out, gate, up, activation, gate_multiplier, down_multiplier)
    if not in_place:
        return d_gate, d_up
    for buffer, grad in ((gate, d_gate), (up, d_up)):
        if grad.data_ptr() != buffer.data_ptr():
            buffer.copy_(grad)
        # Anything that still held gate/up for autograd now raises instead of reading gradients.
        torch.autograd.graph.increment_version(buffer)
    return gate, up


def gated_recompute_backward(d_out, gate, up, activation) -> torch.Tensor:
    """One pass over contiguous-last-dim inputs of the same shape, for the tiled gated MLP: the gradients are
    written over ``gate`` and ``up`` and the forward output (needed for the down projection's weight
    gradient) over ``d_out``, which is returned. The caller owns all three buffers."""
    if gate.numel() == 0:
        return d_out
    if use_triton(gate) and d_out.is_contiguous():
        _backward_triton(d_out, gate, up, activation, 1.0, 1.0, True, out=d_out)
        return d_out
    compute = _compute_dtype(gate.dtype)
    act, d_act = activation.torch_value_and_grad(gate.to(compute))
    d_out_c, up_c = d_out.to(compute), up.to(compute)
    d_gate, d_up, out = d_out_c * up_c * d_act, d_out_c * act, act * up_c
    gate.copy_(d_gate)
    up.copy_(d_up)
    return d_out.copy_(out)


# ----------------------------------------------------------------------------------------------------------
# The autograd Functions' shared contract (LigerSiLUMulFunction, LigerGELUMulFunction, the functional forms).
#
# * Backward recomputes the activation from the saved gate and up.
# * Under create_graph (grad mode on inside backward) or a torch.func transform, backward is the PyTorch
#   composite, itself differentiable, so Hessian-vector products see the activation's second derivative.
# * In-place backward (gradients written over gate's and up's buffers) is taken only where it is provably
#   harmless: both are outputs of autograd ops (not leaves, nor views of leaves, whose values the caller
#   owns), they do not share storage (an aliased pair would read what it already overwrote), no saved-tensor
#   hook is active (``_backend.saved_tensor_hooks_forbid_writing``: unpacked tensors skip autograd's version
#   check, and a user's pack may keep them; the layers' own gate and up, which no other node saves, are
#   still written over under checkpointing and CPU offloading), and the graph is not being retained (a second
#   backward would read gradients instead of activations).


def function_forward(gate, up, activation, gate_multiplier, down_multiplier) -> torch.Tensor:
    """The public Functions' forward: the kernels, or the composite for tensors a torch.func transform wraps
    and for torch.export and torch.jit.trace (``_backend.exporting``)."""
    if (
        (_backend.exporting() or transforms_active(gate, up))
        if torch.compiler.is_compiling()
        # outside a compiled frame the same questions as C-level reads (each helper a Python frame per call, as
        # in backward_from_ctx)
        else (
            torch.compiler._is_exporting_flag
            or _is_tracing()
            or _forward_ad._current_level >= 0
            or is_functorch_wrapped(gate)
            or is_legacy_batched(gate)
            or is_functorch_wrapped(up)
            or is_legacy_batched(up)
        )
    ):
        return _forward_torch(gate, up, activation, gate_multiplier, down_multiplier)
    return gated_forward(gate, up, activation, gate_multiplier, down_multiplier)


def bind_cheaply(function_class):
    """Class decorator of the setup_context-style public Functions. PyTorch's ``apply`` binds every call's
    arguments through ``inspect.signature(forward)``: it parses the signature anew on each call (~17 µs on this
    project's development machine) unless the function carries it as ``__signature__``, and the binding itself
    still costs ~8 µs, a third of the call. Where no torch.func transform is active, the ``apply`` installed
    here fills in the defaults the call left out, takes keywords by name, and then does exactly what PyTorch's
    does with the bound arguments; anything the binding would reject (a wrong count, an unknown or repeated
    keyword) and every call under a transform take PyTorch's ``apply``, errors included. torch.compile traces
    the class's forward, setup_context and backward, never ``apply``."""
    forward = function_class.forward
    signature = forward.__signature__ = inspect.signature(forward)
    parameters = tuple(signature.parameters.values())
    names = tuple(p.name for p in parameters)
    defaults = tuple(p.default for p in parameters if p.default is not p.empty)
    parts = _backend.apply_parts()
    if parts is None or any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in parameters):
        return function_class  # a PyTorch whose apply differs, or a signature the fast binding does not cover
    torch_apply, unwrap_dead, c_apply = parts
    # The C++ apply that PyTorch's reaches through super(), bound to this class once: a subclass takes
    # PyTorch's apply. (A frame that dynamo compiles after a graph break cannot resolve that super().)
    c_apply = c_apply.__get__(None, function_class)
    n_parameters, n_required = len(parameters), len(parameters) - len(defaults)

    def apply(cls, *args, **kwargs):
        given = len(args)
        if (
            cls is not function_class
            or not n_required <= given <= n_parameters
            or torch._C._are_functorch_transforms_active()
        ):
            return torch_apply(cls, *args, **kwargs)
        if kwargs:
            unbound = dict(kwargs)
            tail = tuple(unbound.pop(n, d) for n, d in zip(names[given:], defaults[given - n_required :]))
            if unbound:  # unknown, or repeating a positional argument
                return torch_apply(cls, *args, **kwargs)
            args = (*args, *tail)
        elif given < n_parameters:
            args = (*args, *defaults[given - n_required :])
        # PyTorch's apply, past its binding: dead torch.func wrappers unwrapped, then the C++ apply.
        return c_apply(*unwrap_dead(args))

    apply.__doc__ = torch.autograd.Function.apply.__doc__
    apply.__qualname__ = f"{function_class.__qualname__}.apply"
    function_class.apply = classmethod(apply)
    return function_class


def with_defaults(inputs: tuple, defaults: tuple) -> tuple:
    """A public Function's setup_context ``inputs`` (``a``, ``b``, then the optional arguments) with the
    defaults of those the call left out: eager ``apply`` binds them, torch.compile passes only those given."""
    return (*inputs, *defaults[len(inputs) - 2 :])


def transforms_active(*tensors) -> bool:
    """True inside a torch.func transform (vmap, grad, jacrev...), whose wrapped tensors have no storage a
    Triton kernel could read (nor have the legacy vmap's, ``is_legacy_batched``), or inside a forward-AD dual
    level (``_backend.forward_ad_active``): the differentiable PyTorch composite runs instead. (A compiled graph
    handles transforms itself, and the check is opaque to the compiler.)"""
    if _backend.forward_ad_active():  # compiled too: the torch.library ops have no forward-AD rule
        return True
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if is_functorch_wrapped(t) or is_legacy_batched(t):
            return True
    return False


is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # a tensor of a torch.func transform
# A gradient batched by PyTorch's legacy vmap (autograd.grad(is_grads_batched=True), jacobian(vectorize=True)),
# which is_functorch_wrapped does not see: it has no storage either. (Dynamo cannot trace this query: it is asked
# only where the call is not being compiled.)
is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def may_write_over(gate, up) -> bool:
    """Whether backward may write gradients over ``gate`` and ``up`` (see above). Plain tensors only: a tensor
    subclass (the fake and functional tensors torch.compile traces with, DTensor) has no storage of its own
    to compare, and is never written over."""
    for t in (gate, up):
        if type(t) is not torch.Tensor or t.grad_fn is None or (t._base is not None and t._base.grad_fn is None):
            return False
        if torch._debug_has_internal_overlap(t) != 0:  # expanded (stride-0) or otherwise self-overlapping
            return False
    return gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()


def save_for_backward(ctx, gate, up, activation, gate_multiplier, down_multiplier, in_place, own_buffers=False) -> None:
    """``own_buffers``: gate and up are the caller's own, saved by no other node (see the contract above)."""
    ctx.save_for_backward(gate, up)
    ctx.options = (activation, gate_multiplier, down_multiplier)  # one attribute: backward reads them at once
    ctx.in_place = in_place and may_write_in_place(gate, up, own_buffers)


def may_write_in_place(gate, up, own_buffers: bool):
    """Whether a backward asked to write over ``gate`` and ``up`` may (the contract above), asked in forward; the
    graph's retention is asked when it runs, and for a caller's buffers the incoming gradient too: a truthy answer
    is then ``ASK_INCOMING`` (``may_write_over_now``). A layer's own buffers never meet an incoming gradient that
    shares their memory: nothing outside the layer holds them."""
    return (
        may_write_over(gate, up)
        and not _backend.saved_tensor_hooks_forbid_writing(own_buffers)
        and (own_buffers or (not (_producer_saved_output(gate) or _producer_saved_output(up)) and ASK_INCOMING))
    )


ASK_INCOMING = object()  # (truthy) ``ctx.in_place`` for a caller's buffers: in place if the incoming gradient allows


def _producer_saved_output(t) -> bool:
    """Whether the node that made ``t`` (or its base, for a view) may have saved its output, which its backward would
    then read after the gradients were written over it: every node but those of ops whose derivative needs none of
    their outputs (a product, a sum, a copy, a view; ``_KEEPS_NO_OUTPUT``). Among the others exp, sigmoid and tanh
    keep theirs, SDPA its attention output, the linear-algebra factorizations their factors, and any Python
    Function may: where a saved-tensor hook was active when such a node saved it, autograd's version check is off
    and that backward reads the gradients silently (NOTES.md §39). Their gradients are written fresh."""
    for node in (t.grad_fn, None if t._base is None else t._base.grad_fn):
        while node is not None and type(node).__name__ == "UnsafeViewBackward0":
            # _unsafe_view shares its input's storage without making a view of it (matmul's output, and anyone's
            # aten._unsafe_view): the input's producer made this memory
            node = node.next_functions[0][0]
        if node is not None and type(node).__name__ not in _KEEPS_NO_OUTPUT:
            return True
    return False


# Nodes whose backward formula reads their inputs (or nothing), never their output: what the outputs the layers and
# users hand the gated ops come from (F.linear and matmul, LoRA's sum, chunk and the other views, casts).
_KEEPS_NO_OUTPUT = frozenset(
    (
        "AddmmBackward0 MmBackward0 BmmBackward0 BaddbmmBackward0 MvBackward0 AddBackward0 AddBackward1 SubBackward0 "
        "SubBackward1 RsubBackward0 RsubBackward1 MulBackward0 MulBackward1 DivBackward0 DivBackward1 NegBackward0 "
        "ToCopyBackward0 CloneBackward0 UnsafeViewBackward0 ViewBackward0 ReshapeAliasBackward0 AsStridedBackward0 "
        "SliceBackward0 SelectBackward0 SplitBackward0 SplitWithSizesBackward0 UnsafeSplitBackward0 UnbindBackward0 "
        "TransposeBackward0 TransposeBackward1 PermuteBackward0 TBackward0 ExpandBackward0 SqueezeBackward0 "
        "SqueezeBackward1 SqueezeBackward2 UnsqueezeBackward0 AliasBackward0 CatBackward0 StackBackward0 "
        "IndexBackward0 IndexSelectBackward0 GatherBackward0 EmbeddingBackward0 NativeLayerNormBackward0 "
        "NativeDropoutBackward0 SiluBackward0 GeluBackward0"
    ).split()
)


def may_write_over_now(d_out, gate, up) -> bool:
    """Asked in backward, where a caller's gate and up may be written over: the incoming gradient shares no memory
    with them (a ``grad_outputs`` the caller made as a view of gate's storage: the kernel reads it block by block
    while it writes the gradients there)."""
    storage = d_out.untyped_storage().data_ptr()
    return storage != gate.untyped_storage().data_ptr() and storage != up.untyped_storage().data_ptr()


def backward_from_ctx(ctx, d_out) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    gate, up = ctx.saved_tensors
    args = ctx.options
    if torch.is_grad_enabled() or (
        # _backend.exporting() or transforms_active(d_out, gate, up): outside a compiled frame (compiled autograd
        # traces this too) the same questions as C-level reads, each helper being a Python frame per node
        (_backend.exporting() or transforms_active(d_out, gate, up))
        if torch.compiler.is_compiling()
        else (
            _forward_ad._current_level >= 0
            or torch.compiler._is_exporting_flag
            or _is_tracing()
            or is_functorch_wrapped(d_out)
            or is_legacy_batched(d_out)
            or is_functorch_wrapped(gate)
            or is_legacy_batched(gate)
            or is_functorch_wrapped(up)
            or is_legacy_batched(up)
        )
    ):
        d_gate, d_up = _backward_torch(d_out, gate, up, *args, differentiable=torch.is_grad_enabled())
    # The common case in this frame: what gated_backward and _backward_triton do for contiguous tensors of one
    # shape and dtype on the Triton path, without their layers of calls (on the H200 machine's host a Python
    # call costs about half a µs, and those layers were a fifth of a node's host time: NOTES.md §32). Anything
    # else takes them.
    elif (
        d_out.is_contiguous()
        and gate.is_contiguous()
        and up.is_contiguous()
        and d_out.dtype is gate.dtype
        and d_out.shape == gate.shape
        and gate.numel()
        and use_triton(gate)
    ):
        activation, gate_multiplier, down_multiplier = args
        in_place = ctx.in_place and not graph_is_retained()
        if in_place and ctx.in_place is ASK_INCOMING:
            # The incoming gradient shares no memory with gate or up (contiguous, one shape and dtype: their
            # address ranges apart), a caller's grad_outputs made as a view of gate's storage included.
            n_bytes, at = d_out.nbytes, d_out.data_ptr()
            in_place = not (-n_bytes < at - gate.data_ptr() < n_bytes or -n_bytes < at - up.data_ptr() < n_bytes)
        d_gate, d_up = (gate, up) if in_place else (_backend.new_like(gate), _backend.new_like(up))
        function, n = activation.triton_value_and_grad, gate.numel()
        plan = _PLANS.get((id(function), False, 1, n, 0, 0, 0, 0, 0, BLOCK, NUM_WARPS)) or _plan(
            function, False, 1, n, _CONTIGUOUS[:5]
        )  # (by _plan's key, as in gated_forward)
        tensors = (d_out, gate, up, d_gate, d_up, d_out)
        launch_prepared(_gated_backward_kernel, tensors, plan, (gate_multiplier, down_multiplier))
        if in_place:  # as gated_backward: anything that still held gate or up for autograd now raises
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
    else:
        in_place = (
            ctx.in_place
            and not graph_is_retained()
            and (ctx.in_place is not ASK_INCOMING or may_write_over_now(d_out, gate, up))
        )
        d_gate, d_up = gated_backward(d_out, gate, up, *args, in_place)
    needs = ctx.needs_input_grad
    return (d_gate if needs[0] else None), (d_up if needs[1] else None)


# ----------------------------------------------------------------------------------------------------------
# torch.library ops, for the functional forms and the layers: torch.compile traces them as single opaque
# ops (no graph break, scalars stay Python floats), with autograd and fake (shape) implementations. Their
# namespace is the package's module name, which the Hub loader makes unique per build, so two loaded
# versions never collide.

NAMESPACE = __name__.split(".")[0]


@torch.library.custom_op(f"{NAMESPACE}::gated_forward", mutates_args=())
def gated_forward_op(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_multiplier: float,
    down_multiplier: float,
    in_place_backward: bool,
) -> torch.Tensor:
    return gated_forward(gate, up, REGISTRY[activation], gate_multiplier, down_multiplier)


@gated_forward_op.register_fake
def _(gate, up, activation, gate_multiplier, down_multiplier, in_place_backward):
    return gate.new_empty(gate.shape)


@torch.library.custom_op(f"{NAMESPACE}::gated_backward", mutates_args=())
def gated_backward_op(
    d_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_multiplier: float,
    down_multiplier: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_backward(d_out, gate, up, REGISTRY[activation], gate_multiplier, down_multiplier)


@gated_backward_op.register_fake
def _(d_out, gate, up, activation, gate_multiplier, down_multiplier):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op(f"{NAMESPACE}::gated_backward_in_place", mutates_args=("gate", "up"))
def gated_backward_in_place_op(
    d_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_multiplier: float,
    down_multiplier: float,
) -> None:
    gated_backward(d_out, gate, up, REGISTRY[activation], gate_multiplier, down_multiplier, in_place=True)


@gated_backward_in_place_op.register_fake
def _(d_out, gate, up, activation, gate_multiplier, down_multiplier):
    return None


def _setup_context(ctx, inputs, output):
    gate, up, activation, gate_multiplier, down_multiplier, in_place_backward = inputs
    ctx.save_for_backward(gate, up)
    ctx.args = (activation, gate_multiplier, down_multiplier)
    # Compiled graphs never write in place (see _backward), and fake tensors have no storage to compare.
    ctx.in_place = in_place_backward and not torch.compiler.is_compiling() and may_write_in_place(gate, up, False)


def _backward(ctx, d_out):
    gate, up = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: the differentiable composite (see the contract above)
        activation, gate_multiplier, down_multiplier = ctx.args
        d_gate, d_up = _backward_torch(
            d_out, gate, up, REGISTRY[activation], gate_multiplier, down_multiplier, differentiable=True
        )
    elif (
        ctx.in_place
        and not torch.compiler.is_compiling()
        and not graph_is_retained()
        and may_write_over_now(d_out, gate, up)
    ):
        gated_backward_in_place_op(d_out, gate, up, *ctx.args)
        d_gate, d_up = gate, up
    else:  # compiled graphs get the pure op: the compiler plans the buffers itself
        d_gate, d_up = gated_backward_op(d_out, gate, up, *ctx.args)
    return (
        (d_gate if ctx.needs_input_grad[0] else None),
        (d_up if ctx.needs_input_grad[1] else None),
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd(gated_forward_op, _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# The functional forms (silu_mul, gelu_mul) and the layers call gated_apply. torch.compile gets the
# torch.library op above; eager code gets a plain autograd.Function, because the op's dispatch costs the host
# several times more per call (figures in benchmarks/NOTES.md). A host that cannot run ahead of the GPU (small
# models, decoding) feels that directly. (The public Functions' own apply, bind_cheaply's, costs the same.)


class _EagerGated(torch.autograd.Function):
    # The options as one argument: autograd's apply inspects every argument in forward, and backward answers
    # each with a gradient slot.
    @staticmethod
    def forward(ctx, gate, up, options):
        activation, gate_multiplier, down_multiplier, in_place, own_buffers = options
        # save_for_backward's work in this frame (a call on every eager call of the most frequent op)
        ctx.save_for_backward(gate, up)
        ctx.options = options[:3]
        ctx.in_place = in_place and may_write_in_place(gate, up, own_buffers)
        return gated_forward(gate, up, activation, gate_multiplier, down_multiplier)

    @staticmethod
    def backward(ctx, d_out):
        return (*backward_from_ctx(ctx, d_out), None)


_eager_gated = _backend.c_apply(_EagerGated)


def gated_apply(
    gate, up, activation: GatedActivation, gate_multiplier, down_multiplier, in_place_backward, own_buffers=False
):
    """The fused op with autograd, for validated inputs. ``own_buffers``: the caller made gate and up and
    hands them to nothing else (the layers), so the in-place backward is safe under checkpointing too.

    torch.export and torch.func get the PyTorch composite: an exported program then holds only aten ops and
    loads wherever PyTorch does (the torch.library namespace is per build), and transformed tensors have no
    storage for a kernel."""
    if torch.compiler.is_compiling():
        if _backend.forward_ad_active() or _backend.exporting():  # (see transforms_active)
            return _forward_torch(gate, up, activation, gate_multiplier, down_multiplier)
        return gated_forward_op(gate, up, activation.name, gate_multiplier, down_multiplier, in_place_backward)
    return gated_apply_eager(gate, up, activation, gate_multiplier, down_multiplier, in_place_backward, own_buffers)


def gated_apply_eager(
    gate, up, activation: GatedActivation, gate_multiplier, down_multiplier, in_place_backward, own_buffers=False
):
    """:func:`gated_apply` for a caller that has found the call not compiled. Traced (torch.export,
    torch.jit.trace), in forward-mode AD or under a torch.func transform, the composite runs, for plain tensors
    too: PyTorch's apply would refuse a Function without ``setup_context`` under a transform. So it does for
    tensors batched by PyTorch's legacy vmap (``torch._vmap_internals._vmap``), which have no storage either."""
    # The questions as C-level reads, in one expression (each helper a Python frame on every call of the
    # package's most frequent op): _backend.forward_ad_active() and, outside a compiled frame,
    # _backend.exporting().
    if (
        _forward_ad._current_level >= 0
        or _are_transforms_active()
        or is_functorch_wrapped(gate)  # (dead wrappers too, which PyTorch's apply would unwrap)
        or is_functorch_wrapped(up)
        or torch.compiler._is_exporting_flag
        or _is_tracing()
        or is_legacy_batched(gate)
        or is_legacy_batched(up)
    ):
        return _forward_torch(gate, up, activation, gate_multiplier, down_multiplier)
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):  # inference: no graph to record
        return gated_forward(gate, up, activation, gate_multiplier, down_multiplier)
    return _eager_gated(gate, up, (activation, gate_multiplier, down_multiplier, in_place_backward, own_buffers))


_are_transforms_active = torch._C._are_functorch_transforms_active
_is_tracing = torch._C._is_tracing  # torch.jit.is_tracing() outside TorchScript
_forward_ad = torch.autograd.forward_ad


def eager_call(a, b, activation: GatedActivation, gate_multiplier, down_multiplier, in_place_backward):
    """The functional forms' checks and route in one frame where the checks would pass unchanged (their host time
    is on every call of every gated layer): plain tensors that pass ``check_pair``'s fast case, float
    multipliers and a bool flag, a call not being compiled. Returns what the checks and ``gated_apply`` return
    for such a call, or None for every other call, which then takes them (errors included)."""
    if (
        torch.compiler.is_compiling()
        or type(gate_multiplier) is not float
        or type(down_multiplier) is not float
        or type(in_place_backward) is not bool
        or type(a) is not _Tensor
        or type(b) is not _Tensor
        or a.dtype is not b.dtype
        or a.dtype not in SUPPORTED_DTYPES
        or a.shape != b.shape
        or not a.dim()
        or a.device != b.device
    ):
        return None
    return gated_apply_eager(a, b, activation, gate_multiplier, down_multiplier, in_place_backward)


def gated_mul(a, b, activation="silu", gate_multiplier=1.0, down_multiplier=1.0, in_place_backward=False):
    """``act(gate_multiplier * a) * b * down_multiplier`` for any activation in ``activations.REGISTRY``
    ("silu", "gelu_tanh", "gelu", ...), with autograd; what silu_mul and gelu_mul are for one activation."""
    if type(activation) is str and activation in REGISTRY:
        out = eager_call(a, b, REGISTRY[activation], gate_multiplier, down_multiplier, in_place_backward)
        if out is not None:
            return out
    op = "gated_mul"
    check_pair(a, b, op)
    act = check_activation(activation, op)
    gate_multiplier = check_multiplier(gate_multiplier, "gate_multiplier", op)
    down_multiplier = check_multiplier(down_multiplier, "down_multiplier", op)
    return gated_apply(
        a, b, act, gate_multiplier, down_multiplier, check_flag(in_place_backward, "in_place_backward", op)
    )
