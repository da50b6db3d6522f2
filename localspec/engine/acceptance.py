"""Draft acceptance by position: where in a draft the target stopped agreeing.

A draft's token at position p (1-based) is judged only when the p - 1 before it were accepted:
it is *reached*, then accepted or rejected. A rejection at position 1 (the drafter was wrong
at once) and at position 5 (a long run, cut) call for different draft lengths, which one
acceptance ratio hides. Positions past ``MAX_POSITION`` share its bucket, so the labels stay
a bounded set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_POSITION = 8  # positions 1..7 each, the last bucket: 8 and beyond


def position_label(p: int) -> str:
    """The metrics label of position ``p`` (1-based)."""
    return str(p) if p < MAX_POSITION else f"{MAX_POSITION}+"


POSITION_LABELS = tuple(position_label(p) for p in range(1, MAX_POSITION + 1))


@dataclass
class Acceptance:
    """Drafts and their verdicts, by position."""

    drafts: int = 0  # verification steps with a draft (llama-server's n_draft_verif_steps)
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=lambda: [0] * MAX_POSITION)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITION)

    def add(self, drafted: int, accepted: int) -> None:
        """One verified draft of ``drafted`` tokens whose first ``accepted`` were taken."""
        if drafted <= 0:
            return
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        for p in range(1, min(drafted, accepted + 1) + 1):
            i = min(p, MAX_POSITION) - 1
            self.reached[i] += 1
            if p <= accepted:
                self.accepted_at[i] += 1

    def merge(self, other: Acceptance) -> None:
        self.drafts += other.drafts
        self.drafted += other.drafted
        self.accepted += other.accepted
        for i in range(MAX_POSITION):
            self.reached[i] += other.reached[i]
            self.accepted_at[i] += other.accepted_at[i]

    @classmethod
    def of_steps(cls, steps: Iterable[tuple[str, int, int]]) -> Acceptance:
        """From a result's ``spec_steps`` (source, drafted, accepted)."""
        out = cls()
        for _, drafted, accepted in steps:
            out.add(drafted, accepted)
        return out

    @property
    def rejected_at(self) -> list[int]:
        """Drafts whose first rejected token was at each position."""
        return [r - a for r, a in zip(self.reached, self.accepted_at, strict=True)]

    @property
    def ratio(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        """Accepted tokens per draft (llama-server's mean length is this plus one)."""
        return self.accepted / self.drafts if self.drafts else None

    def to_json(self) -> dict[str, object]:
        return {
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "mean_accepted": None if self.mean_accepted is None else round(self.mean_accepted, 3),
            "positions": [
                {"position": lb, "reached": r, "accepted": a}
                for lb, r, a in zip(POSITION_LABELS, self.reached, self.accepted_at, strict=True)
            ],
        }
