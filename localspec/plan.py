"""The fit planner: which pair, which quant, how many GPU layers, what context, how many slots.

``make_plan(catalog, facts, settings)`` is a pure function: the catalog (or GGUF tensor tables
the caller has already read), the hardware facts and the settings go in, a ``Plan`` with the
arithmetic that justifies it comes out. Nothing here touches the GPU, the network or the disk,
except ``model_facts_from_gguf``, the one reader callers use to give the planner exact
per-layer sizes of files already present.

Memory follows llama.cpp's own allocation (see docs/planning.md): ``n_gpu_layers`` offloads
the *last* repeating blocks and, past ``n_layer``, the output layer; ``token_embd`` stays in
host memory; each layer's KV cache lives with the layer; each device holding layers gets a
compute buffer, the one holding the output layer a larger one (the logits of a ubatch).
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import mmap
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from os import PathLike
from typing import Any, Literal

from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.hardware import GiB, GpuDevice, HardwareFacts

# ---------------------------------------------------------------------------- constants

KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
"""Bytes per cached K or V element (q8_0/q4_0 store 32 values plus an f16 scale)."""

QUANT_BITS: dict[str, float] = {
    "F32": 32.0,
    "F16": 16.0,
    "BF16": 16.0,
    "Q8_0": 8.5,
    "Q6_K": 6.5625,
    "Q5_K_M": 5.69,
    "Q5_K_S": 5.54,
    "Q5_1": 6.0,
    "Q5_0": 5.5,
    "Q4_K_M": 4.85,
    "Q4_K_S": 4.58,
    "Q4_1": 5.0,
    "Q4_0": 4.5,
    "IQ4_XS": 4.25,
    "Q3_K_M": 3.91,
    "Q2_K": 3.35,
}
"""Average bits per weight of llama.cpp's quant mixes: ranks quants, estimates embeddings."""

GPU_MARGIN = 1 * GiB  # llama.cpp's --fit keeps 1024 MiB free per device
HOST_MARGIN = 2 * GiB  # for the OS, the editor and localspec itself
BANDWIDTH_EFFICIENCY = 0.75  # llama.cpp reaches ~70-82 % of memory bandwidth when decoding
COMPUTE_EFFICIENCY = 0.35  # share of peak tensor throughput quantized matmuls reach
MAX_SLOTS = 256  # the server's limit
CTX_STEP = 256  # llama.cpp pads the context to a multiple of 256
PERSONAL_CONTEXT = 16384
DATACENTER_CONTEXT = 8192
MAX_REJECTIONS_SHOWN = 8


class PlanError(ValueError):
    """No candidate can run on this machine (the message says why and what to change)."""


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs of one GGUF (one model at one quant), catalog- or file-derived."""

    model_id: str
    quant: str
    params_b: float  # total parameters (billions): ranks targets by size
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    n_ff: int
    layer_bytes: tuple[int, ...]  # weights of each repeating block, blk.0 .. blk.N-1
    output_bytes: int  # output layer on its device (tied embeddings: token_embd's copy)
    embd_bytes: int  # token_embd: always host memory
    tied_embeddings: bool
    active_fraction: float = 1.0  # MoE: share of layer weights read per token
    source: str = "catalog estimate"  # or the GGUF path the tensor table came from
    file_path: str | None = None

    @property
    def file_bytes(self) -> int:
        untied_output = 0 if self.tied_embeddings else self.output_bytes
        return sum(self.layer_bytes) + self.embd_bytes + untied_output

    @property
    def label(self) -> str:
        return f"{self.model_id} {self.quant}"

    def kv_bytes_per_token_layer(self, type_k: str, type_v: str) -> float:
        kv = self.n_head_kv * self.head_dim
        return kv * (KV_TYPE_BYTES[type_k] + KV_TYPE_BYTES[type_v])


@dataclass(frozen=True)
class Candidate:
    """One way to serve: a target at one quant, with a draft model or n-gram drafting only."""

    pair_id: str
    target: ModelFacts
    draft: ModelFacts | None

    @property
    def label(self) -> str:
        draft = f" + {self.draft.label}" if self.draft else " (n-gram drafting)"
        return self.target.label + draft


@dataclass(frozen=True)
class PlanSettings:
    """What the user (or IT) asks of the plan; None means 'let the planner choose'."""

    allowed: tuple[str, ...] = ()  # fnmatch patterns of pair ids / model ids; empty: all
    pair: str | None = None  # try this pair first
    context: int | None = None  # tokens per slot; None: 16384 personal, 8192 datacenter
    min_context: int = 4096  # shrink the context no further than this
    n_slots: int | None = None  # None: 1 on a personal machine, sized for sessions otherwise
    gpu_memory_cap_bytes: int | None = None  # per GPU
    concurrent_sessions: int | None = None  # datacenter: developer sessions to hold
    max_token_ms: float = 50.0  # p95 time per generated token; also the slowest plan accepted
    acceptance: float = 0.7  # assumed draft acceptance rate for the speedup estimate
    spec_n_max: int = 16
    requests_per_session_per_min: float = 6.0  # an active developer's completion requests
    tokens_per_request: int = 32  # generated tokens per FIM answer
    new_prompt_tokens_per_request: int = 256  # prompt tokens not already in the slot cache
    threads: int | None = None
    allow_q4_kv: bool = False  # q4_0 KV costs quality; off unless asked
    draft_models: bool = True  # False: n-gram pairs only (speculative.mode off or ngram)
    speculative: SpecSettings = field(default_factory=SpecSettings)  # handed to the engine
    cache_reuse: int = 256  # handed to the engine
    measured: Mapping[tuple[str, str], ModelFacts] = field(default_factory=dict)
    """(model id, quant) -> facts read from a GGUF on disk; replaces the catalog estimate."""


def plan_settings_from(settings: Any, **overrides: Any) -> PlanSettings:
    """PlanSettings from localspec's layered Settings (models.*, limits.*, server.slots,
    speculative.*, cache.reuse_chunk). A pinned models.pair is the only pair considered.
    ``overrides`` set PlanSettings fields no settings key holds (concurrent_sessions=500)."""
    models, limits, spec = settings.models, settings.limits, settings.speculative
    allowed = tuple(models.allowed)
    if models.pair:
        if not _allowed(allowed, models.pair):
            raise PlanError(f"models.pair {models.pair!r} is not in models.allowed {list(allowed)}")
        allowed = (models.pair,)
    cap = limits.gpu_memory_gb
    return PlanSettings(
        allowed=allowed,
        pair=models.pair,
        context=limits.context,
        min_context=min(4096, limits.context) if limits.context else 4096,
        n_slots=settings.server.slots,
        gpu_memory_cap_bytes=int(cap * 1e9) if cap else None,
        threads=limits.threads,
        spec_n_max=spec.n_max,
        draft_models=spec.mode not in ("off", "ngram"),
        speculative=SpecSettings(
            mode=spec.mode, n_max=spec.n_max, n_min=spec.n_min, p_min=spec.p_min
        ),
        cache_reuse=settings.cache.reuse_chunk,
        **overrides,
    )


# ---------------------------------------------------------------------------- catalog adapter


def _params_from_arch(m: ModelFacts) -> float:
    per_layer = m.n_embd * m.n_head * m.head_dim * 2 + 2 * m.n_embd * m.n_head_kv * m.head_dim
    per_layer += 3 * m.n_embd * m.n_ff
    embd = m.n_vocab * m.n_embd * (1 if m.tied_embeddings else 2)
    return (m.n_layer * per_layer + embd) / 1e9


def estimate_model_facts(
    model_id: str,
    quant: str,
    *,
    params_b: float,
    file_bytes: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_vocab: int,
    n_ctx_train: int,
    tied_embeddings: bool,
    active_params_b: float | None = None,
) -> ModelFacts:
    """Per-layer sizes from a file size alone: embeddings at the quant's average bits/weight.

    Used until the GGUF is on disk; the tensor table then replaces it (``measured``).
    """
    bits = QUANT_BITS.get(quant.upper(), file_bytes * 8 / (params_b * 1e9))
    embd = int(n_vocab * n_embd * bits / 8)
    output = embd  # tied: the copy llama.cpp puts on the output device; untied: output.weight
    layers_total = max(file_bytes - embd - (0 if tied_embeddings else output), n_layer)
    per_layer = layers_total // n_layer
    active = min(1.0, active_params_b / params_b) if active_params_b else 1.0
    return ModelFacts(
        model_id=model_id,
        quant=quant,
        params_b=params_b,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_ff=int(n_embd * 5.4),  # Qwen2.5's ratio; only sizes a compute buffer
        layer_bytes=(per_layer,) * n_layer,
        output_bytes=output,
        embd_bytes=embd,
        tied_embeddings=tied_embeddings,
        active_fraction=active,
    )


def facts_from_catalog_entry(entry: Any, quant: str) -> ModelFacts:
    """Adapter from a localspec.catalog.ModelEntry (duck-typed: the planner stays data-only)."""
    q = entry.quants[quant]
    size = q.total_size
    if size is None:
        bits = QUANT_BITS.get(quant.upper(), 8.5)
        size = int(entry.params_b * 1e9 * bits / 8)
    a = entry.arch
    return estimate_model_facts(
        entry.id,
        quant,
        params_b=entry.params_b,
        file_bytes=size,
        n_layer=a.n_layer,
        n_embd=a.n_embd,
        n_head=a.n_head,
        n_head_kv=a.n_head_kv,
        head_dim=a.head_dim,
        n_vocab=a.n_vocab,
        n_ctx_train=a.n_ctx_train,
        tied_embeddings=a.tied_embeddings,
        active_params_b=getattr(a, "active_params_b", None),
    )


def _quant_bits(quant: str) -> float:
    return QUANT_BITS.get(quant.upper(), 0.0)


def _allowed(patterns: Sequence[str], *names: str) -> bool:
    return not patterns or any(fnmatch.fnmatch(n, p) for p in patterns for n in names)


def _draft_quant(entry: Any) -> str:
    """Drafts run at Q8_0 (the 0.5B's K-quants barely shrink it; low quants cut acceptance)."""
    quants = list(entry.quants)
    if "Q8_0" in quants:
        return "Q8_0"
    return max(quants, key=_quant_bits)


def candidates_from_catalog(catalog: Any, settings: PlanSettings) -> list[Candidate]:
    """Every (pair, target quant) the settings allow, best first (see ``candidate_order``)."""

    def facts(entry: Any, quant: str) -> ModelFacts:
        measured = settings.measured.get((entry.id, quant))
        return measured if measured is not None else facts_from_catalog_entry(entry, quant)

    out: list[Candidate] = []
    for pair in catalog.pairs.values():
        if not pair.compatible:
            continue
        if not _allowed(settings.allowed, pair.id, pair.target):
            continue
        if pair.draft and not settings.draft_models:
            continue
        target = catalog.models[pair.target]
        draft_entry = catalog.models[pair.draft] if pair.draft else None
        draft = facts(draft_entry, _draft_quant(draft_entry)) if draft_entry else None
        for quant in target.quants:
            out.append(Candidate(pair.id, facts(target, quant), draft))
    return candidate_order(out, settings.pair)


def candidate_order(candidates: Iterable[Candidate], prefer: str | None = None) -> list[Candidate]:
    """Biggest target first; within one target, a draft model before n-gram only, the cheaper
    draft first; then the higher quant. A preferred pair goes to the front."""

    def key(c: Candidate) -> tuple[Any, ...]:
        draft_cost = c.draft.file_bytes if c.draft else math.inf
        return (
            c.pair_id != prefer,
            -c.target.params_b,
            c.target.model_id,
            draft_cost,
            -_quant_bits(c.target.quant),
        )

    return sorted(candidates, key=key)


# ---------------------------------------------------------------------------- memory model


@dataclass(frozen=True)
class Device:
    """A place weights can live: a GPU or host RAM (the last device is always the host)."""

    name: str
    kind: Literal["gpu", "unified", "host"]
    available: int
    margin: int
    bandwidth_gbps: float
    tflops: float

    @property
    def budget(self) -> int:
        return max(0, self.available - self.margin)


def devices_for(facts: HardwareFacts, cap: int | None = None) -> list[Device]:
    """The devices a plan may use, with budgets: GPU free − 1 GiB; unified memory
    min(working set, available RAM) − 2 GiB; host available RAM − 2 GiB."""
    out: list[Device] = []
    gpus: tuple[GpuDevice, ...] = facts.usable_gpus
    for g in gpus:
        available = g.free_bytes if cap is None else min(g.free_bytes, cap)
        if g.unified:
            available = min(available, facts.cpu.ram_available_bytes)
            out.append(
                Device(
                    f"{g.backend}:{g.index} {g.name}",
                    "unified",
                    available,
                    HOST_MARGIN,
                    g.bandwidth_gbps,
                    g.tflops,
                )
            )
        else:
            out.append(
                Device(
                    f"{g.backend}:{g.index} {g.name}",
                    "gpu",
                    available,
                    GPU_MARGIN,
                    g.bandwidth_gbps,
                    g.tflops,
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


@dataclass(frozen=True)
class Layout:
    """Settings that decide memory: everything the check needs besides the models."""

    n_ctx: int  # per slot
    n_slots: int
    type_kv: str
    n_ubatch: int
    target_ngl: int
    split: tuple[float, ...]  # proportions over the GPUs (empty: no GPU)
    draft_device: int | None  # index into the device list; None: no draft model
    spec_n_max: int = 16


@dataclass(frozen=True)
class DeviceMemory:
    """One row of the plan's memory table (bytes)."""

    device: str
    weights: int
    kv: int
    compute: int
    draft: int
    margin: int
    available: int
    shared_with: int = 0  # unified memory: bytes the GPU rows take from the same RAM

    @property
    def used(self) -> int:
        return self.weights + self.kv + self.compute + self.draft

    @property
    def budget(self) -> int:
        return max(0, self.available - self.margin - self.shared_with)

    @property
    def fits(self) -> bool:
        return self.used <= self.budget

    def to_json(self) -> dict[str, int]:
        data = asdict(self)
        data.update(used=self.used, budget=self.budget)
        return data


def layer_devices(n_layer: int, ngl: int, split: Sequence[float]) -> list[int]:
    """Device index of each block and (last entry) of the output layer; -1 is the host.

    llama.cpp's rule (llama-model.cpp load_tensors): the last ``ngl`` of the n_layer + 1
    layers are offloaded, spread over the GPUs at the cumulative split points.
    """
    if not split or ngl <= 0:
        return [-1] * (n_layer + 1)
    total = sum(split)
    points = list(_cumulative([s / total for s in split]))
    i_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < i_start or il - i_start >= act:
            out.append(-1)
        else:
            out.append(min(bisect.bisect_right(points, (il - i_start) / act), len(split) - 1))
    return out


def _cumulative(values: Sequence[float]) -> Iterable[float]:
    acc = 0.0
    for v in values:
        acc += v
        yield acc


def padded_ctx(n_ctx: int) -> int:
    return -(-n_ctx // CTX_STEP) * CTX_STEP


def compute_bytes(m: ModelFacts, n_ubatch: int, *, layers: bool, output: bool) -> int:
    """llama.cpp's compute buffer (graph allocator peak) for one device, flash attention on.

    The output stage holds a ubatch of f32 logits; a layer stage holds the FFN activations.
    Calibrated on the fixture models (tests/test_plan.py checks it against llama.cpp's log).
    """
    logits = 4 * n_ubatch * (m.n_vocab + 2 * m.n_embd) if output else 0
    layer = 4 * n_ubatch * (3 * m.n_embd + 2 * m.n_ff) if layers else 0
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


def model_usage(
    m: ModelFacts, layout: Layout, ngl: int, split: Sequence[float], n_devices: int
) -> list[_Usage]:
    """Bytes per device (GPUs, then host last) for one model under ``layout``."""
    usage = [_Usage() for _ in range(n_devices)]
    host = n_devices - 1
    where = layer_devices(m.n_layer, ngl, split)
    cells = padded_ctx(layout.n_ctx) * layout.n_slots
    kv_layer = int(cells * m.kv_bytes_per_token_layer(layout.type_kv, layout.type_kv))
    for il in range(m.n_layer):
        dev = host if where[il] < 0 else where[il]
        usage[dev].weights += m.layer_bytes[il]
        usage[dev].kv += kv_layer
    out_dev = host if where[m.n_layer] < 0 else where[m.n_layer]
    # On the host a tied output *is* token_embd (one mmap); on a GPU it is a second copy.
    if not (m.tied_embeddings and out_dev == host):
        usage[out_dev].weights += m.output_bytes
    usage[host].weights += m.embd_bytes
    holds_layers = {host if d < 0 else d for d in where[: m.n_layer]}
    for dev in range(n_devices):
        has_layers, has_out = dev in holds_layers, dev == out_dev
        if has_layers or has_out:
            usage[dev].compute += compute_bytes(
                m, layout.n_ubatch, layers=has_layers, output=has_out
            )
    usage[host].compute += output_buffer_bytes(m, layout.n_slots, layout.spec_n_max)
    if host not in holds_layers and out_dev != host:
        usage[host].compute += 4 * layout.n_ubatch * m.n_embd * 2  # input embeddings staging
    return usage


def one_hot(n: int, index: int) -> tuple[float, ...]:
    return tuple(1.0 if i == index else 0.0 for i in range(n))


def memory_table(
    target: ModelFacts, draft: ModelFacts | None, layout: Layout, devices: Sequence[Device]
) -> list[DeviceMemory]:
    """Every device's bytes under ``layout``: the target, its KV and compute, the draft."""
    n = len(devices)
    usage = model_usage(target, layout, layout.target_ngl, layout.split, n)
    if draft is not None and layout.draft_device is not None:
        host = n - 1
        on_gpu = layout.draft_device != host
        split = one_hot(n - 1, layout.draft_device) if on_gpu else ()
        ngl = draft.n_layer + 1 if on_gpu else 0
        for dev, u in enumerate(model_usage(draft, layout, ngl, split, n)):
            usage[dev].draft += u.weights + u.kv + u.compute
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


# ---------------------------------------------------------------------------- speed model


def _device_read_bytes(
    m: ModelFacts,
    ngl: int,
    split: Sequence[float],
    n_devices: int,
    kv_per_token: float,
    kv_tokens: int,
) -> list[float]:
    """Bytes read per generated token on each device: active weights (not token_embd, of
    which one row is read) and the KV of the context so far."""
    reads = [0.0] * n_devices
    host = n_devices - 1
    where = layer_devices(m.n_layer, ngl, split)
    for il in range(m.n_layer):
        dev = host if where[il] < 0 else where[il]
        reads[dev] += m.layer_bytes[il] * m.active_fraction + kv_per_token * kv_tokens
    out_dev = host if where[m.n_layer] < 0 else where[m.n_layer]
    reads[out_dev] += m.output_bytes
    return reads


def token_seconds(
    m: ModelFacts,
    ngl: int,
    split: Sequence[float],
    devices: Sequence[Device],
    *,
    type_kv: str,
    kv_tokens: int,
    batch: int = 1,
    efficiency: float = 1.0,
) -> float:
    """Seconds for one decode step of ``batch`` sequences. Devices run one after another
    (llama.cpp's layer split is a pipeline), each bound by bandwidth or by compute."""
    kv_tok = m.kv_bytes_per_token_layer(type_kv, type_kv)
    one = _device_read_bytes(m, ngl, split, len(devices), kv_tok, kv_tokens)
    kv_only = _device_read_bytes(
        replace(m, layer_bytes=(0,) * m.n_layer, output_bytes=0),
        ngl,
        split,
        len(devices),
        kv_tok,
        kv_tokens,
    )
    total_weights = sum(one) - sum(kv_only) or 1.0
    active_params = m.params_b * 1e9 * m.active_fraction
    seconds = 0.0
    for dev, read, kv in zip(devices, one, kv_only, strict=True):
        if read <= 0:
            continue
        mem = (read + (batch - 1) * kv) / (dev.bandwidth_gbps * 1e9 * efficiency)
        flops = 2 * active_params * (read - kv) / total_weights * batch
        comp = flops / (dev.tflops * 1e12 * (COMPUTE_EFFICIENCY if efficiency < 1 else 1.0))
        seconds += max(mem, comp)
    return seconds


def prompt_seconds(
    m: ModelFacts, devices: Sequence[Device], ngl: int, split: Sequence[float], n_tokens: int
) -> float:
    """Prompt processing is compute-bound: 2 x active params FLOPs per token."""
    weights = _device_read_bytes(m, ngl, split, len(devices), 0.0, 0)
    total = sum(weights) or 1.0
    active = m.params_b * 1e9 * m.active_fraction
    return sum(
        2 * active * n_tokens * w / total / (d.tflops * 1e12 * COMPUTE_EFFICIENCY)
        for d, w in zip(devices, weights, strict=True)
        if w
    )


def speculative_speedup(alpha: float, cost_ratio: float, n_max: int) -> tuple[float, int]:
    """Best expected speedup over draft lengths 1..n_max, and that length.

    (1 − α^(γ+1)) / ((1 − α)(γ·c + 1)): α acceptance, γ draft length, c draft/target cost.
    """
    alpha = min(max(alpha, 0.0), 0.999)
    best = (1.0, 0)
    for gamma in range(1, max(1, n_max) + 1):
        s = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * cost_ratio + 1))
        if s > best[0]:
            best = (s, gamma)
    return best


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest k with P(N ≤ k) ≥ q for N ~ Poisson(mean): busy slots at the q-th percentile."""
    if mean <= 0:
        return 0
    k, cdf = 0, 0.0
    log_mean = math.log(mean)
    while True:
        cdf += math.exp(k * log_mean - mean - math.lgamma(k + 1))
        if cdf >= q or k > mean * 10 + 100:
            return k
        k += 1


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Rejection:
    candidate: str
    reason: str


@dataclass(frozen=True)
class Capacity:
    """Datacenter arithmetic: how many developer sessions the slots hold at the latency bound."""

    sessions_held: int
    sessions_requested: int | None
    slots_by_memory: int
    slots_by_latency: int
    step_ms_at_full_batch: float
    request_busy_s: float
    duty_cycle: float  # share of time one session has a request in flight
    busy_slots_p95: int
    explanation: str


@dataclass(frozen=True)
class Plan:
    """The chosen configuration, its memory per device and the reasons behind it."""

    hardware: str
    pair_id: str
    target: tuple[str, str]  # (model id, quant)
    draft: tuple[str, str] | None
    target_ngl: int
    draft_ngl: int
    target_layers: int  # n_layer + 1 (the output layer): target_ngl == this is full offload
    n_ctx: int
    n_slots: int
    type_k: str
    type_v: str
    n_batch: int
    n_ubatch: int
    flash_attn: bool
    n_threads: int
    n_threads_batch: int
    tensor_split: tuple[float, ...] | None
    draft_device: str | None
    draft_gpu: int | None  # index among the GPUs (llama.cpp main_gpu for the draft); None: CPU
    memory: tuple[DeviceMemory, ...]
    rejected: tuple[Rejection, ...]
    decode_ceiling_tps: tuple[float, float | None]  # (target, draft), bandwidth bound
    expected_tps: float  # target alone, at llama.cpp's usual share of the bandwidth
    expected_spec_speedup: float | None
    best_draft_len: int | None
    fits_wholly: bool
    capacity: Capacity | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    target_source: str = "catalog estimate"
    speculative: SpecSettings = field(default_factory=SpecSettings)
    cache_reuse: int = 256

    @property
    def concurrent_sessions(self) -> int:
        return self.capacity.sessions_held if self.capacity else self.n_slots

    def engine_settings(
        self, target_path: str | PathLike[str], draft_path: str | PathLike[str] | None = None
    ) -> EngineSettings:
        """What the engine loads. n_ctx is per slot (the engine multiplies by n_slots)."""

        def model(path: str | PathLike[str], ngl: int) -> ModelSettings:
            return ModelSettings(
                path=str(path),
                n_gpu_layers=ngl,
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                n_ubatch=self.n_ubatch,
                flash_attn=self.flash_attn,
                type_k=self.type_k,
                type_v=self.type_v,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads_batch,
            )

        if self.draft is not None and draft_path is None:
            raise PlanError(f"the plan uses the draft {self.draft[0]}; give its GGUF path")
        draft = model(draft_path, self.draft_ngl) if self.draft and draft_path else None
        spec = self.speculative
        if draft is None and spec.mode in ("draft", "hybrid"):
            spec = replace(spec, mode="ngram")  # no draft model fits: n-grams still help
        return EngineSettings(
            target=model(target_path, self.target_ngl),
            draft=draft,
            n_slots=self.n_slots,
            spec=spec,
            cache_reuse=self.cache_reuse,
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory"] = [r.to_json() for r in self.memory]
        data["concurrent_sessions"] = self.concurrent_sessions
        return data

    def explain(self) -> str:
        return render_plan(self)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def render_plan(plan: Plan) -> str:
    """The table `localspec plan` prints: choice, memory per device, rejections, speed."""
    t_layers = plan.target_layers
    offload = "all" if plan.target_ngl >= t_layers else f"{plan.target_ngl}"
    lines = [
        f"hardware: {plan.hardware}",
        f"pair:     {plan.pair_id}",
        f"target:   {plan.target[0]} {plan.target[1]}  "
        f"(GPU layers {offload}/{t_layers}; sizes from {plan.target_source})",
        "draft:    "
        + (
            f"{plan.draft[0]} {plan.draft[1]} on {plan.draft_device} (GPU layers {plan.draft_ngl})"
            if plan.draft
            else "none (n-gram drafting from the prompt)"
        ),
        f"context:  {plan.n_ctx} tokens x {plan.n_slots} slot(s), KV {plan.type_k}/{plan.type_v}, "
        f"batch {plan.n_batch}/{plan.n_ubatch}, flash attention "
        f"{'on' if plan.flash_attn else 'auto'}, threads {plan.n_threads}/{plan.n_threads_batch}",
    ]
    if plan.tensor_split:
        lines.append("split:    " + " / ".join(f"{s:.2f}" for s in plan.tensor_split))
    lines += ["", "memory (GiB)"]
    header = f"  {'device':<36}{'weights':>9}{'KV':>8}{'compute':>9}{'draft':>8}"
    header += f"{'margin':>8}{'used':>8}{'budget':>8}"
    lines.append(header)
    for r in plan.memory:
        lines.append(
            f"  {r.device[:35]:<36}{_gib(r.weights):>9}{_gib(r.kv):>8}{_gib(r.compute):>9}"
            f"{_gib(r.draft):>8}{_gib(r.margin):>8}{_gib(r.used):>8}{_gib(r.budget):>8}"
        )
    target_tps, draft_tps = plan.decode_ceiling_tps
    lines += [
        "",
        f"decode ceiling: target {target_tps:.0f} tok/s"
        + (f", draft {draft_tps:.0f} tok/s" if draft_tps else "")
        + f" (bandwidth bound); expected ~{plan.expected_tps:.0f} tok/s",
    ]
    if plan.expected_spec_speedup is not None:
        lines.append(
            f"speculative: expected {plan.expected_spec_speedup:.2f}x at draft length "
            f"{plan.best_draft_len} (assumed acceptance; measured live by the engine)"
        )
    if plan.capacity:
        lines += [
            "",
            "concurrent sessions",
            *("  " + s for s in plan.capacity.explanation.split("\n")),
        ]
    if plan.rejected:
        lines += ["", "rejected"]
        shown = plan.rejected[-MAX_REJECTIONS_SHOWN:]  # the nearest misses come last
        if len(plan.rejected) > len(shown):
            lines.append(f"  ({len(plan.rejected) - len(shown)} bigger candidates: see --json)")
        lines += [f"  {r.candidate}: {r.reason}" for r in shown]
    for note in plan.notes:
        lines.append(f"note: {note}")
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Ctx:
    """Planner state shared by the search helpers."""

    facts: HardwareFacts
    settings: PlanSettings
    devices: tuple[Device, ...]
    datacenter: bool
    ctx_max_setting: int
    n_ubatch_full: int

    @property
    def n_gpus(self) -> int:
        return len(self.devices) - 1

    @property
    def host(self) -> int:
        return len(self.devices) - 1

    @property
    def min_tps(self) -> float:
        return 1000 / self.settings.max_token_ms


@dataclass(frozen=True)
class _Fit:
    cand: Candidate
    layout: Layout
    rows: tuple[DeviceMemory, ...]
    whole: bool
    speedup: float | None
    best_gamma: int | None
    target_s: float  # expected seconds per target token
    capacity: Capacity | None = None


def _fastest_gpu_order(devices: Sequence[Device]) -> list[int]:
    gpus = range(len(devices) - 1)
    return sorted(gpus, key=lambda i: (-devices[i].bandwidth_gbps, -devices[i].budget, i))


def _split_for(c: _Ctx, cand: Candidate, layout: Layout) -> tuple[float, ...]:
    """GPU proportions: each GPU's budget left after the draft and a compute buffer; a GPU
    that cannot hold one layer gets none (it would only carry a compute buffer)."""
    if c.n_gpus == 0:
        return ()
    if c.n_gpus == 1:
        return (1.0,)
    m = cand.target
    cells = padded_ctx(layout.n_ctx) * layout.n_slots
    one_layer = max(m.layer_bytes) + cells * m.kv_bytes_per_token_layer(
        layout.type_kv, layout.type_kv
    )
    free = []
    for i in range(c.n_gpus):
        room = c.devices[i].budget - compute_bytes(
            m, layout.n_ubatch, layers=True, output=i == c.n_gpus - 1
        )
        if cand.draft is not None and layout.draft_device == i:
            room -= memory_table(
                cand.draft,
                None,
                replace(layout, target_ngl=cand.draft.n_layer + 1, split=one_hot(c.n_gpus, i)),
                c.devices,
            )[i].used
        free.append(room if room >= one_layer else 0)
    total = sum(free)
    if total <= 0:
        return tuple(1.0 / c.n_gpus for _ in range(c.n_gpus))
    return tuple(f / total for f in free)


def _rebalance(
    split: tuple[float, ...], rows: Sequence[DeviceMemory], n_gpus: int
) -> tuple[float, ...] | None:
    """Move share away from overflowing GPUs (layers are whole, so proportions round);
    None when no GPU has room to take it."""
    over = [i for i in range(n_gpus) if not rows[i].fits]
    spare = [i for i in range(n_gpus) if rows[i].fits and split[i] > 0]
    if not over or not spare:
        return None
    new = list(split)
    for i in over:
        r = rows[i]
        layer_part = max(r.weights + r.kv, 1)
        excess = r.used - r.budget
        new[i] = split[i] * max(0.0, 1 - 1.1 * excess / layer_part)
    total = sum(new)
    return tuple(s / total for s in new) if total > 0 else None


def _draft_placements(c: _Ctx, cand: Candidate) -> list[int | None]:
    """The draft goes on the fastest GPU first, then the next, then the host."""
    if cand.draft is None:
        return [None]
    return [*_fastest_gpu_order(c.devices), c.host]


def _rows(c: _Ctx, cand: Candidate, layout: Layout) -> tuple[Layout, list[DeviceMemory]]:
    """The layout with its tensor split chosen, and its memory table."""
    split: tuple[float, ...] | None = _split_for(c, cand, layout)
    for _ in range(6):
        assert split is not None
        layout = replace(layout, split=tuple(round(s, 4) for s in split))
        rows = memory_table(cand.target, cand.draft, layout, c.devices)
        if c.n_gpus < 2 or fits(rows):
            break
        split = _rebalance(layout.split, rows, c.n_gpus)
        if split is None:
            break
    return layout, rows


def _full_ngl(m: ModelFacts, c: _Ctx) -> int:
    return m.n_layer + 1 if c.n_gpus else 0


def _ctx_max(c: _Ctx, m: ModelFacts) -> int:
    return min(c.ctx_max_setting, m.n_ctx_train)


def _ladder(c: _Ctx, m: ModelFacts) -> list[tuple[str, int]]:
    """(KV type, context) steps tried before spilling layers: full context at f16, then
    quantized KV, then the context halved toward the floor."""
    ctx_max = _ctx_max(c, m)
    floor = min(padded_ctx(c.settings.min_context), ctx_max)
    kv_types = ["q8_0"] if c.datacenter else ["f16", "q8_0"]
    if c.settings.allow_q4_kv:
        kv_types.append("q4_0")
    if m.head_dim % 32:  # quantized KV blocks hold 32 values of one head
        kv_types = ["f16"]
    steps = [(kv, ctx_max) for kv in kv_types]
    ctx = ctx_max
    while ctx > floor:
        ctx = max(floor, padded_ctx(ctx // 2))
        steps.append((kv_types[-1], ctx))
    return steps


def _largest_ctx(c: _Ctx, cand: Candidate, layout: Layout, hi: int) -> int:
    """Grow the context of a fitting layout up to ``hi`` (binary search on 256-token steps)."""
    lo_steps, hi_steps = layout.n_ctx // CTX_STEP, hi // CTX_STEP
    while lo_steps < hi_steps:
        mid = (lo_steps + hi_steps + 1) // 2
        if fits(_rows(c, cand, replace(layout, n_ctx=mid * CTX_STEP))[1]):
            lo_steps = mid
        else:
            hi_steps = mid - 1
    return lo_steps * CTX_STEP


def _kv_tokens(layout: Layout) -> int:
    """Context read per generated token in the speed estimates: a FIM prompt's worth."""
    return min(layout.n_ctx, 2048)


def _draft_speed(c: _Ctx, cand: Candidate, layout: Layout) -> tuple[float | None, int | None]:
    if cand.draft is None or layout.draft_device is None:
        return None, None
    on_gpu = layout.draft_device != c.host
    t_draft = token_seconds(
        cand.draft,
        cand.draft.n_layer + 1 if on_gpu else 0,
        one_hot(c.n_gpus, layout.draft_device) if on_gpu else (),
        c.devices,
        type_kv=layout.type_kv,
        kv_tokens=_kv_tokens(layout),
    )
    t_target = token_seconds(
        cand.target,
        layout.target_ngl,
        layout.split,
        c.devices,
        type_kv=layout.type_kv,
        kv_tokens=_kv_tokens(layout),
    )
    return speculative_speedup(c.settings.acceptance, t_draft / t_target, c.settings.spec_n_max)


def _finish(c: _Ctx, cand: Candidate, layout: Layout, *, whole: bool) -> _Fit | None:
    """Grow the context into spare memory (personal) or size the slots (datacenter)."""
    capacity = None
    if c.datacenter:
        layout, rows, capacity = _size_slots(c, cand, layout)
        if capacity is None:
            return None
    else:
        layout = replace(layout, n_ctx=_largest_ctx(c, cand, layout, _ctx_max(c, cand.target)))
        layout, rows = _rows(c, cand, layout)
    speedup, gamma = _draft_speed(c, cand, layout)
    target_s = token_seconds(
        cand.target,
        layout.target_ngl,
        layout.split,
        c.devices,
        type_kv=layout.type_kv,
        kv_tokens=_kv_tokens(layout),
        efficiency=BANDWIDTH_EFFICIENCY,
    )
    return _Fit(cand, layout, tuple(rows), whole, speedup, gamma, target_s, capacity)


def _size_slots(
    c: _Ctx, cand: Candidate, layout: Layout
) -> tuple[Layout, list[DeviceMemory], Capacity | None]:
    """Datacenter: as many slots as memory and the per-token latency bound allow, and the
    developer sessions those slots hold at p95."""
    s = c.settings
    kv_tokens = layout.n_ctx // 2  # a slot's context is half full on average

    def step_s(batch: int, lay: Layout) -> float:
        return token_seconds(
            cand.target,
            lay.target_ngl,
            lay.split,
            c.devices,
            type_kv=lay.type_kv,
            kv_tokens=kv_tokens,
            batch=batch,
            efficiency=BANDWIDTH_EFFICIENCY,
        )

    def fits_slots(n: int) -> bool:
        return fits(_rows(c, cand, replace(layout, n_slots=n))[1])

    if not fits_slots(1):
        return layout, [], None
    lo, hi = 1, s.n_slots or MAX_SLOTS
    if fits_slots(hi):
        lo = hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_slots(mid) else (lo, mid)
    by_memory = lo
    limit = s.max_token_ms / 1000
    by_latency = 0
    for b in range(1, by_memory + 1):
        if step_s(b, layout) > limit:
            break
        by_latency = b
    if by_latency == 0:
        return layout, [], None
    n_slots = min(by_memory, by_latency)
    layout, rows = _rows(c, cand, replace(layout, n_slots=n_slots))
    step = step_s(n_slots, layout)
    prompt = prompt_seconds(
        cand.target, c.devices, layout.target_ngl, layout.split, s.new_prompt_tokens_per_request
    )
    busy = prompt + s.tokens_per_request * step
    duty = s.requests_per_session_per_min / 60 * busy
    held = sessions_held(n_slots, duty)
    p95 = poisson_quantile(held * duty, 0.95)
    explanation = "\n".join(
        [
            f"slots: {n_slots} = min({by_memory} by memory at {layout.n_ctx} tokens/slot "
            f"{layout.type_kv} KV, {by_latency} by the {s.max_token_ms:g} ms/token bound)",
            f"one decode step with all {n_slots} slots busy: {step * 1000:.1f} ms "
            f"(weights + KV of {kv_tokens} tokens/slot at {BANDWIDTH_EFFICIENCY:.0%} of "
            "bandwidth, GPUs in sequence)",
            f"a request holds a slot {busy:.2f} s = {prompt * 1000:.0f} ms prompt "
            f"({s.new_prompt_tokens_per_request} new tokens) + {s.tokens_per_request} tokens "
            f"x {step * 1000:.1f} ms",
            f"a session sends {s.requests_per_session_per_min:g} requests/min: busy "
            f"{duty:.1%} of the time",
            f"{held} sessions: {held * duty:.1f} busy slots on average, {p95} at p95 "
            f"(Poisson) <= {n_slots} slots, so p95 time per token <= {step * 1000:.1f} ms",
        ]
    )
    capacity = Capacity(
        sessions_held=held,
        sessions_requested=s.concurrent_sessions,
        slots_by_memory=by_memory,
        slots_by_latency=by_latency,
        step_ms_at_full_batch=step * 1000,
        request_busy_s=busy,
        duty_cycle=duty,
        busy_slots_p95=p95,
        explanation=explanation,
    )
    return layout, rows, capacity


def sessions_held(n_slots: int, duty: float, q: float = 0.95) -> int:
    """Most sessions whose busy-slot count stays within ``n_slots`` at the q-th percentile."""
    if duty <= 0:
        return 10**6
    lo, hi = 0, 1
    while poisson_quantile(hi * duty, q) <= n_slots and hi < 10**6:
        lo, hi = hi, hi * 2
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if poisson_quantile(mid * duty, q) <= n_slots else (lo, mid)
    return lo


def _groups(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    """Candidates of one pair (one target model, one draft), in candidate order."""
    groups: dict[str, list[Candidate]] = {}
    for cand in candidates:
        groups.setdefault(cand.pair_id, []).append(cand)
    return list(groups.values())


def _group_label(group: Sequence[Candidate]) -> str:
    first = group[0]
    quants = "/".join(c.target.quant for c in group)
    draft = f" + {first.draft.label}" if first.draft else " (n-gram drafting)"
    return f"{first.target.model_id} {quants}{draft}"


@dataclass
class _Search:
    """What searching one group found besides a winner: why it failed, the best shortfall."""

    too_slow: list[tuple[Candidate, float]] = field(default_factory=list)
    draft_loses: list[tuple[str, float]] = field(default_factory=list)
    short: _Fit | None = None  # datacenter: the fit holding most sessions, below the ask

    def keep_short(self, fit: _Fit) -> None:
        if _held(fit) > _held(self.short):
            self.short = fit


def _held(fit: _Fit | None) -> int:
    return fit.capacity.sessions_held if fit and fit.capacity else -1


def _short_of_sessions(c: _Ctx, fit: _Fit) -> bool:
    asked = c.settings.concurrent_sessions
    return bool(c.datacenter and asked and _held(fit) < asked)


def _search_whole(c: _Ctx, group: Sequence[Candidate], found: _Search) -> _Fit | None:
    """Every layer on the accelerator (in RAM on a CPU machine). Order of preference: the
    draft on the fastest device, the full context at f16 KV, then quantized KV, then a
    shorter context; within each, the biggest ubatch, then the highest quant."""
    head = group[0]
    slots = c.settings.n_slots or 1
    for draft_dev in _draft_placements(c, head):
        for kv, ctx in _ladder(c, head.target):
            for ubatch in sorted({c.n_ubatch_full, 512}, reverse=True):
                for cand in group:
                    layout = Layout(
                        ctx,
                        slots,
                        kv,
                        ubatch,
                        _full_ngl(cand.target, c),
                        (),
                        draft_dev,
                        c.settings.spec_n_max,
                    )
                    layout, rows = _rows(c, cand, layout)
                    if not fits(rows):
                        continue
                    fit = _finish(c, cand, layout, whole=True)
                    if fit is None:
                        continue
                    if not c.datacenter and 1 / fit.target_s < c.min_tps:
                        found.too_slow.append((cand, 1 / fit.target_s))
                        continue
                    if cand.draft is not None and (fit.speedup or 0) < 1.05:
                        found.draft_loses.append((c.devices[draft_dev or 0].name, fit.speedup or 0))
                        continue
                    if _short_of_sessions(c, fit):
                        found.keep_short(fit)
                        continue
                    return fit
    return None


def _why_not(c: _Ctx, group: Sequence[Candidate], found: _Search) -> str:
    if found.short is not None and found.short.capacity is not None:
        return (
            f"holds at most {found.short.capacity.sessions_held} concurrent sessions, "
            f"fewer than the {c.settings.concurrent_sessions} asked"
        )
    if found.too_slow:
        # the fastest quant; on a tie (compute-bound) the smallest, which comes last
        cand, tps = max(reversed(found.too_slow), key=lambda x: x[1])
        return (
            f"fits, but decodes at ~{tps:.0f} tok/s at best ({cand.target.quant}), under the "
            f"{c.min_tps:.0f} tok/s that {c.settings.max_token_ms:g} ms/token needs"
        )
    if found.draft_loses:
        where, speedup = max(found.draft_loses, key=lambda x: x[1])
        return f"fits only with the draft on {where}, where it would not pay ({speedup:.2f}x)"
    smallest = group[-1]
    kv, ctx = _ladder(c, smallest.target)[-1]
    layout = Layout(
        ctx,
        c.settings.n_slots or 1,
        kv,
        512,
        _full_ngl(smallest.target, c),
        (),
        _draft_placements(c, smallest)[0],
        c.settings.spec_n_max,
    )
    _, rows = _rows(c, smallest, layout)
    over = [r for r in rows if not r.fits]
    if not over:
        return f"no slot meets the {c.settings.max_token_ms:g} ms/token bound"
    r = over[0]
    where, need, usable = r.device, r.used, r.budget
    if r.shared_with:  # unified memory: the GPU's share and the CPU's come from one pool
        where, need = "unified memory", r.used + r.shared_with
        usable = max(0, r.available - r.margin)
    return (
        f"even {smallest.target.quant} needs {_gib(need)} GiB on {where} but "
        f"{_gib(usable)} GiB is usable (at {ctx} tokens, {kv} KV)"
    )


def _search_spill(c: _Ctx, candidates: Sequence[Candidate]) -> _Fit | None:
    """Nothing fits wholly: the smallest target with as many layers on the GPU as fit, at
    the floor context and quantized KV. (Smaller runs faster when spilled, and more memory
    then only ever moves the choice up to a bigger target.)"""
    smallest = min(cand.target.params_b for cand in candidates)
    for group in _groups([cand for cand in candidates if cand.target.params_b == smallest]):
        for draft_dev in _draft_placements(c, group[0]):
            kv, ctx = _ladder(c, group[0].target)[-1]
            for cand in reversed(group):  # the smallest quant spills the fewest layers
                for ngl in range(_full_ngl(cand.target, c) - 1, -1, -1):
                    layout = Layout(
                        ctx,
                        c.settings.n_slots or 1,
                        kv,
                        512,
                        ngl,
                        (),
                        draft_dev,
                        c.settings.spec_n_max,
                    )
                    layout, rows = _rows(c, cand, layout)
                    if not fits(rows):
                        continue
                    fit = _finish(c, cand, layout, whole=False)
                    if fit is not None and (cand.draft is None or (fit.speedup or 0) >= 1.05):
                        return fit
                    break
    return None


def _threads(c: _Ctx, fit: _Fit) -> tuple[int, int]:
    cores = c.facts.cpu.physical_cores
    if c.settings.threads:
        return c.settings.threads, c.settings.threads
    cpu_work = c.n_gpus == 0 or fit.layout.target_ngl < fit.cand.target.n_layer + 1
    cpu_work = cpu_work or fit.layout.draft_device == c.host
    # Leave a core to the editor and the server on personal machines with cores to spare.
    decode = max(1, cores - 1) if cores > 4 and not c.datacenter else cores
    return (decode if cpu_work else min(cores, 4)), cores


def make_plan(catalog: Any, facts: HardwareFacts, settings: Any = None) -> Plan:
    """Choose and justify the serving configuration for ``facts`` (pure; see module doc).

    ``catalog`` is a localspec.catalog.Catalog, or already a list of ``Candidate``;
    ``settings`` a PlanSettings or localspec's Settings (see ``plan_settings_from``).
    """
    if settings is None:
        settings = PlanSettings()
    elif not isinstance(settings, PlanSettings):
        settings = plan_settings_from(settings)
    if isinstance(catalog, list | tuple):
        candidates = candidate_order(
            [
                cand
                for cand in catalog
                if _allowed(settings.allowed, cand.pair_id, cand.target.model_id)
            ],
            settings.pair,
        )
    else:
        candidates = candidates_from_catalog(catalog, settings)
    if not candidates:
        raise PlanError(
            "no catalog pair is allowed by the settings (models.allowed = "
            f"{list(settings.allowed)}); allow at least one pair"
        )
    if settings.pair and all(cand.pair_id != settings.pair for cand in candidates):
        raise PlanError(f"pair {settings.pair!r} is not in the catalog or not allowed")
    datacenter = facts.kind == "datacenter"
    context = settings.context or (DATACENTER_CONTEXT if datacenter else PERSONAL_CONTEXT)
    if context < settings.min_context:
        settings = replace(settings, min_context=context)
    devices = tuple(devices_for(facts, settings.gpu_memory_cap_bytes))
    has_gpu = len(devices) > 1
    c = _Ctx(facts, settings, devices, datacenter, padded_ctx(context), 1024 if has_gpu else 512)

    rejected: list[Rejection] = []
    chosen: _Fit | None = None
    best_short: _Fit | None = None
    for group in _groups(candidates):
        found = _Search()
        chosen = _search_whole(c, group, found)
        if chosen is not None:
            break
        rejected.append(Rejection(_group_label(group), _why_not(c, group, found)))
        if _held(found.short) > _held(best_short):
            best_short = found.short

    warnings = list(facts.warnings)
    notes: list[str] = []
    if chosen is None and best_short is not None and best_short.capacity is not None:
        chosen = best_short
        warnings.append(
            f"no candidate holds {settings.concurrent_sessions} concurrent sessions within "
            f"{settings.max_token_ms:g} ms/token; this plan holds "
            f"{best_short.capacity.sessions_held}"
        )
    if chosen is None:
        chosen = _search_spill(c, candidates)
        if chosen is None:
            raise PlanError(_nothing_fits(c, rejected))
        notes.append(
            "nothing fits wholly on the accelerator: the smallest target runs with "
            f"{chosen.layout.target_ngl} of {chosen.cand.target.n_layer + 1} layers on the GPU"
        )
    if settings.pair and chosen.cand.pair_id != settings.pair:
        notes.append(
            f"the preferred pair {settings.pair} does not fit; chose {chosen.cand.pair_id}"
        )
    if chosen.layout.type_kv != "f16":
        notes.append(f"KV cache quantized to {chosen.layout.type_kv} to fit (flash attention on)")
    if chosen.layout.n_ctx < _ctx_max(c, chosen.cand.target):
        notes.append(f"context shrunk to {chosen.layout.n_ctx} tokens to fit")
    return _to_plan(c, chosen, rejected, notes, warnings)


def _nothing_fits(c: _Ctx, rejected: Sequence[Rejection]) -> str:
    host = c.devices[-1]
    return "\n".join(
        [
            f"no catalog model fits this machine ({c.facts.description}; "
            f"{_gib(host.budget)} GiB of RAM usable):",
            *(f"  {r.candidate}: {r.reason}" for r in rejected[-5:]),
            "free memory, lower limits.context, or allow a smaller model in models.allowed",
        ]
    )


def _to_plan(
    c: _Ctx, fit: _Fit, rejected: list[Rejection], notes: list[str], warnings: list[str]
) -> Plan:
    cand, layout = fit.cand, fit.layout
    n_threads, n_threads_batch = _threads(c, fit)
    draft_ngl, draft_device, draft_tps = 0, None, None
    if cand.draft is not None and layout.draft_device is not None:
        on_gpu = layout.draft_device != c.host
        draft_ngl = cand.draft.n_layer + 1 if on_gpu else 0
        draft_device = c.devices[layout.draft_device].name
        split = one_hot(c.n_gpus, layout.draft_device) if on_gpu else ()
        draft_tps = 1 / token_seconds(
            cand.draft,
            draft_ngl,
            split,
            c.devices,
            type_kv=layout.type_kv,
            kv_tokens=_kv_tokens(layout),
        )
    target_tps = 1 / token_seconds(
        cand.target,
        layout.target_ngl,
        layout.split,
        c.devices,
        type_kv=layout.type_kv,
        kv_tokens=_kv_tokens(layout),
    )
    return Plan(
        hardware=f"{c.facts.name}: {c.facts.description}",
        pair_id=cand.pair_id,
        target=(cand.target.model_id, cand.target.quant),
        draft=(cand.draft.model_id, cand.draft.quant) if cand.draft else None,
        target_ngl=layout.target_ngl,
        draft_ngl=draft_ngl,
        target_layers=cand.target.n_layer + 1,
        n_ctx=layout.n_ctx,
        n_slots=layout.n_slots,
        type_k=layout.type_kv,
        type_v=layout.type_kv,
        n_batch=max(layout.n_ubatch, layout.n_slots),
        n_ubatch=layout.n_ubatch,
        # The memory model assumes flash attention (no n_ctx x n_ubatch score matrix), and a
        # quantized V cache requires it; every llama.cpp backend localspec targets has it.
        flash_attn=True,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        tensor_split=layout.split if c.n_gpus > 1 else None,
        draft_device=draft_device,
        draft_gpu=layout.draft_device if draft_ngl else None,
        memory=fit.rows,
        rejected=tuple(rejected),
        decode_ceiling_tps=(target_tps, draft_tps),
        expected_tps=1 / fit.target_s,
        expected_spec_speedup=fit.speedup,
        best_draft_len=fit.best_gamma,
        fits_wholly=fit.whole,
        capacity=fit.capacity,
        notes=tuple(notes),
        warnings=tuple(warnings),
        target_source=cand.target.source,
        speculative=c.settings.speculative,
        cache_reuse=c.settings.cache_reuse,
    )


def smaller(plan: Plan) -> Plan | None:
    """The next, more frugal plan when llama.cpp still runs out of memory loading ``plan``
    (a driver or another process took more than the probe saw): first halve the context
    (not below 4096), then move a quarter of the GPU layers back to the CPU. None: nothing
    left to give up. The memory table is the original estimate; the note says what changed.
    """
    if plan.n_ctx > 4096:
        n_ctx = max(4096, padded_ctx(plan.n_ctx // 2))
        note = f"loading ran out of memory: context {plan.n_ctx} -> {n_ctx} tokens"
        return replace(plan, n_ctx=n_ctx, notes=(*plan.notes, note))
    if plan.target_ngl > 0:
        ngl = plan.target_ngl - max(1, plan.target_layers // 4)
        ngl = max(0, ngl)
        note = f"loading ran out of memory: GPU layers {plan.target_ngl} -> {ngl}"
        return replace(plan, target_ngl=ngl, fits_wholly=False, notes=(*plan.notes, note))
    return None


# ---------------------------------------------------------------------------- GGUF reader (I/O)

_BLOCK = re.compile(r"^blk\.(\d+)\.")

GGML_TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54),
    35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}  # fmt: skip
"""ggml type id -> (values per block, bytes per block), as in ggml.c's type traits."""

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 12: "Q3_K_M", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 30: "IQ4_XS", 32: "BF16"}  # fmt: skip


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF's metadata (arrays as their lengths) and tensor table: (name, type, elements)."""

    metadata: dict[str, Any]
    tensors: tuple[tuple[str, int, int], ...]

    def tensor_bytes(self, name: str, ggml_type: int, n_elements: int) -> int:
        block, size = GGML_TYPE_SIZES.get(ggml_type, (1, 0))
        if size == 0:
            raise PlanError(f"tensor {name}: unknown ggml type {ggml_type}")
        return n_elements // block * size


def read_gguf_header(path: str | PathLike[str]) -> GgufHeader:
    """Read only what planning needs from a GGUF: arrays (the 150k-token vocabulary) are
    skipped, not decoded, so this takes milliseconds where gguf.GGUFReader takes seconds."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise PlanError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise PlanError(f"{path}: GGUF version {version} is too old")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def value(vtype: int, at: int) -> tuple[Any, int]:
            if vtype == 8:
                return string(at)
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if etype == 8:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, at)
                        at += 8 + n
                elif etype in _SCALARS:
                    at += count * struct.calcsize(_SCALARS[etype])
                else:
                    for _ in range(count):
                        _, at = value(etype, at)
                return count, at
            fmt = "<" + _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = value(vtype, pos + 4)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, ggml_type, math.prod(dims)))
    return GgufHeader(metadata, tuple(tensors))


def model_facts_from_gguf(
    path: str | PathLike[str],
    *,
    model_id: str | None = None,
    quant: str | None = None,
    params_b: float | None = None,
    active_params_b: float | None = None,
) -> ModelFacts:
    """Exact per-layer sizes from a GGUF's tensor table (the planner's ``measured`` input)."""
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise PlanError(f"{path}: GGUF metadata lacks general.architecture")

    def num(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise PlanError(f"{path}: GGUF metadata lacks {arch}.{key}")
            return default
        return int(value)

    layers: dict[int, int] = {}
    embd = output = other = n_params = 0
    has_output = False
    for name, ggml_type, n_elements in header.tensors:
        n_bytes = header.tensor_bytes(name, ggml_type, n_elements)
        n_params += n_elements
        match = _BLOCK.match(name)
        if match:
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + n_bytes
        elif name == "token_embd.weight":
            embd = n_bytes
        elif name.startswith("output"):
            output += n_bytes
            has_output = has_output or name == "output.weight"
        else:
            other += n_bytes
    n_layer = num("block_count")
    n_embd = num("embedding_length")
    n_head = num("attention.head_count")
    tied = not has_output
    ftype = meta.get("general.file_type")
    return ModelFacts(
        model_id=model_id or str(meta.get("general.name") or path),
        quant=quant or _FILE_TYPES.get(int(ftype) if ftype is not None else -1, "unknown"),
        params_b=params_b or n_params / 1e9,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),
        head_dim=num("attention.key_length", n_embd // n_head),
        n_vocab=num("vocab_size", int(meta.get("tokenizer.ggml.tokens", 0))),
        n_ctx_train=num("context_length"),
        n_ff=num("feed_forward_length", int(n_embd * 5.4)),
        layer_bytes=tuple(layers.get(i, 0) for i in range(n_layer)),
        # tied: the output layer is a copy of token_embd (plus output_norm) on its device
        output_bytes=output + (embd if tied else 0) + other,
        embd_bytes=embd,
        tied_embeddings=tied,
        active_fraction=min(1.0, active_params_b / params_b)
        if active_params_b and params_b
        else 1.0,
        source=f"GGUF tensor table ({path})",
        file_path=str(path),
    )


def measured_models(
    catalog: Any, locate: Callable[[str, str], str | PathLike[str] | None]
) -> dict[tuple[str, str], ModelFacts]:
    """Tensor-table facts for every catalog quant already on disk, for PlanSettings.measured.

    ``locate(model_id, quant)`` returns the local GGUF (e.g. via localspec.fetch.find_local)
    or None. Split GGUFs keep their catalog estimate: one shard's table is not the model's.
    """
    out: dict[tuple[str, str], ModelFacts] = {}
    for entry in catalog.models.values():
        for quant, q in entry.quants.items():
            path = locate(entry.id, quant) if len(q.files) == 1 else None
            if path is None:
                continue
            a = entry.arch
            out[(entry.id, quant)] = model_facts_from_gguf(
                path,
                model_id=entry.id,
                quant=quant,
                params_b=entry.params_b,
                active_params_b=getattr(a, "active_params_b", None),
            )
    return out


__all__ = [
    "Candidate",
    "DeviceMemory",
    "ModelFacts",
    "Plan",
    "PlanError",
    "PlanSettings",
    "Rejection",
    "candidates_from_catalog",
    "estimate_model_facts",
    "facts_from_catalog_entry",
    "make_plan",
    "measured_models",
    "memory_table",
    "model_facts_from_gguf",
    "plan_settings_from",
    "render_plan",
    "smaller",
    "speculative_speedup",
]
