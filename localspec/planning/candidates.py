"""The candidates a plan chooses among, in preference order."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

from localspec.planning.facts import facts_from_catalog_entry, quant_bits
from localspec.planning.inputs import PlanSettings, is_allowed
from localspec.planning.types import Candidate, ModelFacts, PlanError


def _draft_quant(entry: Any) -> str:
    """Drafts run at Q8_0 (the 0.5B's K-quants barely shrink it; low quants cut acceptance)."""
    quants = list(entry.quants)
    if "Q8_0" in quants:
        return "Q8_0"
    return max(quants, key=quant_bits)


def candidates_from_catalog(catalog: Any, settings: PlanSettings) -> list[Candidate]:
    """Every (pair, target quant) the settings allow, best first (see ``candidate_order``)."""

    def facts(entry: Any, quant: str) -> ModelFacts:
        measured = settings.measured.get((entry.id, quant))
        return measured if measured is not None else facts_from_catalog_entry(entry, quant)

    out: list[Candidate] = []
    for pair in catalog.pairs.values():
        if not pair.compatible:
            continue
        if not is_allowed(settings.allowed, pair.id, pair.target):
            continue
        if pair.draft and not settings.draft_models:
            continue
        target = catalog.models[pair.target]
        if not all(target.can(need) for need in settings.needs):
            continue
        draft_entry = catalog.models[pair.draft] if pair.draft else None
        draft = facts(draft_entry, _draft_quant(draft_entry)) if draft_entry else None
        for quant in target.quants:
            out.append(Candidate(pair.id, facts(target, quant), draft))
    return candidate_order(out, settings.pair)


def candidate_order(candidates: Iterable[Candidate], prefer: str | None = None) -> list[Candidate]:
    """Biggest target first; within one target, a draft model before n-gram only, the cheaper
    draft first; then the higher quant. A preferred pair goes to the front."""

    def key(c: Candidate) -> tuple[Any, ...]:
        draft_cost = c.draft.file_bytes if c.draft else math.inf
        return (
            c.pair_id != prefer,
            -c.target.params_b,
            c.target.model_id,
            draft_cost,
            -quant_bits(c.target.quant),
        )

    return sorted(candidates, key=key)


def allowed_candidates(catalog: Any, settings: PlanSettings) -> list[Candidate]:
    """The ordered candidates of a catalog, or of a ready list of ``Candidate``; a PlanError
    when the settings leave none, or name a pair that is not among them."""
    if isinstance(catalog, list | tuple):
        candidates = candidate_order(
            [c for c in catalog if is_allowed(settings.allowed, c.pair_id, c.target.model_id)],
            settings.pair,
        )
    else:
        candidates = candidates_from_catalog(catalog, settings)
    if settings.pair and all(cand.pair_id != settings.pair for cand in candidates):
        pair = getattr(catalog, "pairs", {}).get(settings.pair)
        if pair is not None and pair.compatible:
            does = "/".join(catalog.models[pair.target].capabilities)
            raise PlanError(
                f"pair {settings.pair!r} is a {does} pair where a {'+'.join(settings.needs)} "
                "one is needed (an instruct pair for chat goes in models.chat_pair)"
            )
        if candidates:
            raise PlanError(f"pair {settings.pair!r} is not in the catalog or not allowed")
    known = getattr(catalog, "pairs", {})
    if not candidates and settings.pair and settings.pair not in known:
        close = difflib.get_close_matches(settings.pair, list(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "`localspec models` lists them"
        raise PlanError(f"models.pair {settings.pair!r} is not a catalog pair ({hint})")
    if not candidates:
        raise PlanError(
            "no catalog pair is allowed by the settings (models.allowed = "
            f"{list(settings.allowed)}); allow at least one pair"
        )
    return candidates
