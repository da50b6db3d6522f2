"""The fill-in-the-middle prompt, laid out exactly as llama-server's ``format_prompt_infill``.

A pure function of a tokenizer callable, the FIM token ids and the batch/context budgets, so
the layout is testable without a model. Every piece is tokenized on its own with special-token
parsing off (a literal ``<|fim_prefix|>`` typed in user code stays text); the cursor-line
``prompt`` arrives already tokenized with parsing on, as llama-server does.

Layout (Qwen2.5-Coder's repo-level pattern)::

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n chunk0 ... [FIM_SEP]filename\\n   <- extra, end kept
    [BOS] [FIM_PRE] prefix(end kept) prompt [FIM_SUF] suffix(start kept) [FIM_MID]

``typed_in_middle`` moves the cursor-line ``prompt`` behind ``[FIM_MID]``: the text typed on
the line becomes the start of the middle the model writes, so every keystroke only appends to
the tokens of the previous one (exact prefix reuse) instead of changing the middle of the
layout and invalidating the ~255-token suffix block behind it. The model sees the same text
either way: FIM training cuts the middle at random points, so a middle that starts at the
line's beginning is as much in distribution as a prefix that ends mid-line. Its suffix budget
does not shrink as the line grows (llama-server's does, by the prompt's length), so the suffix
block stays the same tokens while the user types.

Budgets: the prefix gets 3/4 of ``n_batch``, the suffix the rest minus the prompt and two
special tokens, the extra context what is left of ``n_ctx`` after a batch and twice the
server's default ``n_predict``. ``spm`` swaps the prefix and suffix blocks.

``room`` (tokens kept free for the completion) stands for llama-server's ``2 * n_predict``
reserve: with ``room = 256`` the layout is llama-server's run with ``-n 128``, the
editors' own ``n_predict``. llama-server's default ``-n -1`` reserves nothing, and with every
budget full its layout then exceeds the context by a few tokens and is rejected. The
extra-context budget must not depend on the request: it is the same for a warm-up and the
keystrokes after it, so the ring's tokens stay at the head of the prompt (prefix reuse) while
the prefix, the cursor line and the suffix change length. Should the layout leave fewer than
``room / 2`` tokens (a tiny ``n_ctx``), the oldest extra context, then the start of the
prefix, makes room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from localspec.engine.types import PromptLayout

Tokenize = Callable[[str], list[int]]  # text -> ids, no BOS, special-token parsing off

# "\n\n--- snippet ---\n\n": separates extra chunks when the vocab has no FIM_SEP token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
PROJECT_NAME = "myproject"  # llama-server's fixed repository name
FILE_PLACEHOLDER = "filename"  # llama-server's fixed name for the file being edited


@dataclass(frozen=True)
class FimIds:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


@dataclass(frozen=True)
class Extra:
    text: str
    filename: str = "tmp"


class ExtraText(Protocol):
    """Anything with an extra chunk's two fields: an Extra, or the request's own chunk objects
    (no copy per chunk and per keystroke)."""

    @property
    def text(self) -> str: ...

    @property
    def filename(self) -> str: ...


def tokenize_mixed(tokenize: Tokenize, value: str | Sequence[int | str]) -> list[int]:
    """Text, or a list mixing token ids and text pieces (each piece tokenized alone)."""
    if isinstance(value, str):
        return tokenize(value)
    out: list[int] = []
    for piece in value:
        if isinstance(piece, str):
            out.extend(tokenize(piece))
        else:
            out.append(piece)
    return out


def extra_blocks(
    tokenize: Tokenize, fim: FimIds, chunks: Sequence[ExtraText]
) -> tuple[list[int], list[int]]:
    """The extra context, and the lengths of its blocks: the repository header, then each
    chunk with its file separator; the current file's separator closes it, outside them."""
    out: list[int] = []
    blocks: list[int] = []
    if fim.rep is not None:
        out.append(fim.rep)
        out.extend(tokenize(PROJECT_NAME + "\n"))
        blocks.append(len(out))
    for chunk in chunks:
        start = len(out)
        if fim.sep is not None:
            out.append(fim.sep)
            out.extend(tokenize(chunk.filename + "\n"))
        else:
            out.extend(tokenize(SNIPPET_SEPARATOR))
        out.extend(tokenize(chunk.text))
        blocks.append(len(out) - start)
    if fim.sep is not None:
        out.append(fim.sep)
        out.extend(tokenize(FILE_PLACEHOLDER + "\n"))
    return out, blocks


def whole_blocks(
    extra: list[int], lengths: Sequence[int], has_header: bool, budget: int
) -> tuple[list[int], list[int]]:
    """The extra context cut to ``budget`` tokens for ring blocks: the repository header
    stays (it never moves, and everything after can attend to it), then the newest chunks that
    fit whole, then the current file's separator. A chunk cut in the middle would be a new
    block, to evaluate again, at every cut, where a whole one moves exactly. The ring ends at
    the first chunk that does not fit: skipping it for older ones that do (a fuller budget)
    lets chunks drop out and come back as the ring turns, each return an evaluation (r27 in
    docs/benchmarks.md: 1.3x the prompt tokens of the contiguous rule)."""
    if len(extra) <= budget:
        return extra, list(lengths)
    closing = len(extra) - sum(lengths)
    header = lengths[0] if has_header else 0
    if header + closing > budget:  # not even the frame fits: no extra context
        return [], []
    spans = []  # (start, length) of each chunk in ``extra``
    start = header
    for n in lengths[1:] if has_header else lengths:
        spans.append((start, n))
        start += n
    room = budget - header - closing
    kept: list[tuple[int, int]] = []
    for start, n in reversed(spans):
        if n > room:
            break
        kept.append((start, n))
        room -= n
    kept.reverse()
    head = [*extra[:header], *(t for s, n in kept for t in extra[s : s + n])]
    head.extend(extra[len(extra) - closing :])
    return head, [*([header] if header else []), *(n for _, n in kept)]


@dataclass(frozen=True)
class Budgets:
    prefix: int
    suffix: int
    extra: int


def budgets(
    *,
    n_prefix: int,
    n_suffix: int,
    n_extra: int,
    n_prompt: int,
    n_batch: int,
    n_ctx: int,
    n_predict: int,
) -> Budgets:
    """How many tokens of each part are kept (llama-server's 3:1 split of one batch).

    ``n_prompt`` is the cursor line's share taken from the suffix budget (0 when it sits
    behind FIM_MID)."""
    quarter = n_batch // 4
    return Budgets(
        prefix=min(n_prefix, 3 * quarter),
        suffix=min(n_suffix, max(0, quarter - (2 + n_prompt))),
        extra=min(max(0, n_ctx - n_batch - 2 * n_predict), n_extra),
    )


def infill_prompt(
    *,
    tokenize: Tokenize,
    fim: FimIds,
    input_prefix: str | Sequence[int | str],
    input_suffix: str | Sequence[int | str],
    input_extra: Sequence[ExtraText],
    prompt_tokens: Sequence[int],
    n_batch: int,
    n_ctx: int,
    n_predict: int = -1,
    bos: int | None = None,
    spm: bool = False,
    room: int = 0,
    typed_in_middle: bool = False,
    ring_only: bool = False,
    ring_blocks: bool = False,
) -> PromptLayout:
    """The token sequence llama-server evaluates for an /infill request, with its ring blocks.

    ``bos`` is the BOS id when the vocabulary adds one (``llama_vocab_get_add_bos``), else None.
    ``n_predict`` is the server's default (-1), not the request's, as in llama-server; a
    ``room`` > 0 replaces its reserve (``2 * n_predict``). ``ring_only`` gives just the
    extra-context head (an editor's ring warm-up: a prefix of the next keystroke's prompt).
    ``ring_blocks`` marks the extra context's blocks (repository header, chunks) in the result,
    for an engine that evaluates each on its own (docs/engine.md, "Ring blocks").
    """
    prefix = tokenize_mixed(tokenize, input_prefix)
    suffix = tokenize_mixed(tokenize, input_suffix)
    extra, extra_lengths = extra_blocks(tokenize, fim, input_extra)
    take = budgets(
        n_prefix=len(prefix),
        n_suffix=len(suffix),
        n_extra=len(extra),
        n_prompt=0 if typed_in_middle else len(prompt_tokens),
        n_batch=n_batch,
        n_ctx=n_ctx,
        n_predict=(room + 1) // 2 if room > 0 else n_predict,
    )
    n_prefix = take.prefix
    n_extra = take.extra
    n_total = n_extra + (bos is not None) + n_prefix + len(prompt_tokens) + take.suffix + 3
    overflow = n_total - (n_ctx - room // 2) if room > 0 else 0  # keep n_predict free
    if overflow > 0:
        cut = min(overflow, n_extra)
        n_extra -= cut
        n_prefix -= min(overflow - cut, n_prefix)
    ends_prefix, middle = ((), prompt_tokens) if typed_in_middle else (prompt_tokens, ())
    prefix_block = [fim.pre, *prefix[len(prefix) - n_prefix :], *ends_prefix]
    suffix_block = [fim.suf, *suffix[: take.suffix]]
    first, second = (suffix_block, prefix_block) if spm else (prefix_block, suffix_block)
    if ring_blocks:
        head, blocks = whole_blocks(extra, extra_lengths, fim.rep is not None, n_extra)
    else:
        head, blocks = (extra[len(extra) - n_extra :] if n_extra else []), []
    # the chunks see the repository header as if it stood right before each (an attention sink)
    sink = bool(blocks) and fim.rep is not None and head[:1] == [fim.rep]
    if ring_only:
        return PromptLayout(head, tuple(blocks), sink)
    tokens = [*head, *([bos] if bos is not None else []), *first, *second, fim.mid, *middle]
    return PromptLayout(tokens, tuple(blocks), sink)
