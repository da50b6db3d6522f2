"""When speculation pays, and how long a draft should be: a small cost model per request.

Pure logic fed with measured times. For the target it keeps the measured time of a verify
batch of each size (on a CPU a batch of 5 costs about twice a single token, a batch of 17
about 3.5 times: far from linear, so a table, not a slope). Per draft source (the draft model;
the n-gram drafter split by how long its match was) it keeps the recent accepted-run lengths
and the cost of one draft token. The expected speed-up of a draft of length k is

    (E[min(R, k)] + 1) * t(1) / (k * c + t(k + 1))

with R the accepted run length (a run that consumed the whole draft counts as its length:
a lower bound). The chosen k maximises it; a source whose best value stays below
``min_gain`` is switched off for the request and re-tried with a short probe after a
back-off that doubles each time the probe fails, so a source whose acceptance collapsed
costs a small, shrinking share. A pipelined draft model (``hidden``) drafts on its own core:
its c is 0 and ``plan(limit=...)`` picks among the tokens it has ready.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 24  # recent drafts per source that shape its estimate
MAX_BACKOFF = 256  # steps a failing draft model stays off, at most
FREE_BACKOFF = 16  # the same for a source whose drafts cost nothing to make
UNSURE_PRIOR = 0.8  # one pseudo-observation: unsure tokens get drafted until measured
MIN_PREFILL_SAMPLE = 32  # draft prefills shorter than this do not update its per-token cost


@dataclass
class SourceStats:
    prior: float  # per-token acceptance assumed before any draft is seen
    cost_ms: float  # one draft token; < 0: not measured yet
    # recent drafts: (accepted, drafted); a fully accepted draft is censored (the run might
    # have gone on), so the run-length distribution is estimated with Kaplan-Meier
    runs: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    off_until: int = 0  # step number before which the source is skipped
    backoff: int = 4

    def survival(self, k: int) -> list[float]:
        """S(j) = P(run >= j) for j = 1..k (Kaplan-Meier over the recent drafts; past the
        observed lengths, the last estimated per-token acceptance carries on)."""
        at_risk = [0] * (k + 2)
        failed = [0] * (k + 2)
        for a, d in self.runs:
            # at risk at positions 1..min(d, a + 1); the run failed at a + 1 if a < d
            last = min(d, a + 1, k)
            at_risk[1] += 1
            at_risk[last + 1] -= 1
            if a < d and a + 1 <= k:
                failed[a + 1] += 1
        out: list[float] = []
        s = 1.0
        cont = self.prior
        risk = 0
        for j in range(1, k + 1):
            risk += at_risk[j]
            if risk > 0:
                # half a pseudo-observation of the prior: a lone sample does not decide alone
                cont = (risk - failed[j] + 0.5 * self.prior) / (risk + 0.5)
            s *= cont
            out.append(s)
        return out

    def expected_accepted(self, k: int) -> float:
        return sum(self.survival(k))


@dataclass
class VerifyCost:
    """Measured ms of a target decode by batch size (EMA), interpolated between sizes."""

    ms: dict[int, float] = field(default_factory=dict)
    prior_slope: float = 0.15  # before measurements: optimistic, so drafting gets tried

    def observe(self, n: int, ms: float) -> None:
        old = self.ms.get(n)
        self.ms[n] = ms if old is None else 0.8 * old + 0.2 * ms

    @property
    def t1(self) -> float:
        return self.ms.get(1, 0.0)

    def cost(self, n: int) -> float:
        t1 = self.t1
        if n in self.ms:
            return max(self.ms[n], t1)
        pts = sorted(self.ms.items())
        lo = max(((k, v) for k, v in pts if k < n), default=(1, t1))
        hi = min(((k, v) for k, v in pts if k > n), default=None)
        if hi is None:
            below = [(k, v) for k, v in pts if k < lo[0]]
            slope = (lo[1] - below[-1][1]) / (lo[0] - below[-1][0]) if below else 0.0
            slope = max(slope, t1 * self.prior_slope)
            return lo[1] + slope * (n - lo[0])
        frac = (n - lo[0]) / (hi[0] - lo[0])
        return lo[1] + frac * (hi[1] - lo[1])


@dataclass
class SpecPolicy:
    """Adaptive draft lengths for one request (mode "auto")."""

    n_max: int = 16
    min_gain: float = 1.05
    probe_len: int = 2
    verify: VerifyCost = field(default_factory=VerifyCost)
    step: int = 0
    sources: dict[str, SourceStats] = field(default_factory=dict)
    # sources whose draft cost the target never waits for (a pipelined draft model)
    hidden: tuple[str, ...] = ()
    _best: dict[tuple[str, int], tuple[object, int, list[float]]] = field(
        default_factory=dict, repr=False
    )
    # prompt prefill, ms per token, of the draft model and of the target (EMAs; < 0: not
    # measured yet). The target's stands in for the draft's until the draft has prefilled.
    draft_prefill_ms: float = -1.0
    target_prefill_ms: float = -1.0
    # the draft model's tokens drafted below p_min ("unsure"), by whether the target took
    # them (SpecSettings.learn_p_min): a draft that is the target's own weights quantized is
    # unsure where the target is too, and they still agree; a weaker draft's unsure tokens
    # are mostly rejected
    unsure: deque[bool] = field(default_factory=lambda: deque(maxlen=2 * WINDOW))
    # the draft model's decode time by tokens in the batch: a catch-up on a few tokens costs
    # several times a token's share of a long prefill
    draft_batches: VerifyCost = field(default_factory=VerifyCost)

    def source(self, name: str) -> SourceStats:
        s = self.sources.get(name)
        if s is None:
            is_model = name == "draft" and name not in self.hidden
            s = SourceStats(prior=0.8, cost_ms=-1.0 if is_model else 0.0)
            self.sources[name] = s
        return s

    # --- measurements -------------------------------------------------------------------
    def observe_target(self, n_tokens: int, ms: float) -> None:
        self.verify.observe(n_tokens, ms)

    def observe_draft_cost(self, source: str, ms_per_token: float) -> None:
        if source in self.hidden:
            return
        s = self.source(source)
        s.cost_ms = _ema(s.cost_ms, ms_per_token)

    def observe_draft_prefill(self, n_tokens: int, ms: float) -> None:
        self.draft_prefill_ms = _prefill_ema(self.draft_prefill_ms, n_tokens, ms)

    def observe_target_prefill(self, n_tokens: int, ms: float) -> None:
        self.target_prefill_ms = _prefill_ema(self.target_prefill_ms, n_tokens, ms)

    def prefill_pays(self, n_tokens: int, horizon: int) -> bool:
        """Whether catching the draft model up on ``n_tokens`` of prompt is repaid by its
        drafts over the next ``horizon`` tokens.

        The draft model must evaluate every new prompt too: at a new cursor location that is
        hundreds of tokens, often more time than its drafts save on a short completion (the
        reason llama-server's draft mode doubles editor latency). Unmeasured, it pays (so it
        gets measured) unless the target's own prefill price says it does not: a draft model
        is smaller, so that price errs on the side of the draft, and on a CPU where the two
        cost about the same it spares the first location a draft prefill."""
        t1 = self.verify.t1
        price = self.draft_prefill_ms if self.draft_prefill_ms >= 0 else self.target_prefill_ms
        if price < 0 or t1 <= 0:
            return True
        g = self.best("draft")[1]
        saved = horizon * t1 * (1.0 - 1.0 / g) if g > 1.0 else 0.0
        return saved > n_tokens * price

    def observe_result(self, source: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        s = self.source(source)
        s.runs.append((accepted, drafted))
        self._best.pop((source, self.n_max), None)
        if self.best(source)[1] >= self.min_gain:
            s.backoff = 4
        elif s.off_until <= self.step:
            s.off_until = self.step + s.backoff
            # a source whose drafts cost nothing to make (n-grams, a pipelined draft model)
            # is re-probed soon: a failed 2-token probe wastes a fraction of one step, and a
            # repetitive stretch it would catch (a table, a list of constants) pays 3-4x
            s.backoff = min(s.backoff * 2, MAX_BACKOFF if s.cost_ms != 0.0 else FREE_BACKOFF)

    # --- decisions ----------------------------------------------------------------------
    def gain(self, source: str, k: int, extra_ms: float = 0.0) -> float:
        """Expected speed-up of drafting k tokens from ``source`` over a plain step
        (``extra_ms``: what making this draft costs beyond its tokens, a catch-up)."""
        s = self.source(source)
        t1 = self.verify.t1
        if k <= 0 or t1 <= 0:
            return 1.0
        produced = s.expected_accepted(k) + 1.0
        cost = k * max(s.cost_ms, 0.0) + extra_ms + self.verify.cost(k + 1)
        return produced * t1 / cost

    def best(self, source: str, limit: int | None = None) -> tuple[int, float]:
        """The best draft length (at most ``limit``) and its expected gain."""
        curve = self._curve(source)
        n = len(curve) if limit is None else min(limit, len(curve))
        best_k, best_g = 0, 1.0
        for k in range(1, n + 1):
            if curve[k - 1] > best_g:
                best_k, best_g = k, curve[k - 1]
        return best_k, best_g

    def _curve(self, source: str) -> list[float]:
        """Expected gain of each draft length 1..n_max (recomputed every few steps: the
        estimates move slowly and this runs on every decoding step)."""
        key = (source, self.n_max)
        hit = self._best.get(key)
        version = (len(self.sources[source].runs), self.sources[source].cost_ms)
        if hit is not None and hit[0] == version and self.step - hit[1] < 4:
            return hit[2]
        result = self._curve_now(source)
        self._best[key] = (version, self.step, result)
        return result

    def _curve_now(self, source: str) -> list[float]:
        s = self.source(source)
        t1 = self.verify.t1
        if t1 <= 0:
            return []
        out: list[float] = []
        produced = 1.0
        for k, surv in enumerate(s.survival(self.n_max), start=1):
            produced += surv
            out.append(produced * t1 / (k * max(s.cost_ms, 0.0) + self.verify.cost(k + 1)))
        return out

    def plan(self, source: str, *, allow_probe: bool = True, limit: int | None = None) -> int:
        """Draft length to use now for ``source`` (0: do not draft from it this step).
        ``allow_probe=False``: only when the estimate says it pays (a probe that would
        first need the draft model's prompt prefill is not worth it). ``limit``: at most
        this many tokens are on offer (a pipelined draft hands over what it has)."""
        s = self.source(source)
        cap = self.n_max if limit is None else min(limit, self.n_max)
        if self.verify.t1 <= 0 or cap <= 0:
            return 0  # a plain step first: every estimate is relative to it
        if s.cost_ms < 0:
            return min(self.probe_len * 2, cap)  # measure the draft model
        if self.step < s.off_until:
            return 0
        k, g = self.best(source, cap)
        if g >= self.min_gain:
            return k
        if self.best(source)[1] >= self.min_gain:
            return 0  # pays with more tokens than are on offer now
        # off: a short probe once the back-off expires keeps the estimate fresh
        return min(self.probe_len, cap) if allow_probe else 0

    def catch_up_ms(self, behind: int) -> float:
        """What bringing the draft model ``behind`` tokens up to date costs beyond the one
        decode a draft's first token costs anyway."""
        if behind <= 1:
            return 0.0
        table = self.draft_batches
        if table.t1 > 0 and len(table.ms) > 1:
            return max(table.cost(behind) - table.t1, 0.0)
        price = (
            self.draft_prefill_ms if self.draft_prefill_ms >= 0 else self.source("draft").cost_ms
        )
        return (behind - 1) * max(price, 0.0)

    def observe_unsure(self, accepted: bool) -> None:
        self.unsure.append(accepted)

    def unsure_pays(self) -> bool:
        """Whether the draft model should draft on past a token it is unsure of: the
        target's recent acceptance of such tokens (with a prior pseudo-count that lets it
        be measured) pays for the token's draft decode and its verify row."""
        t1, cost = self.verify.t1, self.source("draft").cost_ms
        if cost < 0:  # measured only over drafts of two tokens or more: its decodes stand in
            cost = max(self.draft_batches.t1, 0.0)
        if t1 <= 0:
            return False
        rate = (sum(self.unsure) + UNSURE_PRIOR) / (len(self.unsure) + 1.0)
        row = self.verify.cost(3) - self.verify.cost(2)
        return rate * t1 > cost + max(row, 0.0)

    def model_too_costly(self, share: float) -> bool:
        """Whether a draft model token costs at least ``share`` of a target step (``share`` 0:
        never; unmeasured: not yet, so a probe measures it). Its cost model prices the tokens
        but not the catch-ups that keep its cache in step, and a step it drafts is one the free
        n-gram drafts cannot use: where a token costs most of a step, n-grams alone win."""
        cost, t1 = self.source("draft").cost_ms, self.verify.t1
        return share > 0 and cost >= 0 and t1 > 0 and cost >= share * t1

    def is_off(self, source: str, lead: int = 0) -> bool:
        """Whether ``source`` is switched off for at least ``lead`` more steps."""
        return self.step + lead < self.source(source).off_until

    def tick(self) -> None:
        self.step += 1


# A shared step drafts only where its yield per ms beats a plain step's by this much. Its
# drafts speed some sequences and not others, and a speed-up the step's total does not show
# clearly is lost again at the end: the sequences that finish first leave the last ones to
# run in smaller batches (and, from editors that send on, put new prompts into their steps).
# On a CPU, where a step's time grows with its tokens, drafts the model priced only a little
# above 1x left the aggregate where it was and raised the p95 (bench/results/steps/
# history-21-*.json compares the bars); where a step's cost is flat in its tokens (a GPU) the
# gain is well above the bar, and the drafts stay.
SHARED_MIN_GAIN = 1.5


def share_step(
    offers: list[list[float]],
    cost: VerifyCost,
    *,
    others: int = 0,
    min_gain: float = SHARED_MIN_GAIN,
    made: list[bool] | None = None,
    draft_ms: float = 0.0,
) -> list[int]:
    """Draft lengths for the sequences of one step, from the measured cost of a step of that
    many tokens.

    ``offers[i]`` is sequence i's drafted tokens' survival probabilities (S(1) >= S(2) ...:
    the chance the target accepts the first j of them). A step of T tokens costs
    ``cost.cost(T)`` and yields, in expectation, one token per sequence plus the sum of the
    kept survivals; the kept tokens are the likeliest ones across all sequences (each
    sequence's in order), as many as maximise the yield per ms. On a CPU, where a step's
    time grows with its tokens, that keeps the few sure ones; on a GPU, nearly all. A single
    sequence gets the length the single-sequence rule would pick (the same curve).
    ``others``: tokens of the step's other sequences (whose drafts are fixed), counted as
    one emitted token each in the step's yield.

    ``made[i]``: sequence i's offer is the draft model's, not made yet (its survivals are the
    model's record). Its tokens cost a draft batch each, for every such sequence at once, so
    keeping them to depth d adds ``d * draft_ms`` to the step: a draft model is only run for
    the tokens the step keeps, and not at all where its tokens do not pay for themselves."""
    n = len(offers)
    if n == 0:
        return []
    made = made or [False] * n
    items = sorted(
        ((s, i, j) for i, survival in enumerate(offers) for j, s in enumerate(survival)),
        key=lambda x: (-x[0], x[2]),
    )
    base = n + others
    t_plain = cost.cost(base)
    if t_plain <= 0:
        return [0] * n
    plain = base / t_plain
    best, kept = plain, []
    step_ms = [cost.cost(base + k) for k in range(len(items) + 1)]  # once: every depth reads it
    # the model's tokens to depth d cost d draft batches whichever sequences they are for:
    # for each depth, the likeliest tokens that fit it, as many as maximise the yield per ms
    depths = max((len(o) for o, m in zip(offers, made, strict=True) if m), default=0)
    for depth in range(depths + 1):
        fits = [it for it in items if not made[it[1]] or it[2] < depth]
        produced, extra = float(base), depth * draft_ms
        for k, (s, _, _) in enumerate(fits, start=1):
            produced += s
            rate = produced / (step_ms[k] + extra)
            if rate > best:
                best, kept = rate, fits[:k]
    if best < plain * min_gain:
        return [0] * n
    lengths = [0] * n
    for _, i, _ in kept:
        lengths[i] += 1
    return lengths


def ngram_source(match_len: int) -> str:
    """The n-gram drafter's estimates are kept apart by match length: a long match (code
    being copied) is far more reliable than a two-token one."""
    return "ngram" if match_len < 4 else "ngram4" if match_len < 8 else "ngram8"


def _ema(old: float, value: float) -> float:
    """The recent average of a cost; ``old`` < 0: nothing measured yet."""
    return value if old < 0 else 0.8 * old + 0.2 * value


def _prefill_ema(old: float, n_tokens: int, ms: float) -> float:
    if n_tokens < MIN_PREFILL_SAMPLE:
        return old  # a few tokens cost mostly fixed overhead: not a per-token price
    return _ema(old, ms / n_tokens)
