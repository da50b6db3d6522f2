"""Qwen2.5-Coder-shaped GGUFs with random Q8_0 weights, written at disk speed (gpu_check.py).

The test fixtures' writer draws every weight from a normal distribution and quantizes it in
numpy: about a minute per billion weights, so a 7B target alone would spend most of a 10-minute
GPU check. Here each shape's Q8_0 blocks are drawn once into a pool (random int8 quants, one
scale per pool) and every matrix is a slice of a pool: the same bytes a quantizer would write
for weights of that spread, no copy, at the speed the file is written. The metadata and Qwen's
real vocabulary (FIM tokens included) come from the fixtures' writer, so a model tokenizes as
Qwen2.5-Coder does.

With ``follow_miss`` the model is a *follow* model (tests/fixtures/models.py): its output rows
hold the embeddings permuted by ``follow_next`` and its layers are scaled down to a nudge, so
its greedy choice after token t is ``follow_next(t, follow_miss)``. A draft with follow_miss n
then agrees with a follow_miss 0 target on about n - 1 tokens in n: speculation's gain at a
known acceptance, on the real shapes' costs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDER_VERSION = 2  # bump when the bytes written change (the cached file's name holds it)
QK8_0 = 32
Q_RMS = 73.3  # the root mean square of int8 quants drawn uniformly from -127..127


@dataclass(frozen=True)
class QwenShape:
    """A Qwen2.5-Coder model's shape (models/qwen2.5-coder.toml; n_ff from the models'
    config.json: intermediate_size)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool


SHAPES = {
    "0.5b": QwenShape(24, 896, 14, 2, 4864, 151936, True),
    "1.5b": QwenShape(28, 1536, 12, 2, 8960, 151936, True),
    "3b": QwenShape(36, 2048, 16, 2, 11008, 151936, True),
    "7b": QwenShape(28, 3584, 28, 4, 18944, 152064, False),
}


def scaled(shape: QwenShape, scale: int) -> QwenShape:
    """The shape with 1/scale of the heads, width and layers (head size and vocabulary kept):
    the same writer at a size a test can load in seconds."""
    if scale == 1:
        return shape
    head_dim = shape.n_embd // shape.n_head
    n_head = max(1, shape.n_head // scale)
    return QwenShape(
        n_layer=max(1, shape.n_layer // scale),
        n_embd=n_head * head_dim,
        n_head=n_head,
        n_head_kv=max(1, min(n_head, shape.n_head_kv // scale or 1)),
        n_ff=max(QK8_0, shape.n_ff // scale // QK8_0 * QK8_0),  # Q8_0 rows are blocks of 32
        n_vocab=shape.n_vocab,
        tied=shape.tied,
    )


class _Pools:
    """Q8_0 blocks drawn once per (row length, spread); matrices are slices of them."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        self.block = np.dtype([("d", "<f2"), ("qs", "i1", (QK8_0,))])
        self.pools: dict[tuple[int, float], object] = {}

    def reserve(self, cols: int, std: float, n_values: int) -> None:
        """Make the (cols, std) pool hold at least ``n_values`` weights (call before take)."""
        key = (cols, std)
        have = self.pools.get(key)
        n_blocks = n_values // QK8_0
        if have is not None and len(have) >= n_blocks:  # type: ignore[arg-type]
            return
        pool = self.np.empty(n_blocks, dtype=self.block)
        pool["d"] = std / Q_RMS
        pool["qs"] = self.rng.integers(-127, 128, size=(n_blocks, QK8_0), dtype=self.np.int8)
        self.pools[key] = pool

    def blocks(self, rows: int, cols: int, std: float):
        """A (rows, cols / 32) view of Q8_0 blocks: weights of spread ``std``."""
        pool = self.pools[(cols, std)]
        need = rows * cols // QK8_0
        start = int(self.rng.integers(0, len(pool) - need + 1))  # type: ignore[arg-type]
        return pool[start : start + need].reshape(rows, cols // QK8_0)  # type: ignore[index]

    def raw(self, blocks) -> object:
        """The bytes GGUFWriter stores for a Q8_0 tensor: (rows, cols / 32 * 34) uint8."""
        return blocks.view(self.np.uint8).reshape(blocks.shape[0], -1)


def write_q8_model(path: Path, shape: QwenShape, *, seed: int, follow_miss: int | None) -> None:
    """Write the GGUF (see the module's docstring)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import gguf
    import numpy as np

    from tests.fixtures.models import (
        FOLLOW_MIX,
        QWEN_NORMAL,
        QwenSpec,
        _finish,
        _qwen_writer,
        follow_next,
    )

    spec = QwenSpec(
        n_vocab=shape.n_vocab,
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        n_head_kv=shape.n_head_kv,
        n_ff=shape.n_ff,
        seed=seed,
        dtype="q8_0",
        tied=shape.tied,
    )
    follow = follow_miss is not None
    w = _qwen_writer(path, spec, f"localspec-gpucheck-qwen-{shape.n_layer}x{shape.n_embd}")
    q8 = gguf.GGMLQuantizationType.Q8_0
    pools = _Pools(seed)
    e, ff = shape.n_embd, shape.n_ff
    head_dim = e // shape.n_head
    q_dim, kv_dim = shape.n_head * head_dim, shape.n_head_kv * head_dim
    mix = FOLLOW_MIX if follow else 1.0
    # embeddings of norm about sqrt(n_embd) (what RMSNorm makes of a hidden state), matrices
    # with the 1/sqrt(fan-in) spread of the fixtures' writer
    pools.reserve(e, 1.0, shape.n_vocab * e)
    pools.reserve(e, 1.0 / e**0.5, max(ff, q_dim, shape.n_vocab if not shape.tied else 0) * e)
    pools.reserve(q_dim, mix / q_dim**0.5, e * q_dim)
    pools.reserve(ff, mix / ff**0.5, e * ff)
    rng = pools.rng

    def store(name: str, blocks) -> None:
        w.add_tensor(name, pools.raw(blocks), raw_dtype=q8)

    def vector(n: int, centre: float, spread: float) -> np.ndarray:
        return (centre + spread * rng.standard_normal(n)).astype(np.float32)

    embd = pools.blocks(shape.n_vocab, e, 1.0)
    store("token_embd.weight", embd)
    if follow:
        # the output row of follow_next(t) holds t's embedding: the chosen row scores the
        # squared norm, every other a random dot product
        output = np.zeros_like(embd)
        nxt = np.array([follow_next(t, follow_miss or 0) for t in range(shape.n_vocab)])
        # the special tokens lead to ordinary ones too (the rule wraps): written first, so the
        # ordinary token's embedding (the rule is one to one over those) is the one kept
        output[nxt[QWEN_NORMAL:]] = embd[QWEN_NORMAL:]
        output[nxt[:QWEN_NORMAL]] = embd[:QWEN_NORMAL]
        w.add_tensor("output_norm.weight", np.ones(e, np.float32))
        store("output.weight", output)
    else:
        w.add_tensor("output_norm.weight", vector(e, 1.0, 0.1))
        if not shape.tied:
            store("output.weight", pools.blocks(shape.n_vocab, e, 1.0 / e**0.5))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", vector(e, 1.0, 0.1))
        store(p + "attn_q.weight", pools.blocks(q_dim, e, 1.0 / e**0.5))
        w.add_tensor(p + "attn_q.bias", vector(q_dim, 0.0, 0.02))
        store(p + "attn_k.weight", pools.blocks(kv_dim, e, 1.0 / e**0.5))
        w.add_tensor(p + "attn_k.bias", vector(kv_dim, 0.0, 0.02))
        store(p + "attn_v.weight", pools.blocks(kv_dim, e, 1.0 / e**0.5))
        w.add_tensor(p + "attn_v.bias", vector(kv_dim, 0.0, 0.02))
        store(p + "attn_output.weight", pools.blocks(e, q_dim, mix / q_dim**0.5))
        w.add_tensor(p + "ffn_norm.weight", vector(e, 1.0, 0.1))
        store(p + "ffn_gate.weight", pools.blocks(ff, e, 1.0 / e**0.5))
        store(p + "ffn_up.weight", pools.blocks(ff, e, 1.0 / e**0.5))
        store(p + "ffn_down.weight", pools.blocks(e, ff, mix / ff**0.5))
    _finish(w)


def build_model(
    size: str, out_dir: Path, *, seed: int = 0, scale: int = 1, follow_miss: int | None = None
) -> Path:
    """The Q8_0 GGUF of ``size`` (at 1/scale), written once into ``out_dir``."""
    shape = scaled(SHAPES[size], scale)
    kind = "random" if follow_miss is None else f"follow{follow_miss}"
    name = f"qwen2.5-coder-{size}-shape-{shape.n_layer}x{shape.n_embd}-{kind}-s{seed}"
    path = out_dir / f"{name}-q8_0-v{BUILDER_VERSION}.gguf"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        write_q8_model(tmp, shape, seed=seed, follow_miss=follow_miss)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
