"""A budget answer's engine side: a short prompt evaluated apart from its slot, and the slot's
full prompt filling behind it (``Task.apart``, ``Task.behind``; server/jump.py decides when).

Real llama.cpp on the fixture pair: the answer made apart equals the answer of the same short
prompt evaluated cold on the slot, the slot's KV is untouched by it, the fill evaluates nothing
while the answer runs, and the next request on the slot finds the filled context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec.engine import (
    Engine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    Task,
)
from localspec.engine.scheduler import BEHIND_CHUNK
from localspec.engine.types import PromptLayout
from tests.test_engine_batch import each_batch, hybrid_pair, prompts

GREEDY = SamplingParams(top_k=1, temperature=0.0)


@pytest.fixture(scope="module")
def engine(qwen_target: Path, qwen_draft: Path) -> Iterator[Engine]:
    with hybrid_pair(qwen_target, qwen_draft, n_slots=1, prefill_chunk=128) as eng:
        yield eng


def req(prompt: list[int], n_predict: int = 12, **kw: object) -> GenerationRequest:
    return GenerationRequest(slot=0, prompt=prompt, n_predict=n_predict, sampling=GREEDY, **kw)


def run(engine: Engine, *tasks: Task) -> None:
    for task in tasks:
        engine.submit(task)
    while not all(t.done for t in tasks):
        engine.step()
    for t in tasks:
        assert t.error is None, t.error


def test_an_answer_apart_leaves_the_slot_alone_and_equals_a_cold_answer(engine: Engine) -> None:
    full, short = prompts(engine, 2, lines=12)
    engine.clear_slot(0)
    engine.generate(req(full, 0))
    held = engine.slot_tokens(0)
    assert held == full
    spare = engine.spare_sequences
    answer = Task([req(short)], apart=True)
    run(engine, answer)
    assert engine.slot_tokens(0) == held  # the slot's KV and what it reports: untouched
    assert engine.slots[0].tokens == held
    assert engine.spare_sequences == spare  # its sequence is free again
    engine.clear_slot(0)
    cold = engine.generate(req(short))
    assert answer.results[0].tokens == cold.tokens
    assert answer.results[0].n_evaluated == len(short)


def test_the_fill_behind_yields_to_the_answers_prompt_and_the_next_request_reuses_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, full, short = prompts(engine, 3, lines=12)
    engine.clear_slot(0)
    engine.generate(req(old, 0))
    pieces = each_batch(
        engine.pair.tctx, monkeypatch, lambda segs: {s.seq: len(s.tokens) for s in segs}
    )
    answer = Task([req(short)], apart=True)
    fill = Task([req(full, 0)], behind=True)
    run(engine, answer, fill)
    # the answer's prompt (one piece) is evaluated in a step of its own: within its budget
    slot_seq = engine.slots[0].target.seq
    prompt_steps = [b for b in pieces if len(short) in (n for q, n in b.items() if q != slot_seq)]
    assert prompt_steps and all(slot_seq not in b for b in prompt_steps)
    # without flash attention the fill's pieces are small: a newer request waits for one, and
    # a decoding step of the answer that carries one grows by little
    assert not engine.flash_attn
    filled = [n for batch in pieces for seq, n in batch.items() if seq == slot_seq]
    assert filled and max(filled) <= BEHIND_CHUNK < 128
    # ... and it rides along the answer's decoding steps (answers aborted keystroke after
    # keystroke would otherwise starve it)
    assert any(slot_seq in b and len(b) > 1 for b in pieces)
    assert engine.slot_tokens(0) == full
    fill_result: GenerationResult = fill.results[0]
    assert fill_result.n_evaluated + fill_result.n_cached == len(full)
    # the next keystroke at that place: the full prompt and a typed token
    nxt = engine.generate(req([*full, full[-1]], 4))
    assert nxt.n_cached >= len(full) - 1
    assert nxt.n_evaluated <= 2


def test_extra_completions_of_an_answer_apart_share_its_sequence(engine: Engine) -> None:
    full, short = prompts(engine, 2, lines=10)
    engine.clear_slot(0)
    engine.generate(req(full, 0))
    answer = Task([req(short, 8), req(short, 8)], apart=True)
    run(engine, answer)
    assert engine.slot_tokens(0) == full
    a, b = answer.results
    assert a.tokens == b.tokens  # greedy both: the same answer
    assert b.n_cached == len(short)  # the extra one shared the prompt's KV


def test_an_answer_apart_asks_no_more_sequences_than_there_are(engine: Engine) -> None:
    n = engine.max_completions  # spare sequences + the slot's
    with pytest.raises(ValueError, match="apart from its slot"):
        engine.submit(Task([req([1, 2, 3])] * n, apart=True))


def test_prompt_cost_counts_what_the_slot_does_not_hold(engine: Engine) -> None:
    full, other = prompts(engine, 2, lines=10)
    engine.clear_slot(0)
    engine.generate(req(full, 0))
    n_same, price = engine.prompt_cost(0, PromptLayout([*full, 7]))
    assert n_same == 1
    assert price > 0  # measured by the pieces evaluated
    n_other, _ = engine.prompt_cost(0, PromptLayout(other))
    assert n_other >= len(other) - 8
