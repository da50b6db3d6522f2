"""The language of a request's code, as one of a few labels (metrics need a bounded set).

A client that says (a ``language`` field, a file name) is believed; otherwise Pygments reads the
code. Its ``guess_lexer`` over all ~600 lexers is slow (a second on first use) and picks
exotic ones for short snippets, so only the lexers of the labelled languages are asked: each
lexes the sample, and the one that finds the most keywords, builtins and preprocessor lines
for the fewest error tokens wins (a shebang, which Pygments' own ``analyse_text`` recognises,
counts in full).
Detection runs on a thread of its own, beside the request's prompt and generation, and each
slot remembers its last answer while the code's head is the same (an editor's keystrokes).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import PurePath

from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name, get_lexer_for_filename
from pygments.token import Comment, Error, Keyword, Name
from pygments.util import ClassNotFound

OTHER = "other"
# label -> the Pygments lexer that reads it; the labels are the metrics' language values
LEXERS = {
    "python": "python",
    "c": "c",
    "cpp": "cpp",
    "javascript": "javascript",
    "typescript": "typescript",
    "shell": "bash",
    "go": "go",
    "rust": "rust",
    "java": "java",
}
LABELS = (*LEXERS, OTHER)
# names clients and files use (VS Code language ids, Pygments aliases, fence tags)
_ALIASES = {
    "py": "python", "python3": "python", "c++": "cpp", "cc": "cpp", "cxx": "cpp", "h": "c",
    "hpp": "cpp", "js": "javascript", "jsx": "javascript", "javascriptreact": "javascript",
    "node": "javascript", "ts": "typescript", "tsx": "typescript",
    "typescriptreact": "typescript", "bash": "shell", "sh": "shell", "zsh": "shell",
    "shellscript": "shell", "ksh": "shell", "golang": "go", "rs": "rust",
}  # fmt: skip
SAMPLE_CHARS = 2000  # the code a guess reads: enough for a few dozen lines, a few ms to lex
MIN_KNOWN = 2  # keywords, builtins or preprocessor lines a language needs to be seen at all
MIN_SCORE = 0.1  # below it (prose, data, a language without a label): "other"
SLOTS_REMEMBERED = 64  # llama.vim's id_slot is a counter that keeps growing


def label(name: str | None) -> str | None:
    """A client's language name (or a Pygments alias) as a label; None for nothing given."""
    if not name:
        return None
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in LEXERS else OTHER


def from_filename(filename: str | None) -> str | None:
    """The label of a file's name (its extension, or a name such as ``Makefile``); None when
    there is no real name (llama-vscode's placeholder ``tmp``)."""
    if not filename or filename in ("tmp", "filename"):
        return None
    try:
        lexer = get_lexer_for_filename(PurePath(filename).name)
    except ClassNotFound:
        return OTHER
    return next((lb for a in lexer.aliases if (lb := label(a)) != OTHER), OTHER)


@cache
def _lexer(name: str) -> Lexer:
    return get_lexer_by_name(name)


def _score(lexer: Lexer, text: str) -> float:
    seen = errors = known = 0
    for kind, value in lexer.get_tokens(text):
        if not value.strip():
            continue
        seen += 1
        if kind in Error:
            errors += 1
        elif kind in Keyword or kind in Name.Builtin or kind in Comment.Preproc:
            known += 1
    if known < MIN_KNOWN:  # a word of prose may be some language's keyword
        return 0.0
    shebang = float(lexer.analyse_text(text)) if text.startswith("#!") else 0.0
    return (known - 3 * errors) / seen + shebang


def guess(code: str) -> str:
    """The label whose lexer reads ``code`` best (the first ``SAMPLE_CHARS``), or "other"."""
    text = code[:SAMPLE_CHARS]
    if not text.strip():
        return OTHER
    scores = {lb: _score(_lexer(name), text) for lb, name in LEXERS.items()}
    best = max(scores, key=lambda lb: scores[lb])  # ties: the order of LEXERS
    return best if scores[best] >= MIN_SCORE else OTHER


def _guess_or(code: str, fallback: str | None) -> str:
    found = guess(code)
    return fallback if found == OTHER and fallback is not None else found


_FENCE = re.compile(r"```([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def code_in_chat(texts: Iterable[str]) -> tuple[str | None, str]:
    """The code a chat is about: the last fenced block of the messages (its tag as a hint),
    else the last message's text."""
    last = ""
    found: tuple[str | None, str] | None = None
    for text in texts:
        if not text:
            continue
        last = text
        for m in _FENCE.finditer(text):
            if m.group(2).strip():
                found = (label(m.group(1)) if m.group(1) else None, m.group(2))
    return found if found is not None else (None, last)


class LanguageBook:
    """Each slot's language: the client's word, else a guess made on a thread of its own and
    remembered for the slot while the code's head (``key_text``) stays the same."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="localspec-language")
        self._lock = threading.Lock()
        self._slots: OrderedDict[int, tuple[bytes, str]] = OrderedDict()

    def resolve(
        self,
        slot: int,
        *,
        given: str | None,
        code: str,
        key_text: str | None = None,
        fallback: str | None = None,
    ) -> Future[str]:
        """The request's language; done at once when the client said it or the slot's last
        guess is for the same code, else when the guess thread has read ``code``.
        ``fallback``: the answer where the code reads as no labelled language (the files
        of an editor's ring buffer, say)."""
        done: Future[str] = Future()
        if given is not None:
            done.set_result(given)
            return done
        key = hashlib.blake2b(
            (code[:SAMPLE_CHARS] if key_text is None else key_text).encode(errors="replace"),
            digest_size=12,
        ).digest()
        with self._lock:
            hit = self._slots.get(slot)
            if hit is not None and hit[0] == key:
                self._slots.move_to_end(slot)
                done.set_result(hit[1])
                return done
        future = self._pool.submit(_guess_or, code, fallback)
        future.add_done_callback(lambda f: self._remember(slot, key, f))
        return future

    def _remember(self, slot: int, key: bytes, future: Future[str]) -> None:
        if future.exception() is not None:
            return
        with self._lock:
            self._slots[slot] = (key, future.result())
            self._slots.move_to_end(slot)
            while len(self._slots) > SLOTS_REMEMBERED:
                self._slots.popitem(last=False)

    def later(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn`` on the guess thread (work that must not hold up the event loop)."""
        self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
