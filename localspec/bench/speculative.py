"""Speculative decoding benchmark (and the stdlib code prompts it and the tests use)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from localspec.bench import harness
from localspec.bench.background import busy_loops, levels
from localspec.bench.corpus import code_prompts, stdlib_files
from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    ModelSettings,
    SamplingParams,
    SpecSettings,
)
from localspec.engine.llama import physical_cores, resolved_flash_attn

# well-known, stable modules: plain Python code of the kind an editor completes
# --- the benchmark ---------------------------------------------------------------------------

MODES: dict[str, dict[str, object]] = {
    # name: SpecSettings overrides (mode "off" = target-only)
    "target-only": {"mode": "off"},
    # the target alone on every physical core: a pipelined draft uses two cores, so the fair
    # baseline is the better of the two target-only rows
    "target-only-mt": {"mode": "off"},
    # draft-model modes run pipelined where --threads leaves the draft a core of its own
    # (SpecSettings.pipeline=None); the "-seq" rows force draft-then-verify on one thread
    "draft": {"mode": "draft"},
    "draft-seq": {"mode": "draft", "pipeline": False},
    "ngram": {"mode": "ngram"},
    "hybrid": {"mode": "hybrid"},
    "auto": {"mode": "auto"},
    "auto-seq": {"mode": "auto", "pipeline": False},
    # the same sources with the cost-model lengths of "auto"
    "draft-adaptive": {"mode": "draft", "adaptive": True},
    "ngram-adaptive": {"mode": "ngram", "adaptive": True},
    # the draft model fed the whole prompt instead of its window (not run by default)
    "draft-full": {"mode": "draft", "draft_window": 0},
}
MULTI_THREADED = ("target-only-mt",)  # run with the target on physical_cores() threads
BASELINES = ("target-only", "target-only-mt")
DEFAULT_MODES = (
    "target-only", "target-only-mt", "draft", "draft-seq", "draft-adaptive", "ngram",
    "ngram-adaptive", "hybrid", "auto", "auto-seq",
)  # fmt: skip


@dataclass
class ModeTotals:
    tokens: int = 0
    predicted_ms: float = 0.0
    draft_prompt_ms: float = 0.0
    wall_ms: float = 0.0
    outside_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0
    by_source: dict[str, list[int]] = field(default_factory=dict)
    pipelined: int = 0  # requests whose draft model ran on its own thread
    requests: int = 0
    mismatches: int = 0  # prompts whose output differs from target-only
    # at each first divergence: the target's (cold) logit gap between the two tokens; a
    # difference is a legitimate kernel-rounding flip only when this is within 1e-3
    gaps: list[float] = field(default_factory=list)

    def add(self, res: GenerationResult, wall_ms: float) -> None:
        self.tokens += len(res.tokens)
        self.predicted_ms += res.predicted_ms
        self.draft_prompt_ms += res.draft_prompt_ms
        self.wall_ms += wall_ms
        self.outside_ms += res.t_outside_ms
        self.drafted += res.draft_n
        self.accepted += res.draft_n_accepted
        self.pipelined += res.pipelined
        self.requests += 1
        for src, st in res.drafted.items():
            acc = self.by_source.setdefault(src, [0, 0])
            acc[0] += st.drafted
            acc[1] += st.accepted

    @property
    def tok_s(self) -> float:
        return self.tokens / self.predicted_ms * 1000.0 if self.predicted_ms else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def divergence_gap(engine: Engine, prompt: list[int], ref: list[int], out: list[int]) -> float:
    """|logit(ref[i]) - logit(out[i])| of the target alone, cold, at the first divergence."""
    n = min(len(ref), len(out))
    i = next((j for j in range(n) if ref[j] != out[j]), n)
    if i >= n:
        return float("inf")  # one output is a prefix of the other: a stop rule differed
    engine.generate(
        GenerationRequest(slot=1, prompt=prompt + ref[:i], n_predict=0, cache_prompt=False)
    )
    row = engine.pair.tctx.logits(-1)
    return abs(float(row[ref[i]]) - float(row[out[i]]))


def run(
    *,
    target: str,
    draft: str | None,
    n_prompts: int = 16,
    n_predict: int = 128,
    repeats: int = 2,
    lines: int = 40,
    threads: int | None = None,
    modes: tuple[str, ...] = DEFAULT_MODES,
    draft_window: int = 512,
    spec: SpecSettings | None = None,
    progress: bool = True,
    gpu_layers: int = 0,
) -> dict:
    """Run every mode on every prompt, interleaved (machines are noisy: compare in one run)."""
    if draft is None:
        modes = tuple(m for m in modes if MODES[m]["mode"] in ("off", "ngram", "auto"))
    n_threads = threads or physical_cores()
    mt_threads = max(physical_cores(), n_threads)
    base_spec = spec or SpecSettings(draft_window=draft_window)
    # slot 1 only re-scores diverging outputs with a cold cache: attention is chosen as a
    # one-slot daemon chooses it (several slots turn flash attention on, which makes a
    # verify batch dearer on a CPU)
    # gpu_layers > 0 offloads both models (a GPU build: scripts/gpu_check.py); 0 is the CPU
    target_model = ModelSettings(target, n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers)
    target_model = replace(target_model, flash_attn=resolved_flash_attn(target_model, 1))
    draft_model = (
        ModelSettings(draft, n_ctx=2048, n_threads=threads, n_gpu_layers=gpu_layers)
        if draft
        else None
    )
    if draft_model is not None:
        draft_model = replace(draft_model, flash_attn=resolved_flash_attn(draft_model, 1))
    settings = EngineSettings(target=target_model, draft=draft_model, spec=base_spec, n_slots=2)
    prompts = code_prompts(n_prompts, lines=lines)
    totals = {m: ModeTotals() for m in modes}
    greedy = SamplingParams(top_k=1, temperature=0.0)
    t_start = time.perf_counter()
    with Engine.load(settings) as engine:
        flash_attn = engine.flash_attn
        toks = [engine.vocab.tokenize(p) for p in prompts]
        n_runs = repeats * len(toks) * len(modes)
        done = 0
        for rep in range(repeats):
            for i, prompt in enumerate(toks):
                # prompt work stays out of the timings: both models' caches hold the prompt
                engine.settings = replace(settings, spec=base_spec)
                engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
                if draft:
                    engine.prefill_draft(0, prompt)
                reference: list[int] | None = None
                order = list(modes[(i + rep) % len(modes) :] + modes[: (i + rep) % len(modes)])
                outputs: dict[str, list[int]] = {}
                for mode in order:
                    engine.settings = replace(settings, spec=replace(base_spec, **MODES[mode]))
                    if mode in MULTI_THREADED:
                        engine.pair.tctx.set_threads(mt_threads)
                    t0 = time.perf_counter()
                    try:
                        res = engine.generate(
                            GenerationRequest(
                                slot=0, prompt=prompt, n_predict=n_predict, sampling=greedy
                            )
                        )
                    finally:
                        engine.pair.tctx.set_threads(n_threads)
                    totals[mode].add(res, (time.perf_counter() - t0) * 1000.0)
                    outputs[mode] = res.tokens
                    done += 1
                    if progress:
                        elapsed = time.perf_counter() - t_start
                        eta = elapsed / done * (n_runs - done)
                        print(
                            f"\r[{done}/{n_runs}] prompt {i + 1} {mode:<15} "
                            f"{len(res.tokens) / max(res.predicted_ms, 1e-9) * 1000:6.1f} tok/s"
                            f"  elapsed {elapsed:5.0f}s eta {eta:5.0f}s",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                reference = outputs.get("target-only")
                if reference is not None:
                    for mode, out in outputs.items():
                        if out != reference:
                            totals[mode].mismatches += 1
                            totals[mode].gaps.append(divergence_gap(engine, prompt, reference, out))
    if progress:
        print(file=sys.stderr)
    base = totals.get("target-only")
    best = max((totals[m] for m in BASELINES if m in totals), key=lambda t: t.tok_s, default=None)
    rows = []
    for mode, t in totals.items():
        rows.append({
            "mode": mode,
            "tokens": t.tokens,
            "tok_s": round(t.tok_s, 3),
            # tokens/s counting the draft model's (lazy) prompt-window evaluation too
            "tok_s_with_draft_prompt": round(
                t.tokens / (t.predicted_ms + t.draft_prompt_ms) * 1000.0, 3
            ) if t.predicted_ms else 0.0,  # pipelined: an upper bound on the cost (concurrent)
            "draft_prompt_ms": round(t.draft_prompt_ms, 1),
            "ratio": round(t.tok_s / base.tok_s, 3) if base and base.tok_s else None,
            # against the faster target-only row (1 thread or all cores)
            "ratio_best": round(t.tok_s / best.tok_s, 3) if best and best.tok_s else None,
            "threads": mt_threads if mode in MULTI_THREADED else n_threads,
            "pipelined_share": round(t.pipelined / t.requests, 3) if t.requests else 0.0,
            "drafted": t.drafted,
            "accepted": t.accepted,
            "acceptance": round(t.acceptance, 3),
            "by_source": {s: {"drafted": d, "accepted": a} for s, (d, a) in t.by_source.items()},
            "outside_share": round(t.outside_ms / t.wall_ms, 4) if t.wall_ms else 0.0,
            "mismatching_prompts": t.mismatches,
            "mismatch_logit_gaps": [round(g, 6) if g != float("inf") else None for g in t.gaps],
        })  # fmt: skip
    return {
        "target": target,
        "draft": draft,
        "prompts": len(prompts),
        "lines": lines,
        "n_predict": n_predict,
        "repeats": repeats,
        "threads": n_threads,
        "gpu_layers": gpu_layers,
        "physical_cores": physical_cores(),
        "spec": asdict(base_spec),
        "flash_attn": flash_attn,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "rows": rows,
    }


def run_cache_quality(
    *,
    model: str,
    keystrokes: int = 40,
    n_predict: int = 16,
    prefix_lines: int = 30,
    suffix_lines: int = 25,
    threads: int | None = None,
    tail_reuse: int = 32,
    variants: tuple[tuple[int, int, int], ...] = ((8, 32, 0), (8, 32, 32), (16, 32, 32)),
    progress: bool = True,
) -> dict:
    """Replay typing inside a FIM prompt and compare tail reuse with a cold evaluation.

    Each keystroke extends the cursor line (the FIM ``prompt``) in the middle of
    ``FIM_PRE prefix prompt FIM_SUF suffix FIM_MID``. Slots answer every keystroke side by
    side: localspec's reuse (the suffix block shifted into place, recomputed once ``drift``
    tokens changed in front of it; one slot per drift cap), llama-server's rule (runs shorter
    than 256 are recomputed: the whole suffix block) and a cold cache. Greedy answers are
    compared token for token with the cold one.
    """
    configs: list[tuple[str, int, int, int]] = [("cold", 0, 0, 0), ("server", 0, 0, 0)]
    for drift, refresh, roll in variants:
        name = f"drift{drift if drift < 1 << 20 else 'inf'}" + (f"+r{refresh}" if refresh else "")
        configs.append((name + (f"+roll{roll}" if roll else ""), drift, refresh, roll))
    settings = EngineSettings(
        target=ModelSettings(model, n_ctx=2048, n_threads=threads),
        n_slots=len(configs),
        cache_reuse=256,
        tail_reuse=tail_reuse,
        spec=SpecSettings(mode="off"),
    )
    greedy = SamplingParams(top_k=1, temperature=0.0)
    t_start = time.perf_counter()
    stats = {name: {"evaluated": 0, "prompt_ms": 0.0, "identical": 0} for name, *_ in configs}
    per_key: dict[str, list[int]] = {name: [] for name, *_ in configs}
    total = 0
    with Engine.load(settings) as engine:
        v = engine.vocab
        f = v.fim
        if not f.supported:
            raise SystemExit(f"{model} has no FIM tokens")
        for path in stdlib_files():
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            for row in range(prefix_lines + 40, len(lines) - suffix_lines, 97):
                line = lines[row]
                body = line.lstrip()
                if len(body) < 12:
                    continue
                indent = line[: len(line) - len(body)]
                prefix = "\n".join(lines[row - prefix_lines : row]) + "\n"
                suffix = "\n" + "\n".join(lines[row + 1 : row + 1 + suffix_lines]) + "\n"
                pre, suf = v.tokenize(prefix), v.tokenize(suffix)
                for cut in range(4, min(len(body), 20)):
                    prompt = [f.pre, *pre, *v.tokenize(indent + body[:cut]), f.suf, *suf, f.mid]
                    outs = {}
                    for slot, (name, drift, refresh, roll) in enumerate(configs):
                        engine.settings = replace(
                            settings,
                            tail_reuse=256 if name == "server" else tail_reuse,
                            tail_max_drift=drift,
                            tail_refresh=refresh,
                            tail_roll=roll,
                        )
                        res = engine.generate(
                            GenerationRequest(
                                slot=slot,
                                prompt=prompt,
                                n_predict=n_predict,
                                sampling=greedy,
                                cache_prompt=name != "cold",
                            )
                        )
                        outs[name] = res.tokens
                        stats[name]["evaluated"] += res.n_evaluated
                        per_key[name].append(res.n_evaluated)
                        stats[name]["prompt_ms"] += res.prompt_ms
                        stats[name]["identical"] += res.tokens == outs["cold"]
                    total += 1
                    if progress:
                        same = " ".join(f"{n}={s['identical']}" for n, s in stats.items())
                        print(
                            f"\r[{total}/{keystrokes}] identical: {same}",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                    if total >= keystrokes:
                        break
                if total >= keystrokes:
                    break
            if total >= keystrokes:
                break
    if progress:
        print(file=sys.stderr)
    n = max(total, 1)
    return {
        "model": model,
        "keystrokes": total,
        "n_predict": n_predict,
        "tail_reuse": tail_reuse,
        "configs": {
            name: {
                "identical_share": round(s["identical"] / n, 4),
                "mean_evaluated": round(s["evaluated"] / n, 1),
                # the typical keystroke (the first one on a new line evaluates everything)
                "median_evaluated": statistics.median(per_key[name]) if per_key[name] else 0,
                "mean_prompt_ms": round(s["prompt_ms"] / n, 1),
            }
            for name, s in stats.items()
        },
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def format_table(result: dict) -> str:
    head = (
        f"{'mode':<15} {'threads':>8} {'tok/s':>7} {'ratio':>6} {'vs best':>7} {'accept':>7} "
        f"{'drafted':>8} {'outside':>8} {'diff':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        vs_best = f"{r['ratio_best']:.2f}x" if r.get("ratio_best") is not None else "-"
        acc = f"{r['acceptance'] * 100:.0f}%" if r["drafted"] else "-"
        how = str(r["threads"])
        if r["pipelined_share"] > 0:
            how = f"{how}+{how}par"
        elif r["mode"].startswith(("draft", "hybrid", "auto")) and result["draft"]:
            how = f"{how} seq"
        lines.append(
            f"{r['mode']:<15} {how:>8} {r['tok_s']:>7.2f} {ratio:>6} {vs_best:>7} {acc:>7} "
            f"{r['drafted']:>8} {r['outside_share'] * 100:>7.1f}% {r['mismatching_prompts']:>5}"
        )
    lines.append(
        f"({result['prompts']} prompts x {result['repeats']} repeats, {result['n_predict']} "
        f"tokens, greedy, {result['threads']} threads per context, "
        f"{result['physical_cores']} cores; ratio: to target-only, vs best: to the faster "
        "target-only row; 1+1par: the draft model on its own thread beside the target; "
        "diff = prompts whose output differs from target-only)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m localspec.bench.speculative",
        description="Speculative decoding: tokens/s of target-only vs draft-model, n-gram, "
        "hybrid and auto, on code prompts cut from the Python standard library.",
        epilog="example: python -m localspec.bench.speculative --target smollm-f32.gguf "
        "--draft smollm-q4_1.gguf --json spec.json",
    )
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--draft", help="draft GGUF (omit: n-gram modes only)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lines", type=int, default=40, help="lines per prompt")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, from: {', '.join(MODES)}",
    )
    ap.add_argument("--draft-window", type=int, default=512)
    ap.add_argument(
        "--gpu-layers",
        type=int,
        default=0,
        help="layers of each model on the GPU (999: all; needs a GPU build); default 0",
    )
    ap.add_argument(
        "--background",
        default="0",
        help="busy processes beside the benchmark, e.g. 0,1,2: every mode at each level",
    )
    ap.add_argument(
        "--cache-quality",
        type=int,
        metavar="N",
        help="instead: replay N keystrokes inside a FIM prompt on --target (needs FIM "
        "tokens) and compare the suffix-block reuse with a cold cache",
    )
    args = ap.parse_args(argv)
    for path in (args.target, args.draft):
        if path and not Path(path).is_file():
            ap.error(f"model file not found: {path}")
    if args.cache_quality:
        quality = run_cache_quality(
            model=args.target, keystrokes=args.cache_quality, threads=args.threads
        )
        text = json.dumps(quality, indent=2)
        print(text)
        harness.record("speculative", argv, text, quality, json_path=args.json)
        return 0
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    try:
        loads = levels(args.background)
    except ValueError as exc:
        ap.error(str(exc))
    results = []
    tables = []
    for load in loads:
        with busy_loops(load):
            result = run(
                target=args.target,
                draft=args.draft,
                n_prompts=args.prompts,
                n_predict=args.n_predict,
                repeats=args.repeats,
                lines=args.lines,
                threads=args.threads,
                modes=modes,
                draft_window=args.draft_window,
                gpu_layers=args.gpu_layers,
            )
        result["background"] = load
        results.append(result)
        heading = f"{load} busy background process(es):\n" if len(loads) > 1 else ""
        tables.append(heading + format_table(result))
        print("\n" + tables[-1])
    doc = results[0] if len(results) == 1 else {"by_background": results}
    harness.record("speculative", argv, "\n\n".join(tables), doc, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
