"""When speculation pays, and how long a draft should be: a small cost model per request.

Pure logic fed with measured times. Per draft source it keeps a decayed estimate of the
per-token acceptance ``a`` (the geometric model: a draft of k tokens is accepted up to the
first miss) and the cost of one draft token; for the target it keeps the time of a plain
1-token step and how a verify batch grows with its size. The expected speed-up of a draft
of length k is

    E(k) * t1 / (k * c + v(k + 1)),   E(k) = (1 - a^(k + 1)) / (1 - a)

so the chosen length maximises it and a source whose best value falls below ``min_gain`` is
switched off for the request; it is re-tried with a short probe after a back-off that
doubles every time the probe fails, so a source whose acceptance collapsed costs a bounded,
shrinking share (the plain steps in between run at full speed).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceStats:
    accepted: float  # decayed sum of accepted tokens
    missed: float  # decayed count of drafts that ended in a rejection
    cost_ms: float  # one draft token (the n-gram drafter: ~0)
    off_until: int = 0  # step number before which the source is skipped
    backoff: int = 8

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.missed)


@dataclass
class SpecPolicy:
    """Adaptive draft lengths for one request (mode "auto")."""

    n_max: int = 16
    min_gain: float = 1.05
    decay: float = 0.8
    probe_len: int = 2
    t1_ms: float = 0.0  # plain 1-token target step (0: not measured yet)
    slope: float = 0.05  # extra verify cost per extra token, as a fraction of t1
    step: int = 0
    sources: dict[str, SourceStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sources.setdefault("ngram", SourceStats(accepted=2.0, missed=1.0, cost_ms=0.0))
        self.sources.setdefault("draft", SourceStats(accepted=3.0, missed=1.0, cost_ms=-1.0))

    # --- measurements -------------------------------------------------------------------
    def observe_target(self, n_tokens: int, ms: float) -> None:
        if n_tokens <= 1:
            self.t1_ms = ms if self.t1_ms <= 0 else 0.7 * self.t1_ms + 0.3 * ms
        elif self.t1_ms > 0:
            slope = max(0.0, (ms / self.t1_ms - 1.0) / (n_tokens - 1))
            self.slope = 0.7 * self.slope + 0.3 * slope

    def observe_draft_cost(self, source: str, ms_per_token: float) -> None:
        s = self.sources[source]
        s.cost_ms = ms_per_token if s.cost_ms < 0 else 0.7 * s.cost_ms + 0.3 * ms_per_token

    def observe_result(self, source: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        s = self.sources[source]
        s.accepted = self.decay * s.accepted + accepted
        s.missed = self.decay * s.missed + (1.0 if accepted < drafted else 0.0)
        if self.best(source)[1] >= self.min_gain:
            s.backoff = 8
        elif s.off_until <= self.step:
            s.off_until = self.step + s.backoff
            s.backoff = min(s.backoff * 2, 256)

    # --- decisions ----------------------------------------------------------------------
    def gain(self, source: str, k: int) -> float:
        """Expected speed-up of drafting k tokens from ``source`` over a plain step."""
        s = self.sources[source]
        if k <= 0 or self.t1_ms <= 0:
            return 1.0
        a = min(s.acceptance, 0.999)
        expected = (1.0 - a ** (k + 1)) / (1.0 - a)
        verify = self.t1_ms * (1.0 + self.slope * k)
        return expected * self.t1_ms / (k * max(s.cost_ms, 0.0) + verify)

    def best(self, source: str) -> tuple[int, float]:
        best_k, best_g = 0, 1.0
        for k in range(1, self.n_max + 1):
            g = self.gain(source, k)
            if g > best_g:
                best_k, best_g = k, g
        return best_k, best_g

    def plan(self, source: str) -> int:
        """Draft length to use now for ``source`` (0: do not draft from it this step)."""
        s = self.sources[source]
        if self.t1_ms <= 0 or s.cost_ms < 0:
            return min(self.probe_len * 2, self.n_max)  # measure first
        if self.step < s.off_until:
            return 0
        k, g = self.best(source)
        if g >= self.min_gain:
            return k
        # off: a short probe once the back-off expires keeps the estimate fresh
        return min(self.probe_len, self.n_max)

    def tick(self) -> None:
        self.step += 1
