"""Shared by the KV tests: settings, contexts and code tokens for the tiny Qwen model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localspec.bench.corpus import code_prompts
from localspec.engine import ModelSettings
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.vocab import Vocab

N_CTX = 1024


def ms(path: Path, *, flash_attn: bool = False) -> ModelSettings:
    return ModelSettings(
        str(path), n_ctx=N_CTX, n_batch=256, n_ubatch=256, n_threads=2, flash_attn=flash_attn
    )


def new_ctx(model: Model, *, flash_attn: bool = False, n_seq: int = 2) -> Context:
    """A slot and the scratch sequence that parks moved runs (n_seq 3: and the sequence that
    evaluates blocks)."""
    settings = ms(Path(model.path), flash_attn=flash_attn)
    return Context(model, settings, n_seq=n_seq, n_ctx_total=N_CTX, clock=Clock())


def code_tokens(model: Model, n: int) -> list[int]:
    out = Vocab(model.vocab_handle).tokenize("".join(code_prompts(12, lines=30)))
    assert len(out) >= n
    return out[:n]


def model_fixture() -> Callable[..., Iterator[Model]]:
    """A module's ``model`` fixture: the tiny Qwen target, loaded once per module."""

    @pytest.fixture(scope="module", name="model")
    def _model(qwen_target: Path) -> Iterator[Model]:
        m = Model(ms(qwen_target))
        yield m
        m.close()

    return _model


def tokens_fixture(n: int) -> Callable[..., list[int]]:
    """A module's ``toks`` fixture: ``n`` tokens of real code."""

    @pytest.fixture(scope="module", name="toks")
    def _toks(model: Model) -> list[int]:
        return code_tokens(model, n)

    return _toks
