"""Traffic as several editors make it, at the engine: requests on two slots arriving while others
decode, extra completions, speculation with a draft model, rings of chunks evaluated as blocks,
prompts that reuse moved runs of the last one, and cancels at any step. Whatever the
interleaving, once the engine is idle every sequence's KV holds exactly the tokens the engine
believes it holds: no rejected draft's cells, no parked run, no extra completion's cells left
behind, in the target's context or the draft's.

The check counts cells (llama.cpp's per-sequence state size), not logits, so it does not depend
on which kernels this CPU runs or on how a batch was cut (llama.cpp's CPU flash attention, for
one, computes a prompt's KV differently in batches of 64 rows or more: docs/engine.md).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as C
import pytest

from localspec.bench.corpus import code_prompts
from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    SamplingParams,
    SpecSettings,
    Task,
)
from localspec.engine.cache import SlotCaches
from localspec.engine.llama import Context
from tests.test_engine_exact import model_settings

GREEDY = SamplingParams(top_k=1, temperature=0.0)


@pytest.fixture(scope="module", params=[False, True], ids=["draft-inline", "draft-pipelined"])
def engine(request: pytest.FixtureRequest, qwen_target: Path, qwen_draft: Path) -> Iterator[Engine]:
    s = EngineSettings(
        target=model_settings(qwen_target),
        draft=model_settings(qwen_draft),
        n_slots=2,
        prefill_chunk=32,
        cache_reuse=16,  # runs of 16 tokens move by a KV shift: the parking code runs
        tail_reuse=8,
        exact_ms=0.0,  # shift rather than re-evaluate, so the moves happen
        spec=SpecSettings(mode="hybrid", n_max=4, p_min=0.0, pipeline=request.param),
    )
    with Engine.load(s) as eng:
        yield eng


@dataclass(frozen=True)
class StateSize:
    """A sequence's state in bytes: ``empty`` with no cells, else ``base + per_cell * n``."""

    empty: int
    base: int
    per_cell: int

    @classmethod
    def measure(cls, ctx: Context, seq: int) -> StateSize:
        """On ``seq``, which must hold no cells (they are removed again after)."""
        empty = _size(ctx, seq)
        ctx.decode([1, 2, 3], 0, seq, logits="none")
        three = _size(ctx, seq)
        ctx.decode([4, 5], 3, seq, logits="none")
        per_cell = (_size(ctx, seq) - three) // 2
        ctx.seq_rm(seq, -1, -1)
        assert _size(ctx, seq) == empty
        return cls(empty, three - 3 * per_cell, per_cell)

    def cells(self, ctx: Context, seq: int) -> int:
        size = _size(ctx, seq)
        if size == self.empty:
            return 0
        n, rest = divmod(size - self.base, self.per_cell)
        assert rest == 0 and n > 0, (seq, size, self)
        return n


def _size(ctx: Context, seq: int) -> int:
    return int(C.llama_state_seq_get_size(ctx.handle, seq))


def _mismatches(ctx: Context, cache: SlotCaches, size: StateSize) -> list[str]:
    """Sequences whose cells are not what ``cache`` records (run with the engine idle)."""
    wrong = []
    for st in cache.slots:
        if (n := size.cells(ctx, st.seq)) != len(st.tokens):
            wrong.append(f"slot seq {st.seq}: {n} cells for {len(st.tokens)} tokens")
        elif st.tokens and ctx.seq_pos_max(st.seq) != len(st.tokens) - 1:
            wrong.append(f"slot seq {st.seq}: last position {ctx.seq_pos_max(st.seq)}")
        for extra in (st.scratch, st.iso):
            if extra is not None and extra >= 0 and (n := size.cells(ctx, extra)):
                wrong.append(f"seq {extra} (scratch or iso of {st.seq}) holds {n} cells")
    for aux in cache.aux:
        n = size.cells(ctx, aux.seq)
        if aux.tokens or n:
            wrong.append(f"aux seq {aux.seq} holds {len(aux.tokens)} tokens, {n} cells")
    return wrong


def _prompt(
    rng: random.Random, pieces: list[list[int]], last: tuple[list[int], tuple[int, ...]] | None
) -> tuple[list[int], tuple[int, ...]]:
    """A prompt and its leading blocks. Often the last prompt with an edit past its blocks, so
    that runs of it reappear at other positions (a moved run) or as its prefix; else code
    snippets in a random order, half the time behind a ring of chunks evaluated as blocks
    (rotated, as an editor's ring turns)."""
    if last is not None and rng.random() < 0.6:
        tokens, blocks = last
        cut = rng.randrange(sum(blocks), len(tokens))  # past the ring: its blocks stay whole
        insert = rng.choice(pieces)[: rng.randrange(1, 40)]
        drop = rng.randrange(0, 30)
        return (tokens[:cut] + insert + tokens[cut + drop :])[:700], blocks
    blocks: tuple[int, ...] = ()
    ring: list[int] = []
    if rng.random() < 0.5:
        chunks = [p[:24] for p in rng.sample(pieces[:6], rng.randrange(2, 5))]
        ring = [t for c in chunks for t in c]
        blocks = tuple(len(c) for c in chunks)
    body = [t for p in rng.sample(pieces[6:], rng.randrange(1, 3)) for t in p]
    return (ring + body)[:700], blocks


@dataclass(frozen=True)
class Arrival:
    """A request of the storm: sent before step ``at``, cancelled before step ``cancel_at``."""

    at: int
    task: Task
    cancel: threading.Event
    cancel_at: int | None


def _burst(
    rng: random.Random,
    pieces: list[list[int]],
    last: dict[int, tuple[list[int], tuple[int, ...]]],
) -> list[Arrival]:
    """4-8 requests, drawn before any runs: the traffic is the same on every CPU, whatever
    the steps it takes (only the engine's state when each arrives depends on the machine)."""
    out, at = [], 0
    for _ in range(rng.randrange(4, 9)):
        at += rng.randrange(0, 5)  # between two steps, maybe mid-decode
        slot = rng.randrange(2)
        prompt, blocks = _prompt(rng, pieces, last.get(slot))
        last[slot] = prompt, blocks
        sampling = GREEDY if rng.random() < 0.5 else SamplingParams(seed=rng.randrange(99))
        req = GenerationRequest(
            slot=slot,
            prompt=prompt,
            blocks=blocks,
            block_sink=bool(blocks) and rng.random() < 0.5,
            n_predict=rng.choice([0, 4, 12, 24]),
            sampling=sampling,
        )
        cancel = threading.Event()
        task = Task([req] * rng.choice([1, 1, 2, 3]), cancel=cancel)
        # the editor moves on: cancelled a few steps later
        cancel_at = at + rng.randrange(0, 6) if rng.random() < 0.3 else None
        out.append(Arrival(at, task, cancel, cancel_at))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_sequence_holds_what_the_engine_believes_after_a_storm(
    engine: Engine, seed: int
) -> None:
    rng = random.Random(seed)
    tsize = StateSize.measure(engine.pair.tctx, engine.pair.tcache.aux[0].seq)
    dsize = None
    if engine.pair.dcache is not None and engine.pair.dctx is not None:
        dsize = StateSize.measure(engine.pair.dctx, engine.pair.dcache.aux[0].seq)
    pieces = [engine.vocab.tokenize(text)[:160] for text in code_prompts(12, lines=12)]
    last: dict[int, tuple[list[int], tuple[int, ...]]] = {}
    counts = {"done": 0, "cancelled": 0, "shifted": 0, "extra": 0, "blocks": 0}
    for _ in range(4):
        arrivals = _burst(rng, pieces, last)
        tasks = [a.task for a in arrivals]
        waiting = list(arrivals)
        step = 0
        while waiting or engine.busy:
            while waiting and waiting[0].at <= step:
                engine.submit(waiting.pop(0).task)
            for a in arrivals:
                if a.cancel_at is not None and a.cancel_at <= step:
                    a.cancel.set()
            engine.step()
            step += 1
        for task in tasks:
            assert task.done and task.error is None, task.error
            res = task.results[0] if task.results else None
            counts["cancelled" if res is None or res.cancelled else "done"] += 1
            counts["shifted"] += bool(res and res.n_shifted)
            counts["extra"] += len(task.requests) > 1
            counts["blocks"] += bool(task.first.blocks)
        engine.pair.settle_draft()  # a pipelined draft's thread is joined by the cache's next user
        wrong = _mismatches(engine.pair.tctx, engine.pair.tcache, tsize)
        if dsize is not None and engine.pair.dcache is not None and engine.pair.dctx is not None:
            wrong += [
                f"draft {w}" for w in _mismatches(engine.pair.dctx, engine.pair.dcache, dsize)
            ]
        assert not wrong, (counts, wrong)
    # the storm did what it is for: moved runs, ring blocks, extra completions and cancels
    assert all(counts.values()), counts
