"""_launch: the direct launch of a compiled Triton kernel runs exactly what ``kernel[grid]`` would.

On CPU: the launch key determines Triton's own specialization of every argument (so a cached compiled kernel
is only reused where Triton would choose the same one), and what is never cached. On a GPU: the direct
path is the one taken, and stays exact when alignment and divisibility change between calls, under CUDA
graph capture, and with a launch hook registered.
"""

import itertools
import random
import re
from pathlib import Path

import pytest
import torch

from harness import backend, rel_err

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402  (after the skip)
from triton.backends.compiler import BaseBackend  # noqa: E402

INTS = sorted(
    {
        *range(-40, 41),
        *(2**31 + d for d in range(-20, 20)),
        *(-(2**31) + d for d in range(-20, 20)),
        *(2**63 + d for d in range(-20, 20)),
        2**64 - 16,
        2**64 - 1,
    }
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64]


def _triton_spec(value, specialize: bool = True):
    return native_specialize_impl(BaseBackend, value, False, specialize, True)


def _values():
    yield from INTS
    yield from (True, False, 0.0, 1.0, -2.5, 1e300, None)
    storage = torch.empty(256, dtype=torch.uint8)
    for dtype in DTYPES:
        base = storage.view(dtype)
        for offset in range(min(base.numel(), 9)):
            yield base[offset:]


def test_the_key_determines_tritons_specialization(lk):
    """Every launch key maps to one Triton specialization: two arguments with the same key are compiled
    alike, so the compiled kernel cached under a key is the one Triton would launch."""
    seen = {}
    for value in _values():
        key = lk._launch.specialization_key(value)
        spec = _triton_spec(value)
        assert seen.setdefault(key, spec) == spec, f"{value!r}: key {key} also covers {seen[key]}, not {spec}"


def test_every_kernel_in_the_package_is_launched_through_launch(lk):
    """``kernel[grid](...)`` anywhere in the package would bypass the direct launch (and its host saving)."""
    package = Path(lk.__file__).parent
    bypasses = [
        f"{path.name}:{number}"
        for path in sorted(package.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"_kernel\[[^\]]*\]\(", line)
    ]
    assert bypasses == []
    call = re.compile(r"\blaunch(_prepared)?\(\s*_")
    launched = {path.name for path in package.glob("*.py") if call.search(path.read_text())}
    assert {"_gated.py", "rms_norm.py", "rotary.py", "cross_entropy.py", "fused_linear_cross_entropy.py"} <= launched


def test_ints_keep_their_class_not_their_value(lk):
    """The cache stays bounded while lengths vary from call to call: ints are keyed by class."""
    keys = {lk._launch.specialization_key(n) for n in range(2, 100_000)}
    assert len(keys) == 2  # multiples of 16 and the rest


@pytest.mark.parametrize("value", ["silu", b"x", 3 + 0j, torch.float32, object()])
def test_unrecognized_arguments_are_never_keyed(lk, value):
    with pytest.raises(lk._launch._Unrecognized):
        lk._launch.specialization_key(value)


def _scale(x_ptr, out_ptr, n, factor, BLOCK: triton.language.constexpr):
    offsets = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    mask = offsets < n
    x = triton.language.load(x_ptr + offsets, mask=mask)
    triton.language.store(out_ptr + offsets, x * factor, mask=mask)


_scale_kernel = triton.runtime.jit.JITFunction(_scale)  # compiled form, also where tests run interpreted


class _Compiled:
    """Stands in for a compiled kernel whose handles are loaded."""

    function, packed_metadata = object(), object()

    def run(self, *args):
        raise AssertionError("not launched in this test")


@pytest.mark.parametrize(
    ("n_args", "meta", "kept"),
    [
        (4, {"BLOCK": 64, "num_warps": 4}, True),
        (5, {"num_warps": 4}, False),  # BLOCK passed positionally: keyed by class, so never direct
        (4, {"num_warps": 4}, False),  # BLOCK left to a default the key does not hold
    ],
)
def test_only_launches_with_every_constexpr_by_name_are_cached(lk, n_args, meta, kept, monkeypatch):
    monkeypatch.setattr(lk._launch, "_CACHES", {})
    lk._launch._remember(_scale_kernel, ("key",), _Compiled(), n_args, meta)
    cached = lk._launch._CACHES.get(id(_scale_kernel), (None, {}))[1]
    assert (("key",) in cached) == kept
    if kept:
        assert cached[("key",)][4] == (64,)  # the constexpr values, passed after the arguments


class _CudaLauncher:
    """Triton 3.6's CudaLauncher's attributes: the C launch function and the flags its ``__call__`` passes."""

    launch_cooperative_grid, launch_pdl, profile_scratch_size = False, True, 0

    def __init__(self, global_scratch_size):
        self.global_scratch_size = global_scratch_size

    def launch(self, *args):
        raise AssertionError("not launched in this test")


def test_the_c_launcher_is_called_directly_only_without_scratch_memory(lk):
    """The wrapper's one per-launch job is allocating scratch memory: without any, its C function is called with
    the flags the wrapper would pass; with some, or for an unknown launcher class, the wrapper itself."""
    plain, scratch = _CudaLauncher(0), _CudaLauncher(128)
    assert lk._launch._launcher(plain) == (plain.launch, (False, True, None, None))
    assert lk._launch._launcher(scratch) == (scratch, ())
    other = _Compiled().run
    assert lk._launch._launcher(other) == (other, ())


# ----------------------------------------------------------------------------------------------------------
# On a GPU: the direct path is taken, and exact.


def _count_slow_launches(monkeypatch) -> list:
    calls = []
    slow = triton.runtime.jit.JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self.fn.__name__)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", counted)
    return calls


def _every_op(lk, n_cols: int, offset: int, device: str = "cuda"):
    """One call of each kernel family on bf16 CUDA tensors whose rows are ``n_cols`` wide and whose data
    start ``offset`` elements into their storage (offset 1 breaks Triton's 16-byte alignment)."""
    torch.manual_seed(n_cols + offset)
    results = []

    def tensor(*shape):
        flat = torch.randn(offset + torch.Size(shape).numel(), device=device, dtype=torch.bfloat16)
        return flat[offset:].view(shape).requires_grad_()

    a, b = tensor(8, n_cols), tensor(8, n_cols)
    results.append((lk.silu_mul(a, b), (a, b)))
    x, weight = tensor(8, n_cols), tensor(n_cols)
    results.append((lk.rms_norm(x, weight, 1e-6), (x, weight)))
    q, k, cos, sin = tensor(1, 4, 8, 64), tensor(1, 2, 8, 64), tensor(1, 8, 64), tensor(1, 8, 64)
    results.append((torch.cat([t.flatten() for t in lk.liger_rotary_pos_emb(q, k, cos, sin)]), (q, k)))
    # the target offset too: one offset by an element is 8 bytes off, as a slice of labels shifted by one
    logits, target = tensor(8, n_cols), torch.randint(0, n_cols, (offset + 8,), device=device)[offset:]
    results.append((lk.cross_entropy.cross_entropy(logits, target), (logits,)))
    return results


def _run_all(lk, n_cols, offset, device="cuda"):
    outputs = []
    for out, inputs in _every_op(lk, n_cols, offset, device):
        grads = torch.autograd.grad(out.float().square().sum(), inputs)
        outputs.append([out.detach().float(), *[g.float() for g in grads]])
    return outputs


@pytest.mark.gpu
def test_after_warm_up_no_launch_goes_through_triton_s_own_path(lk, monkeypatch):
    assert lk._launch.DIRECT, f"the direct launch is not verified for Triton {triton.__version__}"
    with backend("auto"):
        _run_all(lk, 4096, 0)
        calls = _count_slow_launches(monkeypatch)
        _run_all(lk, 4096, 0)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
def test_after_warm_up_prepared_launches_of_one_dtype_run_their_bound_kernel(lk, monkeypatch, offset):
    """Every prepared launch (the gated ops', rotary's, the losses') finds its compiled kernel through its plan's
    binding, without the keyed path, for aligned data and for data that is not (offset 1)."""
    keyed, keyed_launch = [], lk._launch._launch

    def recorded(kernel, *args):
        keyed.append(kernel.fn.__name__)
        return keyed_launch(kernel, *args)

    with backend("auto"):
        _run_all(lk, 4096, offset)
        _run_all(lk, 4096, offset)
        monkeypatch.setattr(lk._launch, "_launch", recorded)
        _run_all(lk, 4096, offset)
    prepared = {"_gated_forward_kernel", "_gated_backward_kernel", "_rotary_kernel", "_ce_rows_kernel", "_sums_kernel"}
    assert keyed and not prepared & set(keyed), keyed


@pytest.mark.gpu
def test_direct_launches_equal_triton_s_own_as_specializations_change(lk, monkeypatch):
    """Aligned and unaligned data, widths that are and are not multiples of 16, interleaved so that each
    call after the first meets a cache that holds the other specializations: bit-equal to the same calls
    through ``kernel[grid]``."""
    cases = list(itertools.product([4096, 4095, 1000, 16], [0, 1, 8]))
    with backend("auto"):
        direct = [_run_all(lk, n, offset) for n, offset in cases * 2]
        monkeypatch.setattr(lk._launch, "DIRECT", False)
        slow = [_run_all(lk, n, offset) for n, offset in cases * 2]
    for case, got, want in zip(cases * 2, direct, slow):
        for got_op, want_op in zip(got, want):
            for g, w in zip(got_op, want_op):
                assert torch.equal(g, w), case


@pytest.mark.gpu
def test_a_change_of_tritons_debug_setting_is_a_new_kernel(lk, monkeypatch):
    """Triton compiles a kernel per debug setting (device asserts, overflow checks): so does the cache."""
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    with backend("auto"):
        lk.silu_mul(a, a)
        calls = _count_slow_launches(monkeypatch)
        monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
        lk.silu_mul(a, a)
    assert calls == ["_gated_forward_kernel"]


@pytest.mark.gpu
def test_direct_launches_are_captured_by_cuda_graphs(lk):
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    with backend("auto"):
        lk.silu_mul(a, b)  # compiled and cached outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lk.silu_mul(a, b)
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
    want = torch.nn.functional.silu(a.double()) * b.double()
    assert rel_err(out, want) < 1e-2


@pytest.mark.gpu
def test_a_registered_launch_hook_sees_every_launch(lk):
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    with backend("auto"):
        lk.silu_mul(a, a)
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            lk.silu_mul(a, a)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_gated_forward_kernel"]


@pytest.mark.gpu
def test_tensors_on_another_gpu_run_there(lk):
    """A model spread over GPUs (device_map="auto") calls layers whose tensors are not on the current device:
    every op runs on the tensors' device and stream, as a PyTorch op does (Triton alone launches on the
    current one), forward and backward, bit-equal to the same calls on the current device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert torch.cuda.current_device() == 0
    with backend("auto"):
        for offset in (0, 1):
            torch.manual_seed(offset)
            want = _run_all(lk, 4096, offset, "cuda:0")
            torch.manual_seed(offset)
            got = _run_all(lk, 4096, offset, "cuda:1")
            torch.cuda.synchronize(1)
            assert torch.cuda.current_device() == 0
            for got_op, want_op in zip(got, want):
                for g, w in zip(got_op, want_op):
                    assert g.device == torch.device("cuda:1")
                    assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.gpu
def test_a_cpu_tensor_among_gpu_arguments_is_refused_at_every_launch(lk, monkeypatch):
    """A CPU tensor among a kernel's GPU arguments is refused, and not only on the first launch: its key equals an
    aligned GPU tensor's (dtype and alignment), so the second call reaches the cached kernel, whose launcher is
    handed the tensors themselves and asks the driver for each pointer, which refuses a host address. (Passing
    addresses instead would skip that check: NOTES.md §31.)"""
    kernel = lk._gated._gated_forward_kernel
    gate, up = (torch.randn(4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.full_like(gate, float("nan"))
    meta = dict(ACTIVATION=lk.activations.REGISTRY["silu"].triton_value, ONE_ROW=True, BLOCK=2048, num_warps=4)
    args = (gate, up, out, 4096, 0, 0, 0, 1.0, 1.0)
    monkeypatch.setattr(lk._launch, "_CACHES", {})  # so that the entry below is this launch's
    lk._launch.launch(kernel, (2,), args, **meta)  # compiled, and cached for GPU tensors
    assert rel_err(out, torch.nn.functional.silu(gate.double()) * up.double()) < 1e-2
    assert lk._launch._CACHES[id(kernel)][1], "the direct path was not taken"
    for _ in range(2):  # each call reaches the cached kernel, whose launcher refuses the host pointer
        with pytest.raises(ValueError, match="cpu tensor"):
            lk._launch.launch(kernel, (2,), (gate, up.cpu(), *args[2:]), **meta)


def test_a_prepared_share_has_one_token_and_only_equal_shares_share_it(lk):
    """A ``Prepared``'s constexprs and scalar classes stand in the launch key as one token object: equal shares
    get the same token (the grid is no part of the compiled kernel), any difference Triton compiles by (the
    constexpr's type or value, an int's class) another one."""
    prepared = lk._launch.Prepared
    assert prepared((1,), (3,), X=1).key is prepared((2,), (5,), X=1).key
    keys = [prepared((1,), (3,), X=value).key for value in (1, True, 1.0, 2)] + [prepared((1,), (16,), X=1).key]
    assert len({id(key) for key in keys}) == len(keys)


def test_a_prepared_launch_keys_which_parameter_each_argument_is(lk):
    """A plan's scalars sit between the tensors and the trailing arguments: the same plan with the same
    arguments split otherwise passes them to other parameters, and is keyed apart."""
    plan, t = lk._launch.Prepared((1,), (3,), BLOCK=64), torch.empty(64)
    key = lk._launch._prepared_key
    assert key(plan.key, (t, 16), (7,)) != key(plan.key, (t,), (16, 7))  # arguments (t, 16, 3, 7), (t, 3, 16, 7)
    assert key(plan.key, (t, t), ()) != key(plan.key, (t,), (t,))  # both forms: aligned, and per argument


def test_a_prepared_key_keeps_the_launch_s_head_and_each_plain_class_apart(lk):
    """The head (the device, Triton's debug and instrumentation settings) leads the key in both forms, and a
    trailing float, bool and None are three keys (Triton passes fp32, u1 and a constexpr)."""
    key, token, t = lk._launch._prepared_key, object(), torch.empty(64)
    for tensors in ((t,), (t[1:],)):  # the aligned form and the argument-by-argument one
        heads = [(0, False, ""), (1, False, ""), (0, True, ""), (0, False, "consan")]
        assert len({key(token, tensors, (1.0,), head) for head in heads}) == len(heads)
        assert all(key(token, tensors, (1.0,), head)[: len(head)] == head for head in heads)
        assert len({key(token, tensors, (value,)) for value in (1.0, True, None, 1)}) == 4


class _Shifted(torch.Tensor):
    """A tensor whose data_ptr (which Triton calls) is not its storage's: 4 bytes on."""

    def data_ptr(self):
        return super().data_ptr() + 4


def test_a_prepared_key_determines_tritons_specialization(lk):
    """A prepared launch's key (the tensors' alignment, as a marker where all are aligned, and their dtypes; where
    a tensor is of a subclass or a trailing argument not a plain class, each argument apart) maps to one
    specialization of the arguments it keys, whatever the split between tensors and trailing arguments; every
    form is reached."""
    tensors = [v for v in _values() if isinstance(v, torch.Tensor)]
    tensors += [torch.Tensor._make_subclass(_Shifted, t) for t in tensors[:12]]
    tensors += [torch.nn.Parameter(t, requires_grad=False) for t in tensors[:12]]
    scalars = [v for v in _values() if not isinstance(v, torch.Tensor)]
    plain = [v for v in scalars if type(v) is not int]  # drawn as often as the ints: the gated ops' multipliers
    token, seen, aligned_form, unaligned_form = object(), {}, 0, 0
    rng = random.Random(0)
    for _ in range(4000):
        group = tuple(
            rng.choice(tensors) if rng.random() < 0.9 else rng.choice(scalars) for _ in range(rng.randint(1, 4))
        )
        trailing = tuple(
            rng.choice(tensors if rng.random() < 0.2 else plain if rng.random() < 0.5 else scalars)
            for _ in range(rng.randint(0, 2))
        )
        key = lk._launch._prepared_key(token, group, trailing)
        aligned_form += key[1] is lk._launch._ALIGNED
        unaligned_form += type(key[1]) is tuple
        spec = (len(group), tuple(_triton_spec(v) for v in (*group, *trailing)))
        assert seen.setdefault(key, spec) == spec, f"{group}, {trailing}: key also covers {seen[key]}, not {spec}"
    assert 100 < aligned_form and 100 < unaligned_form and aligned_form + unaligned_form < 3900


class _FakeKernel:
    pre_run_hooks = ()


def _as_if_on_gpu(lk, monkeypatch, device: int = 0) -> list:
    """CPU tensors seen by ``launch_prepared`` as tensors of GPU ``device`` (the current one), with the direct
    path on: returns the list where each launch that leaves the bound kernel for ``_launch`` is recorded."""
    monkeypatch.setattr(lk._launch, "DIRECT", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: device)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: ("stream", device), raising=False)
    keyed = []
    monkeypatch.setattr(lk._launch, "_launch", lambda kernel, grid, args, *rest: keyed.append(args))
    return keyed


def _bound_plan(lk, kernel, tensors, trailing, checks=(), grid=(5, 2)):
    """A plan bound, as ``_launch`` binds it after a keyed launch of ``tensors`` and ``trailing``, to a compiled
    kernel whose launcher records what it is handed."""
    plan, ran = lk._launch.Prepared(grid, (3, 4), BLOCK=64), []
    head = (0, triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)
    key = lk._launch._prepared_key(plan.key, tensors, trailing, head)
    compiled = (lambda *args: ran.append(args), ("flag",), "function", "metadata", ("constexpr",), checks)
    lk._launch._bind(kernel, plan, key, len(head), len(tensors), trailing, compiled)
    return plan, key, head, ran


def test_a_bound_plan_launches_its_kernel_exactly_where_the_key_would_find_it(lk, monkeypatch):
    """A plan bound to the compiled kernel of one launch launches it again, without building the key, for exactly
    the arguments whose key equals that launch's (so Triton would choose the same kernel): random tensors of
    three dtypes, aligned or not, plain, ``nn.Parameter`` or a subclass, and trailing floats, bools, None, ints
    and tensors, against bindings of one dtype and of several, of aligned tensors and of tensors some of which
    are not aligned. Every other launch takes the keyed path."""
    pool = []
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        storage = torch.empty(512, dtype=dtype)
        pool += [storage[:64], storage[64:128], storage[1:]]  # aligned, aligned, not aligned
    pool += [torch.nn.Parameter(pool[0], requires_grad=False), torch.Tensor._make_subclass(_Shifted, pool[0])]
    pool += [pool[0]] * 6 + [pool[3], pool[6]] * 3  # the bindings' tensors, often
    plain = [0.5, 1.0, -2.0, True, None, 1, 16, pool[0]]
    kernel, rng = _FakeKernel(), random.Random(0)
    taken = 0
    bindings = [((pool[0],) * 3, (1.0, 2.0)), ((pool[0], pool[1]), ()), ((pool[3],), (0.5,))]
    bindings.append(((pool[0], pool[6], pool[3]), (1.0,)))  # bf16, int64, fp32
    # not every tensor aligned: a bf16 one 2 bytes off, an int64 one 8 bytes off (a target sliced from labels)
    bindings += [((pool[0], pool[8], pool[3]), (1.0,)), ((pool[2], pool[2]), ())]
    for (bound_tensors, bound_trailing), grid in zip(bindings, [(5, 2), (5,), (5, 2, 3), (5,), (5,), (3,)]):
        plan, bound_key, head, ran = _bound_plan(lk, kernel, bound_tensors, bound_trailing, grid=grid)
        grid = (*grid, 1, 1)[:3]  # as Triton launches it
        assert plan.bound is not None
        keyed = _as_if_on_gpu(lk, monkeypatch)
        for _ in range(3000):
            tensors = tuple(rng.choice(pool) for _ in range(rng.choice((len(bound_tensors), rng.randint(1, 4)))))
            trailing = tuple(
                rng.choice((0.25, 3.0) if rng.random() < 0.7 else plain)
                for _ in range(rng.choice((len(bound_trailing), rng.randint(0, 3))))
            )
            same = lk._launch._prepared_key(plan.key, tensors, trailing, head) == bound_key
            ran.clear(), keyed.clear()
            lk._launch.launch_prepared(kernel, tensors, plan, trailing)
            if same:
                assert not keyed and ran == [(*grid, ("stream", 0), "function", "flag", "metadata", None, None, None,
                                              *tensors, 3, 4, *trailing, "constexpr")]  # fmt: skip
            else:
                assert not ran and keyed == [(*tensors, 3, 4, *trailing)], (tensors, trailing)
            taken += same
    assert 300 < taken < 11000  # both branches, often


def test_a_bound_plan_leaves_its_kernel_when_the_launch_s_head_or_its_conditions_change(lk, monkeypatch):
    """What the key's head and ``_launch``'s conditions cover: another kernel, the direct path off, tensors not on
    the GPU or on another one than the bound launch's, another current device, Triton's debug and
    instrumentation settings, a launch or pre-run hook, a changed global the kernel read. Each sends the launch
    to the keyed path, and undone, the bound kernel runs again. A plan with a trailing argument that is not a float
    is never bound."""
    t = torch.empty(64, dtype=torch.bfloat16)
    namespace, kernel = {"SCALE": 2}, _FakeKernel()
    plan, _, _, ran = _bound_plan(lk, kernel, (t, t), (1.0,), checks=((namespace, "SCALE", 2),))
    keyed = _as_if_on_gpu(lk, monkeypatch)

    def launch(kernel=kernel) -> str:
        ran.clear(), keyed.clear()
        lk._launch.launch_prepared(kernel, (t, t), plan, (1.0,))
        assert len(ran) + len(keyed) == 1
        return "bound" if ran else "keyed"

    runtime, compilation = triton.knobs.runtime, triton.knobs.compilation
    changes = {
        "the direct path off": lambda m: m.setattr(lk._launch, "DIRECT", False),
        "not a GPU tensor": lambda m: m.setattr(torch.Tensor, "is_cuda", property(lambda self: False)),
        "tensors on GPU 1": lambda m: m.setattr(torch.Tensor, "get_device", lambda self: 1),
        "GPU 1 current": lambda m: m.setattr(torch._C, "_cuda_getDevice", lambda: 1),
        "both on GPU 1": lambda m: (
            m.setattr(torch.Tensor, "get_device", lambda self: 1),
            m.setattr(torch._C, "_cuda_getDevice", lambda: 1),
        ),
        "debug": lambda m: m.setattr(runtime, "debug", not runtime.debug),
        "instrumentation": lambda m: m.setattr(compilation, "instrumentation_mode", "consan"),
        "a launch enter hook": lambda m: m.setattr(runtime.launch_enter_hook, "calls", [print]),
        "a plain callable as the enter hook": lambda m: m.setattr(runtime, "launch_enter_hook", print),
        "a plain callable as the exit hook": lambda m: m.setattr(runtime, "launch_exit_hook", print),
        "a launch exit hook": lambda m: m.setattr(runtime.launch_exit_hook, "calls", [print]),
        "a pre-run hook": lambda m: m.setattr(kernel, "pre_run_hooks", [print], raising=False),
        "a global": lambda m: m.setitem(namespace, "SCALE", 3),
    }
    assert launch() == "bound"
    assert launch(_FakeKernel()) == "keyed"
    for name, change in changes.items():
        with monkeypatch.context() as m:
            change(m)
            assert launch() == "keyed", name
        assert launch() == "bound", name
    for trailing in ((1,), (True,), (None,), (1.0, 2)):
        assert _bound_plan(lk, kernel, (t, t), trailing)[0].bound is None
    for name in ("grid", "scalars", "meta", "key"):  # what the binding copied cannot change under it
        with pytest.raises(AttributeError, match="fixed once made"):
            setattr(plan, name, getattr(plan, name))


def test_plans_are_made_once_per_key_and_bounded(lk, monkeypatch):
    """``Plans``: a call site's plan is made on its key's first call and found again by the key after; the map is
    cleared when full, and the plans made after the clearing are found again."""
    plans, made = lk._launch.Plans(), []

    def plan(key):
        return plans.get(key) or made.append(key) or plans.add(key, (4,), (key[1],), BLOCK=16)

    first = plan(("rows", 1))
    assert plan(("rows", 1)) is first and made == [("rows", 1)]
    assert (first.grid, first.scalars, first.meta) == ((4,), (1,), {"BLOCK": 16})
    monkeypatch.setattr(lk._launch, "MAX_PLANS", 2)
    second = plan(("rows", 2))
    third = plan(("rows", 3))  # the map held two: cleared first
    assert plan(("rows", 3)) is third and plan(("rows", 2)) is not second
    assert made == [("rows", 1), ("rows", 2), ("rows", 3), ("rows", 2)]


def test_a_launch_checks_the_globals_its_kernel_read(lk):
    """The direct launch keeps Triton's check that a global the kernel read still has its compiled value (a
    changed one sends the launch to ``kernel[grid]``, which raises): the same object or an equal value passes, a
    changed or deleted global does not, ``tl.constexpr`` globals included."""
    from triton.language import constexpr

    value = constexpr(1.5)
    namespace = {"SCALE": value, "N": 4}
    checks = ((namespace, "SCALE", value), (namespace, "N", 4))
    unchanged = lk._launch._globals_unchanged
    assert unchanged(checks)
    namespace["SCALE"] = constexpr(1.5)
    assert unchanged(checks)
    for name, changed in (("SCALE", constexpr(2.0)), ("N", 5)):
        namespace.update(SCALE=value, N=4)
        namespace[name] = changed
        assert not unchanged(checks), name
    del namespace["N"]
    assert not unchanged(checks)


def test_a_cached_launch_keeps_the_live_global_where_it_equals_tritons_copy(lk, monkeypatch):
    """Triton records a deep copy of each global a kernel read; the cache keeps the live global where it still
    equals that copy, so that each launch's check finds it by identity (a copied constexpr never is the global,
    and comparing constexprs by value runs Triton's Python ``__eq__``); a global changed since keeps the copy."""
    import copy

    from triton.language import constexpr

    live, namespace = constexpr(1.5), {}
    namespace.update(SCALE=live, OLD=constexpr(1.0))
    recorded = {("SCALE", 0): (copy.deepcopy(live), namespace), ("OLD", 0): (constexpr(2.0), namespace)}
    kernel = triton.runtime.jit.JITFunction(_scale)
    monkeypatch.setattr(kernel, "used_global_vals", recorded, raising=False)
    monkeypatch.setattr(lk._launch, "_CACHES", {})
    lk._launch._remember(kernel, ("key",), _Compiled(), 4, {"BLOCK": 64, "num_warps": 4})
    checks = {name: value for _, name, value in lk._launch._CACHES[id(kernel)][1][("key",)][5]}
    assert recorded[("SCALE", 0)][0] is not live and checks["SCALE"] is live
    assert checks["OLD"] is recorded[("OLD", 0)][0] and not lk._launch._globals_unchanged(
        ((namespace, "OLD", checks["OLD"]),)
    )
