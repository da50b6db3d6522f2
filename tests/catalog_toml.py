"""Catalog TOML pieces the catalog, fetch and CLI tests share."""

from __future__ import annotations


def tiny_arch(model_id: str, *, n_vocab: int = 151936, tied: bool = True) -> str:
    """The ``[models.<id>.arch]`` table of a tiny qwen2 model (the fixture models' shape)."""
    return (
        f"[models.{model_id}.arch]\n"
        "n_layer = 2\nn_embd = 64\nn_head = 4\nn_head_kv = 2\nhead_dim = 16\n"
        f"n_vocab = {n_vocab}\nn_ctx_train = 4096\ntied_embeddings = {str(tied).lower()}\n"
    )
