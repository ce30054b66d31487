"""The one place that decides how an op runs on a device: Triton or PyTorch.

* Triton runs on CUDA, ROCm (``device.type == "cuda"`` there too) and XPU tensors of fp16, bf16 and fp32.
* Everything else (CPU, MPS/Metal, float64, or a machine without Triton) runs the PyTorch implementation,
  which has the same semantics and the same autograd contract.

``LIGER_KERNELS_BACKEND`` (read once) or ``set_backend`` overrides the choice: ``auto`` (default), ``torch``,
or ``triton``. ``triton`` on
CPU tensors needs ``TRITON_INTERPRET=1`` set before the package is imported; that is how CI runs the real
kernel code on a machine without a GPU.
"""

import functools
import math
import os
import sys

import torch
from torch.autograd import forward_ad

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    jit = triton.jit
    constexpr = tl.constexpr
except ImportError:  # Metal, or a CPU-only install without Triton: the PyTorch path serves every op.
    triton = None
    tl = None
    HAS_TRITON = False

    def jit(fn):
        return fn

    def constexpr(value):
        return value


def next_power_of_2(n: int) -> int:
    """The launchers' host-side form (``triton.next_power_of_2`` is a jit function: slow to call per launch)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


# Every kernel output is allocated through this name (``_backend.new_tensor(shape, dtype=, device=)``, looked
# up at call time) so that tests can poison outputs (fill them with NaN) before a launch.
new_tensor = torch.empty


# ``new_like(t)``: a contiguous output of ``t``'s shape, dtype and device, ``new_tensor(t.shape, dtype=t.dtype,
# device=t.device)`` for half the host time (the hot elementwise ops call it once or twice per call). A partial,
# not a function: no Python frame per call. Looked up at call time too, so that tests can poison it.
new_like = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)


def new_strided(shape, stride, dtype, device) -> torch.Tensor:
    """An output with the given strides (one call; ``new_tensor`` then ``permute`` costs two)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "torch", "triton")


# The environment is read once, not on every call: an op's host cost matters as much as its kernel's in
# eager training and decoding. TRITON_INTERPRET must be set before Triton is imported anyway;
# LIGER_KERNELS_BACKEND is read at the first op, and set_backend changes the choice afterwards.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_choice = None


def triton_interpreted() -> bool:
    return _INTERPRETED


def set_backend(choice: str) -> None:
    """``auto`` (default), ``torch`` or ``triton``, for every op from now on (``LIGER_KERNELS_BACKEND`` gives
    the initial choice)."""
    global _choice
    normalized = choice.strip().lower() if isinstance(choice, str) else choice
    if normalized not in BACKENDS:
        raise ValueError(f"LIGER_KERNELS_BACKEND must be one of {BACKENDS}, got {choice!r}")
    _choice = normalized


def requested_backend() -> str:
    if _choice is None:
        set_backend(os.environ.get("LIGER_KERNELS_BACKEND", "auto") or "auto")
    return _choice


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the op on ``tensor`` (already validated) should run the Triton kernels."""
    choice = _choice if _choice is not None else requested_backend()
    if choice == "torch":
        return False
    runnable = HAS_TRITON and tensor.dtype in TRITON_DTYPES
    # CUDA (ROCm's tensors are is_cuda too) or XPU, asked without building a torch.device
    on_device = tensor.is_cuda or tensor.is_xpu
    if choice == "auto":
        return runnable and on_device
    # choice == "triton": forced, e.g. by tests that run the kernels through the interpreter.
    if tensor.is_meta:  # no data for any kernel to read: the PyTorch math gives the shapes, as on "auto"
        return False
    if not runnable:
        raise RuntimeError(
            f"LIGER_KERNELS_BACKEND=triton but Triton cannot run this op "
            f"(triton installed: {HAS_TRITON}, dtype {tensor.dtype}; supported dtypes {TRITON_DTYPES})"
        )
    if not on_device and not triton_interpreted():
        raise RuntimeError("LIGER_KERNELS_BACKEND=triton on a CPU tensor needs TRITON_INTERPRET=1 set before import")
    return True


def is_finite(value) -> bool:
    """math.isfinite for a real number, also when torch.compile(dynamic=True) traces it as a symbolic float
    (math.isfinite would break the graph there; the subtraction traces as a guard on the answer)."""
    if torch.compiler.is_compiling():  # abs(...) <= max: an int too large for a float is not finite either
        return bool(value - value == 0 and abs(value) <= sys.float_info.max)
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
# Saved-tensor hooks that keep no reference of their own to what they pack: torch.utils.checkpoint's
# (non-reentrant: a handle, then the recomputed tensor handed to each node that saved it) and save_on_cpu's (a
# CPU copy of a GPU tensor; on the CPU, the tensor itself, held only by the saving node).
_PACKS_THAT_KEEP_NOTHING = (
    ("torch.utils.checkpoint", "_checkpoint_hook."),
    ("torch.autograd.graph", "save_on_cpu."),
)


def saved_tensor_hooks_active() -> bool:
    """Whether any saved-tensor hook is active (True where this PyTorch cannot tell)."""
    return _top_saved_tensor_hooks is None or _top_saved_tensor_hooks(False) is not None


def saved_tensor_hooks_forbid_writing(own_buffers: bool) -> bool:
    """Whether a saved-tensor hook is active (``torch.autograd.graph.saved_tensors_hooks``) under which a backward
    must not write over the tensors its node saved. Under any hook an unpacked tensor skips autograd's version
    check, so another node that saved the same tensor would read the gradients without an error, and a user's
    pack may keep the tensors themselves. ``own_buffers``: the caller proves no other node saved them (a
    layer's gate and up, made and consumed inside the layer); then the hooks that keep nothing (checkpointing,
    CPU offloading) allow it. True where this PyTorch cannot tell."""
    if _top_saved_tensor_hooks is None:
        return True
    hooks = _top_saved_tensor_hooks(False)  # (not saved_tensor_hooks_active(): one call fewer per layer call)
    if hooks is None:
        return False
    if not own_buffers:
        return True
    pack = hooks[0]
    module, name = getattr(pack, "__module__", None), getattr(pack, "__qualname__", "")
    return not any(module == m and name.startswith(prefix) for m, prefix in _PACKS_THAT_KEEP_NOTHING)


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_is_retained() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True, autograd.functional.jacobian...), so that
    it may run again over the same saved tensors; assumed so where this PyTorch cannot tell."""
    return True if _keep_graph is None else _keep_graph()


def legacy_batched(t) -> bool:
    """Whether ``t`` is batched by PyTorch's legacy vmap (the incoming gradients of ``autograd.grad(...,
    is_grads_batched=True)`` and ``jacobian(vectorize=True)``): no storage a kernel could read, and not one of
    torch.func's wrapped tensors. Never under torch.compile, which batches with torch.func's and whose tracer
    cannot call this query."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_legacy_batchedtensor(t)


def refuse_batched_gradients(op: str, *d_outs, instead: str = "compute one gradient per call") -> None:
    """The clear error of a backward that cannot take gradients batched by PyTorch's legacy vmap
    (``legacy_batched``) among ``d_outs`` (None: no gradient)."""
    for d in d_outs:  # (legacy_batched's test inline: a loss's backward asks it on every call)
        if d is not None and not torch.compiler.is_compiling() and torch._C._functorch.is_legacy_batchedtensor(d):
            raise RuntimeError(
                f"{op} does not support batched gradients (is_grads_batched=True, jacobian(vectorize=True)); " + instead
            )


def forward_ad_active() -> bool:
    """Whether a forward-mode AD dual level is open (``torch.autograd.forward_ad``). The kernels have no JVP, and
    a dual tensor's tangent would not survive them: the ops run their differentiable PyTorch form instead."""
    return forward_ad._current_level >= 0


def exporting() -> bool:
    """Whether the call is being traced into a program of aten ops: torch.export (strict or not) or
    torch.jit.trace. Every op then takes its aten-only form: a Triton launch is no aten op, and a trace would
    record only the empty output it writes into.

    Not ``torch.compiler.is_exporting()``: before torch 2.14, dynamo folds that call to True under plain
    torch.compile as well, which would send every compiled call down the export path (the PyTorch
    composites, fused by inductor with other roundings, and an untiled MLP). The flag export sets around
    its tracing is read instead; under torch.compile it is False."""
    return torch.compiler._is_exporting_flag or torch.jit.is_tracing()  # dynamo folds is_tracing() to False


# ----------------------------------------------------------------------------------------------------------
# Autograd's apply, for the eager Functions whose host time is on every call.


def apply_parts():
    """(PyTorch's ``Function.apply``, the unwrapping of dead torch.func wrappers it does first, the C++ apply it
    ends in), or None where this PyTorch's apply is not made of those."""
    torch_apply = getattr(torch.autograd.Function.apply, "__func__", None)
    unwrap_dead = getattr(getattr(getattr(torch, "_functorch", None), "utils", None), "unwrap_dead_wrappers", None)
    c_apply = torch._C._FunctionBase.__dict__.get("apply")
    return None if None in (torch_apply, unwrap_dead, c_apply) else (torch_apply, unwrap_dead, c_apply)


def c_apply(function_class):
    """``function_class.apply`` past PyTorch's Python part, which for a Function without ``setup_context``, called
    with no torch.func transform active, only unwraps the arguments' dead torch.func wrappers and then calls
    the C++ apply (about 3 µs per call on this project's development machine, a tenth of an eager call). Its
    callers rule out transforms and wrapped tensors (or unwrap dead ones) first. PyTorch's apply where this
    PyTorch's differs."""
    parts = apply_parts()
    if parts is None or function_class.apply.__func__ is not parts[0]:
        return function_class.apply
    return parts[2].__get__(None, function_class)
