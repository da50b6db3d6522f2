"""ModelFacts from the two sources: catalog estimates (file size, architecture) and the exact
tensor table of a GGUF already on disk."""

from __future__ import annotations

import re
from collections.abc import Callable
from os import PathLike
from typing import Any

from localspec.planning.gguf_header import FILE_TYPES, read_gguf_header
from localspec.planning.types import ModelFacts, PlanError

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

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def quant_bits(quant: str) -> float:
    return QUANT_BITS.get(quant.upper(), 0.0)


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
        quant=quant or FILE_TYPES.get(int(ftype) if ftype is not None else -1, "unknown"),
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
            out[(entry.id, quant)] = model_facts_from_gguf(
                path,
                model_id=entry.id,
                quant=quant,
                params_b=entry.params_b,
                active_params_b=getattr(entry.arch, "active_params_b", None),
            )
    return out
