"""Memory per device, following llama.cpp's own allocation (see docs/planning.md).

``n_gpu_layers`` offloads the *last* repeating blocks and, past ``n_layer``, the output layer;
``token_embd`` stays in host memory; each layer's KV cache lives with the layer; each device
holding layers gets a compute buffer, the one holding the output layer a larger one.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from localspec.hardware import GiB, HardwareFacts
from localspec.planning.types import (
    Device,
    DeviceMemory,
    Layout,
    ModelFacts,
    aux_sequences,
    context_cells,
)

GPU_MARGIN = 1 * GiB  # llama.cpp's --fit keeps 1024 MiB free per device
HOST_MARGIN = 2 * GiB  # for the OS, the editor and localspec itself
CTX_STEP = 256  # llama.cpp pads the context to a multiple of 256


def devices_for(facts: HardwareFacts, cap: int | None = None) -> list[Device]:
    """The devices a plan may use, with budgets: GPU free − 1 GiB; unified memory
    min(working set, available RAM) − 2 GiB; host available RAM − 2 GiB. A software device's
    heap is RAM of whatever size its driver chose: ``cap`` sets it (to play a card that size),
    with a GPU's margin."""
    out: list[Device] = []
    for g in facts.usable_gpus:
        available = g.free_bytes if cap is None else min(g.free_bytes, cap)
        if g.software and cap is not None:
            available = cap
        if g.unified:
            available = min(available, facts.cpu.ram_available_bytes)
        out.append(
            Device(
                f"{g.backend}:{g.index} {g.name}",
                "unified" if g.unified else "gpu",
                available,
                HOST_MARGIN if g.unified and not g.software else GPU_MARGIN,
                g.bandwidth_gbps,
                g.tflops,
                g.max_tensor_bytes,
            )
        )
    cpu = facts.cpu
    out.append(
        Device(
            f"cpu ({cpu.model})",
            "host",
            cpu.ram_available_bytes,
            HOST_MARGIN,
            cpu.bandwidth_gbps,
            cpu.tflops,
        )
    )
    return out


def layer_devices(n_layer: int, ngl: int, split: Sequence[float]) -> list[int]:
    """Device index of each block and (last entry) of the output layer; -1 is the host.

    llama.cpp's rule (llama-model.cpp load_tensors): the last ``ngl`` of the n_layer + 1
    layers are offloaded, spread over the GPUs at the cumulative split points.
    """
    if not split or ngl <= 0:
        return [-1] * (n_layer + 1)
    total = sum(split)
    points = list(itertools.accumulate(s / total for s in split))
    i_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < i_start or il - i_start >= act:
            out.append(-1)
        else:
            out.append(min(bisect.bisect_right(points, (il - i_start) / act), len(split) - 1))
    return out


def layer_homes(n_layer: int, ngl: int, split: Sequence[float], n_devices: int) -> list[int]:
    """``layer_devices`` with the host as its index in a device list (the last one)."""
    host = n_devices - 1
    return [host if d < 0 else d for d in layer_devices(n_layer, ngl, split)]


def one_hot(n: int, index: int) -> tuple[float, ...]:
    return tuple(1.0 if i == index else 0.0 for i in range(n))


def draft_offload(draft: ModelFacts, device: int, n_gpus: int) -> tuple[int, tuple[float, ...]]:
    """(n_gpu_layers, split) that put the whole draft on ``device`` (index n_gpus: the host)."""
    if device == n_gpus:
        return 0, ()
    return draft.n_layer + 1, one_hot(n_gpus, device)


def padded_ctx(n_ctx: int) -> int:
    return -(-n_ctx // CTX_STEP) * CTX_STEP


def kv_cells(layout: Layout) -> int:
    """The KV cells of each model's context under ``layout``, as the engine creates it (every
    slot's context and the extra completions' room)."""
    return context_cells(padded_ctx(layout.n_ctx), layout.n_slots, aux_sequences(layout.n_slots))


def compute_bytes(
    m: ModelFacts, n_ubatch: int, *, layers: bool, output: bool, n_kv: int = 0
) -> int:
    """llama.cpp's compute buffer (graph allocator peak) for one device.

    The output stage holds a ubatch of f32 logits; a layer stage holds the FFN activations,
    and without flash attention (``n_kv`` > 0: the cells attended) also the f32 KQ scores of
    every head plus one more such row block. Calibrated on the fixture models
    (tests/test_plan.py checks it against llama.cpp's log, flash attention on and off).
    """
    logits = 4 * n_ubatch * (m.n_vocab + 2 * m.n_embd) if output else 0
    scores = 4 * n_ubatch * n_kv * (m.n_head + 1)
    layer = 4 * n_ubatch * (3 * m.n_embd + 2 * m.n_ff) + scores if layers else 0
    return max(logits, layer, 4 * n_ubatch * m.n_embd * 2)


def output_buffer_bytes(m: ModelFacts, n_slots: int, spec_n_max: int) -> int:
    """Host logits buffer: one row per output; a verify step asks for n_max + 1 per slot."""
    return 4 * m.n_vocab * n_slots * (spec_n_max + 1)


@dataclass
class _Usage:
    weights: int = 0
    kv: int = 0
    compute: int = 0
    draft: int = 0


def output_on_host(m: ModelFacts, n_ubatch: int, max_tensor: int | None) -> bool:
    """Whether llama.cpp computes the output layer on the host although its weights are on a
    device: a ubatch of f32 logits is larger than one op may touch there (Vulkan's
    maxStorageBufferRange; 128 MiB on lavapipe), so the scheduler runs that op on the CPU."""
    return max_tensor is not None and 4 * n_ubatch * m.n_vocab > max_tensor


def model_usage(
    m: ModelFacts,
    layout: Layout,
    ngl: int,
    split: Sequence[float],
    n_devices: int,
    max_tensor: Sequence[int | None] = (),
) -> list[_Usage]:
    """Bytes per device (GPUs, then host last) for one model under ``layout``; ``max_tensor``:
    each GPU's largest tensor per op (``output_on_host``)."""
    usage = [_Usage() for _ in range(n_devices)]
    host = n_devices - 1
    homes = layer_homes(m.n_layer, ngl, split, n_devices)
    cells = kv_cells(layout)
    kv_layer = int(cells * m.kv_bytes_per_token_layer(layout.type_kv, layout.type_kv))
    for il in range(m.n_layer):
        usage[homes[il]].weights += m.layer_bytes[il]
        usage[homes[il]].kv += kv_layer
    out_dev = homes[m.n_layer]
    # On the host a tied output *is* token_embd (one mmap); on a GPU it is a second copy.
    if not (m.tied_embeddings and out_dev == host):
        usage[out_dev].weights += m.output_bytes
    usage[host].weights += m.embd_bytes
    holds_layers = set(homes[: m.n_layer])
    out_compute = out_dev
    limit = max_tensor[out_dev] if out_dev < len(max_tensor) else None
    if out_dev != host and output_on_host(m, layout.n_ubatch, limit):
        out_compute = host
        usage[host].compute += m.output_bytes  # the weights, copied for the CPU's op
    for dev in range(n_devices):
        has_layers, has_out = dev in holds_layers, dev == out_compute
        if has_layers or has_out:
            usage[dev].compute += compute_bytes(
                m,
                layout.n_ubatch,
                layers=has_layers,
                output=has_out,
                n_kv=0 if layout.flash_attn else cells,
            )
    usage[host].compute += output_buffer_bytes(m, layout.n_slots, layout.spec_n_max)
    if host not in holds_layers and out_compute != host:
        usage[host].compute += 4 * layout.n_ubatch * m.n_embd * 2  # input embeddings staging
    return usage


def draft_bytes(draft: ModelFacts, layout: Layout, devices: Sequence[Device]) -> list[int]:
    """The draft's whole footprint per device, on ``layout.draft_device``."""
    assert layout.draft_device is not None
    ngl, split = draft_offload(draft, layout.draft_device, len(devices) - 1)
    limits = [d.max_tensor_bytes for d in devices]
    usage = model_usage(draft, layout, ngl, split, len(devices), limits)
    return [u.weights + u.kv + u.compute for u in usage]


def memory_table(
    target: ModelFacts, draft: ModelFacts | None, layout: Layout, devices: Sequence[Device]
) -> list[DeviceMemory]:
    """Every device's bytes under ``layout``: the target, its KV and compute, the draft."""
    n = len(devices)
    limits = [d.max_tensor_bytes for d in devices]
    usage = model_usage(target, layout, layout.target_ngl, layout.split, n, limits)
    if draft is not None and layout.draft_device is not None:
        for u, extra in zip(usage, draft_bytes(draft, layout, devices), strict=True):
            u.draft += extra
    rows = [
        DeviceMemory(d.name, u.weights, u.kv, u.compute, u.draft, d.margin, d.available)
        for d, u in zip(devices, usage, strict=True)
    ]
    unified = sum(r.used for r, d in zip(rows, devices, strict=True) if d.kind == "unified")
    if unified:
        rows[-1] = replace(rows[-1], shared_with=unified)
    return rows


def fits(rows: Sequence[DeviceMemory]) -> bool:
    return all(r.fits for r in rows)
