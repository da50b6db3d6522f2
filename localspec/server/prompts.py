"""A request's prompt: how each endpoint's body becomes the tokens the engine evaluates.

Three parts, one job. The FIM layout (``infill_prompt``) is llama-server's
``format_prompt_infill``; the token cache (``TokenCache``) tokenizes each text the editor
repeats once; the builders (``infill``, ``completion``) join them to a model's vocabulary and
run on the worker thread (tokenizing a ring buffer of 16 chunks takes a few milliseconds; the
event loop stays free meanwhile).

The FIM layout is a pure function of a tokenizer callable, the FIM token ids and the
batch/context budgets, so it is testable without a model. Every piece is tokenized on its own
with special-token parsing off (a literal ``<|fim_prefix|>`` typed in user code stays text);
the cursor-line ``prompt`` arrives already tokenized with parsing on, as llama-server does.

Layout (Qwen2.5-Coder's repo-level pattern)::

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n chunk0 ... [FIM_SEP]filename\\n   <- extra, end kept
    [BOS] [FIM_PRE] prefix(end kept) prompt [FIM_SUF] suffix(start kept) [FIM_MID]

``infill_layout`` "typed-in-middle" moves the cursor-line ``prompt`` behind ``[FIM_MID]``: the
text typed on the line becomes the start of the middle the model writes, so every keystroke
only appends to the tokens of the previous one (exact prefix reuse) instead of changing the
middle of the layout and invalidating the ~255-token suffix block behind it. The model sees the
same text either way: FIM training cuts the middle at random points, so a middle that starts at
the line's beginning is as much in distribution as a prefix that ends mid-line. Its suffix
budget does not shrink as the line grows (llama-server's does, by the prompt's length), so the
suffix block stays the same tokens while the user types.

Budgets: the prefix gets 3/4 of the ``window``, the suffix the rest minus the prompt and two
special tokens, the extra context what is left of ``n_ctx`` after the window and twice the
server's default ``n_predict``. llama-server's window is its ``n_batch``; here it is a setting
(``cache.infill_window``, the editors' recommended ``-b 1024`` by default), so the model sees
the same context whatever batch size the plan gave the engine. ``spm`` swaps the prefix and
suffix blocks.

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

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from localspec.engine.api import ServedEngine
from localspec.engine.types import PromptLayout
from localspec.engine.vocab import FimTokens
from localspec.server.errors import InvalidRequest, NotSupported
from localspec.settings import CacheSettings, InfillLayout, RingAttention

INFILL_WINDOW = CacheSettings().infill_window  # the setting's default
Prepare = Callable[[ServedEngine], PromptLayout]  # engine -> the prompt, as the engine evaluates it

# --- the FIM layout -------------------------------------------------------------------------------

Tokenize = Callable[[str], list[int]]  # text -> ids, no BOS, special-token parsing off

# "\n\n--- snippet ---\n\n": separates extra chunks when the vocab has no FIM_SEP token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
PROJECT_NAME = "myproject"  # llama-server's fixed repository name
FILE_PLACEHOLDER = "filename"  # llama-server's fixed name for the file being edited


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
    tokenize: Tokenize, fim: FimTokens, chunks: Sequence[ExtraText]
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
    lets chunks drop out and come back as the ring turns, each return an evaluation (more
    prompt tokens than the contiguous rule in the editor replay: bench/results/replay/
    history-15-*.json)."""
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
    window: int,
    n_ctx: int,
    n_predict: int,
) -> Budgets:
    """How many tokens of each part are kept (llama-server's 3:1 split of one batch).

    ``n_prompt`` is the cursor line's share taken from the suffix budget (0 when it sits
    behind FIM_MID)."""
    quarter = window // 4
    return Budgets(
        prefix=min(n_prefix, 3 * quarter),
        suffix=min(n_suffix, max(0, quarter - (2 + n_prompt))),
        extra=min(max(0, n_ctx - window - 2 * n_predict), n_extra),
    )


def ring_attention_in_effect(
    infill_layout: InfillLayout, ring_attention: RingAttention
) -> RingAttention:
    """How /infill's extra-context chunks attend: ``ring_attention`` in localspec's layout;
    llama-server's layout stays token for token its own, causal."""
    return ring_attention if infill_layout == "typed-in-middle" else "causal"


def infill_prompt(
    *,
    tokenize: Tokenize,
    fim: FimTokens,
    input_prefix: str | Sequence[int | str],
    input_suffix: str | Sequence[int | str],
    input_extra: Sequence[ExtraText],
    prompt_tokens: Sequence[int],
    window: int,
    n_ctx: int,
    n_predict: int = -1,
    bos: int | None = None,
    spm: bool = False,
    room: int = 0,
    infill_layout: InfillLayout = "llama-server",
    ring_only: bool = False,
    ring_attention: RingAttention = "causal",
) -> PromptLayout:
    """The token sequence llama-server evaluates for an /infill request, with its ring blocks.

    ``bos`` is the BOS id when the vocabulary adds one (``llama_vocab_get_add_bos``), else None.
    ``n_predict`` is the server's default (-1), not the request's, as in llama-server; a
    ``room`` > 0 replaces its reserve (``2 * n_predict``). ``ring_only`` gives just the
    extra-context head (an editor's ring warm-up: a prefix of the next keystroke's prompt).
    ``ring_attention`` "blocks" marks the extra context's blocks (repository header, chunks) in
    the result, for an engine that evaluates each on its own (docs/engine.md, "Ring blocks"),
    where ``ring_attention_in_effect`` says it applies.
    """
    typed_in_middle = infill_layout == "typed-in-middle"
    ring_blocks = ring_attention_in_effect(infill_layout, ring_attention) == "blocks"
    prefix = tokenize_mixed(tokenize, input_prefix)
    suffix = tokenize_mixed(tokenize, input_suffix)
    extra, extra_lengths = extra_blocks(tokenize, fim, input_extra)
    take = budgets(
        n_prefix=len(prefix),
        n_suffix=len(suffix),
        n_extra=len(extra),
        n_prompt=0 if typed_in_middle else len(prompt_tokens),
        window=window,
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


# --- the token cache ------------------------------------------------------------------------------

BLOCK = 256


class TokenCache:
    """Memoized tokenization and detokenization for the editor's repeated texts.

    llama-vscode resends the same ring-buffer chunks with every request, and while the user types on
    one line the prefix (the lines above) and the suffix (the lines below) do not change either;
    only the cursor line does. Tokenizing ~5k tokens of code costs tens of milliseconds in
    llama.cpp's BPE, so whole texts are cached by their exact string (exact by construction: the
    same text always gives the same tokens). Used on the worker thread only.

    The answer's ``prompt`` field is the detokenized prompt. A keystroke's prompt starts like the
    previous one (the ring chunks, the lines above), so the text is kept in blocks of 256 tokens
    aligned to the start: the blocks a recent prompt shares are reused after a list comparison (in
    C), the rest are joined from remembered per-token pieces (no Python call per token). One cache
    serves one model (the vocabulary never changes).
    """

    def __init__(
        self, max_tokens: int = 400_000, max_texts: int = 4096, max_recent: int = 4
    ) -> None:
        self.max_tokens = max_tokens
        self.max_texts = max_texts
        self.max_recent = max_recent
        self._texts: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._n_tokens = 0
        # the last prompts detokenized, newest first, each with its text in 256-token blocks
        self._recent: list[tuple[list[int], list[bytes]]] = []
        self._pieces: dict[int, bytes] = {}  # token -> its text, special tokens rendered
        self.hits = 0
        self.misses = 0

    def tokenize(self, vocab: Any, text: str, *, special: bool) -> list[int]:
        """``vocab.tokenize(text, special=special)``, remembered; the caller must not mutate it."""
        key = (text, special)
        found = self._texts.get(key)
        if found is not None:
            self._texts.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        tokens = vocab.tokenize(text, special=special)
        self._texts[key] = tokens
        self._n_tokens += len(tokens)
        while self._texts and (
            self._n_tokens > self.max_tokens or len(self._texts) > self.max_texts
        ):
            _, old = self._texts.popitem(last=False)
            self._n_tokens -= len(old)
        return tokens

    def detokenize(self, vocab: Any, tokens: list[int]) -> str:
        """The prompt as text with special tokens rendered, as llama-server shows it.

        ``tokens`` is kept (as the newest recent prompt): the caller must not mutate it.
        """
        piece = getattr(vocab, "piece", None)
        if not callable(piece):
            return vocab.detokenize(tokens, special=True)
        pieces = self._pieces

        def render(block: list[int]) -> bytes:
            try:
                return b"".join(map(pieces.__getitem__, block))
            except KeyError:
                for t in block:
                    if t not in pieces:
                        pieces[t] = piece(t, special=True)
                return b"".join(map(pieces.__getitem__, block))

        parts = self._shared_head(tokens)
        for start in range(len(parts) * BLOCK, len(tokens), BLOCK):
            parts.append(render(tokens[start : start + BLOCK]))
        self._recent.insert(0, (tokens, parts))
        del self._recent[self.max_recent :]
        return b"".join(parts).decode("utf-8", errors="replace")

    def _shared_head(self, tokens: list[int]) -> list[bytes]:
        """The rendered whole blocks a recent prompt shares with ``tokens`` from the start
        (compared as list slices, in C: the same ids, mostly the same int objects)."""
        best: list[bytes] = []
        whole = len(tokens) // BLOCK * BLOCK
        for recent, parts in self._recent:
            end = min(whole, len(recent) // BLOCK * BLOCK)
            same = 0
            while same < end and tokens[same : same + BLOCK] == recent[same : same + BLOCK]:
                same += BLOCK
            if same // BLOCK > len(best):
                best = parts[: same // BLOCK]
            if same == whole:  # nothing can share more
                break
        return best


# --- the builders ---------------------------------------------------------------------------------


def fim_tokens(vocab: Any) -> FimTokens:
    """The vocabulary's FIM tokens; 501 like llama-server when any of the three is missing."""
    fim: FimTokens = vocab.fim
    if fim.supported:
        return fim
    missing = "".join(
        f"{name} token is missing. "
        for name, value in (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid))
        if value is None
    )
    raise NotSupported(f"Infill is not supported by this model: {missing}")


def _bos(vocab: Any) -> int | None:
    return vocab.bos if vocab.add_bos and vocab.bos is not None and vocab.bos >= 0 else None


def check_ids(tokens: Sequence[int], n_vocab: int) -> None:
    if not tokens or (min(tokens) >= 0 and max(tokens) < n_vocab):  # C loops: fast on 5k ids
        return
    bad = next(t for t in tokens if not 0 <= t < n_vocab)
    raise InvalidRequest(f"token id {bad} is out of range: the vocabulary has {n_vocab}")


def infill(
    *,
    input_prefix: str | Sequence[int | str],
    input_suffix: str | Sequence[int | str],
    input_extra: Sequence[ExtraText],
    prompt: str,
    spm: bool,
    room: int = 0,
    window: int = INFILL_WINDOW,
    infill_layout: InfillLayout = "llama-server",
    ring_only: bool = False,
    ring_attention: RingAttention = "causal",
    cache: TokenCache | None = None,
) -> Prepare:
    cache = cache or TokenCache()

    user_ids = _user_ids(input_prefix, input_suffix)

    def prepare(engine: ServedEngine) -> PromptLayout:
        vocab = engine.vocab
        fim = fim_tokens(vocab)
        check_ids(user_ids, vocab.n_vocab)

        def plain(text: str) -> list[int]:
            return cache.tokenize(vocab, text, special=False)

        return infill_prompt(
            tokenize=plain,
            fim=fim,
            input_prefix=input_prefix,
            input_suffix=input_suffix,
            input_extra=input_extra,
            prompt_tokens=cache.tokenize(vocab, prompt, special=True) if prompt else [],
            window=window,
            n_ctx=engine.n_ctx,
            bos=_bos(vocab),
            spm=spm,
            room=min(room, engine.n_ctx // 4),
            infill_layout=infill_layout,
            ring_only=ring_only,
            ring_attention=ring_attention,
        )

    return prepare


def _user_ids(*values: str | Sequence[int | str]) -> list[int]:
    """Token ids the client wrote itself (the only ones that can be out of range)."""
    return [p for v in values if not isinstance(v, str) for p in v if not isinstance(p, str)]


def truncate(tokens: Sequence[int], n_ctx: int, n_keep: int = 0) -> list[int]:
    """llama-server's rule for a prompt that does not fit (before it dropped truncation): keep
    the first ``n_keep`` tokens (-1: as many as allowed, at most ``n_ctx - 4``), then drop
    whole blocks of half the remaining context from the start of the rest, so the newest
    text stays and the result is shorter than ``n_ctx``."""
    if len(tokens) < n_ctx:
        return list(tokens)
    keep = len(tokens) if n_keep < 0 else n_keep
    keep = max(0, min(n_ctx - 4, keep))
    block = max(1, (n_ctx - keep) // 2)
    erased = (len(tokens) - keep - block) // block
    return [*tokens[:keep], *tokens[keep + erased * block :]]


def completion(prompt: str | Sequence[int | str], cache: TokenCache | None = None) -> Prepare:
    """llama-server's /completion: special tokens parsed, BOS added before leading text."""
    cache = cache or TokenCache()

    def prepare(engine: ServedEngine) -> PromptLayout:
        vocab = engine.vocab

        def special(text: str) -> list[int]:
            return cache.tokenize(vocab, text, special=True)

        tokens = list(tokenize_mixed(special, prompt))  # never mutate a cached list
        starts_with_text = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))
        bos = _bos(vocab)
        if bos is not None and starts_with_text:
            tokens.insert(0, bos)
        check_ids(tokens, vocab.n_vocab)
        return PromptLayout(tokens)

    return prepare
