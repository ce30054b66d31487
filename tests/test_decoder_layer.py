"""decoder_layer.py: the sequence-tiled Llama decoder layer against the layer's own forward in float64 (every
chunking, the batch, the model's checkpoint bypassed), the calls it leaves to the layer, its errors, and (GPU)
the cuDNN pieces in bf16 against float64."""

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from harness import rel_err

VOCAB = 128


@pytest.fixture(autouse=True)
def stock_rotary():
    """Llama's rotary as transformers defines it: a test that kernelized "rotary_pos_emb" leaves the layer of
    the package it loaded bound on modeling_llama's rotary, which the tiled path takes only from its own copy."""
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.apply_rotary_pos_emb
    bound = rotary.__dict__.pop("forward", None) if isinstance(rotary, torch.nn.Module) else None
    yield
    if bound is not None:
        rotary.forward = bound


def tiny(dtype=torch.float64, device="cpu", layers=2, hidden=64, heads=8, kv_heads=2, head_dim=16, seed=0, **config):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=5 * hidden // 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=8192, attn_implementation="sdpa",
                      **config)  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.train()
    return model


def exact_norms(lk, model):
    """transformers' LlamaRMSNorm computes in float32 even for a float64 model; the float64 references use the
    same formula in float64 (the package's rms_norm), so that the comparisons see only the tiling."""
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":  # bound, so that a deep copy binds the copy
            module.forward = types.MethodType(lambda m, h: lk.rms_norm(h, m.weight, m.variance_epsilon), module)
    return model


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).double(), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def tiled_nodes(model, ids, **kwargs) -> int:
    """How many decoder-layer outputs of one forward are the tiled layer's."""
    seen = []
    hooks = [
        layer.register_forward_hook(lambda m, a, out: seen.append(type(out.grad_fn).__name__))
        for layer in model.model.layers
    ]
    try:
        model(input_ids=ids, use_cache=False, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen.count("TiledDecoderLayerBackward")


def ids_for(batch, seq, seed=1, device="cpu"):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("chunk", [4096, 16, 7], ids=["one chunk", "16", "7 (uneven)"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_tiled_layers_equal_the_layers_in_float64(lk, chunk, checkpointing):
    model = exact_norms(lk, tiny())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = ids_for(2, 40)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    tiled = copy.deepcopy(model)
    for module in tiled.model.layers.modules():  # the tiled path reads the layers' norms' own class forward
        module.__dict__.pop("forward", None)
    assert lk.tile_decoder_layers(tiled, chunk=chunk, min_tokens=0) == 2
    assert tiled_nodes(tiled, ids) == 2
    loss, grads = loss_and_grads(tiled, ids)
    assert abs(loss - ref_loss) / ref_loss < 1e-14
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12
    if checkpointing:  # the model's checkpoint is bypassed for a tiled call, not stacked on it
        recomputes = []
        original = lk.decoder_layer.forward
        lk.decoder_layer.forward = lambda *a: recomputes.append(1) or original(*a)
        try:
            loss_and_grads(tiled, ids)
        finally:
            lk.decoder_layer.forward = original
        assert len(recomputes) == 2


def test_bf16_tiled_layers_are_as_close_to_float64_as_the_layers(lk):
    model = tiny(dtype=torch.bfloat16)
    reference = exact_norms(lk, copy.deepcopy(model).double())
    ids = ids_for(1, 96)
    _, ref_grads = loss_and_grads(reference, ids)
    _, stock = loss_and_grads(model, ids)
    lk.tile_decoder_layers(model, chunk=32, min_tokens=0)
    assert tiled_nodes(model, ids) == 2
    _, tiled = loss_and_grads(model, ids)
    for got, want, ref in zip(tiled, stock, ref_grads, strict=True):
        assert rel_err(got, ref) < 1.25 * rel_err(want, ref) + 1e-3


def test_a_retained_graph_gives_the_same_gradients_twice(lk):
    model = tiny()
    lk.tile_decoder_layers(model, chunk=16, min_tokens=0)
    ids = ids_for(1, 40)
    logits = model(input_ids=ids, use_cache=False).logits
    first = torch.autograd.grad(logits.square().sum(), list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_what_the_forward_kept_goes_with_the_backward_unless_the_graph_is_retained(lk):
    model = tiny()
    lk.tile_decoder_layers(model, chunk=16, min_tokens=0)
    ids = ids_for(1, 40)
    for retain in (False, True):
        nodes = []
        hook = model.model.layers[0].register_forward_hook(lambda m, a, out, nodes=nodes: nodes.append(out.grad_fn))
        loss = model(input_ids=ids, use_cache=False).logits.square().sum()
        hook.remove()
        assert nodes[0].kept is not None
        loss.backward(retain_graph=retain)
        assert (nodes[0].kept is None) is not retain


def test_batched_gradients_are_refused(lk):
    model = tiny()
    lk.tile_decoder_layers(model, chunk=16, min_tokens=0)
    x = model.model.embed_tokens(ids_for(1, 40)).detach().requires_grad_()
    out = model.model.layers[0](x, position_embeddings=model.model.rotary_emb(x, torch.arange(40)[None]))
    with pytest.raises(RuntimeError, match="batched gradients"):
        torch.autograd.grad(out, x, torch.randn(3, *out.shape, dtype=out.dtype), is_grads_batched=True)


def test_double_backward_is_refused(lk):
    model = tiny()
    lk.tile_decoder_layers(model, chunk=16, min_tokens=0)
    x = model.model.embed_tokens(ids_for(1, 40)).detach().requires_grad_()
    positions = torch.arange(40)[None]
    out = model.model.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions))
    with pytest.raises(RuntimeError, match="double backward"):  # at once: its gradient has no derivative
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


@pytest.mark.parametrize(
    "case",
    ["padding mask", "cache", "no grad", "hook on q_proj", "eager attention", "dropout", "lora", "another rotary",
     "rotate_half patched", "another attention named sdpa", "sdpa replaced", "attention forward patched",
     "autocast"],
)  # fmt: skip
def test_calls_the_tiled_path_does_not_serve_run_the_layers_own_forward(lk, case, monkeypatch):
    model = tiny()
    ids, kwargs = ids_for(2, 24), {}
    if case == "another attention named sdpa":
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        def halved(module, q, k, v, mask, **kw):
            out, weights = sdpa_attention_forward(module, q, k, v, mask, **kw)
            return out / 2, weights

        AttentionInterface.register("halved_sdpa", halved)
        ALL_MASK_ATTENTION_FUNCTIONS.register("halved_sdpa", sdpa_mask)
        model.set_attn_implementation("halved_sdpa")
    if case == "padding mask":
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, :5] = 0
        kwargs["attention_mask"] = mask
    if case == "hook on q_proj":
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
    if case == "eager attention":
        model.set_attn_implementation("eager")
    if case == "dropout":
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
    if case == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).base_model.model
    reference = copy.deepcopy(model)
    lk.tile_decoder_layers(model, chunk=8, min_tokens=0)
    tiled_nodes(model, ids)  # a first call: nothing below may be hidden by what it found
    from transformers.models.llama import modeling_llama

    if case == "another rotary":  # set after tiling (a later patch or kernelize): read at each call
        stock = modeling_llama.apply_rotary_pos_emb
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, c, s: stock(2 * q, k, c, s))
    if case == "rotate_half patched":
        stock = modeling_llama.rotate_half
        monkeypatch.setattr(modeling_llama, "rotate_half", lambda x: 2 * stock(x))
    if case == "sdpa replaced":  # as context parallelism's ring attention replaces it
        stock = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: stock(*a, **k) / 2)
    if case == "attention forward patched":
        stock = modeling_llama.LlamaAttention.forward

        def halved(self, *args, **kwargs):
            out, weights = stock(self, *args, **kwargs)
            return out / 2, weights

        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", halved)
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert tiled_nodes(model, ids) == 0
            got, want = model(input_ids=ids, use_cache=False).logits, reference(input_ids=ids, use_cache=False).logits
        assert torch.equal(got, want)
        return
    expected = 1 if case == "hook on q_proj" else 0  # the other layer has no hook
    if case == "cache":
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        assert out.past_key_values.get_seq_length() == 24  # the layers filled the cache
        return
    if case == "no grad":
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        return
    assert tiled_nodes(model, ids, **kwargs) == expected
    if not expected:  # every layer its own forward: the untiled model's results exactly
        torch.manual_seed(0)
        got = model(input_ids=ids, use_cache=False, **kwargs).logits
        torch.manual_seed(0)
        want = reference(input_ids=ids, use_cache=False, **kwargs).logits
        assert torch.equal(got, want)


def test_kernelized_norms_and_mlps_are_tiled_and_short_calls_are_not(lk):
    """The package's LigerRMSNorm and MLP layers bound on the modules as kernelize binds them compute the host's
    math, so the layer is still tiled (and equal to the kernelized model); a call under ``min_tokens`` and an
    MLP whose forward is something else run the layer's own forward."""
    model = tiny()
    for module in model.modules():
        name = type(module).__name__
        layer = {"LlamaRMSNorm": lk.LigerRMSNorm, "LlamaMLP": lk.LigerTiledSwiGLUMLP}.get(name)
        if layer is not None:
            module.forward = types.MethodType(layer.forward, module)
    ids = ids_for(2, 40)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    lk.tile_decoder_layers(model, chunk=16, min_tokens=80)
    assert tiled_nodes(model, ids) == 2
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - ref_loss) / ref_loss < 1e-14
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12
    assert tiled_nodes(model, ids_for(2, 39)) == 0  # 78 tokens
    mlp = model.model.layers[1].mlp
    mlp.forward = types.MethodType(lambda m, x: 2 * type(m).forward(m, x), mlp)
    assert tiled_nodes(model, ids) == 1


def test_a_layer_with_a_forward_of_its_own_is_left_alone_and_a_later_checkpoint_is_bypassed(lk):
    model = tiny()
    hooked = model.model.layers[0]
    hooked.forward = types.MethodType(lambda m, *a, **k: type(m).forward(m, *a, **k), hooked)  # as accelerate
    assert lk.tile_decoder_layers(model, chunk=16, min_tokens=0) == 1
    ids = ids_for(1, 40)
    assert tiled_nodes(model, ids) == 1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # after tiling
    calls = []
    original = lk.decoder_layer.forward
    lk.decoder_layer.forward = lambda *a: calls.append(1) or original(*a)
    try:
        for _ in range(2):  # the first call finds the new checkpoint and wraps it for the next ones
            calls.clear()
            model(input_ids=ids, use_cache=False).logits.sum().backward()
    finally:
        lk.decoder_layer.forward = original
    assert len(calls) == 1  # one tiled layer, its forward once: not under the checkpoint
    assert lk.untile_decoder_layers(model) == 1 and "forward" in hooked.__dict__


def test_untile_restores_the_layers(lk):
    model = tiny()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpoint = model.model.layers[0]._gradient_checkpointing_func
    assert lk.tile_decoder_layers(model) == 2
    assert lk.tile_decoder_layers(model) == 2  # twice: still one bypass around the model's checkpoint
    assert model.model.layers[0]._gradient_checkpointing_func.checkpoint is checkpoint
    assert lk.untile_decoder_layers(model) == 2
    layer = model.model.layers[0]
    assert "forward" not in layer.__dict__ and layer._gradient_checkpointing_func is checkpoint
    assert tiled_nodes(model, ids_for(1, 24)) == 0


def test_bad_arguments_are_clear_errors(lk):
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
        lk.tile_decoder_layers("model")
    for chunk in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="`chunk` must be a positive int"):
            lk.tile_decoder_layers(tiny(), chunk=chunk)
    for min_tokens in (-1, 2.0, None):
        with pytest.raises(ValueError, match="`min_tokens` must be a positive int"):
            lk.tile_decoder_layers(tiny(), min_tokens=min_tokens)
    with pytest.raises(ValueError, match="no decoder layer of Llama's form"):
        lk.tile_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1024, 4096], ids=["chunks", "one chunk"])
def test_cuda_tiled_layers_are_as_close_to_float64_as_the_layers(lk, chunk):
    """bf16 on the GPU: cuDNN's pieces merged by their logsumexps, K, V, o and the input through pinned host
    memory; loss and gradients as close to the float64 model as the layers' own (sdpa, cuDNN)."""
    model = tiny(dtype=torch.bfloat16, device="cuda", hidden=512, heads=8, kv_heads=2, head_dim=64)
    reference = exact_norms(lk, copy.deepcopy(model).double())
    ids = ids_for(1, 3000, device="cuda")
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    del reference
    stock_loss, stock = loss_and_grads(model, ids)
    lk.tile_decoder_layers(model, chunk=chunk, min_tokens=0)
    assert tiled_nodes(model, ids) == 2
    loss, tiled = loss_and_grads(model, ids)
    assert abs(loss - ref_loss) <= 1.25 * abs(stock_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for got, want, ref in zip(tiled, stock, ref_grads, strict=True):
        assert rel_err(got, ref) < 1.25 * rel_err(want, ref) + 1e-3


def test_tiled_layers_on_meta_tensors_give_the_shapes(lk, monkeypatch):
    """A model built on the meta device (shape inference) runs its tiled decoder layers as the plain ones do: the
    autocast query for a meta tensor's device raised before."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda **kwargs: None)  # (its own .item() on meta)
    model = tiny(torch.float32, device="meta")
    ids = torch.zeros(1, 96, dtype=torch.long, device="meta")
    plain = model(input_ids=ids, use_cache=False).logits
    assert lk.tile_decoder_layers(model, chunk=32, min_tokens=16) == 2
    tiled = model(input_ids=ids, use_cache=False).logits
    assert tiled.is_meta and tiled.shape == plain.shape == (1, 96, VOCAB)


@pytest.mark.parametrize("rotary", ["own forward", "package layer"])
def test_layers_are_tiled_after_kernelize_binds_the_rotary_module(lk, rotary):
    """kernelize binds a forward on the module transformers makes of apply_rotary_pos_emb: the package's rotary
    layer, or, where the mapping has no "rotary_pos_emb" row, the module's own forward. Either is Llama's rotary
    (the second was refused: "no decoder layer of Llama's form")."""
    from transformers.models.llama import modeling_llama

    function = modeling_llama.apply_rotary_pos_emb
    layer = type(function).forward if rotary == "own forward" else lk.liger_rotary_pos_emb_layer.forward
    function.forward = types.MethodType(layer, function)  # (the autouse fixture unbinds it)
    model = exact_norms(lk, tiny())
    ids = ids_for(2, 40)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    for module in model.model.layers.modules():  # the tiled path reads the layers' norms' own class forward
        module.__dict__.pop("forward", None)
    assert lk.tile_decoder_layers(model, chunk=16, min_tokens=80) == 2
    assert tiled_nodes(model, ids) == 2
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - ref_loss) / ref_loss < 1e-14
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12


def test_a_training_call_with_a_cache_says_once_that_it_runs_untiled(lk, monkeypatch):
    """transformers' models build a KV cache for every call unless use_cache=False: a plain training call then runs
    the layers untiled (the tiled path fills no cache), which once went unsaid, the memory saving silently lost."""
    model = tiny()
    lk.tile_decoder_layers(model, chunk=16, min_tokens=0)
    monkeypatch.setattr(lk.decoder_layer, "_CACHE_WARNED", [])
    ids = ids_for(2, 40)
    with pytest.warns(UserWarning, match="came with a KV cache.*use_cache=False"):
        model(input_ids=ids)
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(type(out.grad_fn).__name__))
             for layer in model.model.layers]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    assert seen.count("TiledDecoderLayerBackward") == 0
    assert tiled_nodes(model, ids) == 2  # (use_cache=False)
