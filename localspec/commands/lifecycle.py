"""``localspec down``, ``status`` and ``logs``: a running daemon, seen from outside."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from localspec import daemon
from localspec import settings as st
from localspec.commands import common as c
from localspec.units import human_bytes

DOWN = c.Command(
    "down",
    "stop the running daemon",
    description="Stop the daemon gracefully (SIGTERM): requests end, models are freed.",
    exit_codes=True,
    epilog="""\
examples:
  localspec down                 stop the daemon on the configured port (SIGTERM, then wait)
  localspec down --port 8013 --force   kill it if it has not stopped after --timeout
""",
)
STATUS = c.Command(
    "status",
    "what the daemon is serving and how it is doing",
    description="Read /health, /props, /slots and /metrics of the running daemon.",
    exit_codes=True,
    epilog="""\
examples:
  localspec status               health, loaded pair, memory, requests, acceptance, uptime
  localspec status --json        the same as JSON (for scripts and IT inventory)
""",
)
LOGS = c.Command(
    "logs",
    "show the daemon's log",
    description="Show the log of a detached daemon or login service ({log_file}).",
    epilog="""\
examples:
  localspec logs                 the last 50 lines of the daemon log
  localspec logs -f              follow it (Ctrl-C to stop)
  localspec logs -n 200
""",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = c.add_command(sub, DOWN, run_down)
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="wait this long")
    p.add_argument("--force", action="store_true", help="kill it if it does not stop in time")
    c.add_settings_flags(p)

    p = c.add_command(sub, STATUS, run_status)
    p.add_argument("--json", action="store_true", help="print JSON")
    c.add_settings_flags(p)

    p = c.add_command(sub, LOGS, run_logs, log_file=daemon.log_file())
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=_count, default=50, metavar="N", help="lines to show")


def _address(args: argparse.Namespace) -> tuple[str, int, str | None]:
    resolved = c.load_settings(args, quiet=True)
    server = resolved.settings.server
    try:
        api_key = st.resolve_api_key(resolved.settings)
    except st.SettingsError:
        api_key = None  # status still works without the key: /health is public
    return server.host, server.port, api_key


def _find_pid(host: str, port: int, api_key: str | None) -> int | None:
    info = daemon.read_pid_file(port)
    if info is not None:
        return info.pid
    if daemon.is_localspec(daemon.base_url(host, port), api_key):
        return daemon.listener_pid(port)
    return None


# --- down ------------------------------------------------------------------------------------


def run_down(args: argparse.Namespace) -> int:
    host, port, api_key = _address(args)
    pid = _find_pid(host, port, api_key)
    if pid is None:
        print(f"no localspec daemon is running on port {port}")
        return c.EXIT_NOT_RUNNING
    with c.Progress(f"stopping localspec (pid {pid})") as progress:
        outcome = daemon.stop(pid, args.timeout, args.force)
        progress.finish(outcome, ok=outcome != "timeout")
    if outcome == "timeout":
        c.error(f"pid {pid} did not stop within {args.timeout:.0f} s; use --force to kill it")
        return c.EXIT_FAILURE
    print(f"localspec on port {port} {'killed' if outcome == 'killed' else 'stopped'}")
    return c.EXIT_OK


# --- status ----------------------------------------------------------------------------------


def _get_json(url: str, api_key: str | None, *, keep: str | None = None) -> Any:
    """The JSON at ``url``; None unless it answered 200 (or, with ``keep``, an error body
    holding that key: /props says why the team server refuses even when it does)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=5.0)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    if response.status_code == 200 or (keep and isinstance(body, dict) and keep in body):
        return body
    return None


def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text → ``{sample name: value summed over labels}`` (counters, gauges)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def gpu_memory(pid: int) -> list[dict[str, Any]]:
    """GPU memory the daemon holds per device, from nvidia-smi (empty without NVIDIA, or where
    a container hides host pids)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "--query-compute-apps=pid,used_memory,gpu_name,gpu_bus_id"
    try:
        out = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0] == str(pid) and parts[1].isdigit():
            devices.append({"name": parts[2], "used_bytes": int(parts[1]) * 1024 * 1024})
    return devices


def gather_status(host: str, port: int, api_key: str | None) -> dict[str, Any]:
    import httpx

    url = daemon.base_url(host, port)
    state, health = daemon.health(url)
    report: dict[str, Any] = {"url": url, "health": state}
    if state == "down":
        return report
    owner = daemon.probe_port(host, port, api_key)
    if owner.kind != "localspec":  # llama-server on llama-vscode's port, say
        report.update(health="not-localspec", localspec=False, held_by=owner.describe())
        return report
    report.update(health_body=health, localspec=True)
    report["props"] = _get_json(f"{url}/props", api_key, keep="backend")
    models = _get_json(f"{url}/v1/models", api_key)
    if isinstance(models, dict) and isinstance(models.get("models"), list):
        report["chat"] = [
            m.get("name") for m in models["models"]
            if isinstance(m, dict) and "chat" in (m.get("capabilities") or ())
        ]  # fmt: skip
    slots = _get_json(f"{url}/slots", api_key)
    if isinstance(slots, list):
        report["slots"] = {
            "total": len(slots),
            "busy": sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing")),
        }
    stats = _get_json(f"{url}/stats/data?since=inf", api_key)
    if isinstance(stats, dict) and isinstance(stats.get("languages"), dict):
        report["acceptance"] = {"languages": stats["languages"], "total": stats.get("total")}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=5.0)
        if response.status_code == 200:
            report["metrics"] = summarise(metric_totals(response.text))

    except (httpx.HTTPError, ValueError):
        pass
    pid = owner.pid  # the probe's: the pid file's, else the listener's
    if pid is not None:
        report["pid"] = pid
        try:
            proc = psutil.Process(pid)
            report["uptime_s"] = round(time.time() - proc.create_time(), 1)
            report["rss_bytes"] = proc.memory_info().rss
        except psutil.Error:
            pass
        report["gpu_memory"] = gpu_memory(pid)
    return report


def summarise(totals: dict[str, float]) -> dict[str, Any]:
    def total(name: str) -> float:
        return totals.get(f"localspec_{name}_total", totals.get(f"localspec_{name}", 0.0))

    drafted, accepted = total("draft_tokens"), total("draft_tokens_accepted")
    evaluated, cached = total("prompt_tokens_evaluated"), total("prompt_tokens_cached")
    return {
        "requests": int(total("requests")),
        "tokens_predicted": int(total("tokens_predicted")),
        "prompt_tokens_evaluated": int(evaluated),
        "prompt_tokens_reused": int(cached),
        "reuse_ratio": round(cached / (cached + evaluated), 3) if cached + evaluated else None,
        "draft_tokens": int(drafted),
        "draft_tokens_accepted": int(accepted),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "queue_depth": int(totals.get("localspec_queue_depth", 0)),
        "budget_answers": int(total("budget_answers")),
        "host_cache": {
            "entries": int(totals.get("localspec_host_cache_entries", 0)),
            "bytes": int(totals.get("localspec_host_cache_bytes", 0)),
            "limit_bytes": int(totals.get("localspec_host_cache_limit_bytes", 0)),
            "restores": int(total("host_cache_restores")),
            "restored_tokens": int(total("host_cache_restored_tokens")),
            "restore_ms": round(total("host_cache_restore_seconds") * 1e3, 1),
        }
        if "localspec_host_cache_limit_bytes" in totals
        else None,
    }


def _human_time(seconds: float) -> str:
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    return " ".join([*parts, f"{minutes}m", f"{sec}s"])


def render_status(report: dict[str, Any]) -> str:
    lines = [f"localspec at {report['url']}: {report['health']}"]
    error = (report.get("health_body") or {}).get("error")
    if report["health"] != "ready" and isinstance(error, dict) and error.get("message"):
        lines.append(f"  why          {error['message']}")  # e.g. the team server is down
    if "pid" in report:
        extra = f", up {_human_time(report['uptime_s'])}" if "uptime_s" in report else ""
        rss = f", {human_bytes(report['rss_bytes'])} resident" if "rss_bytes" in report else ""
        lines.append(f"  process      pid {report['pid']}{extra}{rss}")
    props = report.get("props") or {}
    settings = props.get("default_generation_settings") or {}
    model = props.get("model_path") or props.get("model")
    alias = props.get("model_alias")
    backend = props.get("backend")
    if isinstance(backend, dict):
        lines += _backend_lines(backend)
    if isinstance(backend, dict) and backend.get("answering") == "upstream":
        if alias or model:
            lines.append(f"  upstream     {alias or model}")
        alias = model = None
    if alias and (not model or Path(str(model)).name != alias):
        lines.append(f"  pair         {alias}")
    if model:
        lines.append(f"  target       {model}")
    draft = props.get("draft_model_path")
    if draft:
        lines.append(f"  draft        {draft}")
    speculative = props.get("speculative") or {}
    if isinstance(speculative, dict) and speculative:
        shown = ", ".join(
            f"{k} {v}"
            for k, v in speculative.items()
            if not isinstance(v, (dict, list)) and k != "draft_model"
        )
        lines.append(f"  speculative  {shown}")
    if "chat" in report:  # who answers /v1/chat/completions
        chat = report["chat"]
        lines.append(f"  chat         {', '.join(map(str, chat)) if chat else 'not served'}")
    n_ctx = settings.get("n_ctx") or props.get("n_ctx")
    if n_ctx:
        lines.append(f"  context      {n_ctx} tokens per slot")
    if "slots" in report:
        slots = report["slots"]
        lines.append(f"  slots        {slots['busy']} busy of {slots['total']}")
    lines += _llama_cpp_lines(props.get("llama_cpp"))
    for device in report.get("gpu_memory") or props.get("devices") or []:
        if isinstance(device, dict):
            name = device.get("name", "device")
            used = device.get("used_bytes") or device.get("used")
            lines.append(f"  memory       {name}: {human_bytes(used) if used else device}")
    metrics = report.get("metrics")
    if metrics:
        lines.append(
            f"  requests     {metrics['requests']} served, {metrics['tokens_predicted']} tokens"
            f" generated, {metrics['queue_depth']} queued"
        )
        reuse = metrics["reuse_ratio"]
        lines.append(
            f"  prompt       {metrics['prompt_tokens_reused']} tokens reused, "
            f"{metrics['prompt_tokens_evaluated']} evaluated"
            + (f" ({reuse:.0%} reused)" if reuse is not None else "")
        )
        rate = metrics["acceptance_rate"]
        lines.append(
            f"  acceptance   {metrics['draft_tokens_accepted']} of {metrics['draft_tokens']} "
            "drafted tokens" + (f" ({rate:.0%})" if rate is not None else "")
        )
        if metrics.get("budget_answers"):
            lines.append(
                f"  jumps        {metrics['budget_answers']} answered from the nearest lines "
                "within t_max_prompt_ms (cache.jump_policy budget)"
            )
        cache = metrics.get("host_cache")
        if cache:
            lines.append(
                f"  host cache   {cache['entries']} contexts, {human_bytes(cache['bytes'])} of "
                f"{human_bytes(cache['limit_bytes'])}; {cache['restores']} restores "
                f"({cache['restored_tokens']} tokens in {cache['restore_ms']:.0f} ms)"
            )
    lines += acceptance_table(report.get("acceptance") or {})
    return "\n".join(lines)


def _llama_cpp_lines(info: Any) -> list[str]:
    """The build's backends and, per device, the plan's memory beside what llama.cpp
    allocated (weights, KV, compute)."""
    if not isinstance(info, dict) or not info:
        return []
    lines = []
    if info.get("backends"):
        launcher = info.get("launcher") or {}
        chosen = f" (the launcher chose {launcher['backend']})" if launcher.get("backend") else ""
        lines.append(f"  llama.cpp    {', '.join(map(str, info['backends']))}{chosen}")
        if launcher.get("fallback"):
            lines.append(f"               fell back to the CPU: {launcher['fallback']}")
    rows = [r for r in info.get("memory") or () if isinstance(r, dict)]
    if rows:
        lines.append("  memory       planned / allocated by llama.cpp (model, KV, compute)")
    for r in rows:
        planned, real = r.get("planned") or {}, r.get("allocated") or {}

        def mib(d: dict[str, Any], key: str) -> str:
            return f"{(d.get(key) or 0) / 2**20:.1f}"

        name = r.get("device", "?")
        if r.get("description") and r["description"] != name:
            name = f"{name} ({r['description']})"
        ratio = r.get("ratio")
        share = f", {ratio:.0%} of plan" if isinstance(ratio, int | float) else ""
        lines.append(
            f"    {name}: {mib(planned, 'total')} / {mib(real, 'total')} MiB{share}; "
            + ", ".join(f"{k} {mib(planned, k)}/{mib(real, k)}" for k in ("model", "kv", "compute"))
        )
    return lines


def acceptance_table(acceptance: dict[str, Any]) -> list[str]:
    """Acceptance by language: requests, drafted tokens, the share accepted, the mean accepted
    run, and per draft position the share of the tokens judged there that were accepted."""
    languages = acceptance.get("languages") or {}
    rows = [(name, a) for name, a in languages.items() if isinstance(a, dict)]
    if not rows:
        return []
    n_pos = len(rows[0][1].get("positions") or [])
    pos_labels = [str(p.get("position")) for p in rows[0][1].get("positions") or []]
    head = f"    {'language':<11}{'requests':>9}{'drafted':>9}{'accepted':>9}{'mean run':>9}"
    head += "".join(f"{'@' + lb:>6}" for lb in pos_labels)
    lines = ["  by language  acceptance of draft tokens; @N: accepted / judged at position N", head]
    for name, a in rows:
        ratio, mean = a.get("ratio"), a.get("mean_accepted")
        cells = f"    {name:<11}{a.get('requests', 0):>9}{a.get('drafted', 0):>9}"
        cells += f"{'-' if ratio is None else f'{ratio:.0%}':>9}"
        cells += f"{'-' if mean is None else f'{mean:.2f}':>9}"
        for p in (a.get("positions") or [])[:n_pos]:
            reached, acc = p.get("reached") or 0, p.get("accepted") or 0
            cells += f"{f'{acc / reached:.0%}' if reached else '-':>6}"
        lines.append(cells)
    return lines


def _backend_lines(backend: dict[str, Any]) -> list[str]:
    """Where completions come from: the team server's state, the local fallback, who answered."""
    state = backend.get("status", "?")
    error = f" ({backend['error']})" if backend.get("error") else ""
    slot = ""
    if backend.get("id_slot") is not None and backend.get("upstream_slots"):
        slot = f", slot {backend['id_slot']} of {backend['upstream_slots']}"
    lines = [
        f"  backend      {backend.get('kind')} {backend.get('url')}: {state}{error}{slot}",
        f"  answering    {backend.get('answering')}",
    ]
    if backend.get("local_model"):
        local = backend.get("local_state", "?")
        lines.append(f"  fallback     local model {backend['local_model']} ({local})")
    elif backend.get("no_local"):
        lines.append(f"  fallback     none (no local model: {backend['no_local']})")
    else:
        lines.append("  fallback     none (backend.fallback = none)")
    counts = backend.get("answered") or {}
    reasons = backend.get("fallbacks") or {}
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items()))
    lines.append(
        f"  completions  {counts.get('upstream', 0)} by the upstream, "
        f"{counts.get('local', 0)} by the local model" + (f" (fallbacks: {why})" if why else "")
    )
    return lines


def run_status(args: argparse.Namespace) -> int:
    host, port, api_key = _address(args)
    report = gather_status(host, port, api_key)
    if args.json:
        c.print_json(report)
    elif report["health"] == "down":
        print(f"localspec is not running ({report['url']} does not answer)")
    elif report["health"] == "not-localspec":
        print(f"localspec is not running: port {port} is held by {report['held_by']}")
    else:
        print(render_status(report))
    running = report["health"] not in ("down", "not-localspec")
    return c.EXIT_OK if running else c.EXIT_NOT_RUNNING


# --- logs ------------------------------------------------------------------------------------


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def run_logs(args: argparse.Namespace) -> int:
    try:
        return _show_logs(args)
    except KeyboardInterrupt:  # Ctrl-C is how `logs -f` ends, wherever it lands
        if args.follow:
            return c.EXIT_OK
        raise


def _show_logs(args: argparse.Namespace) -> int:
    path = daemon.log_file()
    if not path.exists():
        print(f"no log yet at {path} (a foreground `localspec up` logs to the terminal)")
        if not args.follow:
            return c.EXIT_OK
        with c.Progress(f"waiting for {path}"):  # as `tail -F`: a daemon about to start writes it
            while not path.exists():
                time.sleep(0.5)
    end = path.stat().st_size  # one offset for both, so no line is shown twice or lost
    for line in daemon.tail(path, args.lines, end):
        print(line)
    if args.follow:
        sys.stdout.flush()
        for line in daemon.follow(path, start=end):
            print(line, flush=True)
    return c.EXIT_OK
