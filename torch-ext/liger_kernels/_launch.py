"""Launching a Triton kernel with as little host work as possible.

In eager training and decoding the host's time per call matters as much as the kernel's: ``kernel[grid](...)``
costs about 15 µs of host time per launch on the H200 machine (Triton 3.6), of which about 5 µs is the
compiled kernel's own launcher. The rest is work a fixed call site does not need redone on every launch:
binding the arguments to the signature, formatting the options into a cache key, launch metadata for hooks
(benchmarks/NOTES.md §15 has the profile). :func:`launch` keeps, per kernel, a map from a cheaper key to the
compiled kernel Triton itself chose, and calls that kernel's launcher directly.

It launches the compiled kernel ``kernel[grid]`` would, because its key determines Triton's own:

* each tensor by dtype, and whether its address is a multiple of 16 (Triton's alignment specialization);
* each int by its width class (i32 / i64 / u64), whether it is 1 (Triton bakes 1 into the kernel) and whether
  it is a multiple of 16 (Triton's divisibility specialization); floats and bools by type only, as Triton;
* the constexprs and launch options by name, type and value; Triton's debug and instrumentation settings;
  the current device (Triton caches per device).

A miss goes through ``kernel[grid]`` (compiling if needed) and keeps the compiled kernel it returns; tests/
test_launch.py checks the key against Triton's own specialization function. What else ``kernel[grid]`` does
per launch is kept or sends the call there: the check that the globals a kernel read have not changed since
it was compiled (Triton raises), and pre-run or launch hooks (profilers such as proton register them). The
direct launch is taken only where its calling convention was verified, Triton 3.6 on NVIDIA CUDA; everywhere
else (ROCm, XPU, the interpreter), and for any argument it does not recognize, ``kernel[grid]`` runs.
"""

import torch

from ._backend import HAS_TRITON, triton, triton_interpreted

# The versions whose JITFunction.run calls ``compiled.run(grid_0, grid_1, grid_2, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *all_arguments)``, the convention used below.
VERIFIED_TRITON = ("3.6.",)

if HAS_TRITON:
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime.jit import JITFunction

    DIRECT = triton.__version__.startswith(VERIFIED_TRITON) and not triton_interpreted() and torch.version.hip is None
else:
    DIRECT = False


# id(kernel) -> (kernel, {key: (launcher, its flags, function, packed_metadata, constexpr_values, global_checks)}).
# The constexprs' values are part of the key (by name, type and value), so each entry holds them ready to pass.
_CACHES = {}
MAX_ENTRIES = 256  # per kernel; bounded because a key holds each int's class, not its value


_PLAIN = (float, bool, type(None))  # Triton: fp32 and u1 unspecialized, None a constexpr


def argument_keys(args, _tensor=torch.Tensor, _plain=_PLAIN, _i64_max=2**63 - 1) -> list:
    """What Triton specializes on for each runtime argument, or more (never less). One expression, not a call
    per argument, with its names bound locally: this runs on every launch."""
    return [
        (value == 1, value % 16 == 0, -(2**31) <= value <= 2**31 - 1, value <= _i64_max)
        if type(value) is int
        else (value.dtype, value.data_ptr() % 16 == 0)
        if isinstance(value, _tensor)
        else type(value)
        if type(value) in _plain
        else _unrecognized(value)
        for value in args
    ]


def specialization_key(value):
    """``argument_keys`` of one argument."""
    return argument_keys((value,))[0]


def _unrecognized(value):
    raise _Unrecognized(type(value).__name__)


class _Unrecognized(Exception):
    """An argument type the key does not cover: the launch goes through ``kernel[grid]``."""


_MISSING = object()


def _globals_unchanged(checks) -> bool:
    """Triton's own check before each launch: a global the kernel read has the value it was compiled with. The
    same object first: comparing a ``tl.constexpr`` global by value runs Triton's Python ``__eq__``, which makes
    a new constexpr (a few µs a launch on the H200 host, NOTES.md §34)."""
    for namespace, name, value in checks:
        current = namespace.get(name, _MISSING)
        if current is not value and current != value:
            return False
    return True


def launch(kernel, grid: tuple, args: tuple, **meta) -> None:
    """``kernel[grid](*args, **meta)``: runtime arguments positionally, in the signature's order, then every
    constexpr and launch option (``num_warps``...) by name; on the device of ``args[0]``.

    Triton launches on the *current* device. A model spread over GPUs (``device_map="auto"``) calls layers
    whose tensors are on another one: the launch is then made with that device current, on its stream, as a
    PyTorch op would be."""
    _launch(kernel, grid, args, meta, None, args)


class Prepared:
    """A call site's fixed part of a launch, for sites that cache a plan per layout (rotary, the gated
    activations): the grid, the scalar arguments that follow the tensors, and the constexprs. Their share of
    the key is computed once here instead of on every launch, and stands in the key as a token: one object per
    distinct share, so that a launch hashes and compares it by identity (a key of tuples is hashed anew at
    every lookup, element by element; for the gated backward's 14 arguments that cost as much host time as the
    launch itself, benchmarks/NOTES.md §31)."""

    __slots__ = ("grid", "scalars", "meta", "key", "bound")

    def __init__(self, grid: tuple, scalars: tuple, **meta):
        self.grid, self.scalars, self.meta = grid, tuple(scalars), meta
        self.bound = None  # the last compiled kernel a keyed launch of this plan found (see ``launch_prepared``)
        try:
            share = (*meta.items(), *map(type, meta.values()), *argument_keys(self.scalars))
            if len(_TOKENS) >= MAX_TOKENS:
                _TOKENS.clear()  # later shares get new tokens: the kernel caches then miss once per share
            self.key = _TOKENS.setdefault(share, _Token())
        except (_Unrecognized, TypeError):  # never direct, as in ``launch``
            self.key = None

    def __setattr__(self, name, value):
        # Fixed once made: its token, and its binding (which copies the grid), stand for what it was made with.
        if name != "bound" and hasattr(self, "key"):
            raise AttributeError(f"a Prepared plan is fixed once made; make a new one instead of setting {name!r}")
        object.__setattr__(self, name, value)


class Plans:
    """A call site's ``Prepared`` plans by its own key, made once per key: ``plans.get(key) or plans.add(key,
    grid, scalars, **meta)`` builds the constexprs' dict only on a miss. The key must determine the plan: ints,
    bools and strings, each always in the same place (so that ``True`` and ``1`` never meet), never a float
    (``-0.0 == 0.0``: a plan made for one would pass it for the other; floats go as ``launch_prepared``'s
    trailing arguments). Bounded, because varying lengths meet many layouts."""

    __slots__ = ("plans", "get")

    def __init__(self):
        self.plans = {}
        self.get = self.plans.get

    def add(self, key, grid: tuple, scalars: tuple, **meta) -> Prepared:
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        plan = self.plans[key] = Prepared(grid, scalars, **meta)
        return plan


MAX_PLANS = 1024


class _Token:
    """A ``Prepared`` share's place in the launch key (hashed and compared by identity)."""

    __slots__ = ()


_TOKENS = {}  # a Prepared share -> its token
MAX_TOKENS = 4096


def launch_prepared(
    kernel,
    tensors: tuple,
    prepared: Prepared,
    trailing: tuple = (),
    *,
    _tensor=torch.Tensor,
    _data_ptr=torch.Tensor.data_ptr,
) -> None:
    """``launch(kernel, prepared.grid, (*tensors, *prepared.scalars, *trailing), **prepared.meta)``. ``trailing``:
    arguments after the plan's scalars that change from call to call (the gated ops' multipliers), keyed at
    each launch as the tensors are, so that a plan never stands for their values.

    The plan remembers the compiled kernel its last keyed launch found, with the facts of that launch's key
    (``_bind``), and launches it again where this launch's key would be the same, checked fact by fact
    instead of built and looked up: on the H200 machine's host that key and its lookup were about a tenth of a
    gated op's eager call (NOTES.md §36). Anything else takes ``_launch``'s keyed path, which binds again. (The
    keyword-only parameters are names bound locally, not arguments: this runs on every launch.)"""
    bound = prepared.bound
    if bound is not None:
        (kernel_, device, debug, instrumentation, alignment, dtypes, n_trailing, grid, run, flags, function, metadata,
         constexprs, checks) = bound  # fmt: skip
        runtime = knobs.runtime
        if (
            kernel_ is kernel
            and DIRECT  # (tests turn it off to compare with Triton's own path)
            and len(tensors) == len(dtypes)
            and len(trailing) == n_trailing
            and (first := tensors[0]).is_cuda
            and first.get_device() == device
            and torch._C._cuda_getDevice() == device
            and runtime.debug == debug
            and knobs.compilation.instrumentation_mode == instrumentation
            and type(runtime.launch_enter_hook) is HookChain
            and not runtime.launch_enter_hook.calls
            and type(runtime.launch_exit_hook) is HookChain
            and not runtime.launch_exit_hook.calls
            and not kernel.pre_run_hooks
        ):
            # The facts of ``_prepared_key``'s common form, each against the bound launch's: exact types, the
            # dtypes, 16-byte alignment (every tensor's, or the bound launch's pattern of it), then float trailing
            # arguments.
            addresses = 0
            for t, dtype in zip(tensors, dtypes):
                kind = type(t)
                if (kind is not _tensor and kind is not _Parameter) or t.dtype is not dtype:
                    break
                addresses |= _data_ptr(t)
            else:
                for value in trailing:
                    if type(value) is not float:
                        break
                else:
                    if (not addresses & 15 if alignment is _ALIGNED else _alignment(tensors) == alignment) and (
                        not checks or _globals_unchanged(checks)
                    ):
                        # (_launch's call, spelled again: a shared helper would be one more frame per launch)
                        run(
                            *grid,
                            torch._C._cuda_getCurrentRawStream(device),
                            function,
                            *flags,
                            metadata,
                            None,  # launch metadata and hooks: none registered (checked above)
                            None,
                            None,
                            *tensors,
                            *prepared.scalars,
                            *trailing,
                            *constexprs,
                        )
                        return
    args = (*tensors, *prepared.scalars, *trailing) if trailing else (*tensors, *prepared.scalars)
    _launch(kernel, prepared.grid, args, prepared.meta, prepared, tensors, trailing)


_data_ptr = torch.Tensor.data_ptr
_ALIGNED = _Token()  # in a prepared key: every tensor's address is a multiple of 16, and the dtypes follow


def _alignment(tensors, _data_ptr=torch.Tensor.data_ptr) -> tuple:
    """Whether each tensor's address is a multiple of 16: a prepared key's alignment where some is not."""
    return tuple([not _data_ptr(t) & 15 for t in tensors])


def _prepared_key(token, tensors, trailing, head=()) -> tuple:
    """A prepared launch's key: ``head`` (the launch's device and Triton's settings), the plan's token, then what
    Triton specializes on in the tensors and the trailing arguments, with the plan's scalars between the two
    groups, so that the key says which parameter each keyed argument is. Where every tensor is of exact type
    ``torch.Tensor`` or ``nn.Parameter`` (a subclass may override the ``data_ptr`` Triton calls), and every
    trailing argument is a float, a bool or None, the common form: the tensors' alignment (the marker
    ``_ALIGNED`` where every address is a multiple of 16, else ``_alignment``'s tuple), each tensor's dtype and
    each trailing argument's class: the same facts as ``argument_keys``' per-tensor (dtype, aligned) and per-float
    class; the marker and the tuple, never equal to the other form's count of tensors, keep the two forms apart.
    Otherwise the tensors' count and each argument's key. (A target sliced from shifted labels, ``labels[..., 1:]``
    of one sequence, is 8 bytes off: in the common form too, so that its launches are bound as well.)"""
    # One pass, with each check inline: this runs at every launch, and a pass of map() and set calls per fact
    # cost twice as much (NOTES.md §35).
    key = [*head, token, _ALIGNED]
    append = key.append
    addresses = 0
    for t in tensors:
        kind = type(t)
        if kind is not _Tensor and kind is not _Parameter:
            return _keyed_apart(token, tensors, trailing, head)
        addresses |= _data_ptr(t)
        append(t.dtype)
    if not tensors:
        return _keyed_apart(token, tensors, trailing, head)
    if addresses & 15:
        key[len(head) + 1] = _alignment(tensors)
    n_keyed = len(key)
    for value in trailing:
        kind = type(value)
        if kind is not float and kind is not bool and value is not None:  # an int (keyed by its value's class)...
            del key[n_keyed:]
            key += argument_keys(trailing)
            break
        append(kind)
    return tuple(key)


def _keyed_apart(token, tensors, trailing, head) -> tuple:
    """``_prepared_key`` with each argument keyed apart, after the tensors' count, which says where they end (a
    tensor among the trailing arguments is keyed as they are)."""
    return (*head, token, len(tensors), *argument_keys(tensors), *argument_keys(trailing))


_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


def _launch(kernel, grid, args, meta, prepared=None, tensors=(), trailing=()) -> None:
    """The launch itself. ``prepared``, when given, a ``Prepared`` whose token stands for the key of ``meta`` and
    of every argument but ``tensors`` (the first arguments) and ``trailing`` (the last)."""
    first = args[0]
    if not first.is_cuda:
        if first.is_xpu and first.get_device() != torch.xpu.current_device():
            with torch.xpu.device(first.get_device()):
                return _launch(kernel, grid, args, meta, prepared, tensors, trailing)
        kernel[grid](*args, **meta)  # XPU, or the interpreter's CPU tensors
        return
    device = first.get_device()
    # torch.cuda.current_device() without its lazy-initialization check: a CUDA tensor exists, so CUDA is set up
    if device != torch._C._cuda_getDevice():
        with torch.cuda.device(device):
            return _launch(kernel, grid, args, meta, prepared, tensors, trailing)
    runtime = knobs.runtime if DIRECT else None
    if (
        DIRECT
        and type(kernel) is JITFunction
        and type(grid) is tuple
        # no launch hook (profilers such as proton register them) and no pre-run hook: Triton's path runs them
        and type(runtime.launch_enter_hook) is HookChain
        and not runtime.launch_enter_hook.calls
        and type(runtime.launch_exit_hook) is HookChain
        and not runtime.launch_exit_hook.calls
        and not kernel.pre_run_hooks
    ):
        entry = _CACHES.get(id(kernel))
        cache = entry[1] if entry is not None and entry[0] is kernel else None
        alignment = None  # a prepared key's of the common form (``_prepared_key``): a launch that may be bound
        try:
            head = (device, runtime.debug, knobs.compilation.instrumentation_mode)
            if prepared is not None and prepared.key is not None:
                key = _prepared_key(prepared.key, tensors, trailing, head)
                alignment = key[len(head) + 1]
                if alignment is not _ALIGNED and type(alignment) is not tuple:
                    alignment = None
            else:
                key = (
                    *head,
                    *meta.items(),
                    *map(type, meta.values()),  # True, 1 and 1.0 are equal keys but distinct constexprs
                    *argument_keys(args),
                )
            compiled = cache.get(key) if cache is not None else None
        except (_Unrecognized, TypeError):  # an argument the key does not cover, or an unhashable constexpr
            key = compiled = None
        if compiled is not None and (not compiled[5] or _globals_unchanged(compiled[5])):
            if alignment is not None:
                _bind(kernel, prepared, key, len(head), len(tensors), trailing, compiled)
            run, flags, function, metadata, constexprs, _ = compiled
            run(
                grid[0],
                grid[1] if len(grid) > 1 else 1,
                grid[2] if len(grid) > 2 else 1,
                torch._C._cuda_getCurrentRawStream(device),
                function,
                *flags,
                metadata,
                None,  # launch metadata and hooks: none registered (checked above)
                None,
                None,
                *args,
                *constexprs,
            )
            return
        compiled = kernel[grid](*args, **meta)
        if key is not None:
            _remember(kernel, key, compiled, len(args), meta)
        return
    kernel[grid](*args, **meta)


def _bind(kernel, prepared, key, n_head: int, n_tensors: int, trailing, compiled) -> None:
    """Remember ``compiled`` on ``prepared`` with what ``launch_prepared`` checks to launch it again: ``key``'s head
    and its tensors' alignment and dtypes (``key`` is of ``_prepared_key``'s common form: the head, the token, the
    alignment, each tensor's dtype, each trailing argument's class), where every trailing argument is a float (an
    int's key is its value's class: not bound). A binding outlives the entry of ``_CACHES`` it came from: that map
    is bounded for memory, and a key's compiled kernel stays the one Triton chose for it."""
    if any(type(value) is not float for value in trailing):
        prepared.bound = None
        return
    dtypes = key[n_head + 2 : n_head + 2 + n_tensors]
    grid = prepared.grid
    grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    prepared.bound = (kernel, *key[:n_head], key[n_head + 1], dtypes, len(trailing), grid, *compiled)


def _launcher(run) -> tuple:
    """(callable, flags): the compiled kernel's C launch function and the flags its Python ``CudaLauncher``
    would pass it (cooperative grid, programmatic dependent launch, no scratch buffers), where the kernel needs
    no scratch memory, whose allocation is the one thing that wrapper does per launch; else the wrapper itself
    and no flags. Either is called as ``(grid, stream, function, *flags, metadata, hooks..., *arguments)``."""
    try:
        scratch = run.global_scratch_size or run.profile_scratch_size
        c_launch, flags = run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    except AttributeError:  # another launcher class than the verified one
        return run, ()
    return (run, ()) if scratch else (c_launch, flags)


def _live(namespace, name, value):
    live = namespace.get(name, _MISSING)
    try:
        return live if live is not _MISSING and bool(live == value) else value
    except (TypeError, ValueError, RuntimeError):  # no truth value (an array): the recorded copy, compared as before
        return value


def _remember(kernel, key, compiled, n_args: int, meta: dict) -> None:
    if hasattr(compiled, "result"):  # an asynchronous compilation's future
        compiled = compiled.result()
    names = kernel.arg_names[n_args:]
    if (
        any(param.is_constexpr for param in kernel.params[:n_args])  # keyed by class, not value: never direct
        or any(name not in meta for name in names)  # a defaulted constexpr
        or getattr(compiled, "function", None) is None  # handles not loaded
    ):
        return
    entry = _CACHES.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _CACHES[id(kernel)] = (kernel, {})
    if len(entry[1]) >= MAX_ENTRIES:
        entry[1].clear()
    # Triton records a deep copy of each global's value: where the live global still equals it, the live object is
    # kept instead, so that ``_globals_unchanged`` finds it by identity (a copied constexpr never is the global)
    checks = tuple(
        (namespace, name, _live(namespace, name, value))
        for (name, _), (value, namespace) in kernel.used_global_vals.items()
    )
    try:
        constexprs = tuple(meta[name] for name in names)
        entry[1][key] = (*_launcher(compiled.run), compiled.function, compiled.packed_metadata, constexprs, checks)
    except TypeError:  # an unhashable constexpr: this launch keeps kernel[grid]
        pass
