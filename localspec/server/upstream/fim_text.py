"""The fill-in-the-middle prompt as text, for an upstream that tokenizes it itself (``openai``).

The layout is local serving's own (:func:`localspec.server.prompts.infill_prompt`, the typed
cursor line behind the middle token so each keystroke only appends to the prompt the
upstream's prefix cache holds), run over characters instead of tokens: a text piece becomes
its code points, each FIM token one sentinel code point, and the budgets (in tokens) become
characters at :data:`CHARS_PER_TOKEN`. The sentinels are Unicode noncharacters, which never
occur in text (any the user's text holds are dropped first), replaced by the catalog model's
FIM token texts at the end.

One difference from local serving cannot be avoided with a text prompt: the upstream parses
special tokens in the whole text, so a literal ``<|fim_prefix|>`` typed in the code becomes
the control token there, where local serving keeps it as text.
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.catalog import FimText
from localspec.engine.vocab import FimTokens
from localspec.server.prompts import ExtraText, infill_prompt

# Code characters per token, the 5th percentile over 4,000-character windows of the Python
# standard library with Qwen's tokenizer (median 4.4): 95 % of windows take no more tokens
# than the budgets assume, so the prompt stays inside the upstream's context.
CHARS_PER_TOKEN = 3.4

_PRE, _SUF, _MID, _REP, _SEP = (0xFDD0 + i for i in range(5))  # noncharacters U+FDD0..
_STRIP = {cp: None for cp in range(0xFDD0, 0xFDF0)}


def _codepoints(text: str) -> list[int]:
    return list(map(ord, text.translate(_STRIP)))


def infill_text(
    fim: FimText,
    *,
    input_prefix: str,
    input_suffix: str,
    input_extra: Sequence[ExtraText],
    prompt: str,
    n_ctx: int,
    room: int = 256,
    spm: bool = False,
    ring_only: bool = False,
    window: int = 1024,
) -> str:
    """The prompt text of one /infill request (``ring_only``: just the extra-context head,
    for a ring warm-up). ``n_ctx`` and ``room`` are tokens."""
    ids = FimTokens(
        pre=_PRE,
        suf=_SUF,
        mid=_MID,
        rep=_REP if fim.rep else None,
        sep=_SEP if fim.sep else None,
    )
    layout = infill_prompt(
        tokenize=_codepoints,
        fim=ids,
        input_prefix=input_prefix,
        input_suffix=input_suffix,
        input_extra=input_extra,
        prompt_tokens=_codepoints(prompt),
        window=int(window * CHARS_PER_TOKEN),
        n_ctx=int(n_ctx * CHARS_PER_TOKEN),
        spm=spm,
        room=int(min(room, n_ctx // 4) * CHARS_PER_TOKEN),
        infill_layout="typed-in-middle",
        ring_only=ring_only,
    )
    text = "".join(map(chr, layout.tokens))
    for sentinel, token in (
        (_PRE, fim.pre),
        (_SUF, fim.suf),
        (_MID, fim.mid),
        (_REP, fim.rep),
        (_SEP, fim.sep),
    ):
        if token:
            text = text.replace(chr(sentinel), token)
    return text
