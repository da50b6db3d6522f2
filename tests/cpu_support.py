"""A fake CPU load for the thread governor: tests decide what other processes do."""

from __future__ import annotations

from localspec.engine.threads import CpuSample, ThreadGovernor


class OtherLoad:
    """A fake /proc: other processes keep ``other_cores`` busy, this process one core."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0

    def run(self, *, seconds: float, other_cores: float) -> None:
        self.t += seconds
        self.own += seconds
        self.busy += seconds * (1.0 + other_cores)

    def sample(self) -> CpuSample:
        return CpuSample(self.busy, self.own, self.t)

    def governor(self, cores: int, interval_s: float = 0.2) -> ThreadGovernor:
        return ThreadGovernor(
            cores, sample=self.sample, interval_s=interval_s, clock=lambda: self.t
        )
