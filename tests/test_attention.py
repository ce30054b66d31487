"""attention.py: the grouped backward against one call and a float64 reference, the attention function in a
model against transformers' sdpa, its refusals, and (GPU) the cuDNN path at real sizes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from harness import python_calls, rel_err


def qkv(batch, seq, q_heads, kv_heads, dim, dtype=torch.float64, device="cpu", seed=0):
    """q, k, v in transformers' layout ([B, S, H, D] memory seen as [B, H, S, D]), and an incoming gradient."""
    g = torch.Generator(device=device).manual_seed(seed)

    def make(heads):
        return torch.randn(batch, seq, heads, dim, dtype=dtype, device=device, generator=g).transpose(1, 2)

    q, k, v = (make(heads).requires_grad_() for heads in (q_heads, kv_heads, kv_heads))
    return q, k, v, make(q_heads)


def attention64(q, k, v, scale):
    """Causal attention written out in float64, independent of any SDPA kernel."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


SHAPES = [(2, 37, 8, 4, 16), (1, 64, 4, 4, 8), (3, 5, 6, 2, 4)]  # batch, S, query heads, KV heads, head dim


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grouped_backward_equals_one_call_and_the_float64_reference(lk, shape):
    batch, seq, q_heads, kv_heads, dim = shape
    attention = lk.attention
    q, k, v, d_out = qkv(*shape)
    ref = attention64(q, k, v, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    results = {}
    for groups in [g for g in range(1, kv_heads + 1) if kv_heads % g == 0]:
        out = attention.GroupedCausalAttention.apply(q, k, v, 0.3, groups, attention.CPU_OPS)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        assert rel_err(out, ref) < 1e-13
        for grad, want, t in zip(grads, ref_grads, (q, k, v)):
            assert rel_err(grad, want) < 1e-12
            assert grad.stride() == t.stride()  # the gradients keep the inputs' layout
        results[groups] = (out, *grads)
    for groups, got in results.items():  # splitting the backward by heads changes no bit
        assert all(torch.equal(a, b) for a, b in zip(got, results[1])), groups


def test_the_backward_splits_where_the_workspace_is_large(lk):
    groups = lk.attention.backward_groups

    def meta(*shape):
        return torch.empty(*shape, device="meta")

    # Llama-3-8B: 32 query heads over 8 KV heads of 128; 8 bytes of workspace per element of q
    assert groups(meta(1, 32, 65536, 128), meta(1, 8, 65536, 128)) == 8  # 2 GiB: one KV head per call
    assert groups(meta(1, 32, 16384, 128), meta(1, 8, 16384, 128)) == 2  # 512 MiB
    assert groups(meta(1, 32, 8192, 128), meta(1, 8, 8192, 128)) == 1  # 256 MiB: one call
    assert groups(meta(1, 32, 8192, 128), meta(1, 32, 8192, 128)) == 1  # no shared heads: 4 bytes an element
    assert groups(meta(1, 32, 16384, 128), meta(1, 32, 16384, 128)) == 1
    assert groups(meta(1, 32, 32768, 128), meta(1, 32, 32768, 128)) == 2
    assert groups(meta(1, 12, 1 << 20, 64), meta(1, 3, 1 << 20, 64)) == 3  # at most one KV head per call
    # queries and keys of different lengths (the tiled decoder layer's pieces): dq follows the 8,192 queries
    # (128 MiB), the expansion of dk and dv the keys (1 GiB at 65,536 keys, 2 GiB at 131,072)
    assert groups(meta(1, 32, 8192, 128), meta(1, 8, 65536, 128)) == 8
    assert groups(meta(1, 32, 8192, 128), meta(1, 8, 16384, 128)) == 2  # 128 + 256 MiB
    assert groups(meta(1, 32, 8192, 128), meta(1, 8, 4096, 128)) == 1  # 128 + 64 MiB


def tiny_llama(device="cpu", dtype=torch.float64, seed=0, hidden=64, heads=8):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def loss_and_grads(model, ids, mask=None):
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_a_model_on_the_registered_attention_equals_sdpa(lk, monkeypatch, grouped, padded, checkpointed):
    """On the CPU the function is transformers' sdpa; with the grouped path forced (through the CPU ops) a model
    still computes sdpa's loss and gradients, under gradient checkpointing too."""
    attention = lk.attention
    model = tiny_llama()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    want_loss, want_grads = loss_and_grads(model, ids, mask)
    calls = []
    if grouped:
        monkeypatch.setattr(attention, "CUDNN_OPS", attention.CPU_OPS)

        # grouped wherever there is no mask (the checks that a call is cuDNN's are the GPU tests')
        def grouped_without_mask(module, query, key, value, mask, *rest):
            return 0 if mask is not None else calls.append(1) or 2

        monkeypatch.setattr(attention, "_grouped_call", grouped_without_mask)
    model.set_attn_implementation(lk.register_sdpa_attention("liger_sdpa_test"))
    try:
        loss, grads = loss_and_grads(model, ids, mask)
    finally:
        model.set_attn_implementation("sdpa")
    assert rel_err(loss, want_loss) < 1e-14
    assert max(rel_err(g, w) for g, w in zip(grads, want_grads)) < 1e-12
    # padding gives sdpa's 4-D mask, which the grouped path never sees; without it every layer is grouped
    # one call per layer, and one more in each checkpoint's recompute
    assert len(calls) == ((4 if checkpointed else 2) if grouped and not padded else 0)


def test_sdpa_mask_function_gives_none_for_a_causal_batch(lk):
    """The grouped path needs the mask skipped: sdpa's mask function does that for an unpadded causal batch."""
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return lk.attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    model = tiny_llama()
    name = lk.register_sdpa_attention("liger_sdpa_spy")
    from transformers import AttentionInterface

    AttentionInterface.register(name, spy)
    model.set_attn_implementation(name)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert seen and all(mask is None for mask in seen)


def test_masks_of_any_rank_are_sdpas_and_bad_names_are_clear_errors(lk):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as stock

    module = tiny_llama().model.layers[0].self_attn
    q, k, v, _ = qkv(2, 8, 8, 2, 8)
    for mask in (torch.ones(8, 8, dtype=torch.bool).tril(), torch.rand(2, 1, 8, 8)):  # broadcast as sdpa does
        assert torch.equal(lk.sdpa_attention_forward(module, q, k, v, mask)[0], stock(module, q, k, v, mask)[0])
    for name in ("sdpa", "eager", "liger", "", None, 3, "paged|liger_sdpa", "org/liger_sdpa", "repo:liger_sdpa"):
        with pytest.raises(ValueError, match="`name`"):
            lk.register_sdpa_attention(name)
    assert lk.register_sdpa_attention("liger_sdpa_twice") == lk.register_sdpa_attention("liger_sdpa_twice")


@pytest.mark.parametrize("keyword", ["s_aux", "sinks", "indices", "block_indices"])
def test_what_sdpa_does_not_apply_is_a_clear_error(lk, keyword):
    """GPT-OSS's attention sinks, DeepSeek-V3.2's sparse selection: models that hand these to an attention other
    than "sdpa" expect it to apply them, which transformers' sdpa would not."""
    module = tiny_llama().model.layers[0].self_attn
    q, k, v, _ = qkv(1, 8, 8, 2, 8)
    with pytest.raises(ValueError, match=f"`{keyword}`"):
        lk.sdpa_attention_forward(module, q, k, v, None, **{keyword: torch.zeros(8)})


def test_groups_must_divide_the_kv_heads(lk):
    q, k, v, _ = qkv(1, 8, 8, 2, 8)
    for groups in (0, 3, 2.0, None):
        with pytest.raises(ValueError, match="`groups`"):
            lk.attention.GroupedCausalAttention.apply(q, k, v, None, groups, lk.attention.CPU_OPS)


def test_another_mask_function_is_a_clear_error(lk):
    """transformers pairs an attention kernel loaded as "repo:function" with flash attention's mask function,
    which gives None for a cached prefill that needs a mask: the function refuses to run under it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("liger_sdpa_flash_masks", lk.sdpa_attention_forward)
    AttentionMaskInterface.register("liger_sdpa_flash_masks", flash_attention_mask)
    AttentionInterface.register("liger_sdpa_no_masks", lk.sdpa_attention_forward)  # no mask even for padding
    module = tiny_llama().model.layers[0].self_attn
    q, k, v, _ = qkv(1, 8, 8, 2, 8)
    lk.sdpa_attention_forward(module, q, k, v, None)  # the model's own "sdpa": sdpa's masks
    module.config._attn_implementation = "liger_sdpa_flash_masks"
    with pytest.raises(ValueError, match="flash_attention_mask.*register_sdpa_attention"):
        lk.sdpa_attention_forward(module, q, k, v, None)
    module.config._attn_implementation = "liger_sdpa_no_masks"
    with pytest.raises(ValueError, match="no mask function.*register_sdpa_attention"):
        lk.sdpa_attention_forward(module, q, k, v, None)


def test_double_backward_is_a_clear_error(lk):
    q, k, v, d_out = qkv(1, 6, 4, 2, 4)
    out = lk.attention.GroupedCausalAttention.apply(q, k, v, 0.5, 2, lk.attention.CPU_OPS)
    # raised at once: a gradient without a derivative could otherwise enter a penalty term as a constant
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, (q, k, v), d_out, create_graph=True)
    torch.autograd.grad(out, (q, k, v), d_out)  # the graph is intact: a plain backward still runs


# ----------------------------------------------------------------------------------------------------------
# keep_attention_context: the forward kept across the checkpoint's recompute (through the CPU ops)


@pytest.fixture
def forced_grouped(lk, monkeypatch):
    """Every unmasked call grouped (2 groups) through the CPU ops; returns the list of forward calls made."""
    attention = lk.attention
    forwards = []

    def forward(*args):
        forwards.append(args[0].shape)
        return attention.CPU_OPS[0](*args)

    monkeypatch.setattr(attention, "CUDNN_OPS", (forward, attention.CPU_OPS[1]))
    monkeypatch.setattr(attention, "_grouped_call", lambda module, q, k, v, mask, *rest: 0 if mask is not None else 2)
    return forwards


def _checkpointed_llama(lk, context_fn=None):
    model = tiny_llama()
    kwargs = {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    model.set_attn_implementation(lk.register_sdpa_attention("liger_sdpa_kept"))
    return model


@pytest.mark.parametrize("offload", [True, False])
def test_kept_attention_is_not_recomputed_and_changes_no_bit(lk, forced_grouped, offload):
    """Under keep_attention_context each layer's attention forward runs once, not again in the recompute, and
    the loss and gradients are bit for bit the plain checkpoint's; with a retained graph the second backward
    gives the same gradients (from the host copies again, or, kept on the GPU and handed over, recomputed)."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = _checkpointed_llama(lk)
    want_loss, want_grads = loss_and_grads(plain, ids)
    assert len(forced_grouped) == 4  # 2 layers, each again in its recompute
    forced_grouped.clear()
    model = _checkpointed_llama(lk, lambda: lk.keep_attention_context(offload=offload))
    loss = model(input_ids=ids, labels=ids).loss
    params = list(model.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)
    assert len(forced_grouped) == 2
    second = torch.autograd.grad(loss, params)
    assert len(forced_grouped) == (2 if offload else 4)
    assert torch.equal(loss, want_loss)
    for grads in (first, second):
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


def _attend_then_write(lk, q, k, v, write):
    """A checkpointable function: the attention function, then (optionally) an in-place write into its output."""
    module = torch.nn.Module()

    def fn(q, k, v):
        out = lk.sdpa_attention_forward(module, q, k, v, None)[0]
        if write:
            out.mul_(2)  # a model's in-place op on the attention output: replayed by the recompute too
        return out.transpose(1, 2)  # [B, S, H, D] as the model gets it, back to q's [B, H, S, D] view

    return fn


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("write", [False, True])
def test_kept_attention_is_the_forwards_own_copy(lk, forced_grouped, offload, write):
    """The model may write into the attention output after the call (the recompute writes again): the store
    keeps a copy of its own, so the recompute starts from the forward's values, as the plain checkpoint's does."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, d_out = qkv(1, 16, 4, 2, 8)
    fn = _attend_then_write(lk, q, k, v, write)
    want = torch.autograd.grad(checkpoint(fn, q, k, v, use_reentrant=False), (q, k, v), d_out)
    context_fn = lambda: lk.keep_attention_context(offload=offload)  # noqa: E731
    forced_grouped.clear()
    got = torch.autograd.grad(checkpoint(fn, q, k, v, use_reentrant=False, context_fn=context_fn), (q, k, v), d_out)
    assert len(forced_grouped) == 1
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_recomputed_call_that_is_not_the_forwards_computes_its_own(lk, forced_grouped):
    """Each entry records its module and the inputs' shapes, strides and dtypes: a recomputed call that differs
    (here: the recompute sees other shapes) computes its own forward instead of taking another call's."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, d_out = qkv(1, 16, 4, 2, 8)
    fn = _attend_then_write(lk, q, k, v, False)
    seen = []

    def changing(q, k, v):  # the forward attends over all 16 positions, the recompute over the first 8
        seen.append(1)
        return fn(*(t if len(seen) == 1 else t[:, :, :8] for t in (q, k, v)))

    forced_grouped.clear()
    out = checkpoint(
        changing, q, k, v, use_reentrant=False, context_fn=lk.keep_attention_context, determinism_check="none"
    )
    with pytest.raises(Exception):  # noqa: B017  (the checkpoint's own check of the recomputed shapes)
        torch.autograd.grad(out, (q, k, v), d_out)
    assert len(forced_grouped) == 2  # the mismatched recomputed call ran its own forward


def test_two_recomputes_at_once_each_take_their_own(lk):
    """Two threads may recompute one retained graph at once: each recompute keeps its own place in the store
    (here two calls of one module with one shape, which only their order tells apart), and neither ends the
    other's."""
    import threading

    recording, replaying = lk.keep_attention_context()
    kept = [(torch.full((2,), float(i)), torch.full((2,), -float(i)), ()) for i in (1, 2)]
    with recording:
        for item in kept:
            lk.attention._stack()[-1].forward("one module, one shape", lambda item=item: item)

    def computed():
        raise AssertionError("a recomputed call computed its own forward")

    def recompute(into):
        with replaying:
            into.extend(lk.attention._stack()[-1].forward("one module, one shape", computed)[0] for _ in kept)

    mine, others = [], []
    with replaying:
        mine.append(lk.attention._stack()[-1].forward("one module, one shape", computed)[0])
        other = threading.Thread(target=recompute, args=(others,))
        other.start()
        other.join()  # the other thread's whole recompute, between this one's two calls
        mine.append(lk.attention._stack()[-1].forward("one module, one shape", computed)[0])
    for got in (mine, others):
        assert [t.tolist() for t in got] == [[1.0, 1.0], [2.0, 2.0]]
    assert lk.attention._stack() == []


def test_a_recompute_that_starts_while_its_forward_records_takes_the_later_entries_too(lk):
    """A backward through an intermediate of a checkpointed forward still running in another thread starts a
    recompute before the forward has recorded every call: the replay takes the later entries as well."""
    recording, replaying = lk.keep_attention_context()
    kept = [(torch.full((2,), float(i)), torch.full((2,), -float(i)), ()) for i in (1, 2)]

    def computed():
        raise AssertionError("a recomputed call computed its own forward")

    with recording:
        forward = lk.attention._stack()[-1]
        forward.forward("call", lambda: kept[0])
        with replaying:
            replay = lk.attention._stack()[-1]
            assert replay.forward("call", computed)[0].tolist() == [1.0, 1.0]
            forward.forward("call", lambda: kept[1])  # recorded after the replay began
            assert replay.forward("call", computed)[0].tolist() == [2.0, 2.0]
    assert lk.attention._stack() == []


def test_a_pair_of_contexts_made_once_is_a_clear_error(lk, forced_grouped):
    """A context_fn must return new contexts per checkpointed call (torch calls it once per call): a pair made
    once and returned for every layer would pair one layer's recompute with another's forward."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, _ = qkv(1, 16, 4, 2, 8)
    fn = _attend_then_write(lk, q, k, v, False)
    pair = lk.keep_attention_context()
    checkpoint(fn, q, k, v, use_reentrant=False, context_fn=lambda: pair)
    with pytest.raises(RuntimeError, match="not a pair made once"):
        checkpoint(fn, q, k, v, use_reentrant=False, context_fn=lambda: pair)
    assert lk.attention._stack() == []


def test_the_store_goes_with_the_graph_and_nothing_is_kept_outside_a_checkpoint(lk, forced_grouped):
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    q, k, v, d_out = qkv(1, 16, 4, 2, 8)
    fn = _attend_then_write(lk, q, k, v, False)
    stores = []

    def context_fn():
        contexts = lk.keep_attention_context()
        stores.append(weakref.ref(contexts[0].store))
        return contexts

    out = checkpoint(fn, q, k, v, use_reentrant=False, context_fn=context_fn)
    assert len(stores[0]().entries) == 1
    torch.autograd.grad(out, (q, k, v), d_out)
    del out
    gc.collect()
    assert stores[0]() is None  # freed with the graph that held it
    fn(q, k, v)  # outside a checkpoint: nothing to keep, nothing kept
    with torch.no_grad():  # a checkpoint under no_grad runs the function plainly
        checkpoint(fn, q, k, v, use_reentrant=False, context_fn=context_fn)
    assert len(stores) == 2 and all(not s() or not s().entries for s in stores)
    with pytest.raises(TypeError, match="`offload`"):
        lk.keep_attention_context(offload="yes")
    with pytest.raises(ValueError, match="use_reentrant=False"):  # torch's: the reentrant checkpoint takes none
        checkpoint(fn, q, k, v, use_reentrant=True, context_fn=context_fn)


def test_a_compiled_model_under_the_context_gives_the_plain_checkpoints_results(lk):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = _checkpointed_llama(lk)
    want_loss, want_grads = loss_and_grads(plain, ids)
    model = torch.compile(_checkpointed_llama(lk, lk.keep_attention_context), backend="eager")
    loss, grads = loss_and_grads(model, ids)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))


# ----------------------------------------------------------------------------------------------------------
# GPU: the cuDNN path at Llama-3-8B's heads


def _cuda_case(seq=16384):
    return qkv(1, seq, 32, 8, 128, dtype=torch.bfloat16, device="cuda")


def _transient_backward(out, inputs, d_out):
    """The backward's gradients and the memory it held beyond them."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(out, inputs, d_out)
    torch.cuda.synchronize()
    return grads, torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


GQA_MODULE = type("Attention", (), {"num_key_value_groups": 4, "is_causal": True})()


@pytest.mark.gpu
def test_cuda_grouped_backward_equals_the_cudnn_call_and_holds_a_quarter(lk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = lk.attention
    q, k, v, d_out = _cuda_case(65536)
    groups = attention._grouped_call(GQA_MODULE, q, k, v, None, 0.0, None, None, {})
    assert groups == 8
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads, full_transient = _transient_backward(want, (q, k, v), d_out)
    out = attention.GroupedCausalAttention.apply(q, k, v, None, groups, attention.CUDNN_OPS)
    grads, transient = _transient_backward(out, (q, k, v), d_out)
    assert torch.equal(out, want)  # the same forward call
    assert torch.equal(grads[1], want_grads[1]) and torch.equal(grads[2], want_grads[2])
    assert rel_err(grads[0], want_grads[0]) < 1e-2  # dq: cuDNN's fp32 atomics sum in no fixed order
    # 2056 MiB for one call, 450 MiB measured for eight (one group's workspace and its share of the gradients)
    assert transient < 0.25 * full_transient, (transient, full_transient)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [2, 8])
def test_cuda_grouped_dq_is_as_close_to_float64_as_the_cudnn_call(lk, groups):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = lk.attention
    q, k, v, d_out = _cuda_case(2048)
    ref_grads = torch.autograd.grad(attention64(q, k, v, 128**-0.5), (q, k, v), d_out.double())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), d_out)
    out = attention.GroupedCausalAttention.apply(q, k, v, None, groups, attention.CUDNN_OPS)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for got, cudnn, ref in zip(grads, want_grads, ref_grads):
        assert rel_err(got, ref) < 1.05 * rel_err(cudnn, ref) + 1e-4


@pytest.mark.gpu
def test_cuda_grouped_path_is_taken_only_where_it_is_the_cudnn_call(lk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    decide = lk.attention._grouped_call
    module = GQA_MODULE
    q, k, v, _ = _cuda_case()
    assert decide(module, q, k, v, None, 0.0, None, None, {}) == 2
    mask = torch.ones(1, 1, q.shape[2], q.shape[2], dtype=torch.bool, device="cuda")
    assert decide(module, q, k, v, mask, 0.0, None, None, {}) == 0
    assert decide(module, q, k, v, None, 0.1, None, None, {}) == 0
    assert decide(module, q, k, v, None, 0.0, None, False, {}) == 0
    assert decide(module, q, k, v, None, 0.0, None, None, {"softcap": 30.0}) == 0
    assert decide(module, q[:, :, :-1], k, v, None, 0.0, None, None, {}) == 0
    assert decide(type("NoGroups", (), {})(), q, k, v, None, 0.0, None, None, {}) == 0
    with torch.no_grad():
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 0
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # PyTorch would not run cuDNN
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 0
    patched = F.scaled_dot_product_attention
    try:  # context parallelism's ring attention patches F.scaled_dot_product_attention
        F.scaled_dot_product_attention = lambda *args, **kwargs: patched(*args, **kwargs)
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 0
    finally:
        F.scaled_dot_product_attention = patched
    with _PassThroughMode():  # a mode would see the stock call's ops
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 0
    with torch.autocast("cuda", dtype=torch.float16):  # sdpa would cast to fp16
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert decide(module, q, k, v, None, 0.0, None, None, {}) == 2
    # torch.func: the stock call (the Function has no functorch rules), even where the split would be taken
    q_func, k_func, v_func, _ = qkv(1, 256, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    saved, lk.attention.MAX_GROUP_WORKSPACE = lk.attention.MAX_GROUP_WORKSPACE, 1
    try:
        assert decide(module, q_func, k_func, v_func, None, 0.0, None, None, {}) == 8
        grad = torch.func.grad(
            lambda q: lk.sdpa_attention_forward(module, q, k_func.detach(), v_func.detach(), None)[0].float().sum()
        )(q_func.detach())
    finally:
        lk.attention.MAX_GROUP_WORKSPACE = saved
    assert grad.shape == q_func.shape
    q32, k32, v32, _ = qkv(1, 4096, 32, 8, 128, dtype=torch.float32, device="cuda")
    assert decide(module, q32, k32, v32, None, 0.0, None, None, {}) == 0
    q_small, k_small, v_small, _ = qkv(1, 2048, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert decide(module, q_small, k_small, v_small, None, 0.0, None, None, {}) == 0  # one group: the stock call


@pytest.mark.gpu
def test_cuda_llama_on_the_registered_attention_equals_sdpa(lk):
    model = tiny_llama(device="cuda", dtype=torch.bfloat16, hidden=512, heads=4)  # heads of 128, as cuDNN takes
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference = copy.deepcopy(model).double()
    want_loss, want_grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    model.set_attn_implementation(lk.register_sdpa_attention())
    calls = []
    original = lk.attention.GroupedCausalAttention.apply
    lk.attention.MAX_GROUP_WORKSPACE, saved = 2**20, lk.attention.MAX_GROUP_WORKSPACE  # split at this size too
    try:
        lk.attention.GroupedCausalAttention.apply = lambda *a: calls.append(a[4]) or original(*a)
        loss, grads = loss_and_grads(model, ids)
    finally:
        lk.attention.GroupedCausalAttention.apply = original
        lk.attention.MAX_GROUP_WORKSPACE = saved
        model.set_attn_implementation("sdpa")
    assert calls and all(groups == 2 for groups in calls)  # both KV heads split, in every layer's call
    assert torch.equal(loss, want_loss)
    for got, want, ref in zip(grads, want_grads, ref_grads):
        assert rel_err(got, ref) < 1.1 * rel_err(want, ref) + 1e-3


@pytest.mark.gpu
def test_cuda_kept_results_come_back_as_the_forward_computed_them(lk):
    """The host round trip (side-stream copies into pinned memory and back): the values the forward computed,
    even where the model writes into the output right after the call and the logsumexps' memory is reused at
    once (the copies run on another stream)."""
    attention = lk.attention
    q, k, v, _ = _cuda_case()
    out, lse, state = attention._cudnn_forward(q, k, v, None)
    want = (out.clone(), lse.clone(), tuple(t.clone() for t in state))
    recording, replaying = lk.keep_attention_context(offload=True)
    forward = [(out, lse, state)]
    with recording:
        attention._kept(None, q, k, v, None, 2)[0].forward("call", forward.pop)
    out.fill_(float("nan"))  # queued on the compute stream while the copies may still run
    del lse
    junk = torch.full_like(want[1], float("nan"))  # takes the freed logsumexps' memory where it could

    def computed():
        raise AssertionError("the recompute computed its own forward")

    with replaying:
        got_out, got_lse, got_state = attention._kept(None, q, k, v, None, 2)[0].forward("call", computed)
    assert torch.equal(got_out, want[0]) and torch.equal(got_lse, want[1]) and junk.isnan().all()
    assert len(got_state) == len(want[2]) and all(
        g.device == w.device and torch.equal(g, w) for g, w in zip(got_state, want[2])
    )  # the random state's tensors come back to where they were, with their values
    assert got_out.is_cuda and got_out.stride() == want[0].stride()


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [True, False])
def test_cuda_llama_with_kept_attention_equals_the_plain_checkpoint(lk, offload):
    """A bf16 Llama under keep_attention_context: one cuDNN forward per layer instead of two, the plain
    checkpoint's loss bit for bit and gradients as close to float64 (dq's fp32 atomics make no two cuDNN
    backwards bit-equal); kept on the host, no more GPU memory at the peak than the plain checkpoint."""
    attention = lk.attention
    model = tiny_llama(device="cuda", dtype=torch.bfloat16, hidden=512, heads=4)
    model.train()
    model.set_attn_implementation(lk.register_sdpa_attention())
    ids = torch.randint(0, 128, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation("sdpa")
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    del reference
    forwards, original = [], attention.CUDNN_OPS
    attention.MAX_GROUP_WORKSPACE, saved = 2**20, attention.MAX_GROUP_WORKSPACE  # split at this size too
    attention.CUDNN_OPS = (lambda *a: forwards.append(1) or original[0](*a), original[1])
    results = {}
    try:
        for name, context_fn in (("plain", None), ("kept", lambda: lk.keep_attention_context(offload=offload))):
            kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn else {})}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            loss_and_grads(model, ids)  # warm: the pinned blocks and cuDNN's plans exist before the peak is read
            forwards.clear()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss, grads = loss_and_grads(model, ids)
            torch.cuda.synchronize()
            results[name] = (loss, grads, len(forwards), torch.cuda.max_memory_allocated() - before)
            del loss, grads
    finally:
        attention.CUDNN_OPS = original
        attention.MAX_GROUP_WORKSPACE = saved
        model.set_attn_implementation("sdpa")
    (plain_loss, plain_grads, plain_forwards, plain_peak), (loss, grads, kept_forwards, peak) = results.values()
    layers = model.config.num_hidden_layers
    assert (plain_forwards, kept_forwards) == (2 * layers, layers)
    assert torch.equal(loss, plain_loss)
    for got, want, ref in zip(grads, plain_grads, ref_grads):
        assert rel_err(got, ref) < 1.1 * rel_err(want, ref) + 1e-3
    if offload:
        assert peak <= plain_peak, (peak, plain_peak)


@pytest.mark.parametrize("grad", [False, True], ids=["decode", "train"])
def test_host_work_per_call_stays_within_its_budget(lk, grad):
    """The function is transformers' sdpa behind its checks wherever it does not split: the Python calls those
    checks make (tests/test_backend.py counts the other entry points' the same way) may not grow unnoticed."""
    import os

    module = tiny_llama().model.layers[0].self_attn
    q, k, v, _ = qkv(1, 1 if not grad else 8, 8, 2, 8)
    lk.sdpa_attention_forward(module, q, k, v, None)  # transformers imported once
    with torch.set_grad_enabled(grad):
        calls = python_calls(lambda: lk.sdpa_attention_forward(module, q, k, v, None), os.path.dirname(lk.__file__))
    # (the attention name read past the config's __getattribute__: one call more than getattr, 2.7 us less)
    assert calls <= (35 if grad else 17), calls


def test_the_attention_name_is_read_as_transformers_reads_it(lk):
    """The mask-function check reads a config's attention name past its Python ``__getattribute__`` only where
    the class keeps transformers' own property and attribute map: the same name as ``getattr`` in every case."""
    from transformers import AutoConfig, LlamaConfig

    read = lambda config: lk.attention._attention_name(config, lk.attention._transformers())  # noqa: E731
    config = LlamaConfig(num_hidden_layers=1)
    for name in (None, "sdpa", "eager", lk.register_sdpa_attention()):
        config._attn_implementation = name
        assert read(config) == config._attn_implementation == name
    hrm = AutoConfig.for_model("hrm_text")  # its own _attn_implementation property: read through getattr
    hrm._attn_implementation = "sdpa"
    assert read(hrm) == "sdpa"

    class Renamed(LlamaConfig):
        attribute_map = {**LlamaConfig.attribute_map, "_attn_implementation_internal": "attn_kind"}

    renamed = Renamed(num_hidden_layers=1)
    renamed.attn_kind = "eager"
    assert read(renamed) == renamed._attn_implementation

    class Rerouted(LlamaConfig):
        def __getattribute__(self, key):
            return "eager" if key == "_attn_implementation_internal" else super().__getattribute__(key)

    rerouted = Rerouted(num_hidden_layers=1)
    rerouted._attn_implementation = "sdpa"
    assert read(rerouted) == rerouted._attn_implementation == "eager"
    assert read(None) is None
