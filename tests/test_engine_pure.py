"""Pure engine logic: stop rules, the cache-reuse planner, the n-gram drafter, the policy."""

from __future__ import annotations

import pytest

from localspec.engine.cache import Pieces
from localspec.engine.cache_plan import Run, plan_reuse, refresh_window
from localspec.engine.engine import draft_window_start
from localspec.engine.ngram import NgramIndex
from localspec.engine.policy import FREE_BACKOFF, MAX_BACKOFF, SpecPolicy
from localspec.engine.sampling import canonical_samplers
from localspec.engine.stops import StopRules, find_partial_stop, incomplete_utf8_tail


def feed(rules: StopRules, pieces: list[str | bytes]) -> tuple[list[str], bool]:
    out = []
    for p in pieces:
        data = p.encode() if isinstance(p, str) else p
        step = rules.push(data, is_eog=False)
        out.append(step.text)
        if step.stop:
            return out, True
    return out, False


# --- stop rules --------------------------------------------------------------------------
def test_stop_string_full_match_stops_and_trims() -> None:
    rules = StopRules(stop=("END",))
    out, stopped = feed(rules, ["a", "b", "E", "N", "D", "x"])
    assert stopped
    assert rules.text == "ab"
    assert rules.stop_type == "word" and rules.stopping_word == "END"
    assert "".join(out) == "ab"


def test_partial_stop_is_held_back_then_released() -> None:
    rules = StopRules(stop=("END",))
    out, stopped = feed(rules, ["a", "E", "N", "x"])
    assert not stopped
    assert out == ["a", "", "", "ENx"]


def test_incomplete_utf8_is_held_back() -> None:
    rules = StopRules()
    euro = "€".encode()
    out, _ = feed(rules, [b"a", euro[:1], euro[1:2], euro[2:]])
    assert out == ["a", "", "", "€"]
    assert incomplete_utf8_tail(b"a" + euro[:2]) == 2
    assert incomplete_utf8_tail(b"a" + euro) == 0


def test_find_partial_stop() -> None:
    assert find_partial_stop("hello wor", "world") == 6
    assert find_partial_stop("hello", "world") == -1


def test_n_predict_budget() -> None:
    rules = StopRules(n_predict=2)
    _, stopped = feed(rules, ["a", "b", "c"])
    assert stopped and rules.stop_type == "limit" and rules.text == "ab"


def test_n_indent_cuts_a_dedented_line() -> None:
    rules = StopRules(n_indent=4)
    out, stopped = feed(rules, ["    x = 1", "\n", "    y = 2", "\n", "z", " = 3"])
    assert stopped and rules.stop_type == "limit"
    assert "".join(out) == rules.text  # the cut text was never streamed
    # the newline stays, the line's text from its first non-blank character is cut
    assert rules.text == "    x = 1\n    y = 2\n"


def test_n_indent_keeps_indented_lines() -> None:
    rules = StopRules(n_indent=4)
    _, stopped = feed(rules, ["a", "\n", "    b", "\n", "     c"])
    assert not stopped


def test_t_max_predict_ms_stops_at_a_newline_after_the_deadline() -> None:
    now = [0.0]
    rules = StopRules(t_max_predict_ms=100, clock=lambda: now[0])
    assert not rules.push(b"a", is_eog=False).stop
    now[0] = 0.5  # 500 ms later, but no newline yet
    assert not rules.push(b"b", is_eog=False).stop
    step = rules.push(b"\n", is_eog=False)
    assert step.stop and rules.stop_type == "limit" and rules.text == "ab\n"


def test_eog_stops_with_eos() -> None:
    rules = StopRules(stop=("x",))
    step = rules.push(b"", is_eog=True)
    assert step.stop and rules.stop_type == "eos"


# --- cache planner -----------------------------------------------------------------------
def test_plan_identical_prompt_reevaluates_only_the_last_token() -> None:
    toks = list(range(100))
    plan = plan_reuse(toks, toks, min_chunk=256)
    assert plan.n_prefix == 99 and plan.n_evaluated == 1


def test_plan_appended_prompt() -> None:
    plan = plan_reuse(list(range(50)), list(range(60)), min_chunk=256)
    assert plan.n_prefix == 50 and plan.n_evaluated == 10 and plan.runs == ()


def test_plan_deleted_middle_chunk_moves_the_rest() -> None:
    cached = list(range(300))
    prompt = cached[:100] + cached[150:]
    plan = plan_reuse(cached, prompt, min_chunk=64)
    assert plan.n_prefix == 100
    assert plan.runs == (Run(src=150, dst=100, n=149),)
    assert plan.n_evaluated == 1  # the last token, for fresh logits
    assert plan_reuse(cached, prompt, min_chunk=0).n_evaluated == 150  # reuse off


def test_plan_inserted_middle_keeps_the_tail_block() -> None:
    """The editor's keystroke: new tokens in the middle, the suffix block unchanged."""
    head, tail = list(range(1000, 1300)), list(range(2000, 2100))
    cached = [*head, 7, *tail]
    prompt = [*head, 8, 9, *tail]
    plan = plan_reuse(cached, prompt, min_chunk=256, tail_min=32)
    assert plan.n_prefix == 300
    assert plan.runs == (Run(src=301, dst=302, n=99),)
    assert plan.fresh == ((300, 302), (401, 402))
    assert plan.n_evaluated == 3
    # llama-server's rule (no short tail run) recomputes the whole tail
    assert plan_reuse(cached, prompt, min_chunk=256, tail_min=256).n_evaluated == 102


def test_plan_keeps_a_partly_evaluated_tail_block() -> None:
    """An aborted keystroke left only the start of the suffix block in the cache: the next
    keystroke moves that start and evaluates the rest, so the block gets built across keys."""
    head, tail = list(range(1000, 1300)), list(range(2000, 2100))
    cached = [*head, 7, *tail[:40]]  # cut off 40 tokens into the block
    prompt = [*head, 8, 9, *tail, 5]
    plan = plan_reuse(cached, prompt, min_chunk=256, tail_min=32)
    assert plan.runs == (Run(src=301, dst=302, n=40),)
    assert plan.fresh == ((300, 302), (342, 403))
    # no refresh while the block is being built: it would be redone on every key
    assert plan_reuse(cached, prompt, min_chunk=256, tail_min=32, tail_refresh=16).runs == (
        Run(src=301, dst=302, n=40),
    )
    # a run that ends neither the cache nor the prompt still needs min_chunk
    inner = [*head, 7, *tail[:40], 6, 6, 6]
    assert plan_reuse(inner, prompt, min_chunk=256, tail_min=32).runs == ()


def test_plan_tail_refresh_recomputes_the_start_of_the_tail_block() -> None:
    head, tail = list(range(1000, 1300)), list(range(2000, 2100))
    cached = [*head, 7, *tail]
    prompt = [*head, 8, 9, *tail]
    plan = plan_reuse(cached, prompt, min_chunk=256, tail_min=32, tail_refresh=16)
    assert plan.runs == (Run(src=317, dst=318, n=83),)
    assert plan.n_evaluated == 2 + 16 + 1
    # a tail too short to keep after the refresh is recomputed whole
    assert plan_reuse(cached, prompt, min_chunk=256, tail_min=90, tail_refresh=16).runs == ()


def test_refresh_window_splits_the_tail_run() -> None:
    head, tail = list(range(1000, 1300)), list(range(2000, 2100))
    plan = plan_reuse([*head, 7, *tail], [*head, 8, 9, *tail], min_chunk=256, tail_min=32)
    rolled = refresh_window(plan, 40, 16)
    assert rolled.runs == (Run(301, 302, 40), Run(357, 358, 43))
    assert rolled.fresh == ((300, 302), (342, 358), (401, 402))
    assert rolled.n_evaluated == plan.n_evaluated + 16
    assert refresh_window(plan, 0, 16).runs == (Run(317, 318, 83),)  # window at the start
    assert refresh_window(plan, 90, 16).runs == (Run(301, 302, 90),)  # window cut at the end
    assert refresh_window(plan, 99, 16) == plan  # nothing left to refresh


def test_plan_without_shift_support_keeps_only_the_prefix() -> None:
    cached = list(range(300))
    prompt = cached[:100] + cached[150:]
    assert plan_reuse(cached, prompt, min_chunk=64, can_shift=False).runs == ()


def test_plan_cached_generation_is_not_reused_past_the_prompt() -> None:
    cached = [*range(50), 900, 901, 902]  # prompt + generated tokens
    plan = plan_reuse(cached, list(range(50)), min_chunk=4)
    assert plan.n_prefix == 49 and plan.n_evaluated == 1


# --- n-gram drafter ----------------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_longest_match() -> None:
    idx = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], n_min=2)
    draft, match = idx.draft(3)
    assert draft == [4, 5, 9] and match == 3
    idx.extend([4])
    assert idx.draft(2)[0] == [5, 9]


def test_ngram_draft_runs_on_through_a_short_period() -> None:
    """A continuation that reaches the tail goes on with the same period: "0 . 0 . 0 ." drafts
    a full-length run instead of the two tokens before the tail."""
    idx = NgramIndex([5, 6, 0, 1, 0, 1, 0, 1], n_min=2)
    draft, match = idx.draft(7)
    assert draft == [0, 1, 0, 1, 0, 1, 0] and match >= 4
    row = [7, 8, 9, 3, 7, 8, 9, 3, 7, 8]  # a period of 4 (a table row)
    assert NgramIndex(row, n_min=2).draft(6)[0] == [9, 3, 7, 8, 9, 3]
    far = NgramIndex([1, 2, 3, 4, 5, 6, 9, 9, 1, 2], n_min=2)  # no repeat into the tail
    assert far.draft(3)[0] == [3, 4, 5]


def test_ngram_draft_ends_where_the_earlier_occurrences_disagree() -> None:
    """``agree``: "1 2" was followed by "3 4 7", "3 5 9" and "3 4 9": only the 3 is sure."""
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 7, 8, 1, 2]
    assert NgramIndex(toks).draft(4) == ([3, 4, 7, 8], 2)  # the most recent, all of it
    assert NgramIndex(toks).draft(4, agree=True) == ([3], 2)
    # an occurrence whose match is shorter than the best one has no say
    longer = [0, 1, 2, 3, 4, 9, 5, 1, 2, 3, 5, 9, 0, 1, 2]
    assert NgramIndex(longer).draft(3, agree=True) == ([3, 4, 9], 3)
    # occurrences agree as far as their continuations go: a short period still drafts on
    periodic = [5, 6, 0, 1, 0, 1, 0, 1]
    assert NgramIndex(periodic).draft(7, agree=True)[0] == [0, 1, 0, 1, 0, 1, 0]
    # every occurrence disagrees on the first token: no draft
    split = [1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramIndex(split).draft(3, agree=True)[0] == []


def test_ngram_no_match() -> None:
    idx = NgramIndex([1, 2, 3, 4], n_min=2)
    assert idx.draft(4) == ([], 0)


# --- policy ------------------------------------------------------------------------------
def test_draft_model_only_while_its_token_costs_under_a_share_of_a_step() -> None:
    pol = SpecPolicy()
    assert not pol.model_too_costly(0.5)  # nothing measured: a probe measures it
    pol.observe_target(1, 18.0)
    assert not pol.model_too_costly(0.5)  # the draft model's cost is not measured yet
    pol.observe_draft_cost("draft", 12.0)  # a Q4_1 SmolLM2 token beside its f32 target
    assert pol.model_too_costly(0.5)
    assert not pol.model_too_costly(0.0)  # 0: no cap
    pol.observe_draft_cost("draft", 1.0)
    pol.observe_draft_cost("draft", 1.0)
    pol.observe_draft_cost("draft", 1.0)
    assert not pol.model_too_costly(0.5)  # 12 -> 7.7 -> 6.4 -> 5.3 ms: under 9


def cpu_like_policy(n_max: int = 16) -> SpecPolicy:
    """Verify costs as measured on a 2-core CPU: a batch of 5 costs 2x a single token."""
    pol = SpecPolicy(n_max=n_max)
    for n, ms in {1: 55.0, 2: 84.0, 3: 98.0, 5: 107.0, 9: 131.0, 17: 200.0}.items():
        pol.observe_target(n, ms)
    return pol


def test_verify_cost_interpolates_and_extrapolates() -> None:
    pol = cpu_like_policy()
    assert pol.verify.cost(5) == 107.0
    assert 107.0 < pol.verify.cost(7) < 131.0
    assert pol.verify.cost(20) > 200.0


def test_policy_switches_a_failing_source_off_and_probes_later() -> None:
    pol = cpu_like_policy(8)
    pol.observe_draft_cost("draft", 24.0)
    for _ in range(6):
        pol.observe_result("draft", pol.plan("draft") or 2, 0)
        pol.tick()
    assert pol.plan("draft") == 0
    for _ in range(300):
        pol.tick()
    assert 0 < pol.plan("draft") <= pol.probe_len


def test_policy_reprobes_a_free_source_soon() -> None:
    """n-gram drafts cost nothing to make: after a string of misses they are probed again
    within FREE_BACKOFF steps, where a costly draft model backs off up to MAX_BACKOFF."""
    free, costly = cpu_like_policy(8), cpu_like_policy(8)
    costly.observe_draft_cost("draft", 24.0)
    for pol, name in ((free, "ngram"), (costly, "draft")):
        for _ in range(1000):
            k = pol.plan(name)
            if k:
                pol.observe_result(name, k, 0)
            pol.tick()
    assert free.source("ngram").backoff == FREE_BACKOFF
    assert costly.source("draft").backoff == MAX_BACKOFF


def test_policy_drafts_long_when_runs_are_long() -> None:
    pol = cpu_like_policy()
    for _ in range(10):
        pol.observe_result("ngram8", 16, 16)
    assert pol.plan("ngram8") >= 12
    assert pol.gain("ngram8", 16) > 3.0


def test_policy_sees_long_runs_behind_short_misses() -> None:
    """n-gram runs are bimodal: often 0-2 tokens, sometimes the whole draft."""
    pol = cpu_like_policy()
    for a in (1, 16, 0, 16, 2, 13, 16, 0):
        pol.observe_result("ngram", 16, a)
    assert pol.plan("ngram") >= 8


def test_policy_weighs_draft_cost() -> None:
    pol = cpu_like_policy()
    pol.observe_draft_cost("draft", 24.0)
    for _ in range(10):
        pol.observe_result("draft", 8, 8)
    cheap = pol.gain("draft", 8)
    pol.observe_draft_cost("draft", 500.0)
    for _ in range(30):
        pol.observe_draft_cost("draft", 500.0)
    assert pol.gain("draft", 8) < 1.0 < cheap


def test_policy_weighs_the_draft_prefill_against_the_tokens_left() -> None:
    """A draft model that must first evaluate 500 new prompt tokens pays on a long completion
    and not on a short one; unmeasured, it is tried (so it gets measured)."""
    pol = cpu_like_policy()
    pol.observe_draft_cost("draft", 10.0)
    for _ in range(10):
        pol.observe_result("draft", 8, 8)
    assert pol.prefill_pays(500, 40)  # no prefill measured yet
    stand_in = cpu_like_policy()
    stand_in.verify, stand_in.sources = pol.verify, pol.sources
    stand_in.observe_target_prefill(400, 2000.0)  # the target's price stands in for the draft's
    assert not stand_in.prefill_pays(500, 40) and stand_in.prefill_pays(500, 1000)
    pol.observe_draft_prefill(8, 800.0)  # too short a prefill to price a token: ignored
    assert pol.draft_prefill_ms < 0
    pol.observe_draft_prefill(400, 2000.0)  # 5 ms a token
    g = pol.best("draft")[1]
    assert g > 1.5
    short, long = 40, 1000
    assert short * 55.0 * (1 - 1 / g) < 500 * 5.0 < long * 55.0 * (1 - 1 / g)
    assert not pol.prefill_pays(500, short)
    assert pol.prefill_pays(500, long)
    assert pol.prefill_pays(20, short)  # a warm draft cache: a few tokens to catch up


def test_policy_prices_a_draft_catch_up_from_measured_batches() -> None:
    """A catch-up on a few tokens costs several times a token's share of a long prefill:
    once the draft's batch times are measured they price it, and the extra cost lowers the
    model's expected gain (what ``weigh_sources`` weighs against the n-gram draft)."""
    pol = cpu_like_policy()
    pol.observe_draft_cost("draft", 12.0)
    for _ in range(10):
        pol.observe_result("draft", 8, 8)
    assert pol.catch_up_ms(1) == 0.0  # the draft's first token's decode: in its token cost
    pol.observe_draft_prefill(400, 1360.0)  # 3.4 ms a token over a long prefill
    assert pol.catch_up_ms(9) == pytest.approx(8 * 3.4)  # no batch times yet: that price
    for n, ms in {1: 12.0, 2: 17.0, 8: 42.0, 32: 108.0}.items():
        pol.draft_batches.observe(n, ms)
    assert pol.catch_up_ms(8) == pytest.approx(30.0)  # 42 - 12, not 7 x 3.4
    assert pol.catch_up_ms(20) == pytest.approx(75.0 - 12.0)  # interpolated, 42..108
    assert pol.gain("draft", 8, pol.catch_up_ms(20)) < pol.gain("draft", 8)


def test_policy_drafts_unsure_tokens_while_the_target_takes_them() -> None:
    """``learn_p_min``: tokens the draft model is unsure of are drafted while the target's
    recent acceptance of them pays for a draft decode and a verify row, and not after it
    rejects them; before any is seen, the prior lets a few be drafted (so they get measured)."""
    assert not SpecPolicy().unsure_pays()  # no target step measured: nothing to weigh
    pol = cpu_like_policy()
    pol.draft_batches.observe(1, 400.0)  # before a draft's token cost, its decodes stand in
    assert not pol.unsure_pays()
    pol.observe_draft_cost("draft", 12.0)  # a row costs 84 - 55 .. 98 - 84 = 14 ms here
    assert pol.unsure_pays()  # 0.8 x 55 > 12 + 14
    for _ in range(6):
        pol.observe_unsure(False)
    assert not pol.unsure_pays()
    for _ in range(40):
        pol.observe_unsure(True)
    assert pol.unsure_pays()  # the window forgot the misses
    pol.observe_draft_cost("draft", 500.0)
    for _ in range(30):
        pol.observe_draft_cost("draft", 500.0)
    assert not pol.unsure_pays()  # a draft token costing more than a step never pays


def test_policy_first_step_is_plain() -> None:
    assert SpecPolicy().plan("ngram") == 0


# --- misc --------------------------------------------------------------------------------
def test_sampler_names() -> None:
    assert canonical_samplers(["top-k", "TopP", "temp", "infill", "penalties"]) == (
        "top_k", "top_p", "temperature", "infill", "penalties",
    )  # fmt: skip
    with pytest.raises(ValueError, match="bogus"):
        canonical_samplers(["top_k", "bogus"])


def test_draft_window_start_moves_in_coarse_steps() -> None:
    assert draft_window_start(300, 512) == 0
    starts = {draft_window_start(n, 512) for n in range(600, 640)}
    assert starts == {128}
    assert all(n - draft_window_start(n, 512) <= 512 for n in range(513, 3000))


def test_policy_limit_takes_the_best_length_on_offer() -> None:
    pol = cpu_like_policy()
    for _ in range(12):
        pol.observe_result("draft", 8, 8)  # long runs: the best length is long
    pol.source("draft").cost_ms = 0.0
    assert pol.plan("draft") > 4
    assert pol.plan("draft", limit=3) == 3
    assert pol.plan("draft", limit=0) == 0


def test_policy_hidden_draft_cost_is_free() -> None:
    """A pipelined draft model's tokens cost the target nothing: only the longer verify
    batch counts, so a mediocre draft still pays where a sequential one does not."""
    seq, par = cpu_like_policy(), SpecPolicy(hidden=("draft",))
    par.verify = seq.verify
    for pol in (seq, par):
        pol.observe_draft_cost("draft", 20.0)  # half a target token
        for _ in range(12):
            pol.observe_result("draft", 4, 2)
    assert par.source("draft").cost_ms == 0.0
    assert par.best("draft")[1] > seq.best("draft")[1]
    assert par.plan("draft") > 0


def test_a_shared_step_keeps_the_likeliest_drafted_tokens_across_sequences() -> None:
    from localspec.engine.policy import VerifyCost, share_step

    gpu_like = VerifyCost(ms={1: 10.0, 64: 11.0})  # a step of 64 tokens costs about one
    cpu_like = VerifyCost(ms={1: 10.0, 2: 16.0, 4: 22.0, 8: 40.0, 16: 70.0})
    sure, unsure = [0.95, 0.9, 0.85, 0.8], [0.3, 0.1, 0.05, 0.01]
    assert share_step([sure, unsure], gpu_like) == [4, 4]  # every token nearly free
    # on a CPU the sure sequence's draft would pay 1.4x the step's yield per ms, the unsure
    # one's less than it costs; a shared step keeps the first only at a lower bar
    kept = share_step([sure, unsure], cpu_like, min_gain=1.05)
    assert kept[0] >= 2 and kept[1] == 0
    assert share_step([sure, unsure], cpu_like) == [0, 0]  # below SHARED_MIN_GAIN
    assert share_step([unsure, unsure], cpu_like, min_gain=1.0) == [0, 0]  # plain pays best
    assert share_step([[], []], cpu_like) == [0, 0]
    assert share_step([sure], VerifyCost()) == [0]  # nothing measured: a plain step first


def test_a_shared_step_prices_the_draft_models_tokens_before_they_are_made() -> None:
    from localspec.engine.policy import VerifyCost, share_step

    gpu_like = VerifyCost(ms={1: 10.0, 64: 11.0})
    sure = [0.95, 0.9, 0.85, 0.8]
    # free draft batches: the model's offer is weighed as a made draft's would be
    assert share_step([sure, sure], gpu_like, made=[True, False]) == share_step(
        [sure, sure], gpu_like
    )
    # each depth of the model's tokens costs a draft batch: dear ones are not made at all,
    # while the n-gram draft beside them, free to make, keeps its tokens
    assert share_step([sure, sure], gpu_like, made=[True, False], draft_ms=30.0) == [0, 4]
    # one draft batch serves every sequence the model drafts for: cheap enough, both keep
    assert share_step([sure, sure], gpu_like, made=[True, True], draft_ms=1.0) == [4, 4]


def test_a_shared_step_counts_the_fixed_drafts_of_other_sequences() -> None:
    from localspec.engine.policy import VerifyCost, share_step

    cpu_like = VerifyCost(ms={1: 10.0, 2: 16.0, 4: 22.0, 8: 40.0, 16: 70.0})
    sure = [0.95, 0.9, 0.85, 0.8]
    alone = share_step([sure], cpu_like)
    crowded = share_step([sure], cpu_like, others=8)  # a step already 8 tokens long
    assert alone[0] >= crowded[0]


def test_a_piece_after_one_that_ran_alone_holds_what_the_budget_buys() -> None:
    pieces = Pieces(chunk=128, most=1024, budget_ms=500.0)
    assert pieces.size() == 128  # no price yet
    pieces.ran(128, 64.0)  # alone, 0.5 ms a token
    assert pieces.size() == 1000
    pieces.ran(128, 12.8)  # 0.1 ms a token: more than a batch holds
    assert pieces.size() == 1024
    pieces.ran(200, 1000.0)  # deep in the context, 5 ms a token: never below a chunk
    assert pieces.size() == 128
    pieces.ran(128, 64.0)
    pieces.ran(128, None)  # it shared a step: back to chunks
    assert pieces.size() == 128
    pieces.ran(16, 1.0)  # too short to price (mostly fixed cost)
    assert pieces.size() == 128
    assert Pieces(128, 1024, budget_ms=0.0, price=0.1).size() == 128  # no budget: chunks
