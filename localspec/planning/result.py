"""The Plan: the chosen configuration with its arithmetic, and the more frugal plan to fall
back to when loading still runs out of memory. Plain values: ``localspec.settings_to``
turns a Plan into what the engine loads (the planner sits below the engine)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from localspec.planning.inputs import Speculation
from localspec.planning.memory import padded_ctx
from localspec.planning.types import DeviceMemory

ChatMode = Literal["shared", "separate", "off"]


@dataclass(frozen=True)
class ChatPlan:
    """Which pair answers chat, and why; ``plan`` is the second pair's, when one loads."""

    mode: ChatMode
    reason: str
    plan: Plan | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "reason": self.reason,
            "plan": None if self.plan is None else self.plan.to_json(),
        }


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
    step_measured: bool = False  # step times measured on this machine (else the bandwidth model)


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
    speculative: Speculation = field(default_factory=Speculation)
    cache_reuse: int = 256
    cache_exact_ms: float = 100.0
    chat: ChatPlan | None = None  # who answers chat (planning/chat.py); None: not decided
    backends: tuple[str, ...] = ()  # the llama.cpp build's backends (its registry: Vulkan, CPU)
    llama_devices: tuple[str, ...] = ()  # the devices it offloads to, "Vulkan0: llvmpipe (...)"
    build_choice: str = ""  # the launcher's backend choice ("" unknown), and why it fell back
    build_fallback: str = ""

    @property
    def concurrent_sessions(self) -> int:
        return self.capacity.sessions_held if self.capacity else self.n_slots

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, chat=None))
        data["memory"] = [r.to_json() for r in self.memory]
        data["concurrent_sessions"] = self.concurrent_sessions
        data["chat"] = None if self.chat is None else self.chat.to_json()
        return data


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
