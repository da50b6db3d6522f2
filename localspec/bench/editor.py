"""The editor traffic model: what llama-vscode / llama.vim send while a person types.

Pure and seeded: :func:`build_schedule` turns source files into a list of :class:`Burst` (one
per cursor location), each holding the exact ``/infill`` bodies and the client-side timing
(typing intervals that become abort deadlines, idle time that carries warm-ups). Every server
in a run replays the same schedule, so their answers and latencies compare request by request.

Protocol facts follow shared/reference/llama-vscode-protocol.md and llama.vim's sources:
256-line prefix window, 64-line suffix window, ``prompt`` = the cursor line so far ("" when it
is only whitespace), ``n_indent`` = the line's indentation, a ring buffer of up to 16 chunks of
32 lines picked from other places (queued on a jump, moved into the ring one per idle second,
each move followed by a warm-up with ``n_predict: 0``).
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KeyKind = Literal["type", "pause", "final"]

BASE_TIME = 1_750_000_000  # fixed epoch for the chunks' "time" field: bodies are reproducible


@dataclass(frozen=True)
class TrafficSettings:
    """The client's knobs (llama-vscode defaults) and the typist's timing model."""

    n_prefix_lines: int = 256
    n_suffix_lines: int = 64
    ring_n_chunks: int = 16
    ring_chunk_lines: int = 32
    ring_scope_lines: int = 1024  # how far from the cursor llama.vim gathers same-file chunks
    n_predict: int = 128
    top_k: int = 40
    top_p: float = 0.99
    t_max_prompt_ms: int = 500
    t_max_predict_ms: int = 500
    seed: int = 42  # the sampler's seed in every body; also seeds the schedule
    greedy: bool = False  # top_k 1: answers independent of sampling
    id_slot: int = 0
    n_cmpl: int = 3  # completions per keystroke (llama-vscode's max_parallel_completions)
    # typist
    locations: int = 20
    lines_per_file: int = 3  # cursor jumps inside one file before switching files
    max_keys: int = 40  # keystrokes per location (the line is retyped up to this many chars)
    interval_s: tuple[float, float] = (0.08, 0.15)  # between keystrokes: the abort deadline
    pause_prob: float = 0.08  # chance that a keystroke is followed by a reading pause
    pause_s: tuple[float, float] = (1.0, 2.5)
    idle_s: tuple[float, float] = (1.0, 3.0)  # after a jump, before the first keystroke
    final_timeout_s: float = 120.0  # the last keystroke of a location waits for its answer

    def check(self) -> None:
        if self.locations < 1:
            raise ValueError(f"locations must be at least 1, got {self.locations}")
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {self.max_keys}")
        if self.n_cmpl < 1:
            raise ValueError(f"n_cmpl must be at least 1, got {self.n_cmpl}")
        if not 0 <= self.pause_prob <= 1:
            raise ValueError(f"pause_prob must be within 0..1, got {self.pause_prob}")
        for name in ("interval_s", "pause_s", "idle_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range 0 <= low <= high, got {low}..{high}")


@dataclass(frozen=True)
class Chunk:
    """One ring-buffer entry, as ``input_extra`` carries it."""

    filename: str
    lines: tuple[str, ...]
    time: int

    def body(self) -> dict[str, Any]:
        return {"text": "\n".join(self.lines) + "\n", "time": self.time, "filename": self.filename}


@dataclass(frozen=True)
class Keystroke:
    body: dict[str, Any]
    wait_s: float  # until the next keystroke: past it the request is aborted
    kind: KeyKind  # type: ordinary; pause: the typist stops to read; final: last on the line


@dataclass(frozen=True)
class Burst:
    """One cursor location: jump, idle (warm-ups), then retype the line key by key."""

    index: int
    filename: str
    line_no: int  # 0-based
    line: str
    idle_s: float
    warmups: tuple[dict[str, Any], ...]  # sent at idle seconds 0, 1, 2, ...
    keys: tuple[Keystroke, ...]


@dataclass
class SourceFile:
    path: str
    lines: list[str]


def default_code_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SKIP_DIRS = frozenset({"site-packages", "__pycache__", ".git", "node_modules", ".venv"})
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "lib2to3"})  # data-heavy, atypical


def load_sources(
    root: Path,
    *,
    pattern: str = "*.py",
    min_lines: int = 80,
    limit: int = 4000,
    skip_dirs: frozenset[str] = SKIP_DIRS,
) -> list[SourceFile]:
    """Readable text files under ``root`` long enough to hold a prefix window worth caching."""
    if not root.is_dir():
        raise ValueError(f"code directory not found: {root}")
    files: list[SourceFile] = []
    for path in sorted(root.rglob(pattern)):
        if len(files) >= limit:
            break
        if skip_dirs.intersection(path.relative_to(root).parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.replace("\r\n", "\n").replace("\t", "    ").split("\n")
        if len(lines) >= min_lines:
            files.append(SourceFile(str(path.resolve()), lines))
    if len(files) < 2:
        raise ValueError(
            f"need at least two source files of {min_lines}+ lines matching {pattern!r} "
            f"under {root}, found {len(files)}"
        )
    return files


def _typable(line: str) -> bool:
    body = line.strip()
    return 8 <= len(body) <= 100 and not body.startswith("#") and '"""' not in body


def _chunk_similarity(a: Sequence[str], b: Sequence[str]) -> float:
    """llama.vim's chunk_sim: 2 x shared lines / total lines."""
    common = sum(1 for line in a if line in set(b))
    return 2.0 * common / max(1, len(a) + len(b))


class Ring:
    """llama.vim's ring buffer: picked chunks wait in a queue, then enter one per idle second."""

    def __init__(self, settings: TrafficSettings) -> None:
        self.settings = settings
        self.chunks: list[Chunk] = []
        self.queued: list[Chunk] = []

    def pick(self, rng: random.Random, src: SourceFile, lo: int, hi: int, now: int) -> None:
        """Queue a random ``ring_chunk_lines`` slice of ``src.lines[lo:hi]`` (as llama.vim)."""
        lines = src.lines[max(0, lo) : max(0, hi)]
        if len(lines) < 3:
            return
        size = self.settings.ring_chunk_lines
        start = rng.randint(0, max(0, len(lines) - size))
        piece = tuple(lines[start : start + size])
        if any(c.lines == piece for c in [*self.chunks, *self.queued]):
            return
        # a new chunk evicts queued and ring chunks that mostly repeat it
        self.queued = [c for c in self.queued if _chunk_similarity(c.lines, piece) <= 0.9]
        self.chunks = [c for c in self.chunks if _chunk_similarity(c.lines, piece) <= 0.9]
        self.queued.append(Chunk(src.path, piece, now))
        if len(self.queued) > self.settings.ring_n_chunks:
            self.queued.pop(0)

    def update(self) -> bool:
        """Move one queued chunk into the ring (evicting the oldest); True if the ring changed."""
        if not self.queued:
            return False
        if len(self.chunks) >= self.settings.ring_n_chunks:
            self.chunks.pop(0)
        self.chunks.append(self.queued.pop(0))
        return True

    def extra(self) -> list[dict[str, Any]]:
        return [c.body() for c in self.chunks]


def _sampling(settings: TrafficSettings) -> dict[str, Any]:
    return {
        "top_k": 1 if settings.greedy else settings.top_k,
        "top_p": settings.top_p,
        "seed": settings.seed,
    }


def infill_body(
    settings: TrafficSettings,
    lines: Sequence[str],
    line_no: int,
    col: int,
    current: str,
    extra: list[dict[str, Any]],
) -> dict[str, Any]:
    """The body llama-vscode sends with the cursor at ``col`` of ``current`` (line ``line_no``)."""
    before = lines[max(0, line_no - settings.n_prefix_lines) : line_no]
    after = lines[line_no + 1 : line_no + 1 + settings.n_suffix_lines]
    typed = current[:col]
    indent = len(current) - len(current.lstrip(" "))
    body: dict[str, Any] = {
        "id_slot": settings.id_slot,
        "input_prefix": "\n".join(before) + "\n",
        "input_suffix": current[col:] + "\n" + "\n".join(after) + "\n",
        "input_extra": extra,
        "prompt": "" if typed.strip() == "" else typed,
        "n_predict": settings.n_predict,
        "n_cmpl": settings.n_cmpl,
        **_sampling(settings),
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": settings.t_max_prompt_ms,
        "t_max_predict_ms": settings.t_max_predict_ms,
    }
    if indent:
        body["n_indent"] = indent
    return body


def warmup_body(settings: TrafficSettings, extra: list[dict[str, Any]]) -> dict[str, Any]:
    """The idle-time request that only fills the KV cache with the ring."""
    return {
        "id_slot": settings.id_slot,
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": extra,
        "prompt": "",
        "n_predict": 0,
        "n_cmpl": 1,
        **_sampling(settings),
        "stream": False,
        "samplers": [],
        "cache_prompt": True,
        "t_max_prompt_ms": settings.t_max_prompt_ms,
        "t_max_predict_ms": 1,
    }


@dataclass
class Schedule:
    settings: TrafficSettings
    setup: dict[str, Any]  # one warm-up with the initial ring, sent (and awaited) before timing
    bursts: list[Burst] = field(default_factory=list)

    @property
    def n_requests(self) -> int:
        return sum(len(b.keys) + len(b.warmups) for b in self.bursts)


def _pick_location(rng: random.Random, src: SourceFile, after: int | None) -> int | None:
    """A typable line: anywhere in a new file, or 5-40 lines further down in the same file."""
    n = len(src.lines)
    if after is None:
        candidates = [i for i in range(n) if _typable(src.lines[i])]
    else:
        candidates = [i for i in range(after + 5, min(n, after + 41)) if _typable(src.lines[i])]
    return rng.choice(candidates) if candidates else None


def build_schedule(settings: TrafficSettings, sources: Sequence[SourceFile]) -> Schedule:
    """Seeded traffic for ``settings.locations`` cursor locations in ``sources``."""
    settings.check()
    if len(sources) < 2:
        raise ValueError(
            "the replay needs at least two source files (ring chunks come from others)"
        )
    rng = random.Random(settings.seed)
    ring = Ring(settings)
    now = BASE_TIME
    half = settings.ring_chunk_lines  # llama.vim picks from +-ring_chunk_size/2 = 32 lines

    # The session so far: a full ring of chunks from other files.
    for src in rng.sample(list(sources), min(len(sources), settings.ring_n_chunks)):
        line = rng.randrange(len(src.lines))
        ring.pick(rng, src, line - half, line + half, now)
        ring.update()
    setup = warmup_body(settings, ring.extra())

    bursts: list[Burst] = []
    src: SourceFile | None = None
    line_no: int | None = None
    in_file = 0
    while len(bursts) < settings.locations:
        prev_src, prev_line = src, line_no
        if src is None or in_file >= settings.lines_per_file:
            src, line_no, in_file = rng.choice(list(sources)), None, 0
        picked = _pick_location(rng, src, line_no)
        if picked is None:
            src, line_no, in_file = None, None, 0
            continue
        line_no, in_file = picked, in_file + 1
        now += 30
        # Leaving a file queues a chunk around the old cursor (BufLeave); a far move queues
        # chunks from beyond the prefix/suffix windows (llama.vim's "extra context nearby").
        if prev_src is not None and prev_line is not None and prev_src is not src:
            ring.pick(rng, prev_src, prev_line - half, prev_line + half, now)
        if prev_src is not src:
            ring.pick(
                rng,
                src,
                line_no - settings.ring_scope_lines,
                line_no - settings.n_prefix_lines,
                now,
            )
            ring.pick(
                rng,
                src,
                line_no + settings.n_suffix_lines,
                line_no + settings.n_suffix_lines + settings.ring_chunk_lines * 2,
                now,
            )

        idle = rng.uniform(*settings.idle_s)
        warmups: list[dict[str, Any]] = []
        for _ in range(int(idle) + 1):
            if ring.update():
                warmups.append(warmup_body(settings, ring.extra()))
        extra = ring.extra()

        line = src.lines[line_no]
        indent = len(line) - len(line.lstrip(" "))
        text = line.rstrip()
        n_keys = min(settings.max_keys, len(text) - indent)
        keys: list[Keystroke] = []
        for k in range(n_keys + 1):
            col = indent + k
            # Retyping: the line holds only what was typed so far; the rest is not there yet.
            current = text[:col]
            body = infill_body(settings, src.lines, line_no, col, current, extra)
            if k == n_keys:
                keys.append(Keystroke(body, settings.final_timeout_s, "final"))
            elif rng.random() < settings.pause_prob:
                keys.append(Keystroke(body, rng.uniform(*settings.pause_s), "pause"))
            else:
                keys.append(Keystroke(body, rng.uniform(*settings.interval_s), "type"))
        bursts.append(
            Burst(len(bursts), src.path, line_no, line, idle, tuple(warmups), tuple(keys))
        )
    return Schedule(settings, setup, bursts)
