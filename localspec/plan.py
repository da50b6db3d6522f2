"""The fit planner: which pair, which quant, how many GPU layers, what context, how many slots.

``make_plan(catalog, facts, settings)`` is a pure function: the catalog (or GGUF tensor tables
the caller has already read), the hardware facts and the settings go in, a ``Plan`` with the
arithmetic that justifies it comes out. The one reader of the disk is
``model_facts_from_gguf``, which callers use to give the planner exact per-layer sizes.

This module is the public face; the work lives in ``localspec.planning`` (see
docs/planning.md for the module map).
"""

from __future__ import annotations

from localspec.planning.candidates import candidate_order, candidates_from_catalog
from localspec.planning.facts import (
    QUANT_BITS,
    estimate_model_facts,
    facts_from_catalog_entry,
    measured_models,
    model_facts_from_gguf,
)
from localspec.planning.gguf_header import GGML_TYPE_SIZES, GgufHeader, read_gguf_header
from localspec.planning.inputs import PlanSettings, Speculation
from localspec.planning.memory import (
    CTX_STEP,
    GPU_MARGIN,
    HOST_MARGIN,
    compute_bytes,
    devices_for,
    fits,
    layer_devices,
    memory_table,
    model_usage,
    one_hot,
    output_buffer_bytes,
    padded_ctx,
)
from localspec.planning.render import MAX_REJECTIONS_SHOWN, render_plan
from localspec.planning.result import Capacity, Plan, Rejection, smaller
from localspec.planning.search import DATACENTER_CONTEXT, PERSONAL_CONTEXT, make_plan
from localspec.planning.speed import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    poisson_quantile,
    prompt_seconds,
    sessions_held,
    speculative_speedup,
    token_seconds,
)
from localspec.planning.types import (
    KV_TYPE_BYTES,
    MAX_SLOTS,
    Candidate,
    Device,
    DeviceMemory,
    Layout,
    ModelFacts,
    PlanError,
)

__all__ = [
    "BANDWIDTH_EFFICIENCY",
    "COMPUTE_EFFICIENCY",
    "CTX_STEP",
    "DATACENTER_CONTEXT",
    "GGML_TYPE_SIZES",
    "GPU_MARGIN",
    "HOST_MARGIN",
    "KV_TYPE_BYTES",
    "MAX_REJECTIONS_SHOWN",
    "MAX_SLOTS",
    "PERSONAL_CONTEXT",
    "QUANT_BITS",
    "Candidate",
    "Capacity",
    "Device",
    "DeviceMemory",
    "GgufHeader",
    "Layout",
    "ModelFacts",
    "Plan",
    "PlanError",
    "PlanSettings",
    "Rejection",
    "Speculation",
    "candidate_order",
    "candidates_from_catalog",
    "compute_bytes",
    "devices_for",
    "estimate_model_facts",
    "facts_from_catalog_entry",
    "fits",
    "layer_devices",
    "make_plan",
    "measured_models",
    "memory_table",
    "model_facts_from_gguf",
    "model_usage",
    "one_hot",
    "output_buffer_bytes",
    "padded_ctx",
    "poisson_quantile",
    "prompt_seconds",
    "read_gguf_header",
    "render_plan",
    "sessions_held",
    "smaller",
    "speculative_speedup",
    "token_seconds",
]
