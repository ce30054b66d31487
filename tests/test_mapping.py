"""The kernel mapping end to end: transformers' own default mapping for this repository and the package's
mapping, kernelized into a tiny Llama, against the un-kernelized model; the names both mappings (and the
published v3) use; the offline form; transformers' ``use_kernels=True`` on a GPU."""

import copy
import logging
import types

import kernels
import pytest
import torch
import torch.nn.functional as F
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import hub_kernels
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

HUB_REPO = "kernels-community/liger-kernels"
# What the published v3 exports, in `layers` and at top level (users and transformers reach for these).
PUBLISHED_V3 = (
    "LigerRMSNorm",
    "LigerLinear",
    "LigerSwiGLUMLP",
    "LigerGEGLUMLP",
    "LigerTiledSwiGLUMLP",
    "LigerTiledGEGLUMLP",
    "liger_rotary_pos_emb",
    "liger_rotary_pos_emb_layer",
    "LigerForCausalLMLoss",
    "LigerForCausalLMLossLayer",
    "liger_fused_linear_cross_entropy",
    "CrossEntropyOutput",
)
# transformers also maps RMSNorm on npu to this repository; build.toml builds no npu (CANN) variant.
NOT_BUILT = {"npu"}
SIZES = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODES = {
    "TRAINING": Mode.TRAINING,
    "INFERENCE": Mode.INFERENCE,
    "TRAINING|TORCH_COMPILE": Mode.TRAINING | Mode.TORCH_COMPILE,
    "INFERENCE|TORCH_COMPILE": Mode.INFERENCE | Mode.TORCH_COMPILE,
}


def transformers_default_mapping() -> dict:
    """transformers' default kernel mapping as ``use_kernels=True`` registers it, freshly built."""
    build = getattr(hub_kernels, "_build_kernel_mapping", None)
    return build() if build is not None else copy.deepcopy(hub_kernels._KERNEL_MAPPING)


def liger_entries(mapping: dict) -> list:
    """``(name, device type, mode, repository)`` for every entry of ``mapping`` that names this repository."""
    rows = []
    for name, devices in mapping.items():
        for device, repos in devices.items():
            device_type = device if isinstance(device, str) else device.type
            for mode, repo in (repos if isinstance(repos, dict) else {Mode.FALLBACK: repos}).items():
                if getattr(repo, "_repo_id", None) == HUB_REPO:
                    rows.append((name, device_type, mode, repo))
    return rows


def local_default_mapping(variant_root, device: str = "cpu") -> dict:
    """transformers' default mapping cut down to its entries for this repository, each loaded from the local
    build; its cuda entries are registered for ``device`` (transformers maps this repository on cuda, rocm and
    npu only, so on a CPU machine they stand in for cpu)."""
    mapping = {}
    for name, device_type, mode, repo in liger_entries(transformers_default_mapping()):
        if device_type == "cuda":
            layer = LocalLayerRepository(variant_root, layer_name=repo.layer_name)
            mapping.setdefault(name, {}).setdefault(device, {})[mode] = layer
    return mapping


def forward_layer(module: nn.Module) -> str:
    """The class whose ``forward`` the module runs (kernelize binds a layer's forward to the instance)."""
    forward = module.forward.__func__ if isinstance(module.forward, types.MethodType) else module.forward
    return forward.__qualname__.split(".")[0]


@pytest.fixture
def tagged_linear(tagged):
    """The two other names transformers' default mapping gives this repository, tagged as a user would:
    ``nn.Linear`` as "Linear", and (with :func:`kernelizable_loss`) the causal-LM loss as "ForCausalLMLoss"
    (transformers 5.22 tags neither, nor the MLPs, which the ``tagged`` fixture tags)."""
    kernels.replace_kernel_forward_from_hub(nn.Linear, "Linear")
    yield
    del nn.Linear.kernel_layer_name, nn.Linear.kernel_condition


def kernelizable_loss(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Give the model transformers' ForCausalLMLoss as a module tagged "ForCausalLMLoss", stored where the
    ``loss_function`` property looks first; as a submodule, kernelize finds it. (Assigning ``loss_function``
    itself would register the module under that name, behind the property.)"""
    model._loss_function = kernels.use_kernel_forward_from_hub("ForCausalLMLoss")(ForCausalLMLoss)
    assert isinstance(model.loss_function, nn.Module)
    return model


def exact_in_model_dtype(reference: LlamaForCausalLM) -> LlamaForCausalLM:
    """transformers rounds two steps to float32 whatever the model's dtype: LlamaRMSNorm normalizes in float32
    and ForCausalLMLoss upcasts the logits with ``.float()`` (a downcast for float64). This reference does the
    same math in the model's dtype, so that a float64 comparison measures the layers, not that rounding."""

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "mean" if num_items_in_batch is None else "sum"
        value = F.cross_entropy(
            logits.reshape(-1, vocab_size),
            shift_labels.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction=reduction,
        )
        return value if num_items_in_batch is None else value / num_items_in_batch

    for module in reference.modules():
        if isinstance(module, LlamaRMSNorm):
            module.forward = types.MethodType(rms_norm, module)
    reference.loss_function = loss
    return reference


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_loss_and_grads(got, want, tol):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss.item() - ref_loss.item()) < tol, (loss.item(), ref_loss.item())
    assert len(grads) == len(ref_grads)
    worst = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))
    assert worst < tol, f"largest gradient difference {worst:.3e}"


def swapped_layers(model) -> dict:
    """Which layer each tagged kind of module of the tiny Llama runs, as a set per kind."""
    kinds = {"RMSNorm": LlamaRMSNorm, "SwiGLUMLP": LlamaMLP, "Linear": nn.Linear}
    found = {kind: {forward_layer(m) for m in model.modules() if isinstance(m, cls)} for kind, cls in kinds.items()}
    loss = model.loss_function
    found["ForCausalLMLoss"] = {forward_layer(loss)} if isinstance(loss, nn.Module) else set()
    return found


def expected_layers(lk, mode: Mode) -> dict:
    """The layers the package's table gives for ``mode``; kernels falls back from inference to the training
    layer where a row has none, as it does for transformers' own mapping."""
    training = Mode.TRAINING in mode
    return {name: {train if training or infer is None else infer} for name, (train, infer) in lk.mapping.LAYERS.items()}


def check_kernelized_llama(lk, mapping, mode: Mode):
    """Kernelize a float64 tiny Llama with ``mapping`` for ``mode``; every tagged module runs this package's
    layer for the mode, and loss and every gradient equal the un-kernelized model's."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES)).double()
    plain = copy.deepcopy(model)
    reference = exact_in_model_dtype(copy.deepcopy(model))
    kernelizable_loss(model)
    training = Mode.TRAINING in mode
    for m in (model, plain, reference):
        m.train(training)
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=mode, device="cpu")

    want = expected_layers(lk, mode)
    got = swapped_layers(model)
    assert got == {kind: want[kind] for kind in got}, got
    loss_module = model.loss_function
    assert loss_module.forward.__func__.__module__.startswith(lk.__name__)

    ids = torch.randint(0, SIZES["vocab_size"], (2, 3 * SIZES["hidden_size"] + 5))
    result = loss_and_grads(model, ids)
    assert_same_loss_and_grads(result, loss_and_grads(reference, ids), 1e-10)
    # and against transformers itself, whose two float32 roundings bound the difference
    assert_same_loss_and_grads(result, loss_and_grads(plain, ids), 1e-6)


@pytest.mark.parametrize("mode", ["TRAINING", "INFERENCE"])
def test_transformers_default_mapping_kernelizes_a_tiny_llama(lk, variant_root, tagged_linear, mode):
    """transformers' own default mapping, every entry for this repository redirected to the local build."""
    mapping = local_default_mapping(variant_root)
    assert set(mapping) and set(mapping) <= set(lk.mapping.LAYERS)
    check_kernelized_llama(lk, mapping, MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_package_mapping_kernelizes_a_tiny_llama(lk, variant_root, tagged_linear, mode):
    """The package's own mapping, in all four modes (kernels refuses a TORCH_COMPILE mode for a layer that
    does not declare ``can_torch_compile``)."""
    check_kernelized_llama(lk, lk.kernel_mapping(variant_root), MODES[mode])


def test_package_mapping_covers_transformers_default_mapping(lk):
    """Every entry transformers maps to this repository is in the package's mapping, same device, same mode,
    same layer, same version; every mode is also there with TORCH_COMPILE."""
    ours = lk.kernel_mapping()
    entries = liger_entries(transformers_default_mapping())
    assert {name for name, *_ in entries} <= set(lk.mapping.LAYERS)
    skipped = set()
    for name, device, mode, repo in entries:
        assert repo._version == lk.mapping.HUB_VERSION, (name, device, mode)
        if device not in lk.mapping.DEVICES:
            skipped.add(device)
            continue
        mine = ours[name][device][mode]
        assert (mine._repo_id, mine._version, mine.layer_name) == (HUB_REPO, repo._version, repo.layer_name)
    assert skipped <= NOT_BUILT
    for devices in ours.values():
        assert set(devices) == set(lk.mapping.DEVICES)
        for modes in devices.values():
            for mode, repo in modes.items():
                assert mode | Mode.TORCH_COMPILE in modes
                assert modes[mode | Mode.TORCH_COMPILE].layer_name == repo.layer_name


def test_every_mapped_or_published_name_exists(lk):
    names = {repo.layer_name for *_, repo in liger_entries(transformers_default_mapping())}
    names |= set(PUBLISHED_V3) | {layer for row in lk.mapping.LAYERS.values() for layer in row if layer}
    missing = sorted(n for n in names if not hasattr(lk.layers, n) or getattr(lk, n, None) is not getattr(lk.layers, n))
    assert not missing, f"not in layers and at top level: {missing}"
    assert not sorted(n for n in names if n not in lk.__all__)


def test_mapping_options(lk, tmp_path):
    local = lk.kernel_mapping(str(tmp_path), devices=("cpu",), layers=["RMSNorm"])
    assert set(local) == {"RMSNorm"} and set(local["RMSNorm"]) == {"cpu"}
    repo = local["RMSNorm"]["cpu"][Mode.INFERENCE]
    assert isinstance(repo, LocalLayerRepository) and repo._repo_path == tmp_path
    pinned = lk.kernel_mapping(revision="v3")["Linear"]["cuda"][Mode.TRAINING]
    assert (pinned._repo_id, pinned._revision, pinned._version) == (HUB_REPO, "v3", None)
    assert Mode.INFERENCE not in lk.kernel_mapping()["Linear"]["cuda"]
    with pytest.raises(ValueError, match="layers must be names from"):
        lk.kernel_mapping(layers=["SwiGLU"])
    with pytest.raises(ValueError, match="not both"):
        lk.kernel_mapping(tmp_path, revision="v3")


@pytest.fixture
def fresh_kernels_caches(monkeypatch, tmp_path):
    """No loaded layer and no resolved version carried over from other tests, and an empty Hub cache
    (``KERNELS_CACHE``, where kernels looks for version refs offline); yields the cache's path."""
    monkeypatch.setattr(kernels.layer.layer, "_CACHED_LAYER", {})
    kernels.LayerRepository._resolve_revision.cache_clear()
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    yield cache
    kernels.LayerRepository._resolve_revision.cache_clear()


def test_offline_with_local_kernels_needs_a_revision(lk, variant_root, tagged, monkeypatch, fresh_kernels_caches):
    """``LOCAL_KERNELS`` + ``HF_HUB_OFFLINE=1`` (conftest): a ``version`` cannot be resolved offline, since
    kernels asks the Hub cache for the version branches first; ``revision="v3"`` loads the local build."""
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO}={variant_root}")
    model = LlamaForCausalLM(LlamaConfig(**SIZES))
    with (
        use_kernel_mapping(lk.kernel_mapping(layers=["SwiGLUMLP"]), inherit_mapping=False),
        pytest.raises(ValueError, match="offline"),
    ):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    with use_kernel_mapping(lk.kernel_mapping(revision="v3"), inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert swapped_layers(model)["SwiGLUMLP"] == {"LigerTiledSwiGLUMLP"}
    assert swapped_layers(model)["RMSNorm"] == {"LigerRMSNorm"}
    norm = next(m for m in model.modules() if isinstance(m, LlamaRMSNorm))
    assert norm.forward.__func__.__module__.startswith(lk.__name__)


def test_unmapped_tagged_layers_are_logged_once_per_module_and_call(lk, variant_root, tagged, caplog):
    """kernels logs "No kernel mapping found" for every module of a tagged class whose name the mapping lacks,
    on every kernelize call. A Llama's RMSNorms are mapped; what remains are the names transformers tags and
    this package does not serve: each MLP's act_fn ("SiLU"), which keeps its own forward (the MLP itself is
    served by "SwiGLUMLP")."""
    model = LlamaForCausalLM(LlamaConfig(**SIZES))
    with (
        caplog.at_level(logging.WARNING, logger="kernels"),
        use_kernel_mapping(lk.kernel_mapping(variant_root), inherit_mapping=False),
    ):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    unmapped = [r.getMessage().split("`")[1] for r in caplog.records if "No kernel mapping found" in r.getMessage()]
    layers = SIZES["num_hidden_layers"]
    assert sorted(unmapped) == ["SiLU"] * layers


# ----------------------------------------------------------------------------------------------------------
# GPU: transformers' own `use_kernels=True` path, unmodified, with LOCAL_KERNELS serving this repository.


def offline_version_refs(cache, mapping) -> None:
    """Write the version refs a Hub cache holds once a machine has loaded each repository of ``mapping``
    online (``refs/v<N>`` naming what to load), so that kernels resolves their versions offline. This
    repository is then served by LOCAL_KERNELS; the others have no files in the cache, so kernels reports
    them missing and transformers keeps those layers' own forward."""
    from huggingface_hub.file_download import repo_folder_name

    for devices in mapping.values():
        for repos in devices.values():
            for repo in repos.values() if isinstance(repos, dict) else [repos]:
                version = getattr(repo, "_version", None)
                if version is not None:
                    ref = cache / repo_folder_name(repo_id=repo._repo_id, repo_type="kernel") / "refs" / f"v{version}"
                    ref.parent.mkdir(parents=True, exist_ok=True)
                    ref.write_text(f"v{version}")


@pytest.fixture
def restored_global_mapping():
    """``use_kernels=True`` registers transformers' mapping for the whole process: undo it afterwards."""
    saved = copy.deepcopy(kernels.layer.globals._KERNEL_MAPPING.get())
    yield
    kernels.layer.globals._KERNEL_MAPPING.set(saved)


@pytest.mark.gpu
def test_cuda_from_pretrained_use_kernels(
    lk, variant_root, tagged, tmp_path, monkeypatch, fresh_kernels_caches, restored_global_mapping
):
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip(f"this transformers does not accept kernels {kernels.__version__}")
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPO}={variant_root}")
    offline_version_refs(fresh_kernels_caches, transformers_default_mapping())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(tmp_path / "model")
    load = {"dtype": torch.float32, "device_map": "cuda"}
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model", **load)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", use_kernels=True, **load)

    layers = swapped_layers(model)  # from_pretrained returns the model in eval mode: inference layers
    assert layers["RMSNorm"] == {"LigerRMSNorm"} and layers["SwiGLUMLP"] == {"LigerSwiGLUMLP"}, layers
    model.train()  # transformers kernelizes again, for training
    plain.train()
    layers = swapped_layers(model)
    assert layers["RMSNorm"] == {"LigerRMSNorm"} and layers["SwiGLUMLP"] == {"LigerTiledSwiGLUMLP"}, layers
    norm = next(m for m in model.modules() if isinstance(m, LlamaRMSNorm))
    assert norm.forward.__func__.__module__.startswith(lk.__name__)
    assert lk._backend.use_triton(torch.empty(1, device="cuda"))

    ids = torch.randint(0, SIZES["vocab_size"], (2, 3 * SIZES["hidden_size"] + 5), device="cuda")
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(model, ids), loss_and_grads(plain, ids)
    errors = [((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads)]
    print(f"use_kernels=True, training layers {layers}: loss {loss.item():.8f} against {ref_loss.item():.8f}; "
          f"largest gradient relative error {max(errors):.2e} over {len(errors)} parameters")  # fmt: skip
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    assert max(errors) < 1e-4
