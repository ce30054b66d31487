"""The tiled MLP in one process: the seed's float64 table and more, gradient accumulation counts, the ZeRO-3
path, autocast and dropout replay, precision in bf16, saved memory, and misuse that must raise."""

import contextlib
import copy
import itertools
import math
import types
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harness import (
    BACKENDS,
    DropoutGatedMLP,
    GatedMLP,
    backend,
    call,
    max_abs_diff,
    quantize,
    rel_err,
    skip_unless_runnable,
    tiled_and_untiled_grads,
    truncates_bf16,
)

H = 64


def mark_zero3(module):
    """What DeepSpeed ZeRO-3 leaves on each partitioned parameter."""
    for i, p in enumerate(module.parameters()):
        p.ds_id = i
    return module


SEED_TABLE = {  # name: (module kwargs, x shape, num_shards, x requires grad, zero3)
    "baseline [2, 256, 64], 4 shards": ({}, (2, 256, H), 4, True, False),
    "2-D input (MoE experts)": ({}, (256, H), 4, True, False),
    "S not divisible by shards": ({}, (2, 250, H), 7, True, False),
    "auto num_shards": ({}, (2, 256, H), None, True, False),
    "single shard": ({}, (2, 256, H), 1, True, False),
    "out_features != in_features": ({"out_features": 48}, (2, 256, H), 4, True, False),
    "x without requires_grad": ({}, (2, 256, H), 4, False, False),
    "ZeRO-3 path": ({}, (2, 256, H), 4, True, True),
    "ZeRO-3, S not divisible": ({}, (2, 250, H), 7, True, True),
    "ZeRO-3, x without requires_grad": ({}, (2, 256, H), 4, False, True),
    "biases": ({"bias": True}, (2, 256, H), 4, True, False),
    "more shards than rows": ({}, (2, 5, H), 8, True, False),
    "S = 1, auto": ({}, (3, 1, H), None, True, False),
}


@pytest.mark.parametrize("case", sorted(SEED_TABLE))
def test_float64_tiled_equals_untiled(lk, case):
    kwargs, shape, num_shards, x_grad, zero3 = SEED_TABLE[case]
    torch.manual_seed(0)
    module = GatedMLP(H, 160, **kwargs).double()
    if zero3:
        mark_zero3(module)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=x_grad)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, num_shards)
    assert all(g is not None for g in tiled[1]), "every trainable tensor gets a gradient"
    assert max_abs_diff(tiled, untiled) < 1e-12


def test_frozen_parameters_stay_none(lk):
    """LoRA-style: frozen weights get no gradient, trainable ones get the untiled one."""
    module = GatedMLP(H, 160, bias=True).double()
    module.gate_proj.weight.requires_grad_(False)
    module.down_proj.bias.requires_grad_(False)
    x = torch.randn(2, 256, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, 4)
    assert module.gate_proj.weight.grad is None and module.down_proj.bias.grad is None
    assert max_abs_diff(tiled, untiled) < 1e-12


@pytest.mark.parametrize("shape", [(2, 0, H), (0, H)])
def test_empty_sequence(lk, shape):
    module = GatedMLP(H, 160).double()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = lk.apply_tiled_mlp(call, module, x)
    assert out.shape == shape
    out.sum().backward()
    assert x.grad.shape == shape
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters())


def test_auto_shards_are_ceil_s_over_h(lk):
    calls = []

    def counting(module, shard):
        calls.append(shard.shape[-2])
        return module(shard)

    module = GatedMLP(H, 160).double()
    lk.apply_tiled_mlp(counting, module, torch.randn(2, 3 * H + 1, H, dtype=torch.float64))
    assert calls == [49, 48, 48, 48]  # ceil(193 / 64) = 4 shards, sizes within one of each other


@pytest.mark.shard_policy
@pytest.mark.parametrize(
    "seq, hidden, expected",
    [
        (8192, 1024, 4),  # ceil(S / H) = 8 shards of 1024 tokens: 4 of 2048 (the minimum shard length)
        (16384, 2048, 8),  # from H = 2048 on, ceil(S / H) shards are at least that long already
        (32768, 4096, 8),
        (1000, 64, 1),  # shorter than one minimum shard: one shard, i.e. untiled
        ((8, 2048), 256, 8),  # the minimum counts rows: a batch of 8 short sequences still tiles
        ((16, 1024), 896, 2),
        (10**6, 4, 100),  # at most MAX_AUTO_SHARDS
    ],
)
def test_automatic_shard_count(lk, seq, hidden, expected):
    assert lk._tiling.MIN_SHARD_TOKENS == 2048
    batch, seq = seq if isinstance(seq, tuple) else (1, seq)
    assert lk._tiling.auto_num_shards(torch.empty(batch, seq, hidden, device="meta")) == expected


@pytest.mark.shard_policy
def test_the_short_call_test_is_the_automatic_count(lk):
    """``_one_shard`` skips reading the MLP's width below two minimum shards' rows (``_tiling.too_few_rows``): it
    must say exactly what the automatic count says, on both sides of that bound and of three shards'."""
    limit = lk._tiling.MIN_SHARD_TOKENS
    assert limit == 2048
    checked = tiled = 0
    for intermediate in (None, 256, 2816, 14336):
        mlp = types.SimpleNamespace(gate_proj=types.SimpleNamespace(out_features=intermediate))
        for rows in (1, limit, 2 * limit - 1, 2 * limit, 2 * limit + 1, 3 * limit - 1, 3 * limit, 8 * limit):
            for batch in (1, 4):
                if rows % batch:
                    continue
                x = torch.empty(batch, rows // batch, 64, device="meta")
                count = lk._tiling.auto_num_shards(x, intermediate)
                assert lk.tiled_mlp._one_shard(x, mlp, None, None) == (count <= 1), (intermediate, rows, batch)
                checked += 1
                tiled += count > 1
    assert tiled and checked - tiled  # both answers met
    narrow = types.SimpleNamespace(gate_proj=types.SimpleNamespace(out_features=None))
    assert not lk.tiled_mlp._one_shard(torch.empty(1, 2 * limit, 64, device="meta"), narrow, None, None)


@pytest.mark.shard_policy
@pytest.mark.parametrize(
    "hidden, intermediate, seq, expected",
    [
        (1024, 2816, 8192, 1),  # each shard needs >= 11,916 rows of GEMM work here: untiled (the fused MLP)
        (1024, 2816, 65536, 5),
        (2048, 8192, 16384, 8),  # exactly the minimum work at 2048 tokens
        (4096, 14336, 32768, 8),  # ceil(S / H) shards, far above the minimum work
        (8192, 28672, 16384, 2),
    ],
)
def test_automatic_shard_count_keeps_a_minimum_of_gemm_work_per_shard(lk, hidden, intermediate, seq, expected):
    """A gated MLP's count (the tiled layers pass I) also keeps rows x H x I per shard at least
    MIN_SHARD_WORK: the host's fixed cost per shard is then small against each shard's GEMMs. The tiled call
    reads I from the module, so a narrow MLP runs as the plain one."""
    x = torch.empty(1, seq, hidden, device="meta")
    assert lk._tiling.auto_num_shards(x, intermediate) == expected
    with torch.device("meta"):
        mlp = GatedMLP(hidden, intermediate)
    assert lk.tiled_mlp.intermediate_size(mlp) == intermediate


@pytest.mark.parametrize("seq, count", [(3 * H, 3), (H // 2, 1)])
def test_frozen_engine_parameters_make_ranks_agree_on_the_shard_count(lk, monkeypatch, seq, count):
    """ZeRO-3 gathers frozen parameters per shard too (LoRA on attention only leaves the MLP frozen): such a
    module still counts as gathered per shard, so the automatic count is agreed across ranks and the call
    always tiles, whatever this rank's tokens (one automatic shard here too: another rank may have more)."""
    mlp = GatedMLP(H, 128).double()
    for p in mlp.parameters():
        p.requires_grad_(False)
        p.ds_id = 0  # what marks a DeepSpeed ZeRO-3 parameter
    assert lk._tiling.engine_managed(lk._tiling.structure(mlp), [])
    agreed = []

    def harmonize(count, x):
        agreed.append(count)
        return count

    monkeypatch.setattr(lk._tiling, "harmonize_num_shards", harmonize)
    x = torch.randn(1, seq, H, dtype=torch.float64, requires_grad=True)
    out = lk.apply_tiled_mlp(call, mlp, x)
    (d_x,) = torch.autograd.grad(out.sum(), x)
    x_ref = x.detach().requires_grad_()
    assert agreed == [count] and torch.allclose(d_x, torch.autograd.grad(mlp(x_ref).sum(), x_ref)[0], atol=1e-12)


def test_one_automatic_shard_runs_untiled(lk, monkeypatch):
    """Any fn: where the automatic count is one shard, the call is the plain fn, once (tiling would only add the
    recompute and the tiled call's host cost), made before the checks that only a tiled call needs; an
    explicit num_shards=1 still tiles, and recomputes."""
    checks = _Spy(monkeypatch, lk._tiling, "untiled_reason")
    calls = []

    def counting(module, shard):
        calls.append(shard.shape[-2])
        return module(shard)

    mlp = GatedMLP(H, 128).double()
    x = torch.randn(1, H // 2, H, dtype=torch.float64, requires_grad=True)  # ceil(S / H) = 1
    lk.apply_tiled_mlp(counting, mlp, x).sum().backward()
    assert calls == [H // 2] and checks.calls == []
    calls.clear()
    lk.apply_tiled_mlp(counting, mlp, x, num_shards=1).sum().backward()
    assert calls == [H // 2, H // 2]


def test_the_one_shard_exit_finds_engine_parameters_as_the_structure_does(lk, monkeypatch):
    """The one-shard call's early exit looks for ZeRO-3 parameters without building the module's structure:
    it answers what ``engine_managed(structure(...))`` does (nested, frozen, shared and None parameters, a module
    inside itself), and where it finds one the full path runs (and agrees a count across ranks)."""
    tiling = lk._tiling

    def marked(path, frozen=False):
        mlp = GatedMLP(H, 128, bias=True).double()
        mlp.register_parameter("unset", None)
        mlp.register_parameter("scale", torch.nn.Parameter(torch.ones((), dtype=torch.float64)))  # the MLP's own
        mlp.gate_proj.add_module("again", mlp.up_proj)  # one module in two places
        mlp.up_proj.add_module("itself", mlp.up_proj)  # and inside itself
        if path:
            p = mlp.get_parameter(path)
            p.ds_id = 0  # what marks a DeepSpeed ZeRO-3 parameter
            p.requires_grad_(not frozen)
        return mlp

    for path, frozen in (
        (None, False),
        ("up_proj.weight", False),
        ("down_proj.bias", True),
        ("gate_proj.weight", True),
        ("scale", False),
    ):
        mlp = marked(path, frozen)
        assert (
            tiling.has_engine_parameters(mlp) == tiling.engine_managed(tiling.structure(mlp), []) == (path is not None)
        )
    assert tiling.has_engine_parameters(types.SimpleNamespace())  # not a module: the full checks decide
    agreed = []
    monkeypatch.setattr(tiling, "harmonize_num_shards", lambda count, x: agreed.append(count) or count)
    x = torch.randn(1, H // 2, H, dtype=torch.float64, requires_grad=True)
    lk.apply_tiled_mlp(call, marked("down_proj.bias", frozen=True), x)
    assert agreed == [1]


@pytest.mark.parametrize("num_shards", [0, -2, 2.0, True, "4"])
def test_bad_num_shards(lk, num_shards):
    with pytest.raises(ValueError, match="`num_shards` must be None"):
        lk.apply_tiled_mlp(call, GatedMLP(H, 32), torch.randn(4, H), num_shards)


def test_bad_arguments(lk):
    module = GatedMLP(H, 32)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        lk.apply_tiled_mlp("mlp", module, torch.randn(4, H))
    with pytest.raises(TypeError, match="`x` must be a torch.Tensor"):
        lk.apply_tiled_mlp(call, module, [[1.0] * H])
    with pytest.raises(ValueError, match=r"`x` must be \[B, S, H\] or \[S, H\]"):
        lk.apply_tiled_mlp(call, module, torch.randn(H))
    with pytest.raises(TypeError, match="`compute_params` must hold tensors"):
        lk.apply_tiled_mlp(call, module, torch.randn(4, H), None, ["weight"])
    with pytest.raises(ValueError, match=r"`fn` must map a shard \[\.\.\., 3, H\] to a tensor \[\.\.\., 3, H_out\]"):
        lk.apply_tiled_mlp(lambda m, x: x.sum(-2), module, torch.randn(2, 6, H), 2)


def accumulation_log(module):
    log = {name: [] for name, p in module.named_parameters() if p.requires_grad}
    for name, p in module.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: log[name].append(getattr(p, "ds_grad_is_ready", None))
            )
    return log


def test_each_weight_accumulates_once_per_backward(lk):
    module = GatedMLP(H, 160, bias=True).double()
    log = accumulation_log(module)
    x = torch.randn(2, 256, H, dtype=torch.float64, requires_grad=True)
    lk.apply_tiled_mlp(call, module, x, 8).sum().backward()
    assert {name: len(fired) for name, fired in log.items()} == {name: 1 for name in log}


def test_zero3_accumulates_per_shard_and_flags_the_last(lk):
    module = mark_zero3(GatedMLP(H, 160).double())
    log = accumulation_log(module)
    x = torch.randn(2, 256, H, dtype=torch.float64, requires_grad=True)
    lk.apply_tiled_mlp(call, module, x, 8).sum().backward()
    for name, flags in log.items():
        assert flags == [False] * 7 + [True], name


def partitioned(module):
    """The status DeepSpeed gives a partitioned parameter (the tensors keep their values: the tiled call's
    own gather is replaced in these tests by a recorder)."""
    for p in module.parameters():
        p.ds_status = types.SimpleNamespace(name="NOT_AVAILABLE")
    return module


@pytest.mark.parametrize("whole", [True, False], ids=["gathered by DeepSpeed", "partitioned"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "gate frozen"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x needs grad", "x needs none"])
def test_zero3_weights_on_the_fast_path_are_gathered_once_and_accumulate_once(lk, monkeypatch, x_grad, frozen, whole):
    """The package's layer math on ZeRO-3 weights (marked as DeepSpeed marks them; tests/test_deepspeed.py runs
    the real engine) takes the fast path and needs nothing agreed across ranks. Weights DeepSpeed gathered
    for the call (as it does inside its forward) are ordinary inputs; partitioned ones are gathered by the call
    itself, once in forward and once in backward. Either way the float64 gradients equal untiled ones and each
    weight accumulates exactly once (DeepSpeed reduces a gradient on every accumulation)."""
    torch.manual_seed(0)
    module = mark_zero3(GatedMLP(H, 160).double())
    if not whole:
        partitioned(module)
    module.gate_proj.weight.requires_grad_(not frozen)
    gathers = []

    @contextlib.contextmanager
    def gathered(params):
        if params:
            gathers.append(len(params))
        yield

    monkeypatch.setattr(lk._zero3, "gathered", gathered)
    fn = lk.gated_mlp.swiglu_mlp
    x = torch.randn(2, 256, H, dtype=torch.float64, requires_grad=x_grad)
    layout = lk.tiled_mlp._layout(fn, module, x, [p for p in module.parameters() if p.requires_grad])
    assert layout.gather == ([] if whole else list(module.parameters())) and not layout.agree
    log = accumulation_log(module)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, 4, fn=fn)
    assert max_abs_diff(tiled, untiled) < 1e-12
    assert {name: len(fired) for name, fired in log.items()} == {name: 2 for name in log}  # tiled, untiled once
    assert ("gate_proj.weight" in log) != frozen
    assert gathers == ([] if whole else [3, 3])  # the three weights, in forward and in backward


def test_zero3_layouts(lk):
    """Who gathers ZeRO-3 weights: DeepSpeed around the call (the MLP or a module above it is a ZeRO-3 leaf,
    or the fast path reads weights DeepSpeed gathered: ordinary inputs), the tiled call itself (the fast path
    on partitioned weights), or DeepSpeed per shard (a user's fn on hooked projections: the count is agreed
    across ranks). A leaf below the MLP is not enough."""
    fn, x = lk.gated_mlp.swiglu_mlp, torch.randn(1, 128, H, dtype=torch.float64)

    def layout(module, f=fn):
        return lk.tiled_mlp._layout(f, module, x, list(module.parameters()))

    module = mark_zero3(GatedMLP(H, 160).double())
    assert layout(module, call) == ([*module.parameters()], [], True, True)
    assert layout(module) == ([], [], False, True)  # ordinary inputs, but the plain call would gather
    partitioned(module)
    assert layout(module) == ([*module.parameters()], [*module.parameters()], False, True)
    for leaf in (module, torch.nn.Sequential(module)):
        for p in module.parameters():
            p.ds_z3_leaf_module = leaf
        assert layout(module) == ([], [], False, False) and layout(module, call) == ([], [], False, False)
    module.gate_proj.weight.ds_z3_leaf_module = module.gate_proj
    assert layout(module, call) == ([*module.parameters()], [], True, True)


def test_deepspeed_hooks_are_recognised(lk):
    """ZeRO-3's gather hooks (one wrapped by DeepSpeed's NVTX decorator) and the flops profiler's counters,
    which DeepSpeed registers on rank 0 only: neither may change how a tiled call runs, or ranks would run
    different collectives. A user's hook is not DeepSpeed's."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

    def gather(module, args):
        return None

    gather.__module__ = "deepspeed.runtime.zero.parameter_offload"
    wrapped = deepspeed.utils.nvtx.instrument_w_nvtx(gather)
    mlp = GatedMLP(H, 160)
    profiler = FlopsProfiler(mlp)
    profiler.start_profile()
    try:
        hooks = [h for m in mlp.modules() for t in (m._forward_pre_hooks, m._forward_hooks) for h in t.values()]
        assert hooks and all(lk._zero3.is_engine_hook(h) for h in hooks)
    finally:
        profiler.end_profile()
    assert lk._zero3.is_engine_hook(gather) and lk._zero3.is_engine_hook(wrapped)
    assert not lk._zero3.is_engine_hook(lambda module, args: None)


def test_a_users_forward_hook_under_zero3_runs_untiled(lk):
    """DeepSpeed's own hooks on the projections only gather and release; a user's hook beside them would
    fire once per shard (and again in the recompute) if the call tiled, so the call runs as the plain one."""
    module = mark_zero3(GatedMLP(H, 160).double())

    def engine_hook(module, args):  # what DeepSpeed ZeRO-3 registers on every module it manages
        return None

    engine_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    module.gate_proj.register_forward_pre_hook(engine_hook)
    x = torch.randn(1, 128, H, dtype=torch.float64)
    params = list(module.parameters())
    assert lk._tiling.untiled_reason(module, x, params) is None
    seen = []
    module.gate_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape[-2]))
    assert lk._tiling.untiled_reason(module, x, params) == "module forward hooks"
    lk.apply_tiled_mlp(call, module, x, 4)
    assert seen == [128]


def autocast_grads(lk, module, base, d_out, tiled, leaf, enabled=True):
    """Forward under bf16 autocast (backward outside it, as PyTorch advises), x a leaf or an activation."""
    x = base if leaf else base * 1.0
    with torch.autocast(base.device.type, dtype=torch.bfloat16, enabled=enabled):
        out = lk.apply_tiled_mlp(call, module, x, 4) if tiled else module(x)
    return [out, *torch.autograd.grad(out, [base, *module.parameters()], d_out)]


@pytest.mark.parametrize("leaf", [True, False], ids=["x leaf", "x activation"])
def test_autocast_is_replayed_in_the_recompute(lk, leaf):
    """Under bf16 autocast the tiled call computes what untiled autocast computes. Output and input gradient
    are row-wise, so they match exactly (autocast's cast cache included: the recompute feeds fn a shard of the
    same kind as x); weight gradients differ only by the per-shard bf16 rounding of the GEMMs, well inside
    the autocast-vs-fp32 gap that a recompute without autocast would show."""
    torch.manual_seed(0)
    module = GatedMLP(H, 160)
    base = torch.randn(2, 256, H, requires_grad=True)
    d_out = torch.randn(2, 256, H)
    tiled = autocast_grads(lk, module, base, d_out, True, leaf)
    untiled = autocast_grads(lk, module, base, d_out, False, leaf)
    fp32 = autocast_grads(lk, module, base, d_out, False, leaf, enabled=False)
    for t, u, f in zip(tiled[:2], untiled[:2], fp32[:2]):
        assert rel_err(t, u) == 0.0 and rel_err(u, f) > 1e-3
    for t, u, f in zip(tiled[2:], untiled[2:], fp32[2:]):
        assert rel_err(t, u) < 0.6 * rel_err(u, f)


def test_dropout_draws_the_same_masks_in_the_recompute(lk):
    """Backward must differentiate the function the forward computed: the reference runs the same shards
    with autograd (same random stream), the tiled call recomputes them. The caller's RNG is left as it was."""
    module = DropoutGatedMLP(H, 160, dropout=0.5).double()
    x = torch.randn(2, 256, H, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(2, 256, H, dtype=torch.float64)

    torch.manual_seed(123)
    ref = torch.cat([module(s) for s in torch.tensor_split(x, 4, dim=-2)], dim=-2)
    want = torch.autograd.grad(ref, [x, *module.parameters()], d_out)

    torch.manual_seed(123)
    out = lk.apply_tiled_mlp(call, module, x, 4)
    assert torch.equal(out, ref)
    state = torch.get_rng_state()
    got = torch.autograd.grad(out, [x, *module.parameters()], d_out)
    assert torch.equal(torch.get_rng_state(), state)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-12


@pytest.mark.parametrize("num_shards", [2, 8, 64])
def test_bf16_weight_gradients_within_the_contract(lk, num_shards):
    """bf16: the tiled weight-gradient error against float64 stays within 1.5x the untiled bf16 error, with the
    sums in bf16 over 2 shards and in fp32 over more (bf16 sums over 8 give about 2x)."""
    torch.manual_seed(0)
    module64 = GatedMLP(H, 128).double()
    module = copy.deepcopy(module64).bfloat16()
    x = torch.randn(1, 4096, H, dtype=torch.float64)
    d_out = torch.randn(1, 4096, H, dtype=torch.float64)
    (_, want), _ = tiled_and_untiled_grads(lk, module64, x, 1, d_out)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x.bfloat16(), num_shards, d_out.bfloat16())
    for t, u, w in zip(tiled[1][1:], untiled[1][1:], want[1:]):
        assert t.dtype == torch.bfloat16
        assert rel_err(t, w) <= 1.5 * rel_err(u, w)


@pytest.mark.parametrize("num_shards", [2, 64])
def test_bf16_fast_path_weight_gradients_within_the_contract(lk, num_shards, monkeypatch):
    """The tiled layer's own gated backward on a bf16 Llama-style host: weight gradients within 1.5x the untiled
    bf16 error against float64, summed in bf16 over 2 shards (no fp32 sums held) and in fp32 over 64 (in bf16
    they would not be within it)."""
    sum_dtypes = set()
    add_matmul = lk._tiled_gated.add_matmul

    def recording(total, a, b, narrow=False):
        total = add_matmul(total, a, b, narrow)
        sum_dtypes.add(total.dtype)
        return total

    monkeypatch.setattr(lk._tiled_gated, "add_matmul", recording)
    torch.manual_seed(0)
    host64 = GatedMLP(H, 128).double()
    host = copy.deepcopy(host64).bfloat16()
    host.num_shards = num_shards
    assert lk.gated_mlp.swiglu_mlp.tiled_fast_path(host) is not None
    x = torch.randn(1, 4096, H, dtype=torch.float64)
    d_out = torch.randn(1, 4096, H, dtype=torch.float64)
    want = torch.autograd.grad(host64(x), list(host64.parameters()), d_out)
    tiled = torch.autograd.grad(
        lk.LigerTiledSwiGLUMLP.forward(host, x.bfloat16()), list(host.parameters()), d_out.bfloat16()
    )
    untiled = torch.autograd.grad(host(x.bfloat16()), list(host.parameters()), d_out.bfloat16())
    assert sum_dtypes == {torch.bfloat16 if num_shards == 2 else torch.float32}
    for t, u, w in zip(tiled, untiled, want):
        assert t.dtype == torch.bfloat16
        assert rel_err(t, w) <= 1.5 * rel_err(u, w)


def _force_split(monkeypatch, lk, forward, shards, blocks):
    """The automatic count run as this split (forward token shards, backward token shards, column blocks),
    whatever the policy would pick at the test's small shapes."""
    split = lk._tiling.Split(forward, shards, blocks)
    monkeypatch.setattr(lk._tiling, "auto_num_shards", lambda x, intermediate=None: max(forward, shards))
    monkeypatch.setattr(lk._tiling, "split_columns", lambda *args, **kwargs: split)


@pytest.mark.parametrize(
    "forward, shards, blocks, sum_dtype",
    [
        (3, 2, 2, torch.bfloat16),  # two token shards sum in bf16
        (4, 2, 2, torch.bfloat16),
        (8, 2, 4, torch.bfloat16),
        (6, 2, 4, torch.bfloat16),
        (16, 8, 2, torch.float32),  # more token shards: fp32 sums
    ],
    ids=["2 shards x 2 blocks (3 fwd)", "2 x 2 (4)", "2 x 4 (8)", "2 x 4 (6)", "8 x 2 (16)"],
)
def test_bf16_column_blocks_within_the_contract(lk, monkeypatch, forward, shards, blocks, sum_dtype):
    """The automatic count run as fewer token shards of column blocks of I in backward, and as token shards of
    its own in forward: weight gradients within 1.5x the untiled bf16 error against float64, with bf16 sums
    over 2 token shards and fp32 sums over 8; d_x, whose blocks' products add in bf16, within 1.5x the untiled
    error too."""
    _force_split(monkeypatch, lk, forward, shards, blocks)
    blocked = _Spy(monkeypatch, lk._tiled_gated, "_blocked_backward")
    forwards = _Spy(monkeypatch, lk.tiled_mlp, "gated_mlp_forward")
    sums = _Spy(monkeypatch, lk._tiled_gated, "matmul_into")
    torch.manual_seed(0)
    host64 = GatedMLP(H, 128, bias=True).double()
    host = copy.deepcopy(host64).bfloat16()
    x = torch.randn(1, 4096, H, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(1, 4096, H, dtype=torch.float64)
    want = torch.autograd.grad(host64(x), [x, *host64.parameters()], d_out)
    xb = x.detach().bfloat16().requires_grad_()
    tiled = torch.autograd.grad(lk.LigerTiledSwiGLUMLP.forward(host, xb), [xb, *host.parameters()], d_out.bfloat16())
    untiled = torch.autograd.grad(host(xb), [xb, *host.parameters()], d_out.bfloat16())
    assert [len(call[2]) for call in forwards.calls] == [forward]
    assert [(len(call[2]), call[-1]) for call in blocked.calls] == [(shards, blocks)]
    # the weights' sums: written by the first token shard's GEMMs, added into by the others, in sum_dtype
    summed = {call[0].dtype for call in sums.calls if len(call) < 5 or not call[4]}
    assert summed == {sum_dtype} and len(sums.calls) == 3 * shards * blocks
    for t, u, w in zip(tiled, untiled, want, strict=True):
        assert t.dtype == torch.bfloat16 and t.is_contiguous()
        assert rel_err(t, w) <= 1.5 * rel_err(u, w)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(
    "shape, sum_dtype, dtype",
    [
        ((130, 70), torch.float32, torch.bfloat16),  # tiles cut by both edges
        ((64, 192), torch.float32, torch.float16),
        ((1, 200), torch.float32, torch.float32),
        ((129, 65), torch.bfloat16, torch.bfloat16),  # two token shards: bf16 sums
    ],
)
def test_the_transposed_sum_is_cast_in_one_pass(lk, backend_name, shape, sum_dtype, dtype):
    """The down projection's gradient from its transposed sum (column blocks): every element of sum^T, rounded
    once to the parameters' dtype (the interpreter truncates to bf16), and the sum itself left unchanged."""
    skip_unless_runnable(backend_name)
    total = torch.randn(shape, dtype=torch.float64).to(sum_dtype)
    kept = total.clone()
    with backend(backend_name):  # (outputs poisoned: conftest)
        grad = lk._grad_sums.cast_transposed(total, dtype)
    want = quantize(total.t().double(), dtype, truncate=truncates_bf16(backend_name) and sum_dtype != dtype)
    assert grad.dtype == dtype and grad.shape == shape[::-1] and grad.is_contiguous()
    assert torch.equal(grad, want) and torch.equal(total, kept)


def test_the_blocked_backward_casts_the_transposed_sum_once(lk, monkeypatch):
    """The column blocks' down-projection sum reaches the parameter through ``cast_transposed``, once."""
    _force_split(monkeypatch, lk, 6, 3, 2)
    casts = _Spy(monkeypatch, lk._tiled_gated, "cast_transposed")
    torch.manual_seed(0)
    module = GatedMLP(H, 160, bias=True).double()
    x = torch.randn(1, 5 * H, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=lk.gated_mlp.swiglu_mlp)
    assert len(casts.calls) == 1 and casts.calls[0][0].shape == (160, H)
    assert max_abs_diff(tiled, untiled) < 1e-12


@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize(
    "frozen, x_grad, batch, intermediate",
    [
        ((), True, 2, 160),
        ((), False, 1, 161),  # odd I: blocks of 81 and 80 columns
        (("gate_proj.weight", "down_proj.bias"), True, 3, 160),  # LoRA-style: some projections frozen
        (("gate_proj.weight", "up_proj.weight", "down_proj.weight"), True, 2, 96),
    ],
)
def test_float64_column_blocks_equal_untiled(lk, monkeypatch, frozen, x_grad, batch, intermediate, blocks):
    """Column blocks (automatic counts on the gated fast path): the gradients of x and of every trainable
    weight and bias equal the untiled module's in float64, frozen ones stay None, and the blocked backward ran:
    6 automatic shards run as 3 token shards of 2 blocks, or as 2 token shards of 4 blocks."""
    _force_split(monkeypatch, lk, 6, math.ceil(6 / blocks), blocks)
    blocked = _Spy(monkeypatch, lk._tiled_gated, "_blocked_backward")
    torch.manual_seed(0)
    module = GatedMLP(H, intermediate, bias=True).double()
    for name in frozen:
        module.get_parameter(name).requires_grad_(False)
    x = torch.randn(batch, 5 * H + 3, H, dtype=torch.float64, requires_grad=x_grad)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=lk.gated_mlp.swiglu_mlp)
    assert [(len(call[2]), call[-1]) for call in blocked.calls] == [(math.ceil(6 / blocks), blocks)]
    assert [g is None for g in tiled[1]] == [g is None for g in untiled[1]]
    assert max_abs_diff(tiled, untiled) < 1e-12


@pytest.mark.parametrize("split", [(3, 2), (2, 4), None], ids=["3 x 2", "2 x 4", "whole"])
def test_the_backward_holds_one_blocks_buffers_at_a_time(lk, monkeypatch, split):
    """Each token shard's (or column block's) gate, up and d_hidden are freed before the next one's are made:
    the backward's peak is one block's three buffers over the sums and d_x (a leftover name that kept a
    block's d_up alive into the next block made it four). "whole": shards of whole columns, as for tied
    projections or a narrow I."""
    split = (4, 1) if split is None else split
    _force_split(monkeypatch, lk, 6, *split)
    original, earlier, calls = lk._tiled_gated.gated_recompute_backward, [], []

    def watched(d_hidden, gate, up, activation):
        calls.append([ref() is None for ref in earlier])
        earlier[:] = [weakref.ref(t) for t in (d_hidden, gate, up)]
        return original(d_hidden, gate, up, activation)

    monkeypatch.setattr(lk._tiled_gated, "gated_recompute_backward", watched)
    torch.manual_seed(0)
    module = GatedMLP(H, 160, bias=True).double()
    x = torch.randn(2, 5 * H, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=lk.gated_mlp.swiglu_mlp)
    assert len(calls) == split[0] * split[1]
    assert calls[0] == [] and all(freed == [True, True, True] for freed in calls[1:])
    assert max_abs_diff(tiled, untiled) < 1e-12


def test_the_generic_backward_holds_one_shards_gradients_at_a_time(lk, monkeypatch):
    """The generic recompute (any fn, or a given shard count): a shard's output and its weight gradients
    (the weights' size) are freed once added into the sums, before the next shard recomputes."""
    original, earlier, calls = lk.tiled_mlp._shard_grads, [], []

    def watched(ctx, out, *args):
        calls.append([ref() is None for ref in earlier])
        grads = original(ctx, out, *args)
        earlier[:] = [weakref.ref(t) for t in (out, *grads) if t is not None]
        return grads

    monkeypatch.setattr(lk.tiled_mlp, "_shard_grads", watched)
    torch.manual_seed(0)
    module = GatedMLP(H, 160, bias=True).double()
    x = torch.randn(2, 5 * H, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, 4)
    assert len(calls) == 4 and calls[0] == []
    assert all(len(freed) == 8 and all(freed) for freed in calls[1:])  # out, d_x and six weights and biases
    assert max_abs_diff(tiled, untiled) < 1e-12


@pytest.mark.parametrize(
    "tie", [("up_proj", "weight", "gate_proj"), ("up_proj", "bias", "gate_proj"), ("down_proj", "weight", "gate_proj")]
)
def test_tied_projections_are_not_split_into_column_blocks(lk, monkeypatch, tie):
    """Two projections sharing a weight or a bias: their gradients add into one sum, which column blocks
    (one sum per projection) would split; such calls keep whole columns, and equal the plain module."""
    blocked = _Spy(monkeypatch, lk._tiled_gated, "_blocked_backward")
    torch.manual_seed(0)
    module = GatedMLP(H, H, bias=True).double()  # I = H, so that down's weight can be gate's
    name, attr, source = tie
    setattr(getattr(module, name), attr, getattr(getattr(module, source), attr))
    x = torch.randn(2, 5 * H + 3, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=lk.gated_mlp.swiglu_mlp)
    assert blocked.calls == []
    assert max_abs_diff(tiled, untiled) < 1e-12


def test_tiling_counts_the_forwards_whole_shard_with_column_blocks(lk):
    """The forward holds gate, up and the output for one of its own token shards: at 3 forward shards and 3
    backward shards of 2 blocks the tiled call holds one activation's worth, not 4/6, so tokens = 1.9 H does
    not pay for three fp32 sums (it would, counting the backward's blocks alone); with 6 forward shards it
    does."""
    args = (1900, 1000, 4096, 2, 3, torch.bfloat16, 3)
    assert not lk._tiling.tiling_pays(*args, blocks=2)
    assert not lk._tiling.tiling_pays(*args, blocks=2, forward_shards=3)
    assert lk._tiling.tiling_pays(2100, *args[1:], blocks=2)
    assert lk._tiling.tiling_pays(*args, blocks=2, forward_shards=6)


@pytest.mark.shard_policy
@pytest.mark.parametrize(
    "seq, hidden, intermediate, dtype, summed, expected",
    [
        (32768, 4096, 14336, torch.bfloat16, 3, (3, 2, 2)),  # Llama-8B at 32k: 2 token shards sum in bf16
        (16384, 4096, 14336, torch.bfloat16, 3, (2, 2, 2)),
        (65536, 4096, 14336, torch.bfloat16, 3, (4, 8, 2)),  # fp32 sums: 8 passes over them, not 16
        (131072, 4096, 14336, torch.bfloat16, 3, (6, 16, 2)),
        (1048576, 4096, 14336, torch.bfloat16, 3, (9, 50, 2)),  # the forward within d_x's 8 GiB
        (8192, 4096, 14336, torch.bfloat16, 3, (2, 2, 1)),  # two shards sum in bf16 already: blocks only cost
        (16384, 2048, 8192, torch.bfloat16, 3, (3, 2, 2)),
        (16384, 8192, 28672, torch.bfloat16, 3, (2, 2, 1)),
        (32768, 4096, 14336, torch.float16, 3, (3, 4, 2)),  # fp16 sums in fp32 over any count
        (32768, 4096, 14336, torch.float32, 3, (3, 4, 2)),
        (32768, 4096, 14336, torch.bfloat16, 0, (5, 8, 1)),  # frozen: no sums to spare passes over
        (16384, 1024, 2816, torch.bfloat16, 3, (4, 16, 1)),  # blocks of 1408 columns: below the minimum
        (16384, 1024, 4097, torch.bfloat16, 3, (4, 16, 1)),  # 2 aligned blocks: 2112 and 1985 columns
        (32768, 4096, None, torch.bfloat16, 3, (8, 8, 1)),  # not the gated fast path
    ],
)
def test_column_block_split(lk, seq, hidden, intermediate, dtype, summed, expected):
    assert lk._tiling.MIN_BLOCK_COLUMNS == 2048
    num_shards = 16 if hidden == 1024 else min(math.ceil(seq / hidden), lk._tiling.MAX_AUTO_SHARDS)  # automatic
    x_shape = torch.Size([1, seq, hidden])
    assert lk._tiling.split_columns(num_shards, x_shape, intermediate, dtype, summed) == expected


def _splits(lk, n, seq_len, batch, hidden, intermediate, dtype, summed):
    """Every backward split the policy may take, as (shards, blocks, held bytes, cost): brute force over the
    token shards."""
    shape = (seq_len, batch, hidden, intermediate, dtype, summed)
    yield n, 1, lk._tiling._held(n, intermediate, *shape), lk._tiling._split_cost(n, 1, *shape)
    for blocks in lk._tiling.COLUMN_BLOCKS:
        if blocks > intermediate:
            continue
        widths = [width for _, width in lk._tiling.column_bounds(intermediate, blocks)]
        if min(widths) < lk._tiling.MIN_BLOCK_COLUMNS:
            continue
        for shards in range(2, n + 1):
            yield (
                shards,
                blocks,
                lk._tiling._held(shards, max(widths), *shape),
                lk._tiling._split_cost(shards, blocks, *shape),
            )


@pytest.mark.shard_policy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("summed, x_grad", [(3, True), (1, True), (0, True), (3, False)])
def test_the_split_is_the_cheapest_within_the_automatic_counts_memory(lk, dtype, summed, x_grad):
    """Over many shapes: the split taken holds no more in backward than the automatic count's whole-column
    shards (one block's three activations and the sums), and no split that also fits is estimated cheaper
    (checked by brute force over every token-shard count); blocks keep MIN_BLOCK_COLUMNS columns; the forward
    takes the fewest token shards (2 to n) that hold no more than the backward does, d_x included where x
    needs a gradient (the held models themselves: test_the_split_holds_no_more_than_whole_columns)."""
    for seq, batch, hidden, intermediate in itertools.product(
        (5000, 16384, 32768, 65537, 131072, 300000), (1, 3), (1024, 2048, 4096, 8192), (2816, 4097, 8192, 14336, 28672)
    ):
        n = max(2, min(math.ceil(seq / hidden), lk._tiling.MAX_AUTO_SHARDS))
        x_shape = torch.Size([batch, seq, hidden])
        split = lk._tiling.split_columns(n, x_shape, intermediate, dtype, summed, x_grad)
        candidates = list(_splits(lk, n, seq, batch, hidden, intermediate, dtype, summed))
        budget = candidates[0][2]
        held, cost = next((h, c) for s, b, h, c in candidates if (s, b) == (split.shards, split.blocks))
        assert held <= budget
        assert all(c >= cost for s, b, h, c in candidates if h <= budget), (x_shape, intermediate, split)
        assert split.blocks == 1 or split.shards >= 2
        room = held + (batch * seq * hidden * dtype.itemsize if x_grad else 0)
        forward_held = [None] + [
            lk._tiling._forward_held(f, seq, batch, hidden, intermediate, dtype) for f in range(1, n + 1)
        ]
        assert 2 <= split.forward <= n
        assert forward_held[split.forward] <= room or split.forward == n
        assert split.forward == 2 or forward_held[split.forward - 1] > room


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages that the ops run under it create (on meta tensors nothing
    runs), a storage counted until its last tensor is gone."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _forget_freed(self):
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._forget_freed()
        before = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in before and storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        self._forget_freed()
        return out


def _measured_peaks(lk, module, x, d_out, split):
    """Bytes the fast path's forward holds beyond its output, and its backward beyond d_x, run as ``split``."""
    params = [p for p in module.parameters() if p.requires_grad]
    projections = [getattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")]
    plan = lk._tiled_gated.GatedPlan(lk.activations.REGISTRY["silu"], *[(p.weight, p.bias) for p in projections])
    bounds = [lk._tiling.shard_bounds(x.shape[-2], count) for count in (split.forward, split.shards)]
    with torch.no_grad(), _LiveBytes() as forward:
        out = lk._tiled_gated.gated_mlp_forward(plan, x, bounds[0])
    held_forward = forward.peak - out.untyped_storage().nbytes()
    del out
    with torch.no_grad(), _LiveBytes() as backward:
        lk._tiled_gated.gated_mlp_backward(plan, params, bounds[1], x, d_out, x.requires_grad, split.blocks)
    return held_forward, backward.peak - (x.untyped_storage().nbytes() if x.requires_grad else 0)


@pytest.mark.shard_policy
@pytest.mark.parametrize(
    "batch, seq, hidden, intermediate, dtype, frozen, x_grad",
    [
        (1, 32768, 4096, 14336, torch.bfloat16, 0, True),  # Llama-8B at 32k: 2 x 2 blocks
        (1, 65536, 4096, 14336, torch.bfloat16, 0, True),
        (1, 32768, 4096, 14336, torch.bfloat16, 0, False),
        (1, 32768, 4096, 14336, torch.float32, 0, True),
        (1, 32768, 4096, 14336, torch.bfloat16, 3, True),  # frozen: whole columns
        (1, 16384, 2048, 8192, torch.bfloat16, 0, True),
        (1, 16384, 8192, 28672, torch.bfloat16, 0, True),
        (2, 32768, 4096, 14336, torch.bfloat16, 0, True),  # a batch: its shards' rows are copied
        (2, 32768, 8192, 8192, torch.bfloat16, 0, True),
        (4, 65536, 8192, 8192, torch.bfloat16, 0, True),
        (3, 20000, 2048, 8192, torch.float16, 1, False),
    ],
)
def test_the_split_holds_no_more_than_whole_columns(
    lk, monkeypatch, batch, seq, hidden, intermediate, dtype, frozen, x_grad
):
    """Counted op by op on meta tensors with the CUDA path's allocations (the fused passes write over their
    inputs, the GEMMs sum into fp32 directly): the chosen split's backward holds no more than the automatic
    count's whole-column shards, the model (``_held``) is an upper bound of both, and the forward holds no more
    than the backward does with d_x."""
    monkeypatch.setattr(lk._tiled_gated, "gated_forward", lambda gate, up, activation: torch.empty_like(gate))
    monkeypatch.setattr(lk._tiled_gated, "gated_recompute_backward", lambda d_hidden, gate, up, activation: d_hidden)
    monkeypatch.setattr(lk._grad_sums, "mm_widens", lambda device, into=False: True)
    with torch.device("meta"):
        module = GatedMLP(hidden, intermediate).to(dtype)
        x = torch.empty(batch, seq, hidden, dtype=dtype, requires_grad=x_grad)
        d_out = torch.empty(batch, seq, hidden, dtype=dtype)
    for name in ("gate_proj", "up_proj", "down_proj")[:frozen]:
        getattr(module, name).weight.requires_grad_(False)
    n = lk._tiling.auto_num_shards(x, intermediate)
    split = lk._tiling.split_columns(n, x.shape, intermediate, dtype, 3 - frozen, x_grad)
    shape = (seq, batch, hidden, intermediate, dtype, 3 - frozen)
    forward, backward = _measured_peaks(lk, module, x, d_out, split)
    _, whole = _measured_peaks(lk, module, x, d_out, lk._tiling.unsplit(n))
    width = max(w for _, w in lk._tiling.column_bounds(intermediate, split.blocks))
    assert backward <= whole <= lk._tiling._held(n, intermediate, *shape)
    assert backward <= lk._tiling._held(split.shards, width, *shape)
    assert forward <= backward + (x.untyped_storage().nbytes() if x_grad else 0)


def test_the_backward_block_holds_three_activations(lk):
    """tiling_pays counts one block's gate, up and d_hidden (the fused pass writes the gradients over them):
    at 3 token shards of 2 blocks (6 forward shards) tokens = 1.75 H saves more than three fp32 sums cost,
    1.7 H does not (counting four activations a block, 1.75 H would not either)."""
    args = (1000, 4096, 2, 3, torch.bfloat16, 3)
    assert lk._tiling.tiling_pays(1750, *args, blocks=2, forward_shards=6)
    assert not lk._tiling.tiling_pays(1700, *args, blocks=2, forward_shards=6)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("intermediate, seq", [(0, 8 * H), (160, 0)])
def test_an_empty_mlp_or_input_tiles_as_the_plain_module(lk, intermediate, seq):
    """I = 0 or S = 0: nothing to split; the call gives the plain module's output and gradients."""
    module = GatedMLP(H, intermediate).double()
    x = torch.randn(2, seq, H, dtype=torch.float64, requires_grad=True)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=lk.gated_mlp.swiglu_mlp)
    assert max_abs_diff(tiled, untiled) == 0


def test_a_fast_path_declared_for_a_module_without_the_projections_takes_the_generic_path(lk):
    """An fn declaring the fast path for a module without gate_proj, up_proj and down_proj (Phi-3's fused
    gate_up_proj): the generic recompute calls fn, and the call equals the plain module, at any shard count."""

    class FusedGateUp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(H, 2 * 96, bias=False)
            self.down_proj = torch.nn.Linear(96, H, bias=False)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)

    def fn(module, x):
        return module(x)

    fn.tiled_fast_path = lambda module: lk.activations.REGISTRY["silu"]
    torch.manual_seed(0)
    module = FusedGateUp().double()
    for seq in (H // 2, 3 * H):  # one automatic shard, and three
        x = torch.randn(2, seq, H, dtype=torch.float64, requires_grad=True)
        tiled, untiled = tiled_and_untiled_grads(lk, module, x, None, fn=fn)
        assert max_abs_diff(tiled, untiled) < 1e-12


def test_the_call_asks_the_policy_with_its_own_shapes(lk, monkeypatch):
    """Both callers (the layers through apply_tiled_mlp, and the Function applied directly) hand the policy
    x's whole shape, the weights' dtype, how many projections are trainable and whether x needs a gradient,
    and run the split it returns."""
    asked, original = [], lk._tiling.split_columns

    def spy(*args):
        asked.append(args)
        return lk._tiling.Split(3, 2, 2)

    monkeypatch.setattr(lk._tiling, "split_columns", spy)
    monkeypatch.setattr(lk._tiling, "auto_num_shards", lambda x, intermediate=None: 5)
    blocked = _Spy(monkeypatch, lk._tiled_gated, "_blocked_backward")
    torch.manual_seed(0)
    module = GatedMLP(H, 160).double()
    module.up_proj.weight.requires_grad_(False)
    for x_grad in (True, False):
        x = torch.randn(2, 3 * H, H, dtype=torch.float64, requires_grad=x_grad)
        lk.LigerTiledSwiGLUMLP.forward(module, x).sum().backward()
        params = [p for p in module.parameters() if p.requires_grad]
        fn = lk.gated_mlp.swiglu_mlp
        lk.LigerTiledMLPFunction.apply(fn, module, x, None, [], None, *params).sum().backward()
    assert asked == [(5, x.shape, 160, torch.float64, 2, grad) for grad in (True, True, False, False)]
    assert [(len(call[2]), call[-1]) for call in blocked.calls] == [(2, 2)] * 4
    assert original is not spy


@pytest.mark.parametrize(
    "columns, blocks, expected",
    [
        (14336, 4, [(0, 3584), (3584, 3584), (7168, 3584), (10752, 3584)]),
        (14336, 3, [(0, 4800), (4800, 4800), (9600, 4736)]),  # starts on multiples of 64
        (8000, 4, [(0, 2048), (2048, 2048), (4096, 2048), (6144, 1856)]),
        (161, 2, [(0, 81), (81, 80)]),  # too narrow to align: within one of each other
        (130, 3, [(0, 44), (44, 43), (87, 43)]),
    ],
)
def test_column_blocks_are_aligned_and_cover_every_column(lk, columns, blocks, expected):
    assert lk._tiling.column_bounds(columns, blocks) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_shards", [4, 8, None], ids=["4 shards", "8 shards", "automatic (blocks)"])
def test_low_precision_bias_gradients_are_rounded_once(lk, dtype, num_shards):
    """Over fp32-summed shards, each shard's bias gradient (a sum over its rows) joins the sum unrounded, so
    the result is rounded once, as the untiled one is: its error against float64 within 1.1x the untiled
    error (rounding each shard's sum to the bias dtype first gave 1.15-1.55x for the down projection's)."""
    torch.manual_seed(0)
    host64 = GatedMLP(H, 128, bias=True).double()
    host = copy.deepcopy(host64).to(dtype)
    if num_shards is not None:
        host.num_shards = num_shards
    x = torch.randn(1, 4096, H, dtype=torch.float64)
    d_out = torch.randn(1, 4096, H, dtype=torch.float64)
    names = [name for name, _ in host64.named_parameters()]
    want = torch.autograd.grad(host64(x), list(host64.parameters()), d_out)
    tiled = torch.autograd.grad(
        lk.LigerTiledSwiGLUMLP.forward(host, x.to(dtype)), list(host.parameters()), d_out.to(dtype)
    )
    untiled = torch.autograd.grad(host(x.to(dtype)), list(host.parameters()), d_out.to(dtype))
    for name, t, u, w in zip(names, tiled, untiled, want, strict=True):
        if name.endswith("bias"):
            assert rel_err(t, w) <= 1.1 * rel_err(u, w), name


def test_graph_saves_x_and_nothing_intermediate_sized(lk):
    S, inter = 512, 4 * H
    module = GatedMLP(H, inter)
    x = torch.randn(1, S, H, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.numel(), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lk.apply_tiled_mlp(call, module, x, 4)
    assert (x.numel(), x.data_ptr()) in saved
    assert max(n for n, _ in saved) <= S * H < S * inter
    out.sum().backward()  # and the graph still runs


def test_double_backward_is_a_clear_error(lk):
    module = GatedMLP(H, 160).double()
    x = torch.randn(2, 64, H, dtype=torch.float64, requires_grad=True)
    out = lk.apply_tiled_mlp(call, module, x, 2)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("gated", [False, True], ids=["fn", "gated"])
def test_batched_gradients_are_a_clear_error(lk, gated):
    """``autograd.grad(is_grads_batched=True)`` batches the incoming gradient with PyTorch's legacy vmap; the
    shards' gradients are written into one buffer, which such a tensor cannot be: a RuntimeError that says so,
    instead of one from inside vmap or the kernels."""
    module = GatedMLP(H, 160)
    x = torch.randn(2, 64, H, requires_grad=True)
    if gated:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        host = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=160))
        host.num_shards = 2
        out = lk.layers.LigerTiledSwiGLUMLP.forward(host, x)
    else:
        out = lk.apply_tiled_mlp(call, module, x, 2)
    with pytest.raises(RuntimeError, match="does not support batched gradients"):
        torch.autograd.grad(out, x, torch.randn(3, *out.shape), is_grads_batched=True)


def test_a_weight_left_out_of_compute_params_is_an_error(lk):
    module = GatedMLP(H, 160).double()
    x = torch.randn(2, 64, H, dtype=torch.float64, requires_grad=True)
    partial = [module.gate_proj.weight, module.up_proj.weight]
    out = lk.apply_tiled_mlp(call, module, x, 2, compute_params=partial)
    with pytest.raises(RuntimeError, match="its gradient would be lost"):
        out.sum().backward()


def test_stale_compute_params_are_an_error(lk):
    """Parameters captured before a wrapper replaced them (fully_shard does): never a silent zero gradient."""
    module = GatedMLP(H, 160).double()
    captured = list(module.parameters())
    for proj in (module.gate_proj, module.up_proj, module.down_proj):
        proj.weight = torch.nn.Parameter(proj.weight.detach().clone())
    x = torch.randn(2, 64, H, dtype=torch.float64)  # no grad: only the weights could carry the backward
    out = lk.apply_tiled_mlp(call, module, x, 2, compute_params=captured)
    with pytest.raises(RuntimeError, match="its gradient would be lost"):
        out.sum().backward()


@settings(max_examples=30, deadline=None)
@given(
    batch=st.one_of(st.none(), st.integers(1, 3)),
    seq=st.integers(0, 70),
    hidden=st.integers(1, 24),
    intermediate=st.integers(1, 40),
    num_shards=st.one_of(st.none(), st.integers(1, 12)),
    x_grad=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_tiled_equals_untiled(lk, batch, seq, hidden, intermediate, num_shards, x_grad, seed):
    torch.manual_seed(seed)
    module = GatedMLP(hidden, intermediate).double()
    shape = (seq, hidden) if batch is None else (batch, seq, hidden)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=x_grad)
    tiled, untiled = tiled_and_untiled_grads(lk, module, x, num_shards)
    assert max_abs_diff(tiled, untiled) < 1e-12


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_around_a_decoder_layer(lk, use_reentrant):
    """torch.utils.checkpoint around a Llama decoder layer whose MLP is tiled: the gradients of the layer's
    input and of every weight equal the plain untiled layer's."""
    import types

    from torch.utils.checkpoint import checkpoint
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=H, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = LlamaDecoderLayer(config, layer_idx=0).double()
    tiled = copy.deepcopy(plain)
    tiled.mlp.forward = types.MethodType(lk.LigerTiledSwiGLUMLP.forward, tiled.mlp)
    x = torch.randn(2, 3 * H, H, dtype=torch.float64)
    position_ids = torch.arange(3 * H).unsqueeze(0)
    cos_sin = LlamaRotaryEmbedding(config)(x, position_ids)
    cos_sin = tuple(t.double() for t in cos_sin)
    d_out = torch.randn(2, 3 * H, H, dtype=torch.float64)

    def grads(layer, checkpointed):
        leaf = x.detach().requires_grad_()

        def run(h):
            return layer(h, position_embeddings=cos_sin, position_ids=position_ids)

        out = checkpoint(run, leaf, use_reentrant=use_reentrant) if checkpointed else run(leaf)
        out = out[0] if isinstance(out, tuple) else out
        layer.zero_grad(set_to_none=True)
        out.backward(d_out)
        return [leaf.grad] + [p.grad for p in layer.parameters()]

    for got, want in zip(grads(tiled, True), grads(plain, False)):
        assert (got - want).abs().max().item() < 1e-12


class _Spy:
    """Counts the calls of ``module.name`` (and keeps their arguments) while the test runs."""

    def __init__(self, monkeypatch, module, name):
        self.calls, original = [], getattr(module, name)

        def spy(*args, **kwargs):
            self.calls.append(args)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)


def _checkpointed_grads(lk, module, norm, x, d_out, tail, tiled=True, early_stop=True, retain=False):
    """Gradients of x and of every parameter (norm's, then the MLP's) after a backward through
    ``tail(h, mlp(norm(h)))``: checkpointed (non-reentrant) with the tiled MLP, or plain with the module."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    leaf = x.detach().requires_grad_(x.requires_grad)
    for p in [*norm.parameters(), *module.parameters()]:
        p.grad = None

    def region(h):
        return tail(h, lk.LigerTiledSwiGLUMLP.forward(module, norm(h)) if tiled else module(norm(h)))

    with set_checkpoint_early_stop(early_stop):
        out = checkpoint(region, leaf, use_reentrant=False) if tiled else region(leaf)
        out.backward(d_out, retain_graph=retain)
        if retain:
            out.backward(d_out)
    return [leaf.grad] + [p.grad for p in [*norm.parameters(), *module.parameters()]]


def _residual(h, mlp_out):
    return h + mlp_out  # saves nothing for backward, as in a decoder layer


def _squared(h, mlp_out):
    return h + mlp_out * mlp_out  # saves the MLP's output: the recompute must produce it


@pytest.mark.parametrize("tail", [_residual, _squared], ids=["MLP last", "MLP output saved after it"])
@pytest.mark.parametrize("fast", [True, False], ids=["gated fast path", "generic recompute"])
@pytest.mark.parametrize("early_stop", [True, False], ids=["early stop", "full recompute"])
def test_checkpoint_recompute_stops_before_the_tiled_forward(lk, monkeypatch, tail, fast, early_stop):
    """Under non-reentrant checkpointing with the MLP last in the region (a decoder layer), the region's
    recompute stops once the tiled call's inputs are saved again: the tiled forward runs once per step, where
    the recompute used to run it again in full for an output nothing reads. Where something after the MLP
    saves its output, or early stop is off, the recompute runs it again. The gradients equal the plain
    layer's in float64 throughout, also for a second backward (retain_graph)."""
    torch.manual_seed(0)
    module, norm = GatedMLP(H, 160).double(), torch.nn.LayerNorm(H).double()
    torch.nn.init.normal_(norm.weight)
    gated = _Spy(monkeypatch, lk.tiled_mlp, "gated_mlp_forward")
    # The generic path calls fn(module, shard) per shard. (A replaced projection forward alone turns the fast
    # path off, as it must: the fast path would not call it.)
    calls = _Spy(monkeypatch, module.gate_proj, "forward") if not fast else types.SimpleNamespace(calls=[])
    x = torch.randn(2, 4 * H, H, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn_like(x)
    shards = lk._tiling.auto_num_shards(x, 160)
    assert shards > 1

    for retain in (False, True):
        gated.calls.clear()
        calls.calls.clear()
        got = _checkpointed_grads(lk, module, norm, x, d_out, tail, early_stop=early_stop, retain=retain)
        runs = 1 + (1 + retain) * (tail is _squared or not early_stop)  # tiled forwards: step + recomputes
        if fast:
            assert (len(gated.calls), len(calls.calls)) == (runs, 0)
        else:  # fn per shard in each forward, and again in each backward's recompute of the shards
            assert (len(gated.calls), len(calls.calls)) == (0, shards * (runs + 1 + retain))
        want = _checkpointed_grads(lk, module, norm, x, d_out, tail, tiled=False, retain=retain)
        calls.calls.clear()
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max().item() < 1e-12


def test_checkpoint_early_stop_input_without_grad(lk, monkeypatch):
    """x that needs no gradient (frozen layers below) with trainable MLP weights: the saving node still
    exists (for the weights), and the tiled backward computes no d_x for it."""
    torch.manual_seed(0)
    module, norm = GatedMLP(H, 160).double(), torch.nn.LayerNorm(H).double()
    norm.requires_grad_(False)
    backward = _Spy(monkeypatch, lk.tiled_mlp, "gated_mlp_backward")
    saver = _Spy(monkeypatch, lk.tiled_mlp._SavedForRecompute, "backward")
    x = torch.randn(2, 4 * H, H, dtype=torch.float64)
    d_out = torch.randn_like(x)
    got = _checkpointed_grads(lk, module, norm, x, d_out, _residual)
    want = _checkpointed_grads(lk, module, norm, x, d_out, _residual, tiled=False)
    assert got[0] is None and want[0] is None
    assert [args[5] for args in backward.calls] == [False]  # want_x
    # ... and the saving node passes None on, not an x-sized tensor of zeros
    assert [args[1] for args in saver.calls] == [None]
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g is None and w is None) or (g - w).abs().max().item() < 1e-12


@pytest.mark.parametrize(
    "tokens, hidden, intermediate, num_shards, pays",
    [
        (4096, 4096, 14336, 1, False),  # Llama-8B MLP, one shard: only the fp32 sums would be added
        (16384, 8192, 28672, 2, True),  # two shards: bf16 sums, no extra memory; half the activations saved
        (8192, 8192, 28672, 3, False),  # three shards: fp32 sums, which cost more than two thirds save
        (32768, 4096, 14336, 8, True),
        (131072, 4096, 14336, 32, True),
        (8192, 1024, 2816, 8, True),
        (16384, 2048, 8192, 8, True),
    ],
)
def test_tiling_is_chosen_where_it_lowers_the_bf16_peak(lk, tokens, hidden, intermediate, num_shards, pays):
    assert lk._tiling.tiling_pays(tokens, hidden, intermediate, 2, num_shards) is pays


def test_fp16_weights_sum_in_fp32_even_over_two_shards(lk):
    """fp16's range: one shard's rounded product can overflow where the sum would not, so fp16 weights keep
    their fp32 sums (and their memory counts) over any number of shards; bf16 over two does not."""
    assert lk._grad_sums.narrow_sums(2, torch.bfloat16) and not lk._grad_sums.narrow_sums(2, torch.float16)
    args = (16384, 8192, 28672, 2, 2)
    assert lk._tiling.tiling_pays(*args, torch.bfloat16) and not lk._tiling.tiling_pays(*args, torch.float16)


def test_frozen_projections_add_no_sums(lk):
    """Frozen projections have no gradients to sum: with all three frozen, any second shard pays (the shape
    where three fp32 sums would not); the layer's own choice reads which projections are trainable."""
    args = (8192, 8192, 28672, 2, 3, torch.bfloat16)
    assert not lk._tiling.tiling_pays(*args) and lk._tiling.tiling_pays(*args, 0)
    host = GatedMLP(64, 512).bfloat16()
    x = torch.randn(1, 96, 64, dtype=torch.bfloat16)  # 3 shards of 32 rows: saves less than 3 fp32 sums cost
    fn = lk.gated_mlp.swiglu_mlp
    assert not lk.tiled_mlp._pays(fn, host, x, 3)
    host.requires_grad_(False)
    assert lk.tiled_mlp._pays(fn, host, x, 3)


def test_fp32_weights_tile_whenever_there_are_shards(lk):
    """fp32 and fp64 weights sum their gradients in place: no extra memory, so any second shard pays."""
    assert lk._tiling.tiling_pays(4096, 4096, 14336, 4, 2) and lk._tiling.tiling_pays(4096, 4096, 14336, 8, 2)
    assert not lk._tiling.tiling_pays(4096, 4096, 14336, 4, 1)


@pytest.mark.parametrize("tile", [None, True, False])
def test_both_branches_of_the_choice_give_the_plain_gradients(lk, tile, monkeypatch):
    """The layer's automatic choice, and each forced branch (host attribute ``tile``), equal the plain module in
    float64; the untiled branch never enters the tiled Function."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    host = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=160)).double()
    tiled = copy.deepcopy(host)
    tiled.forward = types.MethodType(lk.LigerTiledSwiGLUMLP.forward, tiled)
    tiled.tile = tile
    calls = []
    inner = lk.LigerTiledMLPFunction.apply
    monkeypatch.setattr(lk.LigerTiledMLPFunction, "apply", lambda *a: calls.append(1) or inner(*a))
    x = torch.randn(2, 3 * H, H, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn_like(x)
    got = [tiled(x), *torch.autograd.grad(tiled(x), [x, *tiled.parameters()], d_out)]
    want = [host(x), *torch.autograd.grad(host(x), [x, *host.parameters()], d_out)]
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-12
    assert bool(calls) == (tile is not False)


def test_tile_must_be_a_bool_or_none(lk):
    with pytest.raises(TypeError, match="`tile` must be None"):
        lk.apply_tiled_mlp(call, GatedMLP(H, 32), torch.randn(4, H), tile="yes")
