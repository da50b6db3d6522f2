"""The fixture models are what every engine and server test stands on: prove they are sound."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import pytest

from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    ModelSettings,
    SamplingParams,
)
from tests.fixtures.models import QWEN_FIM_IDS, SMOLLM_FIM_TOKENS


def _load(path: Path, **kwargs: object) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, verbose=False, **kwargs)


def _engine(path: Path) -> Engine:
    """A fixture loaded as the engine loads a model (llama_cpp.Llama's defaults put quantized
    weights in AMX buffers, which crash on some Intel CPUs: see engine.llama)."""
    settings = ModelSettings(str(path), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2)
    return Engine.load(EngineSettings(target=settings))


def _fim_ids(llm: llama_cpp.Llama) -> dict[str, int]:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {
        "pre": llama_cpp.llama_vocab_fim_pre(vocab),
        "suf": llama_cpp.llama_vocab_fim_suf(vocab),
        "mid": llama_cpp.llama_vocab_fim_mid(vocab),
        "pad": llama_cpp.llama_vocab_fim_pad(vocab),
        "rep": llama_cpp.llama_vocab_fim_rep(vocab),
        "sep": llama_cpp.llama_vocab_fim_sep(vocab),
    }


@pytest.mark.parametrize(
    "name",
    [
        "qwen_target",
        "qwen_draft",
        "qwen_target_f16",
        "qwen_target_152064",
        "qwen3_target",
        "smollm_q4",
        "smollm_f16",
        "smollm_fim_q4",
    ],
)
def test_fixture_loads_and_generates(name: str, request: pytest.FixtureRequest) -> None:
    with _engine(request.getfixturevalue(name)) as eng:
        tokens = eng.vocab.tokenize("def add(a, b):\n    return")
        assert len(tokens) > 2, "tokenizer produced nothing"
        res = eng.generate(GenerationRequest(slot=0, prompt=tokens, n_predict=4))
        assert res.n_evaluated == len(tokens) and len(res.tokens) >= 1


def test_qwen_vocab_sizes(qwen_target: Path, qwen_target_152064: Path) -> None:
    assert _load(qwen_target, vocab_only=True).n_vocab() == 151936
    assert _load(qwen_target_152064, vocab_only=True).n_vocab() == 152064


@pytest.mark.parametrize("name", ["qwen_target", "qwen_target_152064"])
def test_qwen_fim_tokens_resolve_to_real_ids(name: str, request: pytest.FixtureRequest) -> None:
    llm = _load(request.getfixturevalue(name), vocab_only=True)
    assert _fim_ids(llm) == QWEN_FIM_IDS
    assert llm.token_eos() == 151643


def test_literal_fim_text_stays_text(qwen_target: Path) -> None:
    llm = _load(qwen_target, vocab_only=True)
    code = b"s = '<|fim_prefix|>'"
    as_text = llm.tokenize(code, add_bos=False, special=False)
    assert QWEN_FIM_IDS["pre"] not in as_text
    assert llm.detokenize(as_text) == code
    # The same text with special parsing on IS the control token: the distinction matters.
    assert QWEN_FIM_IDS["pre"] in llm.tokenize(code, add_bos=False, special=True)


def test_qwen_tokenizes_like_qwen(qwen_target: Path) -> None:
    """Spot-check the real BPE: these ids are Qwen2.5's for this text."""
    llm = _load(qwen_target, vocab_only=True)
    assert llm.tokenize(b"Hello world", add_bos=False) == [9707, 1879]


def test_smollm_fim_variant_has_fim_ids(smollm_fim_q4: Path, smollm_q4: Path) -> None:
    fim = _load(smollm_fim_q4, vocab_only=True)
    ids = _fim_ids(fim)
    for role, text in SMOLLM_FIM_TOKENS.items():
        piece = ctypes.create_string_buffer(64)
        vocab = llama_cpp.llama_model_get_vocab(fim.model)
        n = llama_cpp.llama_token_to_piece(vocab, ids[role], piece, 64, 0, True)
        assert piece.raw[:n].decode() == text, role
    # The shipped file has no FIM prefix token: /infill on it must be refused (501).
    assert _fim_ids(_load(smollm_q4, vocab_only=True))["pre"] == -1


PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "The capital of France is",
    "# Read a file and print each line\n",
]


def _greedy(eng: Engine, prompt: str) -> list[int]:
    req = GenerationRequest(
        slot=0, prompt=eng.vocab.tokenize(prompt), n_predict=12, sampling=SamplingParams(top_k=1)
    )
    return eng.generate(req).tokens


def test_dequantized_smollm_matches_original_mostly(smollm_q4: Path, smollm_f16: Path) -> None:
    with _engine(smollm_q4) as original, _engine(smollm_f16) as derived:
        same = sum(_greedy(original, p) == _greedy(derived, p) for p in PROMPTS)
    # Q4_1 -> F16 is lossless on the stored values, so most greedy texts agree; a few may
    # differ where kernels round differently at near-ties.
    assert same >= len(PROMPTS) // 2, f"only {same}/{len(PROMPTS)} prompts agree"
