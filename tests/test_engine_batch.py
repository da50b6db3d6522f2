"""Many sequences in one step: a request's completions, and requests on several slots.

Every check of an output is the strict one: each emitted token re-scored with the target
alone, cold (``Scorer``: the target's greedy choice, up to near ties), so a sequence decoded in
a shared batch must answer what the target answers, whatever its neighbours in the batch.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest

from localspec.bench.corpus import code_prompts
from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SpecSettings,
    Task,
)
from localspec.engine import completion as completion_mod
from localspec.engine.llama import Context, Segment
from localspec.engine.stops import StopRules
from tests.fixtures.models import follow_chain
from tests.steer import fixed_costs
from tests.test_engine_exact import Scorer, model_settings

T = TypeVar("T")

GREEDY = SamplingParams(top_k=1, temperature=0.0)


def hybrid_pair(target: Path, draft: Path, *, n_slots: int, prefill_chunk: int) -> Engine:
    """The fixture pair drafting in hybrid mode at any confidence, the draft thread off, so
    what is drafted does not follow timing."""
    s = EngineSettings(
        target=model_settings(target),
        draft=model_settings(draft),
        n_slots=n_slots,
        prefill_chunk=prefill_chunk,
        spec=SpecSettings(mode="hybrid", n_max=4, p_min=0.0, pipeline=False),
    )
    return Engine.load(s)


@pytest.fixture(scope="module")
def engine(qwen_target: Path, qwen_draft: Path) -> Iterator[Engine]:
    with hybrid_pair(qwen_target, qwen_draft, n_slots=2, prefill_chunk=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def scorer(qwen_target: Path) -> Iterator[Scorer]:
    s = Scorer(qwen_target)
    yield s
    s.close()


@pytest.fixture
def batches(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[Segment]]:
    """Every batch the target decodes during the test, as its segments."""
    return each_batch(engine.pair.tctx, monkeypatch, list)


def prompts(engine: Engine, n: int, lines: int = 8) -> list[list[int]]:
    return [engine.vocab.tokenize(text)[-150:] for text in code_prompts(n, lines=lines)]


def exact(scorer: Scorer, prompt: list[int], out: list[int], banned: Collection[int] = ()) -> bool:
    return scorer.check(prompt, out, banned)[0] == 0


# near-uniform draws among the two likeliest tokens: a sampled completion that parts from
# the greedy one within a few tokens, and the same draws whatever the batch's rounding
HOT = SamplingParams(samplers=("top_k", "temperature"), top_k=2, temperature=20.0)


def hot(req: GenerationRequest, seed: int, **changes: int) -> GenerationRequest:
    return replace(req, sampling=replace(HOT, seed=seed), **changes)


def alone(engine: Engine, *reqs: GenerationRequest) -> list[GenerationResult]:
    """The answers of one request from an empty slot 0."""
    engine.clear_slot(0)
    return engine.generate_many(list(reqs))


@contextlib.contextmanager
def follow_draft_engine(
    target: Path, draft: Path, monkeypatch: pytest.MonkeyPatch, *, pipeline: bool = False
) -> Iterator[Engine]:
    """One slot drafting with the follow pair's draft model (its drafts rejected at known
    places), on a machine where a step's tokens cost little, so the drafts are kept whatever
    this CPU, its load or an earlier test measured."""
    fixed_costs(monkeypatch, {1: 10.0, 64: 10.5})
    s = EngineSettings(
        target=model_settings(target),
        draft=model_settings(draft),
        spec=SpecSettings(mode="draft", n_max=4, p_min=0.0, pipeline=pipeline),
        follow_load=False,
    )
    with Engine.load(s) as engine:
        yield engine


def each_batch(
    ctx: Context, monkeypatch: pytest.MonkeyPatch, what: Callable[[Sequence[Segment]], T]
) -> list[T]:
    """``what`` of every batch ``ctx`` decodes during the test, taken before it is decoded."""
    seen: list[T] = []
    decode_many = ctx.decode_many

    def record(segments: Sequence[Segment]) -> list[int]:
        seen.append(what(segments))
        return decode_many(segments)

    monkeypatch.setattr(ctx, "decode_many", record)
    return seen


def batch_sequences(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The sequence ids of every batch ``ctx`` decodes during the test, batch by batch."""
    return each_batch(ctx, monkeypatch, lambda segments: {seg.seq for seg in segments})


def batch_sizes(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every batch ``ctx`` decodes during the test."""
    return each_batch(ctx, monkeypatch, lambda segments: sum(len(seg.tokens) for seg in segments))


def run(engine: Engine, *tasks: Task) -> None:
    for task in tasks:
        engine.submit(task)
    while engine.step():
        pass
    for task in tasks:
        assert task.done and task.error is None, task.error


def test_n_cmpl_evaluates_the_prompt_once_and_agreeing_completions_share_a_sequence(
    engine: Engine, scorer: Scorer, batches: list[list[Segment]]
) -> None:
    """Completions whose draws agree (greedy ones always do) decode as one sequence: the
    others draw from its rows, so the request costs what one completion does."""
    (prompt,) = prompts(engine, 1)
    engine.clear_slot(0)
    reqs = [
        GenerationRequest(slot=0, prompt=prompt, n_predict=12, sampling=GREEDY, spec_n_max=k)
        for k in (4, 0, 2)
    ]
    results = engine.generate_many(reqs)
    assert [r.n_evaluated for r in results] == [len(prompt), 0, 0]
    assert all(r.n_cached == len(prompt) for r in results[1:])
    prompt_rows = sum(len(s.tokens) for b in batches for s in b if s.pos0 < len(prompt))
    assert prompt_rows == len(prompt)  # evaluated once, not once per completion
    assert {s.seq for b in batches for s in b} == {0}  # one sequence decoded for all three
    assert [r.n_followed for r in results] == [0, 11, 11]  # all but the prompt's first draw
    for r in results:
        assert len(r.tokens) == 12 and exact(scorer, prompt, r.tokens)
    # the slot keeps the first completion, as with one; the others' sequences are freed
    assert engine.slot_tokens(0) == prompt + results[0].tokens[:-1]
    for aux in engine.pair.tcache.aux:
        assert aux.tokens == [] and engine.pair.tctx.seq_pos_max(aux.seq) == -1


def test_a_cancel_ends_a_request_whose_completions_share_a_sequence(engine: Engine) -> None:
    (prompt,) = prompts(engine, 1)
    engine.clear_slot(0)
    stop = threading.Event()
    req = GenerationRequest(slot=0, prompt=prompt, n_predict=40, sampling=GREEDY)
    task = Task([req, replace(req), replace(req)], cancel=stop)
    engine.submit(task)
    while not any(c.followers for r in engine.scheduler.running for c in r.completions):
        engine.step()
    engine.step()
    stop.set()
    while engine.step():
        pass
    assert task.error is None and len(task.results) == 3
    assert all(r.cancelled and r.tokens == task.results[0].tokens for r in task.results)
    assert 0 < len(task.results[0].tokens) < 40
    assert engine.slot_tokens(0) == prompt + task.results[0].tokens[:-1]
    for aux in engine.pair.tcache.aux:
        assert aux.tokens == [] and engine.pair.tctx.seq_pos_max(aux.seq) == -1


def test_completions_that_part_decode_in_sequences_of_their_own(
    qwen_follow: Path, qwen_follow_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampled completion follows the first while its draws equal the first's tokens (the
    draft model's drafts verified once for both), gets its own sequence where they part, and
    answers exactly what it answers alone with its seed; a third with the same seed parts the
    same way and follows the second. The follow pair's drafts are rejected at known places and
    the cost model keeps them (fixed costs), so followers draw at several rows per step."""
    n = 24
    with follow_draft_engine(qwen_follow, qwen_follow_draft, monkeypatch) as engine:
        (prompt,) = prompts(engine, 1)
        first = GenerationRequest(slot=0, prompt=prompt, n_predict=n, sampling=GREEDY)

        def sampled(seed: int) -> GenerationRequest:
            return hot(first, seed)

        def tokens(req: GenerationRequest) -> list[int]:
            return alone(engine, req)[0].tokens

        def agreed(a: list[int], b: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), n)

        greedy = tokens(first)
        # a seed whose draws part from the greedy tokens after a few, on this CPU
        seed, own = next(
            (seed, toks)
            for seed, toks in ((sd, tokens(sampled(sd))) for sd in range(1, 500))
            if 3 <= agreed(toks, greedy) <= n - 4
        )
        k = agreed(own, greedy)
        seen: list[set[int]] = []
        decode_many = engine.pair.tctx.decode_many

        def record(segments: Sequence[Segment]) -> list[int]:
            seen.append({s.seq for s in segments if s.pos0 >= len(prompt)})
            return decode_many(segments)

        monkeypatch.setattr(engine.pair.tctx, "decode_many", record)
        engine.clear_slot(0)
        lead, part, twin = engine.generate_many([first, sampled(seed), sampled(seed)])
    assert lead.tokens == greedy and part.tokens == own and twin.tokens == own
    assert any(n_drafted > 0 for _, n_drafted, _ in lead.spec_steps)
    assert lead.n_followed == 0 and k <= part.n_followed <= k + 4
    assert twin.n_followed == n - 1  # the leader's rows, then the second's
    decoding = [b for b in seen if b]
    assert decoding[0] == {0}  # all three on the slot's sequence at first
    # the second parted into a sequence of its own and the third followed it: two in all
    assert len(set().union(*decoding)) == 2


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-thread", "pipelined"])
def test_extra_completions_draft_with_the_draft_model_in_one_draft_batch(
    qwen_follow: Path, qwen_follow_draft: Path, monkeypatch: pytest.MonkeyPatch, pipelined: bool
) -> None:
    """Once a request's completions part, each drafts with the draft model in a draft
    sequence of its own, which starts from the prompt window the slot's draft sequence holds
    (its cells shared, not evaluated again); their drafts are made in one draft batch, each
    answers exactly what it answers alone with its seed, and the extra draft sequences are
    freed with the request, the slot's keeping only the first completion's verified tokens.
    Pipelined, the first completion drafts on the draft thread while the others follow it;
    the thread is settled in the step where they part, and joined before any other sequence
    of the draft's context is touched."""
    n = 24
    with follow_draft_engine(
        qwen_follow, qwen_follow_draft, monkeypatch, pipeline=pipelined
    ) as engine:
        dctx, dcache = engine.pair.dctx, engine.pair.dcache
        assert dctx is not None and dcache is not None
        (prompt,) = prompts(engine, 1)
        first = GenerationRequest(slot=0, prompt=prompt, n_predict=n, sampling=GREEDY)
        greedy = alone(engine, first)[0].tokens
        # two seeds whose draws part from the greedy tokens (and each other's) early, here
        early: dict[int, list[int]] = {}
        for seed in range(1, 500):
            toks = alone(engine, hot(first, seed))[0].tokens
            parts = toks[:2] == greedy[:2] and toks[2:6] != greedy[2:6]
            if parts and all(toks[2:6] != other[2:6] for other in early.values()):
                early[seed] = toks
            if len(early) == 2:
                break
        assert len(early) == 2
        seen = batch_sequences(dctx, monkeypatch)

        def watch(segments: Sequence[Segment]) -> tuple[int, bool]:
            """A target batch's sequences, and whether a draft thread drafts beside it."""
            running = engine.scheduler.running
            piped = any(c.pipe is not None for run in running for c in run.completions)
            return len({seg.seq for seg in segments}), piped

        steps = each_batch(engine.pair.tctx, monkeypatch, watch)
        engine.clear_slot(0)
        lead, *extras = engine.generate_many([first, *(hot(first, seed) for seed in early)])
        assert lead.tokens == greedy
        assert lead.pipelined == pipelined
        # the thread drafts while the completions ride one sequence, and is settled once they
        # part: beside other sequences it would take cores from their shared steps
        assert any(piped for n_seq, piped in steps if n_seq == 1) == pipelined
        assert any(n_seq > 1 for n_seq, _ in steps)
        assert not any(piped for n_seq, piped in steps if n_seq > 1)
        for res, own in zip(extras, early.values(), strict=True):
            assert res.tokens == own
            if not pipelined:  # (a draft thread stopped early may leave the window unfinished)
                assert res.draft_n_evaluated == 0  # the window came from the slot's sequence
        aux_seqs = {st.seq for st in dcache.aux}
        assert len(aux_seqs) == 2 and aux_seqs <= set().union(*seen)  # each drafted on its own
        assert any(len(seqs & aux_seqs) == 2 for seqs in seen)  # in one draft batch
        for st in dcache.aux:
            assert st.tokens == [] and dctx.seq_pos_max(st.seq) == -1
        drafts = engine.draft_slot_tokens(0)
        verified = prompt + lead.tokens
        assert drafts == verified[: len(drafts)]


def test_alternatives_past_the_budget_end_with_the_first_completion(
    qwen_follow: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The editor waits for all of a request's completions and shows the first: once the
    first has ended, an extra completion past ``t_max_predict_ms`` stops there, mid-line
    (``limit``), its tokens a prefix of what it answers alone; without a budget (0) it runs
    on to ``n_predict``. The clock reads a second later at every look, so every completion
    is past a 500 ms budget from its second token on, whatever this machine's speed."""

    class SlowClock:
        t = 0.0

        def __call__(self) -> float:
            self.t += 1.0
            return self.t

    monkeypatch.setattr(completion_mod, "StopRules", partial(StopRules, clock=SlowClock()))
    s = EngineSettings(
        target=model_settings(qwen_follow), spec=SpecSettings(mode="off"), follow_load=False
    )
    n = 24
    with Engine.load(s) as engine:
        (prompt,) = prompts(engine, 1)
        first = GenerationRequest(slot=0, prompt=prompt, n_predict=4, sampling=GREEDY)

        def sampled(seed: int, budget_ms: int) -> GenerationRequest:
            return hot(first, seed, n_predict=n, t_max_predict_ms=budget_ms)

        owns = [alone(engine, sampled(seed, 0))[0].tokens for seed in (1, 2)]
        assert all(len(toks) == n for toks in owns)  # (no end-of-generation before n)
        lead, *extras = alone(engine, first, sampled(1, 500), sampled(2, 500))
        assert len(lead.tokens) == 4
        for res, own in zip(extras, owns, strict=True):
            assert 0 < len(res.tokens) <= 4 and res.tokens == own[: len(res.tokens)]
            assert res.stop_type == "limit"
        lead, *extras = alone(engine, first, sampled(1, 0), sampled(2, 0))
        assert [res.tokens for res in extras] == owns


def test_requests_on_two_slots_decode_in_the_same_steps(
    engine: Engine, scorer: Scorer, batches: list[list[Segment]]
) -> None:
    a, b = prompts(engine, 2)
    tasks = [
        Task([GenerationRequest(slot=s, prompt=p, n_predict=16, sampling=GREEDY)])
        for s, p in ((0, a), (1, b))
    ]
    run(engine, *tasks)
    assert any({s.seq for s in batch} == {0, 1} for batch in batches)
    for task, prompt, slot in ((tasks[0], a, 0), (tasks[1], b, 1)):
        (res,) = task.results
        assert len(res.tokens) == 16 and exact(scorer, prompt, res.tokens)
        assert engine.slot_tokens(slot) == prompt + res.tokens[:-1]


def switch_beside_a_completion(engine: Engine, scorer: Scorer) -> None:
    """Slot 0 decodes while slot 1 evaluates a 440-token prompt (a file switch); both answers
    are the target's. Slot 0 asks for 160 tokens with the end tokens banned (``ignore_eos``):
    at most 5 a step (a token and 4 drafted), it outlasts the switch's 7 pieces whatever this
    CPU's model output lets it accept, and the random model cannot end it early."""
    (short,) = prompts(engine, 1)
    long = engine.vocab.tokenize("".join(code_prompts(6, lines=20)))[:440]
    endless = replace(
        GREEDY, logit_bias=tuple((t, -math.inf) for t in sorted(engine.vocab.eog)), ignore_eos=True
    )
    decoding = Task([GenerationRequest(slot=0, prompt=short, n_predict=160, sampling=endless)])
    engine.submit(decoding)
    engine.step()
    while not engine.scheduler.running[0].completions[0].out:
        engine.step()  # slot 0 is decoding
    switch = Task([GenerationRequest(slot=1, prompt=long, n_predict=4, sampling=GREEDY)])
    engine.clear_slot(1)
    run(engine, switch)
    assert len(decoding.results[0].tokens) == 160
    assert exact(scorer, short, decoding.results[0].tokens, banned=engine.vocab.eog)
    assert exact(scorer, long, switch.results[0].tokens)


def is_piece(seg: Segment) -> bool:
    """Slot 1's prompt piece (its verify steps, a token and its draft, are not pieces)."""
    return seg.seq == 1 and len(seg.tokens) > 1 and seg.logits != "all"


def test_a_long_prompt_is_evaluated_in_pieces_between_the_others_steps(
    engine: Engine, scorer: Scorer, batches: list[list[Segment]]
) -> None:
    """A file switch on one slot does not freeze the other's completion: every step carries
    the decoding sequence's token and one piece of the new prompt. On a CPU with flash
    attention (two slots) the piece goes in a batch of its own after the decoding rows': a
    row of another sequence in a piece's 64-row tile of llama.cpp's CPU kernel would make
    every row of the tile attend to that sequence's cells too."""
    assert engine.pair.pieces_apart
    switch_beside_a_completion(engine, scorer)
    assert not any(any(map(is_piece, b)) and any(s.seq == 0 for s in b) for b in batches)
    # a batch of the decoding sequence's rows before each piece (but the last few, once
    # slot 0 has ended): the prompt went piece by piece beside it, not after it
    steps = [i for i, b in enumerate(batches) if any(map(is_piece, b))]
    beside = [i for i in steps if i > 0 and {s.seq for s in batches[i - 1]} == {0}]
    assert len(beside) >= 440 // 64 - 1, (len(beside), len(steps))
    # pieces of one size (440 as 7 of 62-63, not 6 x 64 + 56): no short last piece runs dearer
    sizes = {len(s.tokens) for b in batches for s in b if is_piece(s)}
    assert max(sizes) <= 64 and max(sizes) - min(sizes) <= 1, sizes


def test_without_flash_attention_a_piece_shares_the_decoding_rows_batch(
    qwen_target: Path, scorer: Scorer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """That kernel computes every row against every cell whatever the batch holds, so one
    pass over the weights carries both."""
    s = EngineSettings(
        target=replace(model_settings(qwen_target), flash_attn=False),
        n_slots=2,
        prefill_chunk=64,
        spec=SpecSettings(mode="off"),
    )
    with Engine.load(s) as plain:
        assert not plain.pair.pieces_apart
        seen = each_batch(plain.pair.tctx, monkeypatch, list)
        observed: list[int] = []  # each step's tokens, as the step-cost table learns them
        monkeypatch.setattr(plain.pair, "observe_step", lambda n, ms, pipelined: observed.append(n))
        switch_beside_a_completion(plain, scorer)
    shared = [b for b in seen if any(map(is_piece, b)) and any(s.seq == 0 for s in b)]
    assert len(shared) >= 440 // 64 - 1
    # a step's time is priced by all its tokens, the piece's included
    assert max(observed) == max(sum(len(s.tokens) for s in b) for b in shared) > 60


def test_cancelling_one_request_leaves_the_other_running(engine: Engine, scorer: Scorer) -> None:
    a, b = prompts(engine, 2)
    stop = threading.Event()
    cancelled = Task(
        [GenerationRequest(slot=0, prompt=a, n_predict=40, sampling=GREEDY)], cancel=stop
    )
    going = Task([GenerationRequest(slot=1, prompt=b, n_predict=40, sampling=GREEDY)])
    engine.submit(cancelled)
    engine.submit(going)
    for _ in range(6):
        engine.step()
    stop.set()
    while engine.step():
        pass
    (cut,) = cancelled.results
    (full,) = going.results
    assert cut.cancelled and cut.stop_type == "none" and len(cut.tokens) < 40
    assert engine.slot_tokens(0) == a + cut.tokens[:-1] if cut.tokens else a
    assert len(full.tokens) == 40 and not full.cancelled and exact(scorer, b, full.tokens)


def test_a_request_waits_for_its_busy_slot_and_others_do_not(engine: Engine) -> None:
    a, b, c = prompts(engine, 3)
    first = Task([GenerationRequest(slot=0, prompt=a, n_predict=8, sampling=GREEDY)])
    same = Task([GenerationRequest(slot=0, prompt=b, n_predict=8, sampling=GREEDY)])
    other = Task([GenerationRequest(slot=1, prompt=c, n_predict=8, sampling=GREEDY)])
    for task in (first, same, other):
        engine.submit(task)
    engine.step()  # first starts; same waits for slot 0
    started = {r.task.slot: r.task for r in engine.scheduler.running}
    assert started[0] is first and same in engine.scheduler.waiting
    while engine.step():
        pass
    assert engine.slot_tokens(0)[: len(b)] == b  # same ran after first, on its slot


def test_requests_whose_extra_completions_need_more_sequences_than_are_free_take_turns(
    engine: Engine,
) -> None:
    """Two requests, each with every extra sequence: both pass the check while the
    sequences are free, but one prompt's completions take them all. The second starts when
    the first is done (its sequences are taken when it starts), not with an error once its
    own prompt is in."""
    a, b = prompts(engine, 2)
    n = engine.max_completions
    tasks = [
        Task([GenerationRequest(slot=s, prompt=p, n_predict=4, sampling=GREEDY)] * n)
        for s, p in ((0, a), (1, b))
    ]
    for task in tasks:
        engine.submit(task)
    engine.step()
    assert [r.task for r in engine.scheduler.running] == tasks[:1]  # the other waits
    while engine.step():
        pass
    for task in tasks:
        assert task.error is None and len(task.results) == n
        assert all(len(r.tokens) == 4 for r in task.results)


def test_more_completions_than_sequences_are_refused(engine: Engine) -> None:
    (prompt,) = prompts(engine, 1)
    req = GenerationRequest(slot=0, prompt=prompt, n_predict=4)
    with pytest.raises(ValueError, match="at most"):
        engine.generate_many([req] * (engine.max_completions + 1))


def test_extra_completions_stop_at_their_reserved_room(qwen_target: Path) -> None:
    s = EngineSettings(target=model_settings(qwen_target), aux_room=10, n_aux=1)
    with Engine.load(s) as eng:
        (prompt,) = prompts(eng, 1)
        req = GenerationRequest(slot=0, prompt=prompt, n_predict=30, sampling=GREEDY)
        first, extra = eng.generate_many([req, replace(req)])
        assert len(first.tokens) == 30 and len(extra.tokens) == 9
        assert extra.stop_type == "limit"


def test_the_draft_model_drafts_for_several_sequences_in_one_batch(
    qwen_follow: Path, qwen_follow_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft-model drafts for two slots come from shared draft batches; outputs stay the
    target's, and each draft cache keeps only verified tokens.

    Beside each other, the sequences' draft lengths come from the measured cost of a step and
    their acceptance so far: here the follow pair (its drafts accepted two tokens in three,
    rejected at known places) and the costs of a machine where a bigger step costs little
    more, so the drafts are kept whatever this CPU, its load or an earlier test measured."""
    fixed_costs(monkeypatch, {1: 10.0, 64: 10.5})
    s = EngineSettings(
        target=model_settings(qwen_follow),
        draft=model_settings(qwen_follow_draft),
        n_slots=2,
        spec=SpecSettings(mode="draft", n_max=4, p_min=0.0, pipeline=False),
        follow_load=False,  # step costs are kept per thread count: one count throughout
    )
    scorer = Scorer(qwen_follow)
    try:
        with Engine.load(s) as engine:
            dctx = engine.pair.dctx
            assert dctx is not None
            seen = batch_sequences(dctx, monkeypatch)
            a, b = prompts(engine, 2)
            tasks = [
                Task(
                    [
                        GenerationRequest(
                            slot=s, prompt=p, n_predict=20, sampling=GREEDY, spec_n_max=4
                        )
                    ]
                )
                for s, p in ((0, a), (1, b))
            ]
            run(engine, *tasks)
            assert any(seqs == {0, 1} for seqs in seen)
            for task, prompt, slot in ((tasks[0], a, 0), (tasks[1], b, 1)):
                (res,) = task.results
                assert 0 < res.drafted["draft"].accepted < res.drafted["draft"].drafted
                assert res.tokens == follow_chain(prompt[-1], 20)
                assert exact(scorer, prompt, res.tokens)
                drafts = engine.draft_slot_tokens(slot)
                verified = prompt + res.tokens
                assert drafts == verified[: len(drafts)] and len(drafts) >= len(prompt)
    finally:
        scorer.close()


@contextlib.contextmanager
def follow_auto_engine(
    target: Path, draft: Path, monkeypatch: pytest.MonkeyPatch, verify_ms: dict[int, float]
) -> Iterator[Engine]:
    """Two slots in auto mode on the follow pair, on a machine with these step costs and a
    draft model a tenth of the target's size (0.5B beside 7B: the prior for a draft batch's
    cost before the model has drafted; the fixtures are the same size)."""
    fixed_costs(monkeypatch, verify_ms, draft_ms=1.0)
    s = EngineSettings(
        target=model_settings(target),
        draft=model_settings(draft),
        n_slots=2,
        spec=SpecSettings(mode="auto", n_max=4, p_min=0.0, pipeline=False),
        follow_load=False,
    )
    with Engine.load(s) as engine:
        engine.pair.draft_size_ratio = 0.1
        yield engine


@pytest.mark.parametrize(
    ("verify_ms", "shared_drafts"),
    [
        ({1: 10.0, 64: 10.5}, True),  # a bigger step costs little more: drafts pay
        ({1: 10.0, 2: 11.0, 3: 40.0, 64: 900.0}, False),  # pay alone, not beside another
    ],
    ids=["flat", "steep"],
)
def test_a_shared_step_runs_the_draft_model_only_where_its_tokens_pay(
    qwen_follow: Path,
    qwen_follow_draft: Path,
    monkeypatch: pytest.MonkeyPatch,
    verify_ms: dict[int, float],
    shared_drafts: bool,
) -> None:
    """In auto mode the draft model's tokens for a shared step are weighed before they are
    made: where a step with them would yield less per ms (a CPU, where every token in a step
    costs), the draft model neither drafts nor evaluates its prompt window for that step,
    though alone the same draft would pay; where a bigger step is nearly free, it drafts for
    both sequences in one draft batch. Outputs are the target's either way. (The draft's
    cache already holds both prompts, as at an editor's next keystroke: a shared step never
    pays a draft prompt prefill, ``test_..._without_a_draft_prefill`` below.)"""
    with follow_auto_engine(qwen_follow, qwen_follow_draft, monkeypatch, verify_ms) as engine:
        a, b = prompts(engine, 2, lines=40)
        for slot, prompt in ((0, a), (1, b)):  # the draft's cache holds each prompt
            engine.prefill_draft(slot, prompt)
        dctx, tctx = engine.pair.dctx, engine.pair.tctx
        assert dctx is not None
        events: list[tuple[str, int]] = []  # (which model, decoding sequences in the batch)
        for name, ctx in (("draft", dctx), ("target", tctx)):

            def record(segments: Sequence[Segment], name: str = name, real=ctx.decode_many):
                events.append((name, len({seg.seq for seg in segments})))
                return real(segments)

            monkeypatch.setattr(ctx, "decode_many", record)
        tasks = [
            Task([GenerationRequest(slot=s, prompt=p, n_predict=20, sampling=GREEDY)])
            for s, p in ((0, a), (1, b))
        ]
        run(engine, *tasks)
        for task, prompt in zip(tasks, (a, b), strict=True):
            assert task.results[0].tokens == follow_chain(prompt[-1], 20)
    # the target step each draft batch served: the next target batch after it
    served = [
        next(n for kind, n in events[i + 1 :] if kind == "target")
        for i, (kind, _) in enumerate(events)
        if kind == "draft"
    ]
    assert any(n >= 2 for n in served) == shared_drafts


def test_on_flat_step_costs_auto_mode_drafts_for_extra_completions_with_the_model(
    qwen_follow: Path, qwen_follow_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a bigger step costs little more (a GPU), auto mode keeps the draft model's
    tokens for a request's parted completions too: one draft batch holds the slot's draft
    sequence and both extra completions' (the draft's cache holds the prompt, as at an
    editor's next keystroke)."""
    flat = {1: 10.0, 64: 10.5}
    with follow_auto_engine(qwen_follow, qwen_follow_draft, monkeypatch, flat) as engine:
        dctx, dcache = engine.pair.dctx, engine.pair.dcache
        assert dctx is not None and dcache is not None
        (prompt,) = prompts(engine, 1)
        engine.prefill_draft(0, prompt)
        seen = batch_sequences(dctx, monkeypatch)
        first = GenerationRequest(slot=0, prompt=prompt, n_predict=24, sampling=GREEDY)
        extras = [hot(first, seed) for seed in (3, 4)]
        lead, *_ = engine.generate_many([first, *extras])
        assert lead.tokens == follow_chain(prompt[-1], 24)
        aux_seqs = {st.seq for st in dcache.aux}
        assert any(len(seqs & aux_seqs) >= 2 for seqs in seen)


def test_a_shared_step_drafts_without_a_draft_prefill(
    qwen_follow: Path, qwen_follow_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two new prompts decoding together, on costs where a draft would pay: the draft
    model's cache holds neither prompt, and a shared step does not evaluate hundreds of
    prompt tokens of the draft model on the path of both sequences for the few tokens it
    keeps, so neither request evaluates its draft window."""
    flat = {1: 10.0, 64: 10.5}
    with follow_auto_engine(qwen_follow, qwen_follow_draft, monkeypatch, flat) as engine:
        a, b = prompts(engine, 2, lines=40)  # 150 tokens each
        tasks = [
            Task([GenerationRequest(slot=s, prompt=p, n_predict=12, sampling=GREEDY)])
            for s, p in ((0, a), (1, b))
        ]
        run(engine, *tasks)
        for task, prompt in zip(tasks, (a, b), strict=True):
            (res,) = task.results
            assert res.tokens == follow_chain(prompt[-1], 12)
            assert res.draft_n_evaluated == 0
            assert "draft" not in res.drafted


def test_prompts_that_arrive_together_are_evaluated_together(
    engine: Engine, scorer: Scorer, batches: list[list[Segment]]
) -> None:
    """Two file switches at once: every step carries a piece of each prompt (one pass over
    the weights for both), and each answer is still the target's."""
    texts = "".join(code_prompts(8, lines=20))
    a = engine.vocab.tokenize(texts)[:300]
    b = engine.vocab.tokenize(texts)[300:600]
    engine.clear_slot(0)
    engine.clear_slot(1)
    tasks = [
        Task([GenerationRequest(slot=s, prompt=p, n_predict=6, sampling=GREEDY)])
        for s, p in ((0, a), (1, b))
    ]
    run(engine, *tasks)
    both = [b for b in batches if sum(len(s.tokens) > 1 for s in b) == 2]
    assert len(both) >= 300 // 64 - 1  # piece beside piece, not one prompt after the other
    assert all({s.seq for s in batch} == {0, 1} for batch in both)
    for task, prompt in ((tasks[0], a), (tasks[1], b)):
        assert exact(scorer, prompt, task.results[0].tokens)


def piece_sizes(batches: list[list[Segment]], seq: int) -> list[int]:
    """The prompt pieces of sequence ``seq``, in order (its verify steps are not pieces)."""
    return [len(s.tokens) for b in batches for s in b if s.seq == seq and s.logits != "all"]


def test_a_prompt_alone_goes_in_the_pieces_its_time_budget_buys(
    engine: Engine,
    qwen_target: Path,
    scorer: Scorer,
    batches: list[list[Segment]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With flash attention (two slots) and nothing else to run, a prompt is evaluated in
    pieces as long as the budget buys at the measured price (here unbounded, so the test
    does not depend on this machine's speed): in one batch when its price is known as it
    starts, else one chunk first and the rest after that piece priced itself. Without flash
    attention (one CPU slot), chunks: their size does not change that kernel's speed."""
    monkeypatch.setattr(engine, "settings", replace(engine.settings, prefill_piece_ms=1e9))
    long = engine.vocab.tokenize("".join(code_prompts(6, lines=20)))[:440]
    ask = GenerationRequest(slot=1, prompt=long, n_predict=4, sampling=GREEDY)
    engine.clear_slot(1)
    monkeypatch.setattr(engine.pair.tcache, "ms_per_token", -1.0)  # nothing measured yet
    task = Task([ask])
    run(engine, task)
    assert piece_sizes(batches, 1) == [63, 377]  # (440 as pieces of 64 would be 7 of 63)
    assert exact(scorer, long, task.results[0].tokens)
    assert engine.pair.tcache.ms_per_token > 0  # the first piece priced itself
    engine.clear_slot(1)
    batches.clear()
    run(engine, Task([ask]))
    assert piece_sizes(batches, 1) == [440]

    one_slot = EngineSettings(
        target=model_settings(qwen_target), prefill_chunk=64, prefill_piece_ms=1e9
    )
    with Engine.load(one_slot) as plain:
        assert not plain.pair.tctx.flash_attn
        seen = batch_sizes(plain.pair.tctx, monkeypatch)
        plain.generate(replace(ask, slot=0))
        plain.clear_slot(0)
        seen.clear()
        plain.generate(replace(ask, slot=0))
        assert seen[:7] == [63] * 6 + [62]  # 440 as pieces of 64: 7 of one size
