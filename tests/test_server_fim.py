"""The FIM prompt layout against llama-server's rules, built by hand.

The layout is a pure function of a tokenizer callable; a one-character-per-token tokenizer
makes every budget visible. The same rules on Qwen's real tokenizer are checked end to end in
test_server_http.py (the slot's evaluated tokens).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localspec.engine.vocab import FimTokens
from localspec.server.prompts import (
    SNIPPET_SEPARATOR,
    Extra,
    budgets,
    extra_blocks,
    infill_prompt,
    tokenize_mixed,
)

PRE, SUF, MID, REP, SEP, BOS = -1, -2, -3, -4, -5, -6
QWEN_LIKE = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP)
NO_REPO = FimTokens(pre=PRE, suf=SUF, mid=MID)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_repo_level_layout_in_llama_server_order() -> None:
    extra = [Extra("def a():\n", "/src/a.py"), Extra("x = 1\n")]
    got = infill_prompt(
        tokenize=chars,
        fim=QWEN_LIKE,
        input_prefix="import os\n",
        input_suffix="\nprint(x)\n",
        input_extra=extra,
        prompt_tokens=chars("y ="),
        window=1024,
        n_ctx=4096,
    ).tokens
    want = [
        REP, *chars("myproject\n"),
        SEP, *chars("/src/a.py\n"), *chars("def a():\n"),
        SEP, *chars("tmp\n"), *chars("x = 1\n"),  # a chunk without filename is "tmp"
        SEP, *chars("filename\n"),  # the literal placeholder, not the real name
        PRE, *chars("import os\n"), *chars("y ="),
        SUF, *chars("\nprint(x)\n"),
        MID,
    ]  # fmt: skip
    assert got == want


def test_empty_extra_still_names_project_and_file() -> None:
    got = infill_prompt(
        tokenize=chars, fim=QWEN_LIKE, input_prefix="a", input_suffix="b", input_extra=[],
        prompt_tokens=[], window=64, n_ctx=4096,
    ).tokens  # fmt: skip
    assert got == [REP, *chars("myproject\n"), SEP, *chars("filename\n"), PRE, 97, SUF, 98, MID]


def test_without_repo_tokens_chunks_get_the_snippet_separator() -> None:
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="p", input_suffix="s",
        input_extra=[Extra("one", "f.py"), Extra("two")], prompt_tokens=[], window=64,
        n_ctx=4096,
    ).tokens  # fmt: skip
    sep = chars(SNIPPET_SEPARATOR)
    assert got == [*sep, *chars("one"), *sep, *chars("two"), PRE, ord("p"), SUF, ord("s"), MID]


def test_prefix_keeps_its_end_within_three_quarters_of_the_batch() -> None:
    prefix = "".join(chr(ord("A") + i % 26) for i in range(100))
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix=prefix, input_suffix="", input_extra=[],
        prompt_tokens=[], window=40, n_ctx=4096,
    ).tokens  # fmt: skip
    assert got == [PRE, *chars(prefix[-30:]), SUF, MID]  # 3 * (40 // 4) = 30


def test_suffix_keeps_its_start_within_the_last_quarter_minus_prompt() -> None:
    suffix = "0123456789abcdefghij"
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="", input_suffix=suffix, input_extra=[],
        prompt_tokens=chars("xyz"), window=40, n_ctx=4096,
    ).tokens  # fmt: skip
    # 40 // 4 - (2 + 3 prompt tokens) = 5 suffix tokens, from the start
    assert got == [PRE, *chars("xyz"), SUF, *chars("01234"), MID]


def test_long_prompt_leaves_no_room_for_suffix() -> None:
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="", input_suffix="suffix", input_extra=[],
        prompt_tokens=list(range(20)), window=40, n_ctx=4096,
    ).tokens  # fmt: skip
    assert got == [PRE, *range(20), SUF, MID]


def test_extra_keeps_its_end_within_context_minus_batch_and_predict() -> None:
    chunk = "".join(chr(ord("a") + i % 26) for i in range(200))
    n_ctx, window = 160, 100
    got = infill_prompt(
        tokenize=chars, fim=QWEN_LIKE, input_prefix="P", input_suffix="S",
        input_extra=[Extra(chunk, "big.txt")], prompt_tokens=[], window=window, n_ctx=n_ctx,
    ).tokens  # fmt: skip
    full_extra = extra_blocks(chars, QWEN_LIKE, [Extra(chunk, "big.txt")])[0]
    n_extra = n_ctx - window + 2  # the server's n_predict is -1: 2 * -1 adds two tokens
    assert got == [*full_extra[-n_extra:], PRE, ord("P"), SUF, ord("S"), MID]
    assert got[: len(got) - 5][-len(chars("filename\n")) :] == chars("filename\n")


def test_extra_budget_counts_a_positive_server_n_predict() -> None:
    take = budgets(n_prefix=0, n_suffix=0, n_extra=1000, n_prompt=0, window=100, n_ctx=400,
                   n_predict=50)  # fmt: skip
    assert take.extra == 400 - 100 - 100


def test_no_extra_when_the_batch_fills_the_context() -> None:
    got = infill_prompt(
        tokenize=chars, fim=QWEN_LIKE, input_prefix="P", input_suffix="S",
        input_extra=[Extra("chunk")], prompt_tokens=[], window=512, n_ctx=256,
    ).tokens  # fmt: skip
    assert got == [PRE, ord("P"), SUF, ord("S"), MID]


def test_bos_goes_after_the_extra_context_and_before_fim_pre() -> None:
    got = infill_prompt(
        tokenize=chars, fim=QWEN_LIKE, input_prefix="P", input_suffix="S", input_extra=[],
        prompt_tokens=[], window=64, n_ctx=4096, bos=BOS,
    ).tokens  # fmt: skip
    assert got[got.index(BOS) - len(chars("filename\n")) - 1] == SEP
    assert got[got.index(BOS) + 1] == PRE


def test_spm_puts_the_suffix_block_first() -> None:
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="P", input_suffix="S", input_extra=[],
        prompt_tokens=chars("q"), window=64, n_ctx=4096, bos=BOS, spm=True,
    ).tokens  # fmt: skip
    assert got == [BOS, SUF, ord("S"), PRE, ord("P"), ord("q"), MID]


def test_mixed_prefix_pieces_keep_token_ids_and_tokenize_text() -> None:
    assert tokenize_mixed(chars, ["ab", 7, "c"]) == [97, 98, 7, 99]
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix=["a", 5], input_suffix=[6, "b"],
        input_extra=[], prompt_tokens=[], window=64, n_ctx=4096,
    ).tokens  # fmt: skip
    assert got == [PRE, 97, 5, SUF, 6, 98, MID]


def test_room_is_llama_servers_n_predict_reserve() -> None:
    chunk = "".join(chr(ord("a") + i % 26) for i in range(300))
    args = dict(
        tokenize=chars, fim=QWEN_LIKE, input_extra=[Extra(chunk)], prompt_tokens=[],
        window=100, n_ctx=200,
    )  # fmt: skip
    short = infill_prompt(input_prefix="P", input_suffix="S", room=20, **args).tokens  # type: ignore[arg-type]
    # llama-server run with -n 10 reserves 2 * 10 tokens of context the same way
    assert short == infill_prompt(input_prefix="P", input_suffix="S", n_predict=10, **args).tokens  # type: ignore[arg-type]
    assert len(short) == 80 + 5  # extra budget n_ctx - window - room

    full = "x" * 300
    exact = infill_prompt(input_prefix=full, input_suffix=full, n_predict=10, **args).tokens  # type: ignore[arg-type]
    fitted = infill_prompt(input_prefix=full, input_suffix=full, room=20, **args).tokens  # type: ignore[arg-type]
    assert fitted == exact and len(fitted) == 200 - 20 + 1  # still leaves n_predict free

    tight = dict(args, n_ctx=120)  # the budget leaves no extra; prefix + suffix alone overflow
    fitted = infill_prompt(input_prefix=full, input_suffix=full, room=40, **tight).tokens  # type: ignore[arg-type]
    exact = infill_prompt(input_prefix=full, input_suffix=full, n_predict=20, **tight).tokens  # type: ignore[arg-type]
    assert len(exact) == 101 and len(fitted) == 120 - 20
    assert fitted == [PRE, *exact[2:]]  # the prefix lost its oldest token


def test_the_extra_context_head_does_not_move_while_the_user_types() -> None:
    """With a full ring the extra context's cut point must not depend on the prefix, cursor
    line or suffix lengths: a moving head would defeat prefix reuse on every keystroke."""
    chunk = "".join(chr(ord("a") + i % 26) for i in range(400))
    heads = set()
    for n_pre, n_suf, n_prompt in [(10, 5, 0), (10, 5, 1), (10, 5, 3), (90, 0, 2), (200, 200, 4)]:
        got = infill_prompt(
            tokenize=chars, fim=QWEN_LIKE, input_prefix="p" * n_pre, input_suffix="s" * n_suf,
            input_extra=[Extra(chunk)], prompt_tokens=list(range(1000, 1000 + n_prompt)),
            window=100, n_ctx=300, room=40,
        ).tokens  # fmt: skip
        assert len(got) <= 300 - 40 + 3  # llama-server's -n 20 layout, never trimmed
        heads.add(tuple(got[: got.index(PRE)]))
    assert len(heads) == 1


def test_room_then_trims_the_start_of_the_prefix() -> None:
    got = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="abcdefghij", input_suffix="", input_extra=[],
        prompt_tokens=[], window=40, n_ctx=12, room=4,
    ).tokens  # fmt: skip
    assert got == [PRE, *chars("defghij"), SUF, MID]  # 12 - 4/2 = 10 tokens: the prefix end


@settings(max_examples=300, deadline=None)
@given(
    n_pre=st.integers(0, 120),
    n_suf=st.integers(0, 120),
    n_prompt=st.integers(0, 12),
    chunk_sizes=st.lists(st.integers(0, 80), max_size=4),
    window=st.integers(4, 160),
    n_ctx=st.integers(16, 400),
    room=st.integers(0, 64),
    bos=st.booleans(),
    spm=st.booleans(),
)
def test_layout_invariants(
    n_pre: int, n_suf: int, n_prompt: int, chunk_sizes: list[int], window: int, n_ctx: int,
    room: int, bos: bool, spm: bool,
) -> None:  # fmt: skip
    prefix, suffix = "p" * n_pre, "s" * n_suf
    prompt = list(range(1000, 1000 + n_prompt))
    extra = [Extra("e" * n, f"f{i}") for i, n in enumerate(chunk_sizes)]
    kw = dict(
        tokenize=chars, fim=QWEN_LIKE, input_prefix=prefix, input_suffix=suffix,
        input_extra=extra, prompt_tokens=prompt, window=window, n_ctx=n_ctx,
        bos=BOS if bos else None, spm=spm,
    )  # fmt: skip
    exact = infill_prompt(n_predict=(room + 1) // 2 if room else -1, **kw).tokens  # type: ignore[arg-type]
    got = infill_prompt(room=room, **kw).tokens  # type: ignore[arg-type]
    assert got[-1] == MID and got.count(PRE) == got.count(SUF) == 1
    full_extra = extra_blocks(chars, QWEN_LIKE, extra)[0]
    head = got[: got.index(BOS if bos else (SUF if spm else PRE))]
    assert head == full_extra[len(full_extra) - len(head) :]  # extra keeps its end
    kept_prefix = [t for t in got[len(head) :] if t == ord("p")]
    kept_suffix = [t for t in got[len(head) :] if t == ord("s")]
    assert len(kept_suffix) == min(n_suf, max(0, window // 4 - 2 - n_prompt))
    if room == 0:
        assert got == exact
    else:
        floor = 3 + bos + n_prompt + len(kept_suffix)  # what room may not cut
        assert len(got) <= max(n_ctx - room // 2, floor)
        assert len(got) == len(exact) or len(got) == max(n_ctx - room // 2, floor)
        assert len(kept_prefix) <= min(n_pre, 3 * (window // 4))


# ---------------------------------------------------------------- typed text behind FIM_MID


def _typed(prompt: str, **kw: object) -> list[int]:
    args: dict = dict(
        tokenize=chars, fim=NO_REPO, input_prefix="def f():\n", input_suffix="\nreturn 1\n",
        input_extra=[Extra("x = 1\n", "a.py")], window=64, n_ctx=4096,
        infill_layout="typed-in-middle",
    )  # fmt: skip
    args.update(kw)
    return infill_prompt(prompt_tokens=chars(prompt), **args).tokens  # type: ignore[arg-type]


def test_typed_in_middle_puts_the_cursor_line_after_fim_mid() -> None:
    sep = chars(SNIPPET_SEPARATOR)
    assert _typed("    y =") == [
        *sep, *chars("x = 1\n"),
        PRE, *chars("def f():\n"),
        SUF, *chars("\nreturn 1\n"),
        MID, *chars("    y ="),
    ]  # fmt: skip
    spm = _typed("    y =", spm=True)  # the swap keeps the typed text last
    assert spm[-len("    y =") - 1 :] == [MID, *chars("    y =")]
    assert spm.index(SUF) < spm.index(PRE)


def test_typed_in_middle_keystrokes_only_append() -> None:
    """Each keystroke's tokens start with the previous keystroke's: exact prefix reuse. The
    suffix budget no longer shrinks with the line (llama-server's does)."""
    suffix = "".join(chr(ord("a") + i % 26) for i in range(100))
    line = "    value = compute(1, 2)"
    previous: list[int] = []
    for n in range(len(line) + 1):
        got = _typed(line[:n], input_suffix=suffix)
        assert got[: len(previous)] == previous
        assert got[got.index(SUF) + 1 : got.index(MID)] == chars(suffix[: 64 // 4 - 2])
        previous = got
    server = infill_prompt(
        tokenize=chars, fim=NO_REPO, input_prefix="def f():\n", input_suffix=suffix,
        input_extra=[], prompt_tokens=chars(line[:6]), window=64, n_ctx=4096,
    ).tokens  # fmt: skip
    assert server[server.index(SUF) + 1 : server.index(MID)] == chars(suffix[: 16 - 2 - 6])


def test_ring_blocks_are_the_header_and_the_newest_whole_chunks_that_fit() -> None:
    extra = [Extra("def a():\n", "a.py"), Extra("x = 1\n", "b.py")]
    kwargs = dict(
        tokenize=chars, fim=QWEN_LIKE, input_prefix="p\n", input_suffix="s\n",
        input_extra=extra, prompt_tokens=chars("y"), window=64, infill_layout="typed-in-middle",
    )  # fmt: skip
    whole = infill_prompt(**kwargs, n_ctx=4096, ring_attention="blocks")  # type: ignore[arg-type]
    header, a, b = len("myproject\n") + 1, 1 + len("a.py\ndef a():\n"), 1 + len("b.py\nx = 1\n")
    assert whole.blocks == (header, a, b) and whole.block_sink  # the chunks see the header
    # the blocks end where the current file's separator begins
    assert whole.tokens[header + a + b] == SEP
    assert whole.tokens[header + a + b + 1 :][:9] == chars("filename\n")
    assert infill_prompt(**kwargs, n_ctx=4096).blocks == ()  # type: ignore[arg-type]
    no_header = infill_prompt(**{**kwargs, "fim": NO_REPO}, n_ctx=4096, ring_attention="blocks")  # type: ignore[arg-type]
    assert len(no_header.blocks) == 2 and not no_header.block_sink
    # the extra context's budget is n_ctx - 64 + 2: 29 tokens hold the header (11) and the
    # current file's separator (10) but no chunk whole; 33 also hold chunk b (12), not a
    assert infill_prompt(**kwargs, n_ctx=91, ring_attention="blocks").blocks == (header,)  # type: ignore[arg-type]
    cut = infill_prompt(**kwargs, n_ctx=95, ring_attention="blocks")  # type: ignore[arg-type]
    assert cut.blocks == (header, b)
    assert cut.tokens[: header + b] == [
        *whole.tokens[:header],
        *whole.tokens[header + a : header + a + b],
    ]
    # a chunk too big to fit ends the ring there, though an older one would fit
    big = [Extra("def a():\n", "a.py"), Extra("z" * 40, "big.py"), Extra("x = 1\n", "b.py")]
    ends = infill_prompt(**{**kwargs, "input_extra": big}, n_ctx=112, ring_attention="blocks")  # type: ignore[arg-type]
    assert ends.blocks == (header, b)  # 50 tokens: a (15) would fit beside b, big (48) not
    # causal: the extra context keeps its end, cut mid-chunk (llama-server's rule)
    causal = infill_prompt(**kwargs, n_ctx=95)  # type: ignore[arg-type]
    assert (
        causal.blocks == ()
        and causal.tokens[:33] == whole.tokens[header + a + b + 10 - 33 : header + a + b + 10]
    )
    ring = infill_prompt(**kwargs, n_ctx=4096, ring_attention="blocks", ring_only=True)  # type: ignore[arg-type]
    assert ring.tokens == whole.tokens[: len(ring.tokens)] and ring.blocks == whole.blocks
