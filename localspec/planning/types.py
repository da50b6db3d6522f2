"""The planner's shared data: model facts, candidates, devices, layouts and memory rows."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

# llama.cpp's limit on sequence ids in one context (LLAMA_MAX_SEQ)
MAX_SEQ = 256
# the engine's slot limit: a slot takes three sequence ids (its cache, the runs a reuse plan
# parks, its ring blocks)
MAX_SLOTS = 85
# KV cells an extra completion's sequence holds beyond the shared prompt (it generates at
# most this many tokens)
AUX_ROOM = 256


def aux_sequences(n_slots: int, asked: int | None = None) -> int:
    """Sequences for requests' extra completions (``n_cmpl`` > 1, decoding at once): two per
    slot unless ``asked`` (llama-vscode asks for three completions), within the sequence ids
    the slots leave."""
    n = asked if asked is not None else 2 * n_slots
    return max(0, min(n, MAX_SEQ - 3 * n_slots))


def context_cells(n_ctx: int, n_slots: int, n_aux: int, aux_room: int = AUX_ROOM) -> int:
    """KV cells of one model's context (target or draft, each the same shape): every slot's
    ``n_ctx`` and every extra completion's room."""
    return n_ctx * n_slots + n_aux * aux_room


UNQUANTIZED_KV = frozenset({"f16", "f32", "bf16"})


def default_flash_attn(on_gpu: bool, type_k: str, type_v: str, n_slots: int = 1) -> bool:
    """Whether llama.cpp's flash attention is on, the engine's and the plan's one rule.

    On GPUs; for a quantized KV cache (llama.cpp needs it for a quantized V); and for several
    slots: they share one KV buffer, and without it every token computes a score for every
    cell below the highest used one, every slot's, masked or not, where its CPU kernel skips
    masked cells. One slot on the CPU: off, because llama.cpp's KQ matmul verifies a draft deep
    in the context much faster and decodes faster (bench/results/replay/history-12-*.json,
    bench/results/speculative/history-31-*.json), for an n_kv x n_ubatch score matrix in the
    compute buffer that the planner counts."""
    quantized = type_k not in UNQUANTIZED_KV or type_v not in UNQUANTIZED_KV
    return on_gpu or quantized or n_slots > 1


KV_TYPE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
"""Bytes per cached K or V element (q8_0/q4_0 store 32 values plus an f16 scale)."""


class PlanError(ValueError):
    """No candidate can run on this machine (the message says why and what to change)."""


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
    def draft_label(self) -> str:
        return f" + {self.draft.label}" if self.draft else " (n-gram drafting)"

    @property
    def label(self) -> str:
        return self.target.label + self.draft_label


@dataclass(frozen=True)
class Device:
    """A place weights can live: a GPU or host RAM (the last device is always the host)."""

    name: str
    kind: Literal["gpu", "unified", "host"]
    available: int
    margin: int
    bandwidth_gbps: float
    tflops: float
    max_tensor_bytes: int | None = None  # an op with a larger tensor runs on the host

    @property
    def budget(self) -> int:
        return max(0, self.available - self.margin)


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
    flash_attn: bool = True  # off: llama.cpp's KQ matmul, with an n_kv x n_ubatch score matrix


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


@dataclass(frozen=True)
class StepCosts:
    """One model's decode step time by the tokens in it (one per busy slot), measured on a
    machine by ``localspec bench steps``; the capacity arithmetic uses it instead of the
    bandwidth model when it was measured for the candidate the plan weighs."""

    ms_by_tokens: Mapping[int, float]
    kv_tokens: int  # each sequence's context while it was measured
    source: str  # what measured it, where and when (shown in the plan)

    def step_ms(self, n_tokens: int) -> float:
        """Interpolated between the measured sizes; beyond them, along the last two."""
        points = sorted(self.ms_by_tokens.items())
        if not points:
            raise ValueError("no measured step sizes")
        first, t_first = points[0]
        if n_tokens <= first:
            return t_first
        if len(points) == 1:  # one size measured: grow in proportion (an upper bound)
            return t_first * n_tokens / first
        for (a, ta), (b, tb) in itertools.pairwise(points):
            if n_tokens <= b:
                return ta + (tb - ta) * (n_tokens - a) / (b - a)
        (a, ta), (b, tb) = points[-2], points[-1]
        return tb + (tb - ta) / (b - a) * (n_tokens - b)
