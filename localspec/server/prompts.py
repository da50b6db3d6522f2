"""How each endpoint's body becomes prompt tokens, run on the worker thread (tokenizing a ring
buffer of 16 chunks takes a few milliseconds; the event loop stays free meanwhile)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from localspec.engine.types import PromptLayout
from localspec.server.errors import InvalidRequest, NotSupported
from localspec.server.fim import ExtraText, FimIds, infill_prompt, tokenize_mixed
from localspec.server.tokcache import TokenCache

Prepare = Callable[[Any], PromptLayout]  # engine -> the prompt, as the engine evaluates it


_last_fim: tuple[Any, FimIds] | None = None  # (vocab, its ids): asked twice per request


def fim_ids(vocab: Any) -> FimIds:
    """The vocabulary's FIM tokens; 501 like llama-server when any of the three is missing."""
    global _last_fim
    last = _last_fim
    if last is not None and last[0] is vocab:
        return last[1]
    fim = vocab.fim
    missing = "".join(
        f"{name} token is missing. "
        for name, value in (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid))
        if value is None or value < 0
    )
    if missing:
        raise NotSupported(f"Infill is not supported by this model: {missing}")

    def opt(value: int | None) -> int | None:
        return None if value is None or value < 0 else value

    ids = FimIds(pre=fim.pre, suf=fim.suf, mid=fim.mid, rep=opt(fim.rep), sep=opt(fim.sep))
    _last_fim = (vocab, ids)
    return ids


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
    typed_in_middle: bool = False,
    ring_only: bool = False,
    ring_blocks: bool = False,
    cache: TokenCache | None = None,
) -> Prepare:
    cache = cache or TokenCache()

    user_ids = _user_ids(input_prefix, input_suffix)

    def prepare(engine: Any) -> PromptLayout:
        vocab = engine.vocab
        fim = fim_ids(vocab)
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
            n_batch=engine.n_batch,
            n_ctx=engine.n_ctx,
            bos=_bos(vocab),
            spm=spm,
            room=min(room, engine.n_ctx // 4),
            typed_in_middle=typed_in_middle,
            ring_only=ring_only,
            ring_blocks=ring_blocks,
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

    def prepare(engine: Any) -> PromptLayout:
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
