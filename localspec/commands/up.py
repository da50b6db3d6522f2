"""``localspec up``: settings → (plan → pull) → load → serve, in the foreground or detached."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localspec import daemon, settings_to
from localspec import settings as st
from localspec.commands import common as c

if TYPE_CHECKING:  # the engine's and the server's modules load llama.cpp and FastAPI
    from localspec.engine.types import EngineSettings, ModelSettings
    from localspec.planning.result import Plan
    from localspec.server.options import ServerSettings
    from localspec.server.upstream.config import UpstreamSettings

log = logging.getLogger("localspec.up")

UP = c.Command(
    "up",
    "plan, fetch and serve the completion endpoint",
    description="Start the completion daemon (llama-server compatible /infill, /completion).",
    exit_codes=True,
    epilog="""\
examples:
  localspec up                                  plan, download and serve on localhost:8012
  localspec up --detach                         the same in the background; returns when ready
  localspec up --target 7b.gguf --draft 0.5b.gguf   serve local GGUF files, no catalog
  localspec up --target 7b.gguf --chat-target 7b-instruct.gguf   and a chat model beside it
  localspec up --pair qwen2.5-coder-7b+0.5b --ctx-size 8192
  localspec up --host 0.0.0.0 --api-key-file ~/.config/localspec/key   share on the LAN

A localspec daemon already answering on the port is reported and `up` exits 0.
Ctrl-C or SIGTERM shut down gracefully: in-flight requests finish or are cancelled.
""",
)


class UpError(RuntimeError):
    """A reason `up` cannot serve, worded for the user."""


def register(sub: argparse._SubParsersAction) -> None:
    p = c.add_command(sub, UP, run)
    p.add_argument("--target", type=Path, metavar="GGUF", help="serve this local target model")
    p.add_argument("--draft", type=Path, metavar="GGUF", help="local draft model (with --target)")
    p.add_argument(
        "--chat-target",
        type=Path,
        metavar="GGUF",
        help="with --target: a local instruct model that answers chat (default: the target, "
        "when its GGUF has a chat template)",
    )
    p.add_argument(
        "--chat-draft", type=Path, metavar="GGUF", help="local draft model for --chat-target"
    )
    p.add_argument(
        "--gpu-layers",
        type=int,
        default=-1,
        metavar="N",
        help="layers to offload with --target (default: all; ignored by CPU builds)",
    )
    p.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --target: flash attention (default auto: on for GPU layers and quantized "
        "KV, off on the CPU, where verifying drafts is faster without it)",
    )
    p.add_argument("--detach", action="store_true", help="run in the background")
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="with --detach: how long to wait for /health (default 900 s)",
    )
    p.add_argument("--log-file", type=Path, metavar="FILE", help="append all output to FILE")
    c.add_settings_flags(p, serve=True)


def run(args: argparse.Namespace) -> int:
    resolved = c.load_settings(args)
    settings = resolved.settings
    api_key = st.check_security(settings)
    upstream_key = st.check_backend(settings)
    _warn_readable_inline_key(resolved)
    if args.draft is not None and args.target is None:
        c.error("--draft needs --target (a catalog pair brings its own draft: use --pair)")
        return c.EXIT_USAGE
    if args.chat_target is not None and args.target is None:
        c.error("--chat-target needs --target (catalog pairs: use --chat-pair)")
        return c.EXIT_USAGE
    if args.chat_draft is not None and args.chat_target is None:
        c.error("--chat-draft needs --chat-target")
        return c.EXIT_USAGE
    if args.target is not None and args.draft is None and settings.speculative.mode == "draft":
        c.error("speculative.mode is 'draft' but no draft model is given (--draft)")
        return c.EXIT_USAGE
    host, port = settings.server.host, settings.server.port
    owner = daemon.probe_port(host, port, api_key)
    if owner.kind == "localspec":
        _say_already_running(host, port, owner)
        return c.EXIT_OK
    if owner.kind == "other":
        c.error(
            f"port {port} is held by {owner.describe()}; stop it or pick another port "
            "with --port (llama-vscode's endpoint setting must match)"
        )
        return c.EXIT_PORT_BUSY
    if args.detach:
        return _detach(args, host, port)
    if args.log_file is not None:
        _redirect_output(args.log_file)
    return _serve(args, settings, api_key, upstream_key)


def _say_already_running(host: str, port: int, owner: daemon.PortOwner) -> None:
    pid = f" (pid {owner.pid})" if owner.pid else ""
    print(f"localspec is already running at {daemon.base_url(host, port)}{pid}")


def _warn_readable_inline_key(resolved: st.ResolvedSettings) -> None:
    origin = resolved.origins["server.api_key"]
    if origin.kind not in ("system", "user") or os.name != "posix":
        return
    try:
        readable = Path(origin.label).stat().st_mode & 0o044
    except OSError:
        return
    if readable:
        c.warn(
            f"warning: server.api_key is written in {origin.label}, which other users can "
            "read; prefer server.api_key_file (mode 600)"
        )


# --- background ------------------------------------------------------------------------------


def _detach(args: argparse.Namespace, host: str, port: int) -> int:
    child_argv = ["up", *c.flag_argv(args), "--gpu-layers", str(args.gpu_layers)]
    child_argv += ["--flash-attn", args.flash_attn]
    for name in ("target", "draft", "chat_target", "chat_draft"):
        path = getattr(args, name)
        if path is not None:
            child_argv += [f"--{name.replace('_', '-')}", str(path.expanduser().resolve())]
    log_path = args.log_file.expanduser().resolve() if args.log_file else daemon.log_file()
    if args.log_file:
        child_argv += ["--log-file", str(log_path)]
    logged = log_path.stat().st_size if log_path.exists() else 0
    proc = daemon.spawn_detached(child_argv, log_path)
    url = daemon.base_url(host, port)
    words = {"down": "starting", "loading": "loading models"}
    try:
        with c.Progress(f"starting localspec in the background (pid {proc.pid})") as progress:

            def show(state: daemon.HealthState) -> None:
                if state in words:
                    progress.update(f"{words[state]} (pid {proc.pid})")

            outcome = daemon.wait_until_ready(url, proc, args.wait_timeout, show)
            if outcome == "ready":
                progress.finish(f"ready at {url}")
            else:
                progress.finish("not ready", ok=False)
    except KeyboardInterrupt:
        c.warn(
            f"stopped waiting; the daemon keeps starting in the background (pid {proc.pid}): "
            "`localspec status` shows it, `localspec down` stops it"
        )
        return c.EXIT_OK
    if outcome == 0 and daemon.probe_port(host, port).kind == "localspec":
        outcome = "ready"  # another `up` won the race; the child saw it and left
    if outcome == "ready":
        owner = daemon.probe_port(host, port)
        pid = owner.pid if owner.kind == "localspec" and owner.pid else proc.pid
        print(f"localspec is running at {url} (pid {pid})")
        print(f"logs: {log_path}; stop: localspec down")
        return c.EXIT_OK
    if isinstance(outcome, int):
        c.error(f"the daemon exited with code {outcome} before it was ready; its log ends:")
        for line in daemon.lines_from(log_path, logged)[-20:]:  # this start's, not the last's
            print(f"  {line}", file=sys.stderr)
        return outcome if outcome != 0 else c.EXIT_FAILURE
    c.error(
        f"not ready after {args.wait_timeout:.0f} s (still {outcome}); it keeps going in the "
        f"background as pid {proc.pid}: follow with `localspec logs -f`, stop with `localspec down`"
    )
    return c.EXIT_FAILURE


def _redirect_output(path: Path) -> None:
    """Send stdout, stderr (and llama.cpp's own C-level output) to an appended log file."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# --- foreground ------------------------------------------------------------------------------


@dataclass
class Served:
    engine: EngineSettings
    alias: str
    plan: Plan | None = None  # the Plan behind a catalog pair; None for --target/--draft files
    paths: tuple[Path, Path | None] | None = None  # (target, draft) files of a planned pair
    chat: EngineSettings | None = None  # a second pair that answers chat
    chat_alias: str | None = None
    chat_refusal: str | None = None  # why no chat is served (the 501's text)


CHAT_OFF = "Chat is off on this daemon: models.chat = off (`localspec profile explain`)"


def _local_models(args: argparse.Namespace, settings: st.Settings) -> Served:
    flash_attn = {"auto": None, "on": True, "off": False}[args.flash_attn]
    models: list[ModelSettings | None] = []
    for path in (args.target, args.draft, args.chat_target, args.chat_draft):
        if path is None:
            models.append(None)
            continue
        path = path.expanduser().resolve()
        if not path.is_file():
            raise UpError(f"model file not found: {path}")
        if not settings.allows_model(path.name, path.stem):
            raise UpError(
                f"{path.name} is not in models.allowed ({', '.join(settings.models.allowed)}), "
                "set by your profile; ask your IT team or run `localspec profile explain`"
            )
        models.append(
            settings_to.file_model_settings(
                settings, path, gpu_layers=args.gpu_layers, flash_attn=flash_attn
            )
        )
    target, draft, chat_target, chat_draft = models
    assert target is not None  # _local_models serves --target
    off = settings.models.chat == "off"
    chat = None
    if chat_target is not None and not off:
        chat = settings_to.file_engine_settings(settings, chat_target, chat_draft, host_cache=False)
    return Served(
        settings_to.file_engine_settings(settings, target, draft),
        args.target.name,
        chat=chat,
        chat_alias=args.chat_target.name if chat is not None else None,
        chat_refusal=CHAT_OFF if off else None,
    )


def _planned_models(settings: st.Settings) -> Served:
    """Probe → plan → pull: the catalog pair that fits this machine, downloaded and verified."""
    from localspec import fetch, hardware, plan, step_costs
    from localspec.commands.models import load_catalog

    try:
        with c.Progress("probing hardware") as progress:
            facts = hardware.probe()
            progress.finish("done")
        catalog = load_catalog()
        measured = step_costs.load(facts.description)
        asked = settings_to.plan_inputs(settings)
        chosen = plan.make_plan(catalog, facts, asked, step_costs=measured)
    except ValueError as exc:  # CatalogError, HardwareError, PlanError
        raise UpError(str(exc)) from None
    print(plan.render_plan(chosen), file=sys.stderr)
    chat = chosen.chat
    chat_plan = chat.plan if chat is not None else None  # a second pair answers chat
    chat_engine = None
    try:
        target_path, draft_path = fetch.pull_plan(chosen, settings=settings, catalog=catalog)
        if chat_plan is not None:
            chat_paths = fetch.pull_plan(chat_plan, settings=settings, catalog=catalog)
            chat_engine = settings_to.plan_engine_settings(
                chat_plan, *chat_paths, n_slots=chosen.n_slots, host_cache_gb=0
            )
    except fetch.FetchError as exc:
        raise UpError(str(exc)) from None
    engine = settings_to.plan_engine_settings(
        chosen, target_path, draft_path, host_cache_gb=settings.cache.ram_gb
    )
    return Served(
        dataclasses.replace(engine, gpu_memory_cap=settings_to.gpu_memory_cap(settings)),
        chosen.pair_id,
        chosen,
        (target_path, draft_path),
        chat=chat_engine,
        chat_alias=chat_plan.pair_id if chat_plan is not None else None,
        chat_refusal=chat.reason if chat is not None and chat.mode == "off" else None,
    )


def _fallback(served: Served, *, out_of_memory: bool = False) -> Served | None:
    """The next, more frugal plan after a planned pair failed to load (llama.cpp ran out of
    memory because a driver or another process took more than the probe saw); None when
    nothing is left to give up. Models given as files are re-fitted only when llama.cpp ran
    out of memory (``out_of_memory``): fewer GPU layers, a shorter context
    (engine/memory.py ``refit``), said in one line."""
    from localspec import plan

    if served.plan is None or served.paths is None:
        if not out_of_memory:
            return None
        from localspec.engine.memory import refit

        refitted = refit(served.engine)
        if refitted is None:
            return None
        engine, changed = refitted
        c.warn(f"loading ran out of memory: re-planned with {changed}; retrying")
        return dataclasses.replace(served, engine=engine)
    smaller = plan.smaller(served.plan)
    if smaller is None:
        return None
    c.warn(f"{smaller.notes[-1]}; retrying")
    engine = dataclasses.replace(
        settings_to.plan_engine_settings(smaller, *served.paths),
        host_cache_bytes=served.engine.host_cache_bytes,
        gpu_memory_cap=served.engine.gpu_memory_cap,
    )
    return dataclasses.replace(served, engine=engine, plan=smaller)


def _upstream_settings(settings: st.Settings, key: str | None) -> UpstreamSettings | None:
    """The ``backend`` section as the server takes it; None for kind local. The openai kind
    lays FIM prompts out with a catalog model's FIM tokens: ``backend.fim_model``, else the
    catalog model ``backend.model`` names."""
    backend = settings.backend
    if backend.kind != "openai":
        return settings_to.upstream_settings(settings, api_key=key)
    from localspec.commands.models import load_catalog

    name = backend.fim_model or backend.model
    if not name:
        raise UpError(
            "backend.kind = openai needs backend.model (the upstream's model name) or "
            "backend.fim_model (the catalog model whose FIM tokens lay out prompts)"
        )
    try:
        catalog = load_catalog()
    except ValueError as exc:
        raise UpError(str(exc)) from None
    entry = catalog.match_model(name)
    if entry is None or entry.tokenizer.fim_text is None:
        which = "backend.fim_model" if backend.fim_model else "backend.model"
        raise UpError(
            f"{which} = {name!r} names no catalog model with FIM tokens "
            f"(`localspec models` lists them); set backend.fim_model to the one the "
            "upstream serves"
        )
    return settings_to.upstream_settings(
        settings, api_key=key, fim=entry.tokenizer.fim_text, fim_model=entry.id
    )


def _upstream_alone(upstream: UpstreamSettings, why: str) -> UpstreamSettings:
    """No local model can stand in (none on this machine and none to download, or the
    profile allows none): the upstream serves alone, and /props, ``status`` and a 503 say
    why, rather than ``up`` failing while the team server could answer."""
    first = why.splitlines()[0] if why else "not available"
    c.warn(f"no local model to stand in for the upstream ({first}); serving through the upstream")
    return dataclasses.replace(upstream, fallback="none", no_local=first)


def _server_settings(
    settings: st.Settings, api_key: str | None, served: Served | None
) -> ServerSettings:
    """The daemon's settings, with what was loaded: its slots, names and chat refusal."""
    if served is None:  # the upstream alone answers
        return settings_to.server_settings(settings, api_key=api_key)
    return settings_to.server_settings(
        settings,
        api_key=api_key,
        model_alias=served.alias,
        chat_alias=served.chat_alias,
        chat_refusal=served.chat_refusal,
    )


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # before the server owns the signals: stop a long step cleanly


def _configure_logging(log_settings: st.LogSettings) -> None:
    """One log setup for the CLI and the server (text or JSON; a line per request)."""
    from localspec.server.logs import configure

    configure(log_settings.level, log_settings.format, log_settings.requests)


def _serve(
    args: argparse.Namespace, settings: st.Settings, api_key: str | None, upstream_key: str | None
) -> int:
    _configure_logging(settings.log)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _terminate)
    backend = settings.backend
    served: Served | None = None
    try:
        upstream = _upstream_settings(settings, upstream_key)
        if upstream is None:  # the local model serves
            served = _local_models(args, settings) if args.target else _planned_models(settings)
        elif upstream.fallback == "local":  # it stands in
            try:
                served = _local_models(args, settings) if args.target else _planned_models(settings)
            except UpError as exc:
                upstream = _upstream_alone(upstream, str(exc))
        server_settings = _server_settings(settings, api_key, served)
    except UpError as exc:
        c.error(str(exc))
        return c.EXIT_FAILURE
    except KeyboardInterrupt:
        c.warn("interrupted before serving; nothing to stop")
        return c.EXIT_OK
    from localspec.server import serve

    log_path = args.log_file.expanduser() if args.log_file else None
    host, port = settings.server.host, settings.server.port
    url = daemon.base_url(host, port)
    if upstream is None:
        waiting = f"loading {served.alias}" if served else "starting"
    else:
        local = f"; local fallback {served.alias}" if served else ""
        waiting = f"connecting to the {backend.kind} upstream {backend.url}{local}"
    progress = c.Progress(waiting).__enter__()

    def on_ready(*_: object) -> None:
        progress.finish(f"serving at {url} (Ctrl-C to stop)")

    def on_bound(_: object) -> None:
        # only once the port is ours: an `up` that loses a start race must not replace the
        # winner's pid file, and then remove it as its own on the way out
        daemon.write_pid_file(host, port, log_path)

    uvicorn_level = "debug" if settings.log.level == "debug" else "warning"
    try:
        while True:
            code = serve(
                server_settings,
                settings_to.with_speculation_extras(served.engine, settings) if served else None,
                chat_engine_settings=served.chat if served else None,
                on_ready=on_ready,
                on_bound=on_bound,
                log_level=uvicorn_level,
                upstream=upstream,
            )
            # serve: 0 clean stop, 4 could not bind, 5 out of memory, else the load failed
            retry = (
                _fallback(served, out_of_memory=code == 5)
                if code not in (0, 4) and served
                else None
            )
            if retry is None:
                break
            served = retry
        owner = daemon.probe_port(host, port, api_key) if code == 4 else None
        if owner is not None and owner.kind == "localspec":
            # another `up` bound the port between our probe and our bind: the daemon the
            # user asked for is running, as when the probe sees it
            progress.finish("another localspec took the port first")
            _say_already_running(host, port, owner)
            code = 0
    except KeyboardInterrupt:
        code = c.EXIT_OK
    finally:
        if not progress.finished:
            progress.finish("stopped", ok=False)
        daemon.remove_pid_file(port)
    return {0: c.EXIT_OK, 4: c.EXIT_PORT_BUSY}.get(code, c.EXIT_FAILURE)
