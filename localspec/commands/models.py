"""``localspec models``, ``pull``, ``plan`` and ``catalog``: what can run, fetch it, fit it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from localspec import paths, settings_to
from localspec import settings as st
from localspec.commands import common as c
from localspec.units import human_bytes

MODELS = c.Command(
    "models",
    "list catalog models and which are downloaded",
    epilog="""\
examples:
  localspec models               every catalog model and quant, its size, whether it is here
  localspec models --json
""",
)
PULL = c.Command(
    "pull",
    "download and verify model files",
    exit_codes=True,
    epilog="""\
examples:
  localspec pull qwen2.5-coder-1.5b                  download (or verify) the Q8_0 files
  localspec pull qwen2.5-coder-7b --quant Q4_K_M
  localspec pull --pair qwen2.5-coder-7b+0.5b        both models of a pair
  HF_ENDPOINT=http://mirror.local localspec pull qwen2.5-coder-0.5b
  localspec pull ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF/qwen2.5-coder-0.5b-q8_0.gguf
Files already verified on disk cost no network request; hub.offline forbids the network.
""",
)
PLAN = c.Command(
    "plan",
    "show what `up` would run on this machine, and why",
    epilog="""\
examples:
  localspec plan                         the pair, quants, GPU layers, context for this machine
  localspec plan --json                      the same plan with its arithmetic, as JSON
  localspec plan --hardware rtx4090-24gb     plan for a named hardware profile instead
  localspec plan --gpu-memory-gb 10 --ctx-size 8192
  localspec plan --team 50 --hardware h100-80gb --emit vllm
                      a shared server for 50 developers: the vLLM launch command, the capacity
                      arithmetic behind it, and the profile that points workstations at it
  localspec plan --team 500 --hardware 2xh100-80gb --emit llama-server --server-url https://llm.corp:8012
""",
)
CATALOG = c.Command(
    "catalog",
    "maintain the model catalog",
    epilog="""\
examples:
  localspec catalog refresh --dry-run        what would change in the catalog files
  localspec catalog refresh models/          pin sizes and sha256 of these files from the hub

Extra catalog files: *.toml in <system config dir>/models and <user config dir>/models.
""",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = c.add_command(sub, MODELS, run_models)
    p.add_argument("--json", action="store_true", help="print JSON")
    c.add_settings_flags(p, address=False)

    p = c.add_command(sub, PULL, run_pull)
    p.add_argument("model", nargs="?", help="catalog model id, or owner/repo[@rev]/file.gguf")
    p.add_argument("--quant", help="quantization (default Q8_0, or the only one)")
    p.add_argument("--pair", dest="pull_pair", metavar="PAIR", help="pull both models of a pair")
    p.add_argument("--force", action="store_true", help="download again even if verified")
    c.add_settings_flags(p, address=False)

    p = c.add_command(sub, PLAN, run_plan)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--hardware", metavar="NAME|FILE", help="plan for a hardware profile")
    team = p.add_argument_group(
        "team server", "plan a shared server for a team (docs/team-server.md)"
    )
    team.add_argument("--team", type=int, metavar="N", help="developers sharing the server")
    team.add_argument(
        "--emit",
        choices=("llama-server", "vllm", "sglang"),
        default="llama-server",
        help="the engine whose launch command to print (default llama-server)",
    )
    team.add_argument(
        "--server-url", metavar="URL", help="the server's URL, for the workstation profile"
    )
    c.add_settings_flags(p, serve=True)

    actions = c.add_actions(c.add_command(sub, CATALOG), "catalog_command")
    refresh = CATALOG.action("refresh", "pin revisions, sizes and sha256 from the hub")
    q = c.add_command(actions, refresh, run_catalog_refresh)
    q.add_argument("files", nargs="*", type=Path, metavar="FILE", help="catalog files or dirs")
    q.add_argument("--dry-run", action="store_true", help="show the changes, write nothing")
    q.add_argument("--update-revisions", action="store_true", help="move pins to current main")
    q.add_argument("--json", action="store_true", help="print JSON")
    c.add_settings_flags(q, address=False)


def catalog_dirs() -> list[Path]:
    """Extra catalog files that IT (system) or the user may add beside their settings."""
    return [paths.system_config_dir() / "models", paths.user_config_dir() / "models"]


def load_catalog() -> Any:
    from localspec.catalog import load_catalog as load

    return load(catalog_dirs())


def run_models(args: argparse.Namespace) -> int:
    from localspec import fetch
    from localspec.catalog import CatalogError

    settings = c.load_settings(args).settings
    try:
        catalog = load_catalog()
    except CatalogError as exc:
        c.error(str(exc))
        return c.EXIT_USAGE
    readonly = [Path(d).expanduser() for d in settings.models.dirs]
    rows = fetch.model_status(catalog, readonly_dirs=readonly)
    if args.json:
        c.print_json([{**r.__dict__, "path": str(r.path) if r.path else None} for r in rows])
        return c.EXIT_OK
    width = max((len(r.model_id) for r in rows), default=10)
    print(f"{'model':<{width}}  {'quant':<8}  {'size':>9}  state")
    for r in rows:
        state = "verified" if r.verified else "present" if r.present else "-"
        size = human_bytes(r.size_bytes) if r.size_exact else f"~{human_bytes(r.size_bytes)}"
        print(f"{r.model_id:<{width}}  {r.quant:<8}  {size:>9}  {state}")
    if catalog.pairs:
        print("\npairs:")
        for pair in catalog.pairs.values():
            draft = pair.draft or "n-gram drafting"
            print(f"  {pair.id}: {pair.target} + {draft}")
    return c.EXIT_OK


def _pick_quant(model: Any, quant: str | None) -> str:
    if quant is not None:
        if quant not in model.quants:
            raise ValueError(
                f"{model.id} has no quant {quant}; it has {', '.join(model.quant_ladder())}"
            )
        return quant
    if "Q8_0" in model.quants:
        return "Q8_0"
    if len(model.quants) == 1:
        return next(iter(model.quants))
    raise ValueError(
        f"{model.id} has several quants; choose one with --quant "
        f"({', '.join(model.quant_ladder())})"
    )


def _pull_specs(args: argparse.Namespace, settings: st.Settings, catalog: Any) -> list[Any]:
    """What to pull: a pair's models, a catalog model, or an ``owner/repo/file.gguf`` ref."""
    from localspec.fetch import FileSpec

    if args.model and "/" in args.model:
        spec = FileSpec.parse(args.model)
        if not settings.allows_model(Path(spec.filename).name, Path(spec.filename).stem):
            raise ValueError(f"{spec.filename} is not in models.allowed")
        return [spec]
    if args.pull_pair:
        pair = catalog.pair(args.pull_pair)
        ids = [pair.target, *([pair.draft] if pair.draft else [])]
        names = [pair.id]
    elif args.model:
        ids, names = [args.model], []
    else:
        raise ValueError("name a model, an owner/repo/file.gguf, or --pair (`localspec models`)")
    quants = []
    for index, model_id in enumerate(ids):
        model = catalog.model(model_id)
        if not settings.allows_model(model_id, *names):
            allowed = ", ".join(settings.models.allowed)
            raise ValueError(f"{model_id} is not in models.allowed ({allowed})")
        quants.append(model.quants[_pick_quant(model, args.quant if index == 0 else None)])
    return quants


def run_pull(args: argparse.Namespace) -> int:
    from localspec import fetch
    from localspec.catalog import CatalogError

    try:
        settings = c.load_settings(args).settings
        specs = _pull_specs(args, settings, load_catalog())
        options = fetch.hub_options(settings)
    except st.SettingsError:  # a ValueError too: bad settings are told as such (cli.main)
        raise
    except (CatalogError, ValueError) as exc:
        c.error(str(exc))
        return c.EXIT_USAGE
    try:
        files = fetch.pull(specs, force=args.force, **options)
    except fetch.FetchError as exc:
        c.error(str(exc))
        return c.EXIT_FAILURE
    for path in files:
        print(path)
    return c.EXIT_OK


def run_plan(args: argparse.Namespace) -> int:
    from localspec import hardware, plan, step_costs
    from localspec.planning.host_cache import host_cache_budget, plan_free_bytes

    try:
        settings = c.load_settings(args).settings
        catalog = load_catalog()
        measured = {}
        if args.hardware:
            facts = hardware.load_hardware_profile(args.hardware)
        else:
            with c.Progress("probing hardware") as progress:
                facts = hardware.probe()
                progress.finish("done")
            measured = step_costs.load(facts.description)  # `localspec bench steps` here
        if args.team is not None:
            from localspec.planning.render import render_team
            from localspec.planning.team import team_plan

            team = team_plan(
                catalog,
                facts,
                settings_to.plan_inputs(settings),
                developers=args.team,
                engine=args.emit,
                server_url=args.server_url,
                step_costs=measured,
            )
            if args.json:
                c.print_json(team.to_json())
            else:
                print(render_team(team))
            return c.EXIT_OK
        asked = settings_to.plan_inputs(settings)
        chosen = plan.make_plan(catalog, facts, asked, step_costs=measured)
    except st.SettingsError:  # a ValueError too: bad settings are told as such (cli.main)
        raise
    except ValueError as exc:  # CatalogError, HardwareError, PlanError are ValueErrors
        c.error(str(exc))
        return c.EXIT_USAGE
    window = settings.cache.infill_window
    host_cache = host_cache_budget(plan_free_bytes(chosen.memory), settings.cache.ram_gb)
    if args.json:
        c.print_json({**chosen.to_json(), "infill_window": window, "host_cache_bytes": host_cache})
    else:
        print(plan.render_plan(chosen))
        print(infill_window_line(window))
        print(host_cache_line(host_cache))
    return c.EXIT_OK


def host_cache_line(n_bytes: int) -> str:
    """What ``plan`` says of the host cache of slot contexts (engine/hostcache.py)."""
    if n_bytes <= 0:
        return "host cache of slot contexts: off (cache.ram_gb = 0)"
    return (
        f"host cache of slot contexts: {n_bytes / (1 << 30):.1f} GiB (cache.ram_gb; unset: "
        "half the host memory the plan leaves free, at most 8 GiB)"
    )


def infill_window_line(window: int) -> str:
    """What ``plan`` says of /infill's window: it does not follow the plan's batch size."""
    return (
        f"infill window: {window} tokens ({3 * (window // 4)} prefix, {window // 4} suffix; "
        "cache.infill_window), whatever the batch size"
    )


def run_catalog_refresh(args: argparse.Namespace) -> int:
    from localspec.catalog import CatalogError
    from localspec.fetch import hub_options, refresh_catalog

    settings = c.load_settings(args).settings
    options = hub_options(settings)
    if options["offline"]:
        c.error("hub.offline is set: refreshing the catalog needs the hub")
        return c.EXIT_USAGE
    try:
        target = list(args.files) if args.files else load_catalog()
        with c.Progress("asking the hub for revisions, sizes and sha256") as progress:
            changes = refresh_catalog(
                target,
                endpoint=options["endpoint"],
                token=options["token"],
                update_revisions=args.update_revisions,
                dry_run=args.dry_run,
            )
            progress.finish(f"{len(changes)} change(s)")
    except CatalogError as exc:
        c.error(str(exc))
        return c.EXIT_USAGE
    except Exception as exc:  # the hub client raises httpx and huggingface_hub errors
        c.error(f"catalog refresh failed: {exc}")
        return c.EXIT_FAILURE
    if args.json:
        c.print_json([change.to_dict() for change in changes])
    else:
        for change in changes:
            print(change)
        if args.dry_run and changes:
            print("(dry run: no file written)")
    return c.EXIT_OK
