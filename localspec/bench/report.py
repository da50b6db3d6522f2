"""Summaries of a replay: per-server figures, ratios between servers, the table and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from localspec.bench.driver import Outcome, divergence
from localspec.bench.stats import fmt, mean, percentile, ratio, share


@dataclass
class Summary:
    """One server's figures over one replay (keystroke requests only, unless named)."""

    server: str
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0  # keystroke requests answered with an error or not at all
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    paired_p50_ms: float | None = None  # over keystrokes every server completed
    paired_p95_ms: float | None = None
    paired_n: int = 0  # how many keystrokes that is
    final_p50_ms: float | None = None  # the last keystroke of each line (always completes)
    final_p95_ms: float | None = None
    # latency minus the server's generation time: waiting and prompt work, the part the cache
    # decides (generation length depends on the answer, and so on the model and the layout)
    before_gen_p50_ms: float | None = None
    before_gen_p95_ms: float | None = None
    prompt_n_mean: float | None = None  # prompt tokens evaluated per completed request
    # all prompt work (the server's /metrics counter over each location's keystrokes and
    # warm-ups, aborted requests included) per keystroke sent
    prompt_all_per_key: float | None = None
    prompt_n_p50: float | None = None
    cache_n_mean: float | None = None  # prompt tokens reused per completed request
    prompt_ms_mean: float | None = None  # where the time goes: prompt evaluation ...
    predicted_ms_mean: float | None = None  # ... and generation
    queue_ms_mean: float | None = None  # waiting behind other work (Server-Timing, localspec)
    predicted_n_mean: float | None = None
    extra_cmpl_predicted_n_mean: float | None = None  # n_cmpl > 1: the other completions
    predicted_per_s: float | None = None
    draft_n: int = 0
    draft_accepted: int = 0
    acceptance: float | None = None
    warmups: int = 0
    warmups_dropped: int = 0  # warm-ups the server refused or dropped (e.g. superseded)
    warmup_p50_ms: float | None = None
    warmup_prompt_n_mean: float | None = None
    setup_ms: float | None = None  # the first (cold) fill of the ring
    cold_checked: int = 0
    cold_identical: float | None = None
    cold_consistent: float | None = None
    # where answers part from their cold ones (cold probes with n_probs): the cold model's
    # top-1 minus top-2 probability there, against its usual margin over all its tokens
    cold_parted: int = 0
    parted_margin_p50: float | None = None
    parted_margin_max: float | None = None
    parted_runner_up: float | None = None  # share that took the cold model's second choice
    cold_margin_p50: float | None = None
    agree_with_first: float | None = None  # final answers equal to the first server's
    # cold answers equal to the first server's cold answer to the same request: with the same
    # prompt layout and model, the share a change of arithmetic alone (kernels, batch sizes)
    # leaves alone: the ceiling "identical to cold cache" can reach with this model
    cold_agree_with_first: float | None = None
    # where those cold answers part, the first server's cold top-2 margin (its n_probs report)
    cold_vs_first_margin_p50: float | None = None
    cold_vs_first_margin_max: float | None = None
    # answers made from the cursor's nearest lines within t_max_prompt_ms (cache.jump_policy
    # budget): how many, and how many equal the first server's answer to the same keystroke
    budget: int = 0
    budget_share: float | None = None
    budget_equal_first: float | None = None
    budget_compared: int = 0


KEYS = ("type", "pause", "final")


def _sum(values: Sequence[float | int | None]) -> float:
    return float(sum(v for v in values if v is not None))


def summarize(outcomes: Sequence[Outcome], servers: Sequence[str]) -> list[Summary]:
    by_key: dict[tuple[str, int, int], Outcome] = {
        (o.server, o.burst, o.key): o for o in outcomes if o.kind in KEYS
    }
    keys = sorted({(b, k) for (_, b, k) in by_key})
    paired = [
        bk
        for bk in keys
        if all(
            by_key.get((s, *bk)) is not None and by_key[(s, *bk)].status == "ok" for s in servers
        )
    ]
    first = servers[0] if servers else ""
    summaries = []
    for name in servers:
        mine = [o for o in outcomes if o.server == name]
        keyed = [o for o in mine if o.kind in KEYS]
        ok = [o for o in keyed if o.status == "ok"]
        lat = [o.latency_ms for o in ok]
        finals = [o for o in ok if o.kind == "final"]
        warm = [o for o in mine if o.kind == "warmup" and o.status == "ok"]
        setup = [o for o in mine if o.kind == "setup" and o.status == "ok"]
        colds = [o.cold for o in ok if o.cold is not None and o.cold.status == "ok"]
        pl = [by_key[(name, *bk)].latency_ms for bk in paired]
        s = Summary(server=name)
        s.sent = len(keyed)
        s.completed = len(ok)
        s.aborted = sum(o.status == "aborted" for o in keyed)
        s.errors = sum(o.status == "error" for o in keyed)
        s.p50_ms, s.p95_ms, s.p99_ms = (percentile(lat, q) for q in (50, 95, 99))
        s.paired_p50_ms, s.paired_p95_ms = percentile(pl, 50), percentile(pl, 95)
        s.paired_n = len(pl)
        s.final_p50_ms = percentile([o.latency_ms for o in finals], 50)
        s.final_p95_ms = percentile([o.latency_ms for o in finals], 95)
        pre = [o.latency_ms - o.predicted_ms for o in ok if o.predicted_ms is not None]
        s.before_gen_p50_ms, s.before_gen_p95_ms = percentile(pre, 50), percentile(pre, 95)
        prompt_n = [float(o.prompt_n) for o in ok if o.prompt_n is not None]
        s.prompt_n_mean, s.prompt_n_p50 = mean(prompt_n), percentile(prompt_n, 50)
        meters = [o.prompt_n for o in mine if o.kind == "meter" and o.prompt_n is not None]
        s.prompt_all_per_key = sum(meters) / len(keyed) if meters and keyed else None
        s.cache_n_mean = mean([float(o.cache_n) for o in ok if o.cache_n is not None])
        s.prompt_ms_mean = mean([o.prompt_ms for o in ok if o.prompt_ms is not None])
        s.predicted_ms_mean = mean([o.predicted_ms for o in ok if o.predicted_ms is not None])
        s.queue_ms_mean = mean([o.server_timing["queue"] for o in ok if "queue" in o.server_timing])
        s.predicted_n_mean = mean([float(o.predicted_n) for o in ok if o.predicted_n is not None])
        extra = [float(n) for o in ok for n in o.cmpl_predicted[1:]]
        s.extra_cmpl_predicted_n_mean = mean(extra)  # n_cmpl > 1: the other completions
        pred_ms = _sum([o.predicted_ms for o in ok])
        s.predicted_per_s = _sum([o.predicted_n for o in ok]) / pred_ms * 1e3 if pred_ms else None
        s.draft_n = int(_sum([o.draft_n for o in ok]))
        s.draft_accepted = int(_sum([o.draft_n_accepted for o in ok]))
        s.acceptance = share(s.draft_accepted, s.draft_n)
        s.warmups = len(warm)
        s.warmups_dropped = sum(o.kind == "warmup" and o.status == "error" for o in mine)
        s.warmup_p50_ms = percentile([o.latency_ms for o in warm], 50)
        s.warmup_prompt_n_mean = mean([float(o.prompt_n) for o in warm if o.prompt_n is not None])
        s.setup_ms = setup[0].latency_ms if setup else None
        s.cold_checked = len(colds)
        s.cold_identical = share(sum(c.identical for c in colds), len(colds))
        s.cold_consistent = share(sum(c.consistent for c in colds), len(colds))
        margins = [c.margin for c in colds if c.margin is not None]
        s.cold_parted = len(margins)
        s.parted_margin_p50 = percentile(margins, 50)
        s.parted_margin_max = max(margins, default=None)
        s.parted_runner_up = share(sum(bool(c.runner_up) for c in colds), len(margins))
        typical = [c.typical_margin for c in colds if c.typical_margin is not None]
        s.cold_margin_p50 = percentile(typical, 50)
        s.budget = sum(o.budget for o in ok)
        s.budget_share = share(s.budget, len(ok)) if s.budget else None
        if name != first:
            pairs = [
                (o.content, by_key[(first, o.burst, o.key)].content)
                for o in finals
                if by_key.get((first, o.burst, o.key)) is not None
                and by_key[(first, o.burst, o.key)].status == "ok"
            ]
            s.agree_with_first = share(sum(a == b for a, b in pairs), len(pairs))
            budget_pairs = [
                (o.content, theirs.content)
                for o in ok
                if o.budget
                and (theirs := by_key.get((first, o.burst, o.key))) is not None
                and theirs.status == "ok"
                and not theirs.budget
            ]
            s.budget_compared = len(budget_pairs)
            s.budget_equal_first = (
                share(sum(a == b for a, b in budget_pairs), len(budget_pairs))
                if budget_pairs
                else None
            )
            cold_pairs = [
                (o.cold, theirs.cold)
                for o in ok
                if o.cold is not None
                and o.cold.status == "ok"
                and (theirs := by_key.get((first, o.burst, o.key))) is not None
                and theirs.cold is not None
                and theirs.cold.status == "ok"
            ]
            s.cold_agree_with_first = share(
                sum(a.content == b.content for a, b in cold_pairs), len(cold_pairs)
            )
            parted = [
                divergence(a.content, b.probabilities)
                for a, b in cold_pairs
                if a.content != b.content and b.probabilities
            ]
            first_margins = [m for m, _ in filter(None, parted)]
            s.cold_vs_first_margin_p50 = percentile(first_margins, 50)
            s.cold_vs_first_margin_max = max(first_margins, default=None)
        summaries.append(s)
    return summaries


RATIO_FIELDS = ("p50_ms", "p95_ms", "p99_ms", "paired_p50_ms", "paired_p95_ms", "final_p50_ms",
                "final_p95_ms", "before_gen_p50_ms", "before_gen_p95_ms", "prompt_n_mean",
                "prompt_all_per_key")  # fmt: skip


def ratios(summaries: Sequence[Summary]) -> dict[str, dict[str, float | None]]:
    """The first server's figures divided by each other server's (below 1: the first is better)."""
    if len(summaries) < 2:
        return {}
    first = summaries[0]
    return {
        other.server: {f: ratio(getattr(first, f), getattr(other, f)) for f in RATIO_FIELDS}
        for other in summaries[1:]
    }


def best_anchor(summaries: Sequence[Summary], prefix: str = "llama-server") -> Summary | None:
    """llama-server's best configuration in the run: the lowest paired p50 (then p50)."""
    anchors = [s for s in summaries if s.server.startswith(prefix)]
    scored = [s for s in anchors if (s.paired_p50_ms or s.p50_ms) is not None]
    return min(scored, key=lambda s: s.paired_p50_ms or s.p50_ms or 0.0) if scored else None


ROWS: tuple[tuple[str, str, str], ...] = (
    ("keystrokes sent", "sent", "d"),
    ("completed", "completed", "d"),
    ("aborted (next key came first)", "aborted", "d"),
    ("errors", "errors", "d"),
    ("latency p50 ms (completed)", "p50_ms", ".0f"),
    ("latency p95 ms", "p95_ms", ".0f"),
    ("latency p99 ms", "p99_ms", ".0f"),
    ("paired p50 ms (done by all)", "paired_p50_ms", ".0f"),
    ("paired p95 ms", "paired_p95_ms", ".0f"),
    ("end-of-line p50 ms", "final_p50_ms", ".0f"),
    ("end-of-line p95 ms", "final_p95_ms", ".0f"),
    ("latency - generation p50 ms", "before_gen_p50_ms", ".0f"),
    ("latency - generation p95 ms", "before_gen_p95_ms", ".0f"),
    ("prompt tokens evaluated/req", "prompt_n_mean", ".1f"),
    ("  median", "prompt_n_p50", ".0f"),
    ("  all prompt work / keystroke", "prompt_all_per_key", ".1f"),
    ("prompt tokens reused/req", "cache_n_mean", ".0f"),
    ("prompt ms/req", "prompt_ms_mean", ".0f"),
    ("generation ms/req", "predicted_ms_mean", ".0f"),
    ("queue wait ms/req", "queue_ms_mean", ".0f"),
    ("tokens generated/req", "predicted_n_mean", ".1f"),
    ("generation tokens/s", "predicted_per_s", ".1f"),
    ("drafted", "draft_n", "d"),
    ("acceptance", "acceptance", ".0%"),
    ("warm-ups answered", "warmups", "d"),
    ("warm-ups dropped", "warmups_dropped", "d"),
    ("warm-up p50 ms", "warmup_p50_ms", ".0f"),
    ("warm-up prompt tokens", "warmup_prompt_n_mean", ".0f"),
    ("first ring fill ms", "setup_ms", ".0f"),
    ("cold-cache checks", "cold_checked", "d"),
    ("identical to cold cache", "cold_identical", ".0%"),
    ("consistent with cold cache", "cold_consistent", ".0%"),
    ("parted from cold (n_probs)", "cold_parted", "d"),
    ("  cold top-2 margin there p50", "parted_margin_p50", ".3f"),
    ("  ... max", "parted_margin_max", ".3f"),
    ("  took cold's 2nd choice", "parted_runner_up", ".0%"),
    ("cold top-2 margin, all tokens p50", "cold_margin_p50", ".3f"),
    ("end-of-line answers = first", "agree_with_first", ".0%"),
    ("budget answers (nearest lines)", "budget", "d"),
    ("  share of completed", "budget_share", ".0%"),
    ("  compared with first's answer", "budget_compared", "d"),
    ("  = first's answer", "budget_equal_first", ".0%"),
    ("cold answers = first's cold", "cold_agree_with_first", ".0%"),
    ("  parted: first's top-2 margin p50", "cold_vs_first_margin_p50", ".3f"),
    ("  ... max", "cold_vs_first_margin_max", ".3f"),
)


def table(summaries: Sequence[Summary]) -> str:
    names = [s.server for s in summaries]
    width = max(12, *(len(n) for n in names))
    label_w = max(len(r[0]) for r in ROWS)
    lines = [" " * label_w + "  " + "  ".join(n.rjust(width) for n in names)]
    for label, attr, spec in ROWS:
        if all(getattr(s, attr) is None for s in summaries):
            continue  # (nothing measured: cold checks off, one server, no budget answers)
        cells = [fmt(getattr(s, attr), spec).rjust(width) for s in summaries]
        lines.append(label.ljust(label_w) + "  " + "  ".join(cells))
    rel = ratios(summaries)
    if rel:
        lines.append("")
        lines.append(f"{names[0]} / other (below 1: {names[0]} is better)")
        for other, values in rel.items():
            shown = ", ".join(f"{k.removesuffix('_ms')} {fmt(v, '.2f')}" for k, v in values.items())
            lines.append(f"  vs {other}: {shown}")
    return "\n".join(lines)


def summary_json(s: Summary) -> dict[str, Any]:
    return {f.name: getattr(s, f.name) for f in fields(s)}


def plot(outcomes: Sequence[Outcome], servers: Sequence[str], path: Path) -> None:
    """Latency CDFs (completed keystrokes) and prompt tokens evaluated, one line per server."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'localspec[bench]' (or pip install matplotlib)"
        ) from None
    fig, (ax_lat, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in servers:
        ok = [o for o in outcomes if o.server == name and o.kind in KEYS and o.status == "ok"]
        lat = sorted(o.latency_ms for o in ok)
        if lat:
            ys = [(i + 1) / len(lat) for i in range(len(lat))]
            ax_lat.step(lat, ys, where="post", label=f"{name} (n={len(lat)})")
        toks = sorted(float(o.prompt_n) for o in ok if o.prompt_n is not None)
        if toks:
            ys = [(i + 1) / len(toks) for i in range(len(toks))]
            ax_tok.step([max(t, 0.5) for t in toks], ys, where="post", label=name)
    ax_lat.set(xscale="log", xlabel="latency ms (completed /infill)", ylabel="share of requests")
    ax_lat.set_title("Editor replay latency")
    ax_tok.set(xscale="log", xlabel="prompt tokens evaluated per request", ylabel="share")
    ax_tok.set_title("Prompt work per request")
    for ax in (ax_lat, ax_tok):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
