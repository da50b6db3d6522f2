"""``localspec bench replay``: an editor session replayed against localspec and llama-server.

For N cursor locations in real source files, the replay jumps there and retypes the line key
by key with one ``/infill`` per keystroke, exactly as llama-vscode sends them (see
:mod:`localspec.bench.editor`), aborting a request when the next keystroke comes first.
Several servers replay the same session in one run, interleaved location by location, and the
report compares them: latency percentiles, prompt tokens evaluated and reused, generation
speed, speculative acceptance, and how often an answer equals a cold-cache evaluation of the
same request (the quality cost of chunk reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from localspec.bench import anchor, editor, harness, proxy, report
from localspec.bench.background import busy_loops
from localspec.bench.command import bench_parser, interruptible, key_from_file
from localspec.bench.driver import Outcome, Target, replay
from localspec.bench.stats import fmt, percentile, ratio

EPILOG = """\
examples:
  # localspec vs llama-server (plain and draft modes) on the same files, one interleaved run
  localspec bench replay --target t.gguf --draft d.gguf --vs-llama-server plain,draft \\
      --locations 20 --json replay.json --plot replay.png
  # a running daemon against any other server speaking /infill
  localspec bench replay --url http://127.0.0.1:8012 --vs http://127.0.0.1:8080
  # your own code, greedy answers, every completed request checked against a cold cache
  localspec bench replay --url http://127.0.0.1:8012 --code ~/src/app --greedy --cold all
  # what a localspec in front of a team server adds (docs/team-server.md), and failover
  localspec bench replay --target t.gguf --via-proxy --cold none --json proxy.json
  localspec bench replay --target t.gguf --failover --cold none --json failover.json

llama-server comes from $LLAMA_SERVER_BIN (build it with scripts/build-llama-server.sh).
"""


def _range(text: str) -> tuple[float, float]:
    try:
        low, _, high = text.partition(",")
        values = (float(low), float(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX in seconds, got {text!r}") from None
    if not 0 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("localspec bench replay", __doc__, EPILOG)
    srv = p.add_argument_group("servers")
    srv.add_argument("--target", type=Path, metavar="GGUF", help="target model file")
    srv.add_argument("--draft", type=Path, metavar="GGUF", help="draft model file")
    srv.add_argument("--url", help="replay against this running server instead of starting one")
    srv.add_argument(
        "--vs", action="append", default=[], metavar="URL", help="also replay against URL"
    )
    srv.add_argument(
        "--vs-llama-server",
        metavar="MODES",
        help="start $LLAMA_SERVER_BIN with the same files in these comma-separated modes: "
        "plain, ngram, draft, or any llama-server --spec-type; MODE+fa-off turns its flash "
        "attention off",
    )
    srv.add_argument(
        "--no-localspec", action="store_true", help="do not start localspec (anchors only)"
    )
    srv.add_argument("--llama-server-bin", metavar="PATH", help="instead of $LLAMA_SERVER_BIN")
    srv.add_argument("--spec-mode", help="localspec's speculative mode (default: its settings)")
    srv.add_argument(
        "--jump-policy",
        choices=("wait", "budget"),
        help="localspec's cache.jump_policy (default: its settings)",
    )
    srv.add_argument(
        "--also-jump-policy",
        choices=("wait", "budget"),
        metavar="POLICY",
        help="also replay against a second localspec with this cache.jump_policy (named "
        "localspec/jump-POLICY; its budget answers are compared with the first's)",
    )
    srv.add_argument("--ctx", type=int, default=4096, help="context per slot (default 4096)")
    srv.add_argument(
        "--threads", type=int, default=None, help="llama.cpp threads (default: physical cores)"
    )
    srv.add_argument("--cache-reuse", type=int, default=256, help="KV-shift chunk (default 256)")
    srv.add_argument(
        "--cache-exact-ms",
        type=float,
        metavar="MS",
        help="localspec's budget for exact KV instead of a KV shift (default: its settings)",
    )
    srv.add_argument(
        "--ring-attention",
        choices=("causal", "blocks"),
        help="how localspec's ring chunks attend (default: its settings)",
    )
    srv.add_argument(
        "--flash-attn", choices=("on", "off"), help="localspec's flash attention (default: its own)"
    )
    srv.add_argument(
        "--api-key-file", type=Path, metavar="FILE",
        help="for --url: the daemon's key (mode 600; a key on the command line would show in ps)",
    )  # fmt: skip
    srv.add_argument(
        "--load-timeout", type=float, default=600.0, help="seconds to wait for a server to load"
    )
    srv.add_argument("--log-dir", type=Path, help="where started servers log (default: a tmpdir)")
    srv.add_argument(
        "--via-proxy",
        action="store_true",
        help="also replay through a second localspec whose backend is the started one "
        "(backend.kind llama-server): the latency a team-server proxy adds",
    )
    srv.add_argument(
        "--failover",
        action="store_true",
        help="replay through a proxy with a local fallback only, killing the team server "
        "halfway and starting it again at three quarters",
    )

    tr = p.add_argument_group("traffic")
    tr.add_argument("--code", type=Path, help="source tree to type in (default: Python's stdlib)")
    tr.add_argument("--pattern", default="*.py", help="file glob under --code (default *.py)")
    tr.add_argument("--locations", type=int, default=20, help="cursor locations (default 20)")
    tr.add_argument("--max-keys", type=int, default=40, help="keystrokes per line (default 40)")
    tr.add_argument("--seed", type=int, default=42, help="schedule and sampler seed")
    tr.add_argument("--greedy", action="store_true", help="top_k 1 instead of llama-vscode's 40")
    tr.add_argument(
        "--interval", type=_range, default=(0.08, 0.15), metavar="MIN,MAX", help="typing (s)"
    )
    tr.add_argument("--pause-prob", type=float, default=0.08, help="reading pause per keystroke")
    tr.add_argument(
        "--t-max-predict-ms", type=int, default=500, help="the client's generation time budget"
    )
    tr.add_argument(
        "--n-cmpl",
        type=int,
        default=3,
        help="completions per keystroke (default 3, llama-vscode's; llama-server then runs "
        "with that many slots per client)",
    )
    tr.add_argument(
        "--also-n-cmpl",
        type=int,
        metavar="N",
        help="also replay the same keystrokes with N completions each against a second "
        "localspec (same files and flags), interleaved: the cost of --n-cmpl's extra "
        "completions, keystroke by keystroke",
    )
    tr.add_argument(
        "--clients",
        type=int,
        default=1,
        help="editors replaying at once, each on a slot of its own with its own schedule "
        "(servers then run one after the other)",
    )
    tr.add_argument(
        "--same-slot",
        action="store_true",
        help="with --clients: every client sends id_slot 0, as llama-vscode and llama.vim do "
        "(default: client i sends i)",
    )
    tr.add_argument(
        "--also-pinned",
        action="store_true",
        help="also replay against a second localspec whose id_slot picks the slot "
        "(server.slot_choice=pinned, llama-server's rule): with --clients --same-slot, what "
        "choosing slots by their cache buys",
    )
    tr.add_argument(
        "--background",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes beside the servers for the whole replay",
    )
    tr.add_argument(
        "--cold",
        choices=("none", "final", "pauses", "all"),
        default="final",
        help="which completed requests to re-evaluate with a cold cache (default: final "
        "keystroke of each line; pauses adds reading pauses)",
    )

    tr.add_argument(
        "--cold-servers",
        choices=("all", "first"),
        default="all",
        help="which servers get the cold-cache checks (a full prompt evaluation each)",
    )
    tr.add_argument(
        "--cold-on",
        choices=("twin", "self"),
        default="twin",
        help="where a started server's cold checks run: twin (default) starts a second "
        "instance with the same files and flags, so the measured cache evolves as in an "
        "editor; self sends them to the server itself, whose slot then keeps the cold, exact "
        "KV and starts the next location from it (--url/--vs servers: always self)",
    )

    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON")
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="latency plot (matplotlib)")
    out.add_argument("--quiet", action="store_true", help="no per-location progress lines")
    return p


def _threads(explicit: int | None) -> int:
    if explicit:
        return explicit
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or 1)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return max(1, os.cpu_count() or 1)


def server_specs(args: argparse.Namespace) -> list[anchor.ServerSpec]:
    """What to start: localspec unless --url, then llama-server per requested mode."""
    specs: list[anchor.ServerSpec] = []
    need_files = (args.url is None and not args.no_localspec) or args.vs_llama_server
    if need_files:
        if args.target is None:
            raise ValueError("give --target (and --draft) to start servers, or --url")
        for path in (args.target, args.draft):
            if path is not None and not path.is_file():
                raise ValueError(f"model file not found: {path}")
    serve = anchor.ServeSettings(
        target=args.target.resolve() if args.target else Path(),
        draft=args.draft.resolve() if args.draft else None,
        ctx=args.ctx,
        threads=_threads(args.threads),
        cache_reuse=args.cache_reuse,
        cache_exact_ms=args.cache_exact_ms,
        ring_attention=args.ring_attention,
        flash_attn=args.flash_attn,
        slots=args.clients,
        n_cmpl=args.n_cmpl,
    )
    if args.url is None and not args.no_localspec:
        specs.append(anchor.localspec_spec(serve, args.spec_mode))
        if args.jump_policy:
            own = specs[0]
            specs[0] = replace(own, argv=[*own.argv, "--jump-policy", args.jump_policy])
        if args.also_jump_policy:
            other = anchor.twin(specs[0])
            argv = [*other.argv]
            if "--jump-policy" in argv:
                del argv[argv.index("--jump-policy") : argv.index("--jump-policy") + 2]
            specs.append(
                replace(
                    other,
                    name=jump_twin(specs[0].name, args.also_jump_policy),
                    argv=[*argv, "--jump-policy", args.also_jump_policy],
                )
            )
        if args.also_n_cmpl is not None:
            name = n_cmpl_twin(specs[0].name, args.also_n_cmpl)
            specs.append(replace(anchor.twin(specs[0]), name=name))
        if args.also_pinned:
            pinned = anchor.twin(specs[0])
            specs.append(
                replace(
                    pinned,
                    name=f"{specs[0].name}/pinned",
                    argv=[*pinned.argv, "--set", "server.slot_choice=pinned"],
                )
            )
    elif args.also_n_cmpl is not None or args.also_pinned or args.also_jump_policy:
        raise ValueError(
            "--also-n-cmpl, --also-pinned and --also-jump-policy start a second localspec: "
            "drop --url"
        )
    if args.vs_llama_server:
        binary = anchor.find_llama_server(args.llama_server_bin)
        for mode in (m.strip() for m in args.vs_llama_server.split(",")):
            if mode:
                specs.append(anchor.llama_server_spec(binary, serve, mode))
    if args.via_proxy or args.failover:
        if args.url is not None or not specs:
            raise ValueError("--via-proxy and --failover start the team server: drop --url")
        # the first started server is the team server: slot 0 for the direct replay, 1 the
        # proxy's; the proxy replays right after it
        team = specs[0]
        proxy.two_slots(team)
        specs.insert(1, proxy.proxy_spec(team.url, serve, local=args.failover))
    return specs


def jump_twin(name: str, policy: str) -> str:
    """The name of the localspec that replays the same keystrokes under another jump policy."""
    return f"{name}/jump-{policy}"


def n_cmpl_twin(name: str, n_cmpl: int) -> str:
    """The name of the localspec that replays the same keystrokes with ``n_cmpl`` each."""
    return f"{name}/n_cmpl{n_cmpl}"


def oracle_specs(
    args: argparse.Namespace, specs: Sequence[anchor.ServerSpec]
) -> dict[str, anchor.ServerSpec]:
    """The twin each cold-checked started server gets (by its name), for ``--cold-on twin``."""
    if args.cold == "none" or args.cold_on != "twin":
        return {}
    checked = [spec for spec in specs if spec.name != proxy.PROXY]  # its answers are upstream's
    if args.cold_servers == "first":  # the first target: the URL's (checked on itself) if any
        checked = checked[:1] if args.url is None else []
    return {spec.name: anchor.twin(spec) for spec in checked}


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def _burst_line(n: int, burst: editor.Burst, done: list[Outcome], servers: Sequence[str]) -> str:
    parts = []
    for name in servers:
        mine = [o for o in done if o.server == name and o.key >= 0]
        ok = [o for o in mine if o.status == "ok"]
        p50 = percentile([o.latency_ms for o in ok], 50)
        cold = [o.cold.identical for o in ok if o.cold is not None]
        mark = "" if not cold else (" =cold" if all(cold) else " !=cold")
        parts.append(f"{name} {len(ok)}/{len(mine)} ok p50 {fmt(p50)} ms{mark}")
    where = f"{Path(burst.filename).name}:{burst.line_no + 1}"
    return f"[{burst.index + 1}/{n}] {where:<28} " + " | ".join(parts)


async def _run(
    targets: list[Target],
    schedule: editor.Schedule,
    cold: str,
    cold_first: bool,
    quiet: bool,
    after_burst: Callable[[int], None] | None = None,
) -> list[Outcome]:
    names = [t.name for t in targets]
    n = len(schedule.bursts)

    def progress(index: int, burst: editor.Burst, done: list[Outcome]) -> None:
        if not quiet:
            print(_burst_line(n, burst, done, names), file=sys.stderr, flush=True)
        if after_burst is not None:
            after_burst(index)

    try:
        return await replay(
            targets,
            schedule,
            cold=cold,  # type: ignore[arg-type]
            cold_servers={targets[0].name} if cold_first else None,
            progress=progress,
        )
    finally:
        for t in targets:
            await t.aclose()


# the ratios a run prints after its table: (label, Summary field)
LATENCY_RATIOS = (("p50", "p50_ms"), ("p95", "p95_ms"), ("paired p50", "paired_p50_ms"),
                  ("paired p95", "paired_p95_ms"))  # fmt: skip
WORK_RATIOS = (("prompt tokens", "prompt_n_mean"), ("all prompt work", "prompt_all_per_key"))


def shown_ratios(
    first: report.Summary, other: report.Summary, fields: Sequence[tuple[str, str]]
) -> str:
    """``first``'s figures over ``other``'s, one "label 0.00x" each."""
    return ", ".join(
        f"{label} {fmt(ratio(getattr(first, attr), getattr(other, attr)), '.2f')}x"
        for label, attr in fields
    )


def own_n_cmpl(
    outcomes: Sequence[Outcome], first: str, twin: str, n_cmpl: int, n_twin: int
) -> dict[str, Any]:
    """``first`` against its twin replaying the same keystrokes with ``n_twin`` completions:
    print the ratios and return them. Paired over the keystrokes both completed (which of them
    complete before the next key differs between the two, so the plain p50s compare
    different requests)."""
    both = report.summarize([o for o in outcomes if o.server in (first, twin)], [first, twin])
    got = report.ratios(both)[twin]
    shown = shown_ratios(both[0], both[1], LATENCY_RATIOS)
    paired = both[0].paired_n
    print(f"\n{first} (n_cmpl {n_cmpl}) vs itself with n_cmpl {n_twin}: {shown} "
          f"({paired} keystrokes completed by both)")  # fmt: skip
    each = [both[0].paired_p50_ms, both[1].paired_p50_ms]
    return {"n_cmpl": n_cmpl, "twin_n_cmpl": n_twin, "paired_n": paired,
            "paired_p50_ms_each": each, **got}  # fmt: skip


CLIENT_STRIDE = 100_000  # client i's bursts are numbered from i x this (one key per burst)


def client_schedule(
    traffic: editor.TrafficSettings,
    sources: Sequence[editor.SourceFile],
    i: int,
    n: int,
    same_slot: bool = False,
) -> editor.Schedule:
    """Client ``i`` of ``n``: its own seed (its own places in the code) and ``id_slot`` (0 for
    all with ``same_slot``, as real editors send)."""
    if n == 1:
        return editor.build_schedule(traffic, sources)
    mine = replace(traffic, seed=traffic.seed + i, id_slot=0 if same_slot else i)
    schedule = editor.build_schedule(mine, sources)
    schedule.bursts = [replace(b, index=b.index + i * CLIENT_STRIDE) for b in schedule.bursts]
    return schedule


async def _run_clients(
    targets: list[Target], schedules: list[editor.Schedule], cold: str, quiet: bool
) -> list[Outcome]:
    """Every client's session at once on each server, one server after the other (clients
    on different servers at the same time would share the cores)."""
    outcomes: list[Outcome] = []
    try:
        for target in targets:
            if not quiet:
                print(f"  {len(schedules)} clients on {target.name}", file=sys.stderr, flush=True)
            runs = [
                replay([target], schedule, cold=cold)  # type: ignore[arg-type]
                for schedule in schedules
            ]
            for got in await asyncio.gather(*runs):
                outcomes.extend(got)
    finally:
        for t in targets:
            await t.aclose()
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    return interruptible(lambda args: _main(args, argv), build_parser().parse_args(argv))


def _main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    try:
        traffic = editor.TrafficSettings(
            locations=args.locations,
            max_keys=args.max_keys,
            seed=args.seed,
            greedy=args.greedy,
            interval_s=args.interval,
            pause_prob=args.pause_prob,
            t_max_predict_ms=args.t_max_predict_ms,
            n_cmpl=args.n_cmpl,
        )
        traffic.check()
        if args.clients < 1 or args.background < 0:
            raise ValueError("--clients must be at least 1 and --background at least 0")
        code = args.code or editor.default_code_dir()
        print(f"reading sources under {code}", file=sys.stderr)
        skip = editor.SKIP_DIRS | (editor.STDLIB_SKIP_DIRS if args.code is None else frozenset())
        sources = editor.load_sources(code, pattern=args.pattern, skip_dirs=skip)
        schedules = [
            client_schedule(traffic, sources, i, args.clients, args.same_slot)
            for i in range(args.clients)
        ]
        schedule = schedules[0]
        specs = server_specs(args)
        if not specs and not args.url and not args.vs:
            raise ValueError("nothing to replay against: drop --no-localspec, or add --url/--vs")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{len(schedule.bursts)} locations, {schedule.n_requests} requests per server "
        f"from {len(sources)} files; an equal /infill window on every server: "
        f"{anchor.ServeSettings.batch} tokens (llama-server -b, localspec --infill-window)",
        file=sys.stderr,
    )

    log_dir = args.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "localspec-bench-logs"
    twins = oracle_specs(args, specs)
    # the localspec that replays the keystrokes with --also-n-cmpl completions, if any
    own_twin = None if args.also_n_cmpl is None else n_cmpl_twin(specs[0].name, args.also_n_cmpl)
    if twins:
        print(
            f"cold checks go to a twin of each server ({len(twins)} more to start)",
            file=sys.stderr,
        )
    started: list[anchor.ManagedServer] = []
    try:
        if specs:
            print("starting servers (one at a time)", file=sys.stderr)
            started = anchor.start_all(
                [*specs, *twins.values()], log_dir, args.load_timeout, _progress
            )
        targets: list[Target] = []
        if args.url:
            targets.append(Target(f"url:{args.url.rstrip('/').rsplit(':', 1)[-1]}", args.url,
                                  key_from_file(args.api_key_file)))  # fmt: skip
        for spec in specs:
            if args.failover and spec.name != proxy.PROXY:
                continue  # the team server is only reached through the proxy (others idle)
            twin = twins.get(spec.name)
            oracle = Target(twin.name, twin.url) if twin is not None else None
            # a proxy's own engine does none of the work it relays: no prompt-work meter
            meter = not (spec.name == proxy.PROXY and not args.failover)
            overrides = {"n_cmpl": args.also_n_cmpl} if spec.name == own_twin else None
            targets.append(
                Target(spec.name, spec.url, oracle=oracle, meter=meter, overrides=overrides)
            )
        for i, url in enumerate(args.vs):
            targets.append(Target(f"vs{i + 1}:{url.rstrip('/').rsplit(':', 1)[-1]}", url))
        n_bursts = len(schedule.bursts)
        failover = None
        if args.failover:
            team = started[0]  # specs[0], started first
            failover = proxy.FailoverRun(
                team,
                targets[0].url,
                kill_after=max(1, n_bursts // 2),
                restart_after=max(2, n_bursts * 3 // 4),
                load_timeout_s=args.load_timeout,
            )
        t0 = time.perf_counter()
        with busy_loops(args.background):
            if args.clients == 1:
                run = _run(
                    targets,
                    schedule,
                    args.cold,
                    args.cold_servers == "first",
                    args.quiet,
                    after_burst=failover,
                )
            else:
                run = _run_clients(targets, schedules, args.cold, args.quiet)
            outcomes = asyncio.run(run)
        wall_s = time.perf_counter() - t0
    except (anchor.ServerError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in started:
            code = server.proc.poll() if server.proc is not None else None
            if code is not None:  # it should still be serving: say how it ended
                print(
                    f"warning: {server.spec.name} exited during the run with code {code}; "
                    f"log {server.log_path}:\n{server.log_tail(15)}",
                    file=sys.stderr,
                )
            server.stop()

    names = [t.name for t in targets]
    summaries = report.summarize(outcomes, names)
    table_text = report.table(summaries)
    print()
    print(table_text)
    best = report.best_anchor(summaries)
    if best is not None and summaries[0].server != best.server:
        first = summaries[0]
        shown = shown_ratios(first, best, LATENCY_RATIOS + WORK_RATIOS)
        print(f"\n{first.server} vs llama-server's best here ({best.server}): {shown}")
    extra: dict[str, Any] = {}
    if args.also_jump_policy and best is not None:
        other = next(s for s in summaries if s.server == jump_twin(names[0], args.also_jump_policy))
        shown = shown_ratios(other, best, LATENCY_RATIOS)
        line = f"{other.server} vs {best.server}: {shown}"
        table_text += "\n" + line
        print(line)
        extra["jump_policy_vs_llama_server"] = {
            "server": other.server,
            **{label: ratio(getattr(other, f), getattr(best, f)) for label, f in LATENCY_RATIOS},
        }
    if own_twin is not None:
        extra["vs_own_n_cmpl"] = own_n_cmpl(
            outcomes, names[0], own_twin, args.n_cmpl, args.also_n_cmpl
        )
    if args.via_proxy:
        added = proxy.overhead(outcomes, direct=specs[0].name)
        print("\n" + proxy.overhead_table(added))
        extra["proxy_overhead"] = {**proxy.to_json(added), "met": added.met}
    if failover is not None:
        phases = proxy.failover_phases(outcomes, failover, n_bursts)
        print("\n" + proxy.failover_table(phases, failover))
        extra["failover"] = {
            "phases": [proxy.to_json(p) for p in phases],
            "down_noticed_s": failover.down_noticed_s,
            "back_s": failover.back_s,
            "events": failover.events,
            "every_request_answered": all(p.errors == 0 for p in phases),
        }
    print(f"\nwall time {wall_s:.0f} s; server logs in {log_dir}")

    doc = {
        "benchmark": "replay",
        "machine": harness.machine(),
        "traffic": {k: v for k, v in vars(traffic).items()},
        "clients": args.clients,
        "same_slot": args.same_slot,
        "infill_window": anchor.ServeSettings.batch,  # every server's (anchor.localspec_spec)
        "background": args.background,
        "code": str(args.code or editor.default_code_dir()),
        "cold_on": {t.name: t.oracle.name if t.oracle else "self" for t in targets},
        "servers": [{"name": s.spec.name, "url": s.spec.url, "argv": s.spec.argv} for s in started]
        + [{"name": t.name, "url": t.url} for t in targets if t.name.startswith(("url", "vs"))],
        "wall_s": wall_s,
        "summaries": [report.summary_json(s) for s in summaries],
        "ratios": report.ratios(summaries),
        "best_llama_server": best.server if best else None,
        "requests": [o.to_json() for o in outcomes],
        **extra,
    }
    harness.record("replay", argv, table_text, doc, json_path=args.json)
    if args.plot:
        try:
            report.plot(outcomes, names, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
