"""Speed estimates: the bandwidth-bound decode ceiling, prompt time, the speculative speedup,
and the queueing arithmetic of concurrent sessions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from localspec.planning.memory import draft_offload, layer_homes
from localspec.planning.types import Device, Layout, ModelFacts

BANDWIDTH_EFFICIENCY = 0.75  # llama.cpp reaches ~70-82 % of memory bandwidth when decoding
COMPUTE_EFFICIENCY = 0.35  # share of peak tensor throughput quantized matmuls reach
FIM_KV_TOKENS = 2048  # context read per generated token in the estimates: a FIM prompt's worth


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
    homes = layer_homes(m.n_layer, ngl, split, n_devices)
    for il in range(m.n_layer):
        reads[homes[il]] += m.layer_bytes[il] * m.active_fraction + kv_per_token * kv_tokens
    reads[homes[m.n_layer]] += m.output_bytes
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


def target_seconds(
    m: ModelFacts,
    layout: Layout,
    devices: Sequence[Device],
    *,
    kv_tokens: int | None = None,
    batch: int = 1,
    efficiency: float = 1.0,
) -> float:
    """``token_seconds`` of the target as ``layout`` places it (default: a FIM context)."""
    return token_seconds(
        m,
        layout.target_ngl,
        layout.split,
        devices,
        type_kv=layout.type_kv,
        kv_tokens=min(layout.n_ctx, FIM_KV_TOKENS) if kv_tokens is None else kv_tokens,
        batch=batch,
        efficiency=efficiency,
    )


def draft_seconds(draft: ModelFacts, layout: Layout, devices: Sequence[Device]) -> float:
    """``token_seconds`` of the draft, whole on ``layout.draft_device``, bandwidth bound."""
    assert layout.draft_device is not None
    ngl, split = draft_offload(draft, layout.draft_device, len(devices) - 1)
    return token_seconds(
        draft,
        ngl,
        split,
        devices,
        type_kv=layout.type_kv,
        kv_tokens=min(layout.n_ctx, FIM_KV_TOKENS),
    )


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
