"""``localspec profile show|explain|validate``: the effective settings and where they came from."""

from __future__ import annotations

import argparse
from pathlib import Path

import tomli_w

from localspec import paths
from localspec import settings as st
from localspec.commands import common as c

PROFILE = c.Command(
    "profile",
    "show, explain and validate settings and IT profiles",
    description="Inspect the layered settings.",
    exit_codes=True,
    epilog="""\
examples:
  localspec profile explain              every key: value, where it was set, what locks it
  localspec profile explain --port 9000  with flags applied, as `up` would see them
  localspec profile show                 the effective settings as TOML (the key redacted)
  localspec profile validate             check the system profiles and your config.toml
  localspec profile validate corp.toml   check one file before pushing it to every machine
  localspec profile keys                 every key, its type, env variable and meaning

layers, lowest first: defaults, system profiles (*.toml in the system config dir, sorted),
your config.toml, LOCALSPEC_* environment, flags. A system profile may lock keys:
  locked = ["models.allowed", "hub.endpoint", "server.host", "telemetry"]
""",
)


def register(sub: argparse._SubParsersAction) -> None:
    actions = c.add_actions(c.add_command(sub, PROFILE), "profile_command")
    for name, helptext, func in (
        ("show", "print the effective settings as TOML", run_show),
        ("explain", "print every value and the file/env/flag it came from", run_explain),
    ):
        q = c.add_command(actions, PROFILE.action(name, helptext), func)
        q.add_argument("--json", action="store_true", help="print JSON")
        c.add_settings_flags(q, serve=True)
    validate = "check profile files (default: every layer on this machine)"
    q = c.add_command(actions, PROFILE.action("validate", validate), run_validate)
    q.add_argument("files", nargs="*", type=Path, metavar="FILE", help="profile files to check")
    q.add_argument("--user", action="store_true", help="check FILEs as user config files")
    c.add_command(actions, PROFILE.action("keys", "list every settings key"), run_keys)


def run_show(args: argparse.Namespace) -> int:
    resolved = c.load_settings(args, quiet=True)
    table = st.to_toml_dict(resolved.settings)
    if args.json:
        c.print_json(table)
    else:
        print(tomli_w.dumps(table), end="")
    return c.EXIT_OK


def render_explain(resolved: st.ResolvedSettings) -> str:
    rows = st.explain(resolved)
    key_width = max(len(r.key) for r in rows)
    value_width = min(40, max(len(r.value) for r in rows))
    lines = []
    for row in rows:
        value = row.value
        lock = "  [locked]" if row.locked_by else ""
        lines.append(f"{row.key:<{key_width}}  {value:<{value_width}}  {row.origin}{lock}")
    sources = ["", "layers read:"]
    sources += [
        f"  {layer.origin}" for layer in resolved.layers if layer.origin.kind in ("system", "user")
    ]
    if len(sources) == 2:
        sources.append(
            f"  (no system profiles in {paths.system_config_dir()}, no {st.user_config_path()})"
        )
    if resolved.locks:
        sources += ["", "locked keys:"]
        sources += [f"  {key}  by {origin}" for key, origin in resolved.locks.items()]
    if resolved.violations:
        sources += ["", "ignored (locked):"]
        sources += [f"  {v}" for v in resolved.violations]
    return "\n".join(lines + sources)


def run_explain(args: argparse.Namespace) -> int:
    resolved = c.load_settings(args, quiet=True)
    if args.json:
        c.print_json(
            {
                "settings": [row.as_dict() for row in st.explain(resolved)],
                "layers": [str(layer.origin) for layer in resolved.layers],
                "ignored": [
                    {
                        "key": v.key,
                        "by": str(v.by),
                        "locked_by": str(v.locked_by),
                    }
                    for v in resolved.violations
                ],
            }
        )
    else:
        print(render_explain(resolved))
    return c.EXIT_OK


def run_validate(args: argparse.Namespace) -> int:
    if not args.files:
        resolved = st.load()
        st.check_backend(resolved.settings)  # as `up` would: its refusal, its words
        files = [
            layer.origin for layer in resolved.layers if layer.origin.kind in ("system", "user")
        ]
        for origin in files:
            print(f"ok: {origin}")
        if not files:
            print(f"ok: no profiles ({paths.system_config_dir()}, {st.user_config_path()})")
        for violation in resolved.violations:
            print(f"note: {violation}")
        return c.EXIT_OK
    problems: list[str] = []
    for path in args.files:
        layer, layer_problems = st.read_toml_layer(path, "user" if args.user else "system")
        layer_problems += st.validate_layer(layer)
        if not layer_problems:
            try:
                # the backend URL rule `up` applies (the key and CA files are the target's)
                st.check_backend_url(st.resolve([st.Layer(st.DEFAULT_ORIGIN), layer]).settings)
            except st.SettingsError as exc:
                layer_problems += exc.problems
        if layer_problems:
            problems += layer_problems
        else:
            locks = f" (locks {', '.join(layer.locks)})" if layer.locks else ""
            print(f"ok: {path}{locks}")
    if problems:
        return c.settings_error(st.SettingsError(problems))
    return c.EXIT_OK


def run_keys(args: argparse.Namespace) -> int:
    for key, info in st.KEYS.items():
        print(f"{key}  ({info.type_name}; env {info.env_name})\n    {info.description}")
    return c.EXIT_OK
