"""A model's vocabulary: tokenize/detokenize, special ids (BOS, EOG, FIM) and the pair check."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp.llama_cpp as C

from localspec.engine.errors import PairMismatchError

VOCAB_CHECK_START = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
VOCAB_MAX_SIZE_DIFF = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE


@dataclass(frozen=True)
class FimTokens:
    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def supported(self) -> bool:
        """/infill needs at least prefix, suffix and middle."""
        return None not in (self.pre, self.suf, self.mid)


def _opt(token: int) -> int | None:
    return None if token < 0 else int(token)


class Vocab:
    def __init__(self, handle: object) -> None:
        self.handle = handle
        self.n_vocab = int(C.llama_vocab_n_tokens(handle))
        self.type = int(C.llama_vocab_type(handle))
        self.bos = _opt(C.llama_vocab_bos(handle))
        self.eos = _opt(C.llama_vocab_eos(handle))
        self.add_bos = bool(C.llama_vocab_get_add_bos(handle))
        self.add_eos = bool(C.llama_vocab_get_add_eos(handle))
        self.fim = FimTokens(
            pre=_opt(C.llama_vocab_fim_pre(handle)),
            suf=_opt(C.llama_vocab_fim_suf(handle)),
            mid=_opt(C.llama_vocab_fim_mid(handle)),
            pad=_opt(C.llama_vocab_fim_pad(handle)),
            rep=_opt(C.llama_vocab_fim_rep(handle)),
            sep=_opt(C.llama_vocab_fim_sep(handle)),
        )
        eog = {t for t in range(self.n_vocab) if C.llama_vocab_is_eog(handle, t)}
        # FIM pad/rep/sep end an infill completion (llama.cpp marks them EOG too; be explicit)
        eog |= {t for t in (self.fim.pad, self.fim.rep, self.fim.sep) if t is not None}
        self.eog: frozenset[int] = frozenset(eog)
        self._pieces: dict[int, bytes] = {}

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Never adds BOS; ``special=False`` keeps literal control-token text as plain text."""
        data = text.encode("utf-8")
        if not data:
            return []
        cap = len(data) + 8
        arr = (C.llama_token * cap)()
        n = C.llama_tokenize(self.handle, data, len(data), arr, cap, False, special)
        if n < 0:
            cap = -n
            arr = (C.llama_token * cap)()
            n = C.llama_tokenize(self.handle, data, len(data), arr, cap, False, special)
        return list(arr[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token renders as (control tokens render empty unless ``special``)."""
        key = token if not special else -1 - token
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        # a buffer per miss: the engine's thread and the server's (n_probs candidates) both ask
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.handle, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        self._pieces[key] = out
        return out

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode(
            "utf-8", errors="replace"
        )

    def text(self, token: int) -> bytes:
        """The token's stored text (as in the GGUF), for the pair check."""
        return C.llama_vocab_get_text(self.handle, token) or b""


def check_pair(target: Vocab, draft: Vocab) -> None:
    """llama.cpp's compatibility rule for speculative decoding; the error names the mismatch."""
    if target.type != draft.type:
        raise PairMismatchError(f"vocab type differs: target {target.type}, draft {draft.type}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        raise PairMismatchError(
            f"BOS differs: target add_bos={target.add_bos} id={target.bos}, "
            f"draft add_bos={draft.add_bos} id={draft.bos}"
        )
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        raise PairMismatchError(
            f"EOS differs: target add_eos={target.add_eos} id={target.eos}, "
            f"draft add_eos={draft.add_eos} id={draft.eos}"
        )
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFF:
        raise PairMismatchError(
            f"vocab sizes differ by {diff} (> {VOCAB_MAX_SIZE_DIFF}): target "
            f"{target.n_vocab}, draft {draft.n_vocab}"
        )
    for i in range(VOCAB_CHECK_START, min(target.n_vocab, draft.n_vocab)):
        a, b = target.text(i), draft.text(i)
        if a != b:
            raise PairMismatchError(
                f"token {i} differs: target {a.decode('utf-8', 'replace')!r}, "
                f"draft {b.decode('utf-8', 'replace')!r}"
            )
