"""What a recompute must see again of its forward: autocast, the random state, and the module's tensors."""

import contextlib

import torch


def autocast_state(device_type: str):
    """The autocast settings of ``device_type`` and the CPU (meta and other devices without autocast: CPU's)."""
    kinds = {"cpu"}
    if torch.amp.is_autocast_available(device_type):
        kinds.add(device_type)
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in sorted(kinds)], (
        torch.is_autocast_cache_enabled()
    )


def autocast_enabled(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


@contextlib.contextmanager
def replay_autocast(state):
    kinds, cache_enabled = state
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in kinds:
            stack.enter_context(
                torch.autocast(device_type=kind, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            )
        yield


def _rng_devices(device: torch.device):
    if device.type in ("cpu", "meta"):
        return None, []
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None, []
    index = device.index if device.index is not None else module.current_device()
    return module, [index]


def capture_rng(device: torch.device):
    module, indices = _rng_devices(device)
    device_state = module.get_rng_state(indices[0]) if module is not None else None
    return torch.get_rng_state(), device_state


@contextlib.contextmanager
def replay_rng(device: torch.device, state):
    """Restore the forward's random state for the recompute, and the caller's afterwards."""
    module, indices = _rng_devices(device)
    with torch.random.fork_rng(devices=indices, device_type=device.type if module is not None else "cuda"):
        cpu_state, device_state = state
        torch.set_rng_state(cpu_state)
        if module is not None:
            module.set_rng_state(device_state, indices[0])
        yield


# The module's tensors. torch.func.functional_call (MAML fast weights, stacked ensembles) substitutes a
# module's parameters for the length of one call and puts the originals back before backward; a recompute
# that re-read the module would use the originals. So the forward's tensors are recorded and put back in
# place, for the recompute only.

_MISSING = object()


def capture_tensors(module):
    """Every (table, name, tensor) of ``module``'s and its submodules' parameters and buffers."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [
        (table, name, t) for m in module.modules() for table in (m._parameters, m._buffers) for name, t in table.items()
    ]


@contextlib.contextmanager
def forward_tensors(captured):
    """The captured tensors back in their modules for the body, and whatever was there before afterwards."""
    swapped = []
    for table, name, tensor in captured:
        current = table.get(name, _MISSING)
        if current is not tensor:
            swapped.append((table, name, current))
            table[name] = tensor
    try:
        yield
    finally:
        for table, name, current in reversed(swapped):
            if current is _MISSING:
                del table[name]
            else:
                table[name] = current
