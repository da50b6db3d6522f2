"""Speculation by language: target-only, today's policy (``auto``), the policy that follows
the context (each language's own acceptance record, no drafts while the target's entropy is
high), and relaxed top-k acceptance, on Python, C, JavaScript and shell files found on this
machine. Prints a table per language and overall, writes JSON.

Every request carries its language (as the server hands it to the engine), modes are
interleaved per prompt (a noisy machine slows them alike), and the prompt's evaluation stays
out of the timings (both models' caches hold it before each mode runs). Exact modes must
answer the target-only output token for token; relaxed acceptance's divergence is measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from localspec.bench import harness
from localspec.bench.speculative import divergence_gap
from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    ModelSettings,
    SamplingParams,
    SpecSettings,
)
from localspec.engine.acceptance import Acceptance
from localspec.engine.completion import draft_window_start
from localspec.engine.llama import physical_cores, resolved_flash_attn
from localspec.engine.oracle import DepthOracle

LANGUAGES = ("python", "c", "javascript", "shell")
EXTENSIONS = {
    "python": (".py",),
    "c": (".c", ".h"),
    "javascript": (".js", ".mjs"),
    "shell": (".sh", ".bash"),
}
MODES: dict[str, dict[str, Any]] = {
    "target-only": {"mode": "off"},
    "today": {"mode": "auto"},
    "by-context": {"mode": "auto", "by_language": True},  # + entropy_max from the command line
    "relaxed": {"mode": "auto", "accept": "topk"},  # + accept_top_k / accept_p_min
    # today's cost model without the draft model (where a draft token costs nearly a step)
    "ngram-auto": {"mode": "ngram", "adaptive": True},
    # n-gram drafts end where the match's earlier occurrences disagree (SpecSettings.ngram_agree)
    "agree": {"mode": "auto", "ngram_agree": True},
    # the same, and the draft model only while a draft token costs under half a target step
    "exact-depth": {"mode": "auto", "ngram_agree": True, "draft_cost_max": 0.5},
    # each step the n-gram draft or the draft model's, by expected yield per ms (the model's
    # catch-up priced in); the model drafts past unsure tokens while the target takes them
    "context": {"mode": "auto", "weigh_sources": True, "learn_p_min": True},
    "context-agree": {
        "mode": "auto",
        "weigh_sources": True,
        "learn_p_min": True,
        "ngram_agree": True,
    },
    # agree's n-gram drafts and today's cost model, no draft model
    "ngram-agree": {"mode": "ngram", "adaptive": True, "ngram_agree": True},
    # the ceiling of any depth policy with this pair (engine/oracle.py): knows the target's
    # output, drafts exactly what it accepts (on this thread: the oracle weighs draft costs)
    "oracle": {"mode": "auto", "pipeline": False},
    # the same with n-grams only: where a draft model token costs nearly a target step, its
    # drafts spend time that n-gram drafts a few tokens later would have saved for free
    "oracle-ngram": {"mode": "ngram", "pipeline": False},
}
EXACT = (
    "today",
    "context",
    "context-agree",
    "by-context",
    "ngram-auto",
    "agree",
    "exact-depth",
    "ngram-agree",
    "oracle",
    "oracle-ngram",
)
ORACLES = ("oracle", "oracle-ngram")
SCAN_PER_ROOT = 20_000  # files looked at under each search root, at most
MIN_BYTES, MAX_BYTES = 3_000, 400_000


def _roots(language: str) -> list[Path]:
    """Where a language's files usually are, likeliest first."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    usual = {
        "python": [stdlib],
        "c": [Path("/usr/include"), Path("/usr/src"), Path("/usr/share"), stdlib.parent],
        "javascript": [Path("/usr/share"), Path("/usr/lib"), Path("/usr/local/lib"),
                       Path("/opt"), Path.home(), stdlib],
        "shell": [Path("/usr/bin"), Path("/etc"), Path("/usr/share"), Path("/usr/lib"),
                  Path("/usr/local")],
    }[language]  # fmt: skip
    return [r for r in usual if r.is_dir()]


def _readable_code(path: Path) -> str | None:
    """The file's text if it looks like hand-written code (not minified, not binary)."""
    try:
        if not MIN_BYTES <= path.stat().st_size <= MAX_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.splitlines()
    if len(lines) < 60 or sum(map(len, lines)) / len(lines) > 90:
        return None
    return text


def _walk(roots: list[Path]) -> Iterator[Path]:
    """Files under each root, in a stable order, at most ``SCAN_PER_ROOT`` per root."""
    for root in roots:
        seen = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                yield Path(dirpath) / name
                seen += 1
            if seen >= SCAN_PER_ROOT:
                break


def find_files(language: str, n: int, roots: list[Path] | None = None) -> list[Path]:
    """``n`` files of ``language`` on this machine, spread over what the search finds (by
    extension; shell also by a ``#!/bin/sh``-style first line)."""
    found: list[Path] = []
    for path in _walk(roots or _roots(language)):
        if len(found) >= 8 * n:
            break
        ok = path.suffix in EXTENSIONS[language]
        if not ok and language == "shell" and not path.suffix and path.parent.name == "bin":
            try:
                with path.open("rb") as f:
                    head = f.read(32)
                ok = head.startswith((b"#!/bin/sh", b"#!/bin/bash", b"#!/usr/bin/env bash"))
            except OSError:
                ok = False
        if ok and _readable_code(path) is not None:
            found.append(path)
    if len(found) <= n:
        return found
    step = len(found) / n
    return [found[int(i * step)] for i in range(n)]


def prompts_of(files: list[Path], lines: int) -> list[str]:
    """One snippet per file: ``lines`` lines from a third of the way in (past the header)."""
    out = []
    for path in files:
        text = (_readable_code(path) or "").splitlines()
        start = min(len(text) // 3, max(0, len(text) - lines))
        chunk = text[start : start + lines]
        if chunk:
            out.append("\n".join(chunk) + "\n")
    return out


@dataclass
class Totals:
    tokens: int = 0
    predicted_ms: float = 0.0
    acc: Acceptance = field(default_factory=Acceptance)
    requests: int = 0
    identical: int = 0  # outputs equal to target-only's
    differing_tokens: int = 0  # relaxed: tokens that differ from target-only's, position-wise
    compared_tokens: int = 0
    first_divergence: list[int] = field(default_factory=list)  # token index, per differing
    # exact modes: the target's own (cold) logit gap between the two tokens where an output
    # parted from target-only's; a near-tie (< 1e-3) is a batch-size rounding flip, not a bug
    gaps: list[float] = field(default_factory=list)

    def add(self, res: GenerationResult) -> None:
        self.tokens += len(res.tokens)
        self.predicted_ms += res.predicted_ms
        self.acc.merge(Acceptance.of_steps(res.spec_steps))
        self.requests += 1

    @property
    def tok_s(self) -> float:
        return self.tokens / self.predicted_ms * 1e3 if self.predicted_ms else 0.0

    def merge(self, other: Totals) -> None:
        self.tokens += other.tokens
        self.predicted_ms += other.predicted_ms
        self.acc.merge(other.acc)
        self.requests += other.requests
        self.identical += other.identical
        self.differing_tokens += other.differing_tokens
        self.compared_tokens += other.compared_tokens
        self.first_divergence += other.first_divergence
        self.gaps += other.gaps


def run(
    *,
    target: str,
    draft: str,
    per_language: int = 8,
    n_predict: int = 96,
    lines: int = 40,
    threads: int | None = None,
    entropy_max: float = 2.5,
    accept_top_k: int = 3,
    accept_p_min: float = 0.1,
    languages: tuple[str, ...] = LANGUAGES,
    modes_run: tuple[str, ...] = tuple(MODES),
    rounds: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Every mode on every prompt, ``rounds`` times (interleaved: prompt by prompt, modes in
    a rotating order), per-round figures kept to show the run-to-run spread."""
    workload = {lang: find_files(lang, per_language) for lang in languages}
    prompts = {lang: prompts_of(files, lines) for lang, files in workload.items()}
    # copies: the command line's values go in; target-only and today always run (the others
    # are measured against them)
    names = ["target-only", "today", *(m for m in MODES if m in modes_run and m not in
                                       ("target-only", "today"))]  # fmt: skip
    modes = {name: dict(MODES[name]) for name in names}
    if "by-context" in modes:
        modes["by-context"]["entropy_max"] = entropy_max
    if "relaxed" in modes:
        modes["relaxed"] |= {"accept_top_k": accept_top_k, "accept_p_min": accept_p_min}
    n_threads = threads or physical_cores()
    target_model = ModelSettings(target, n_ctx=2048, n_threads=threads)
    target_model = replace(target_model, flash_attn=resolved_flash_attn(target_model, 1))
    draft_model = ModelSettings(draft, n_ctx=2048, n_threads=threads)
    draft_model = replace(draft_model, flash_attn=resolved_flash_attn(draft_model, 1))
    base = SpecSettings()
    # slot 1 only re-scores a diverging output with a cold cache (divergence_gap)
    settings = EngineSettings(target=target_model, draft=draft_model, spec=base, n_slots=2)
    greedy = SamplingParams(top_k=1, temperature=0.0)
    # per round, language and mode
    totals = {(r, lang, m): Totals() for r in range(rounds) for lang in languages for m in modes}
    t_start = time.perf_counter()
    order = list(modes)
    n_runs = sum(len(p) for p in prompts.values()) * len(order) * rounds
    done = 0
    refs: dict[tuple[str, int], DepthOracle] = {}
    with Engine.load(settings) as engine:
        # languages take turns, prompt by prompt: an editor's day switches between files
        queue = [
            (lang, i, p)
            for i in range(max(map(len, prompts.values()), default=0))
            for lang in languages
            for p in prompts[lang][i : i + 1]
        ]
        for r in range(rounds):
            for k, (lang, i, text) in enumerate(queue):
                prompt = engine.vocab.tokenize(text)[-1024:]
                engine.settings = settings
                engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
                engine.prefill_draft(0, prompt)
                outputs: dict[str, list[int]] = {}
                turn = order[(k + r) % len(order) :] + order[: (k + r) % len(order)]
                for name in ORACLES:  # an oracle needs target-only's output
                    if name in turn and (lang, i) not in refs:
                        turn.remove(name)
                        turn.insert(turn.index("target-only") + 1, name)
                for mode in turn:
                    engine.settings = replace(settings, spec=replace(base, **modes[mode]))
                    res = engine.generate(
                        GenerationRequest(
                            slot=0,
                            prompt=prompt,
                            n_predict=n_predict,
                            sampling=greedy,
                            language=lang,
                            oracle=refs.get((lang, i)) if mode in ORACLES else None,
                        )
                    )
                    totals[(r, lang, mode)].add(res)
                    outputs[mode] = res.tokens
                    if mode == "target-only" and (lang, i) not in refs:
                        engine.settings = settings
                        greedy_draft, draft_ms = draft_greedy(engine, prompt, res.tokens)
                        refs[(lang, i)] = DepthOracle.of(res.tokens, greedy_draft, draft_ms)
                    done += 1
                    if progress:
                        el = time.perf_counter() - t_start
                        print(
                            f"\r[{done}/{n_runs}] {lang:<10} {mode:<11} "
                            f"{len(res.tokens) / max(res.predicted_ms, 1e-9) * 1e3:7.1f} tok/s "
                            f"elapsed {el:5.0f}s eta {el / done * (n_runs - done):5.0f}s",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                ref = outputs["target-only"]
                for mode, out in outputs.items():
                    t = totals[(r, lang, mode)]
                    t.identical += out == ref
                    if out != ref:
                        n = min(len(out), len(ref))
                        t.first_divergence.append(
                            next((j for j in range(n) if out[j] != ref[j]), n)
                        )
                        if mode in EXACT:
                            engine.settings = settings
                            t.gaps.append(divergence_gap(engine, prompt, ref, out))
                    n = min(len(out), len(ref))
                    t.compared_tokens += max(len(out), len(ref))
                    t.differing_tokens += sum(a != b for a, b in zip(out[:n], ref[:n], strict=True))
                    t.differing_tokens += abs(len(out) - len(ref))
    if progress:
        print(file=sys.stderr)

    def total(lang: str | None, mode: str, r: int | None = None) -> Totals:
        out = Totals()
        for (rr, lg, m), t in totals.items():
            if m == mode and (lang is None or lg == lang) and (r is None or rr == r):
                out.merge(t)
        return out

    rows = []
    spread: dict[str, dict[str, list[float]]] = {}  # per-round vs-today ratios
    for lang in (*languages, None):
        label = lang or "overall"
        by_mode = {m: total(lang, m) for m in modes}
        rows += [_row(label, m, by_mode) for m in modes]
        per_round = [{m: total(lang, m, r) for m in modes} for r in range(rounds)]
        spread[label] = {
            m: [round(_ratio(pr[m], pr["today"]), 3) for pr in per_round] for m in modes
        }
    return {
        "target": target,
        "draft": draft,
        "files": {lang: [str(p) for p in files] for lang, files in workload.items()},
        "per_language": per_language,
        "n_predict": n_predict,
        "lines": lines,
        "threads": n_threads,
        "entropy_max": entropy_max,
        "accept_top_k": accept_top_k,
        "accept_p_min": accept_p_min,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "rounds": rounds,
        "rows": rows,
        "vs_today_by_round": spread,
    }


def _ratio(t: Totals, base: Totals) -> float:
    return t.tok_s / base.tok_s if base.tok_s else 0.0


def draft_greedy(
    engine: Engine, prompt: list[int], output: list[int], n_timed: int = 8
) -> tuple[list[int], float]:
    """The draft model's greedy token at each position of ``output`` (after the prompt's
    draft window and the output before it), in one pass over slot 1's draft sequence; and
    the ms of one draft token's decode (the median of ``n_timed`` single-token decodes of the
    output, as drafting runs them)."""
    pair = engine.pair
    st = engine.slots[1].draft
    if pair.dcache is None or pair.dctx is None or st is None or not output:
        return [], -1.0
    window = prompt[draft_window_start(len(prompt), pair.settings.spec.draft_window) :]
    seq = window + output[:-1]
    first = len(window) - 1  # the row whose logits give output[0]
    engine.clear_slot(1)
    out: list[int] = []
    n_batch = pair.dctx.n_batch
    try:
        for at in range(0, len(seq), n_batch):
            chunk = seq[at : at + n_batch]
            rows = [j for j in range(len(chunk)) if at + j >= first]
            pair.dcache.append(st, chunk, logits=rows)
            out += [int(pair.dctx.logits(j).argmax()) for j in rows]
        pair.dcache.truncate(st, len(window))
        times = []
        for tok in output[:n_timed]:
            t0 = time.perf_counter()
            pair.dcache.append(st, [tok], logits="last")
            pair.dctx.logits(-1).argmax()
            times.append((time.perf_counter() - t0) * 1000.0)
    finally:
        engine.clear_slot(1)
    return out, statistics.median(times) if times else -1.0


def _row(language: str, mode: str, by_mode: dict[str, Totals]) -> dict[str, Any]:
    t = by_mode[mode]
    base, today = by_mode["target-only"].tok_s, by_mode["today"].tok_s
    return {
        "language": language,
        "mode": mode,
        "requests": t.requests,
        "tokens": t.tokens,
        "tok_s": round(t.tok_s, 2),
        "vs_target": round(t.tok_s / base, 3) if base else None,
        "vs_today": round(t.tok_s / today, 3) if today else None,
        "drafted": t.acc.drafted,
        "accepted": t.acc.accepted,
        "acceptance": None if t.acc.ratio is None else round(t.acc.ratio, 3),
        "mean_accepted": None if t.acc.mean_accepted is None else round(t.acc.mean_accepted, 2),
        "identical": t.identical,
        "differing_token_share": round(t.differing_tokens / t.compared_tokens, 4)
        if t.compared_tokens
        else 0.0,
        "first_divergence": t.first_divergence,
        "divergence_logit_gaps": [round(g, 6) if g != float("inf") else None for g in t.gaps],
    }


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"{'language':<11}{'mode':<14}{'tok/s':>8}{'vs tgt':>8}{'vs today':>9}{'accept':>8}"
        f"{'mean run':>9}{'identical':>10}{'diff tok':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["mode"] == "target-only" and r["language"] != "overall":
            continue  # its tok/s is each row's "vs tgt" base: overall's is shown
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        mean = f"{r['mean_accepted']:.2f}" if r["mean_accepted"] is not None else "-"
        lines.append(
            f"{r['language']:<11}{r['mode']:<14}{r['tok_s']:>8.1f}"
            f"{(r['vs_target'] or 0):>7.2f}x{(r['vs_today'] or 0):>8.2f}x{acc:>8}{mean:>9}"
            f"{r['identical']:>5}/{r['requests']:<4}{r['differing_token_share']:>8.1%}"
        )
    rounds = result.get("rounds", 1)
    spread = result.get("vs_today_by_round", {}).get("overall", {})
    if rounds > 1 and spread:
        lines.append(
            "overall vs today per round: "
            + "; ".join(
                f"{m} {min(v):.2f}-{max(v):.2f}x"
                for m, v in spread.items()
                if m not in ("today", "target-only")
            )
        )
    modes = {r["mode"] for r in result["rows"]}
    gate = f", entropy gate {result['entropy_max']}" if result["entropy_max"] else ""
    notes = [
        f"{result['per_language']} files/language x {rounds} rounds, {result['n_predict']} "
        f"tokens, greedy, {result['threads']} threads"
    ]
    said = {
        "by-context": f"by-context: own record per language{gate}",
        "relaxed": f"relaxed: top-{result['accept_top_k']}, p >= {result['accept_p_min']}",
        "ngram-auto": "ngram-auto: auto without the draft model",
        "agree": "agree: n-gram drafts end where the context disagrees",
        "exact-depth": "exact-depth: agree, draft model only under half a step",
        "ngram-agree": "ngram-agree: agree without the draft model",
        "context": "context: the better source each step, unsure drafts while they pay",
        "context-agree": "context-agree: context with agree's n-gram drafts",
        "oracle": "oracle: exactly the accepted drafts",
        "oracle-ngram": "oracle-ngram: n-grams only",
    }
    notes += [text for mode, text in said.items() if mode in modes]
    lines.append("(" + "; ".join(notes) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="localspec bench languages",
        description="Speculation by language on files found on this machine: target-only, "
        "today's auto policy, the policy that follows the context, relaxed acceptance.",
        epilog="example: localspec bench languages --target smollm2-f32.gguf "
        "--draft smollm2-q4_1.gguf --json languages.json",
    )
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--draft", required=True, help="draft GGUF")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--files", type=int, default=8, help="files (prompts) per language")
    ap.add_argument("--n-predict", type=int, default=96)
    ap.add_argument("--lines", type=int, default=40, help="lines per prompt")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--entropy-max", type=float, default=2.5, help="by-context's gate (nats)")
    ap.add_argument("--top-k", type=int, default=3, help="relaxed: rank limit")
    ap.add_argument("--p-min", type=float, default=0.1, help="relaxed: probability floor")
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated, of " + ", ".join(MODES) + " (target-only and today always run)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (spread)")
    args = ap.parse_args(argv)
    modes_run = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes_run if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s): {', '.join(unknown)}")
    for path in (args.target, args.draft):
        if not Path(path).is_file():
            ap.error(f"model file not found: {path}")
    result = run(
        target=args.target,
        draft=args.draft,
        per_language=args.files,
        n_predict=args.n_predict,
        lines=args.lines,
        threads=args.threads,
        entropy_max=args.entropy_max,
        accept_top_k=args.top_k,
        accept_p_min=args.p_min,
        modes_run=modes_run,
        rounds=max(1, args.rounds),
    )
    table = format_table(result)
    print(table)
    harness.record("languages", argv, table, result, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
