"""The layered settings model: precedence, locks, named errors, security rules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localspec import settings as st


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "system", tmp_path / "user" / "config.toml"


def _load(dirs: tuple[Path, Path], env: dict[str, str] | None = None, flags=None):
    system_dir, user_file = dirs
    return st.load(environ=env or {}, flags=flags or {}, system_dir=system_dir, user_file=user_file)


# Each layer sets server.port; the highest layer present wins and is named as the origin.
PRECEDENCE = [
    ("default", {}, 8012, "default"),
    ("system", {"system"}, 8100, "system profile"),
    ("second system", {"system", "system2"}, 8101, "system profile"),
    ("user", {"system", "system2", "user"}, 8200, "user config"),
    ("env", {"system", "user", "env"}, 8300, "env LOCALSPEC_SERVER_PORT"),
    ("flag", {"system", "user", "env", "flag"}, 8400, "flag --port"),
]


@pytest.mark.parametrize(("name", "present", "port", "origin"), PRECEDENCE)
def test_each_layer_overrides_the_one_below(dirs, name, present, port, origin) -> None:
    system_dir, user_file = dirs
    if "system" in present:
        _write(system_dir / "10-base.toml", "[server]\nport = 8100\n")
    if "system2" in present:
        _write(system_dir / "20-team.toml", "[server]\nport = 8101\n")
    if "user" in present:
        _write(user_file, "[server]\nport = 8200\n")
    env = {"LOCALSPEC_SERVER_PORT": "8300"} if "env" in present else {}
    flags = {"server.port": (8400, "--port")} if "flag" in present else {}
    resolved = _load(dirs, env, flags)
    assert resolved.settings.server.port == port
    assert str(resolved.origins["server.port"]).startswith(origin)
    assert resolved.violations == []


def test_locks_hold_against_user_env_and_flags(dirs) -> None:
    system_dir, user_file = dirs
    profile = _write(
        system_dir / "50-corp.toml",
        'locked = ["server.host", "hub", "telemetry"]\n'
        '[hub]\nendpoint = "https://mirror.corp.example/hf"\n',
    )
    _write(user_file, '[server]\nhost = "0.0.0.0"\n[hub]\noffline = true\n')
    env = {"LOCALSPEC_HUB_ENDPOINT": "https://elsewhere.example", "HF_ENDPOINT": "http://x.y"}
    flags = {"server.host": ("192.168.1.5", "--host"), "server.port": (9000, "--port")}
    resolved = _load(dirs, env, flags)
    s = resolved.settings
    assert s.server.host == "localhost"
    assert s.hub.endpoint == "https://mirror.corp.example/hf"
    assert s.hub.offline is False  # "hub" locks every key of the section
    assert s.server.port == 9000  # not locked: the flag wins
    tried = {(v.key, str(v.by)) for v in resolved.violations}
    assert tried == {
        ("server.host", f"user config {user_file}"),
        ("server.host", "flag --host"),
        ("hub.offline", f"user config {user_file}"),
        ("hub.endpoint", "env LOCALSPEC_HUB_ENDPOINT"),
    }
    assert all(v.locked_by.label == str(profile) for v in resolved.violations)
    assert str(profile) in str(resolved.violations[0])
    rows = {r.key: r for r in st.explain(resolved)}
    assert rows["server.host"].locked_by == f"system profile {profile}"
    assert rows["telemetry"].locked_by == f"system profile {profile}"


def test_lock_keeps_value_from_lower_profile_and_holds_against_later_profile(dirs) -> None:
    system_dir, _ = dirs
    _write(system_dir / "10-a.toml", 'locked = ["models.allowed"]\n[models]\nallowed = ["a"]\n')
    _write(system_dir / "20-b.toml", '[models]\nallowed = ["b"]\n')
    resolved = _load(dirs)
    assert resolved.settings.models.allowed == ["a"]
    assert [v.by.label for v in resolved.violations] == [str(system_dir / "20-b.toml")]


def test_setting_the_locked_value_again_is_not_a_violation(dirs) -> None:
    system_dir, user_file = dirs
    _write(system_dir / "p.toml", 'locked = ["server.port"]\n[server]\nport = 8500\n')
    _write(user_file, "[server]\nport = 8500\n")
    resolved = _load(dirs, {"LOCALSPEC_SERVER_PORT": "8500"})
    assert resolved.violations == []


@pytest.mark.parametrize(
    ("where", "text", "expected"),
    [
        ("user", "[server]\nprot = 1\n", "unknown key 'server.prot' (did you mean 'server.port'?)"),
        ("user", "[serer]\nport = 1\n", "unknown key 'serer.port' (did you mean 'server.port'?)"),
        ("user", "[server]\nport = 'x'\n", "server.port: Input should be a valid integer"),
        ("system", "[server]\nport = 99999\n", "server.port: Input should be less than"),
        ("user", "[speculative]\nmode = 'fast'\n", "speculative.mode: Input should be 'off'"),
        ("user", "telemetry = true\n", "telemetry: localspec has no telemetry"),
        ("user", "server = 3\n", "'server' is a section"),
        ("user", "[server\n", "not valid TOML"),
        ("user", 'locked = ["server.host"]\n', "'locked' is honoured only in system profiles"),
        ("system", 'locked = ["server.hots"]\n', "did you mean 'server.host'?"),
        ("user", "[hub]\nendpoint = 'ftp://x'\n", "hub.endpoint: must be an http:// or https://"),
        (
            "user",
            "[hub]\nendpoint = 'https://'\n",
            "hub.endpoint: must be an http:// or https:// URL with a host",
        ),
        ("user", "[server]\nport = true\n", "server.port: must be a number, not true"),
        ("system", "[server]\nslots = false\n", "server.slots: must be a number"),
        (
            "user",
            "[limits]\ngpu_memory_gb = inf\n",
            "limits.gpu_memory_gb: Input should be a finite number",
        ),
        (
            "user",
            "[backend]\nfallback_ms = nan\n",
            "backend.fallback_ms: Input should be a finite number",
        ),
        (
            "system",
            "[backend]\nkind = 'openai'\nurl = 'https://llm.corp'\n",
            "kind 'openai' needs backend.model",
        ),
    ],
)
def test_bad_profiles_name_file_and_key(dirs, where, text, expected) -> None:
    system_dir, user_file = dirs
    path = _write(system_dir / "bad.toml" if where == "system" else user_file, text)
    with pytest.raises(st.SettingsError) as info:
        _load(dirs)
    message = str(info.value)
    assert str(path) in message
    assert expected in message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"# caf\xe9\n[server]\nport = 9000\n", "not UTF-8 text (byte 5"),
        ("[server]\nport = 9000\n".encode("utf-16"), "not UTF-8 text"),
        (b"[models]\nallowed = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    ],
    ids=["latin-1", "utf-16", "nested"],
)
def test_a_profile_that_is_not_toml_text_is_named_not_a_traceback(dirs, data, expected) -> None:
    system_dir, _ = dirs
    path = system_dir / "10-corp.toml"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    with pytest.raises(st.SettingsError) as info:
        _load(dirs)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_a_byte_order_mark_and_editor_files_in_the_profile_directory_are_harmless(dirs) -> None:
    system_dir, _ = dirs
    (system_dir).mkdir(parents=True)
    (system_dir / "10-corp.toml").write_bytes(b"\xef\xbb\xbf[server]\nport = 9000\n")  # Notepad
    (system_dir / ".#10-corp.toml").symlink_to("/nonexistent/editor-lock")  # emacs, mid-edit
    _write(system_dir / ".20-old.toml", "[server]\nport = 9999\n")  # put aside
    assert _load(dirs).settings.server.port == 9000


def test_a_files_relative_paths_are_relative_to_the_file(dirs) -> None:
    system_dir, user_file = dirs
    _write(system_dir / "10-corp.toml", '[models]\ndirs = ["models", "/srv/models", "~/m"]\n')
    _write(user_file, '[server]\napi_key_file = "server.key"\n')
    s = _load(dirs, {"LOCALSPEC_HUB_TOKEN_FILE": "token"}).settings
    assert s.server.api_key_file == user_file.parent / "server.key"
    assert s.models.dirs == [system_dir / "models", Path("/srv/models"), Path("~/m")]
    assert s.hub.token_file == Path("token")  # the environment's: the working directory's


def test_every_problem_is_reported_at_once(dirs) -> None:
    _, user_file = dirs
    _write(user_file, "[server]\nprot = 1\n[speculative]\nn_max = 'x'\n")
    with pytest.raises(st.SettingsError) as info:
        _load(dirs)
    assert len(info.value.problems) == 2


def test_cross_field_rule_uses_merged_values(dirs) -> None:
    system_dir, user_file = dirs
    _write(system_dir / "a.toml", "[speculative]\nn_max = 32\n")
    _write(user_file, "[speculative]\nn_min = 20\n")
    assert _load(dirs).settings.speculative.n_min == 20  # fine: 20 <= 32 after merging
    with pytest.raises(st.SettingsError, match=r"n_min \(20\) is larger than n_max \(8\)"):
        _load(dirs, flags={"speculative.n_max": (8, "--draft-max")})


def test_env_values_are_parsed_and_unknown_env_is_an_error(dirs) -> None:
    env = {
        "LOCALSPEC_MODELS_ALLOWED": "qwen-7b, qwen-1.5b",
        "LOCALSPEC_HUB_OFFLINE": "true",
        "LOCALSPEC_SPECULATIVE_P_MIN": "0.5",
        "LOCALSPEC_MODELS_DIR": "/not/a/setting",  # a directory override, not a setting
        "LOCALSPEC_LLAMA_LOG": "1",  # llama.cpp's log, a debugging switch, not a setting
        "LOCALSPEC_VENV": "/opt/venv",  # the launcher's, exported to run it with another venv
        "LOCALSPEC_PYTHON": "python3.12",
        "LOCALSPEC_WHEELHOUSE": "/tmp/wheels",
    }
    s = _load(dirs, env).settings
    assert s.models.allowed == ["qwen-7b", "qwen-1.5b"]
    assert s.hub.offline is True
    assert s.speculative.p_min == 0.5
    with pytest.raises(st.SettingsError, match="LOCALSPEC_SERVER_PROT: not a localspec setting"):
        _load(dirs, {"LOCALSPEC_SERVER_PROT": "1"})


def test_hf_env_is_a_lower_spelling_of_hub_keys(dirs) -> None:
    resolved = _load(dirs, {"HF_ENDPOINT": "http://127.0.0.1:9/", "HF_HUB_OFFLINE": "1"})
    assert resolved.settings.hub.endpoint == "http://127.0.0.1:9"
    assert resolved.settings.hub.offline is True
    assert str(resolved.origins["hub.endpoint"]) == "env HF_ENDPOINT"
    both = {"HF_ENDPOINT": "http://a.example", "LOCALSPEC_HUB_ENDPOINT": "http://b.example"}
    assert _load(dirs, both).settings.hub.endpoint == "http://b.example"


def test_set_option_parses_toml_literals() -> None:
    flags, problems = st.parse_set_options(
        ["server.port=9001", "hub.endpoint=http://m.example", 'models.allowed=["a","b"]', "x"]
    )
    assert problems and "expected KEY=VALUE" in problems[0]
    layer, layer_problems = st.flag_layer(flags)
    assert layer_problems == []
    assert layer.values["server.port"][0] == 9001
    assert layer.values["hub.endpoint"][0] == "http://m.example"
    assert layer.values["models.allowed"][0] == ["a", "b"]


def test_explain_never_prints_the_api_key(dirs) -> None:
    _, user_file = dirs
    _write(user_file, '[server]\napi_key = "sk-very-secret"\n')
    resolved = _load(dirs, {"LOCALSPEC_SERVER_API_KEY": "sk-other-secret"})
    rows = {r.key: r for r in st.explain(resolved)}
    assert rows["server.api_key"].value == "set (from env LOCALSPEC_SERVER_API_KEY)"
    dumped = repr(st.explain(resolved)) + repr(st.to_toml_dict(resolved.settings))
    assert "secret" not in dumped.replace("<secret>", "")


def test_a_key_on_the_command_line_is_refused() -> None:
    # it would show in ps, and `up --detach` would hand it to the daemon's command line
    flags, _ = st.parse_set_options(["server.api_key=sk-in-argv", "backend.api_key=sk-2"])
    layer, problems = st.flag_layer(flags)
    assert layer.values == {}
    assert len(problems) == 2 and all("shows in ps" in p for p in problems)
    assert "server.api_key_file" in problems[0]


def test_credentials_in_urls_are_never_shown(dirs) -> None:
    system_dir, user_file = dirs
    _write(
        system_dir / "10-corp.toml",
        'locked = ["hub.proxy"]\n[hub]\nproxy = "http://svc:Corp0rateProxyPw@proxy.corp:3128"\n'
        'endpoint = "https://hf-mirror.corp/?token=MIRRORTOKEN"\n',
    )
    _write(user_file, '[hub]\nproxy = "http://alice:AlicePw@proxy.corp:3128"\n')
    resolved = _load(dirs)
    rows = {r.key: r.value for r in st.explain(resolved)}
    assert rows["hub.proxy"] == "http://svc:<secret>@proxy.corp:3128"
    assert rows["hub.endpoint"] == "https://hf-mirror.corp/?<secret>"
    shown = repr(st.explain(resolved)) + repr(st.to_toml_dict(resolved.settings))
    shown += "".join(map(str, resolved.violations))
    assert resolved.violations and "AlicePw" not in shown
    assert "Corp0rateProxyPw" not in shown and "MIRRORTOKEN" not in shown
    assert resolved.settings.hub.proxy == "http://svc:Corp0rateProxyPw@proxy.corp:3128"  # used


def test_a_locked_hub_endpoint_keeps_hf_endpoint_out(dirs) -> None:
    from localspec.fetch.plan_files import DEFAULT_HUB, hub_options

    rogue = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert hub_options(_load(dirs, rogue).settings)["endpoint"] == "http://127.0.0.1:9"
    system_dir, _ = dirs
    _write(system_dir / "10-corp.toml", 'locked = ["hub"]\n[hub]\noffline = false\n')
    resolved = _load(dirs, rogue)
    assert resolved.violations  # reported ...
    assert hub_options(resolved.settings)["endpoint"] == DEFAULT_HUB  # ... and held


def test_every_key_named_in_the_brief_exists() -> None:
    wanted = [
        "models.allowed",
        "models.dirs",
        "models.pair",
        "hub.endpoint",
        "hub.offline",
        "hub.proxy",
        "hub.ca_bundle",
        "hub.token_file",
        "server.host",
        "server.port",
        "server.api_key",
        "server.api_key_file",
        "server.api_key_required",
        "server.slots",
        "server.queue_limit",
        "server.body_timeout_s",
        "server.max_connections",
        "server.metrics",
        "limits.context",
        "limits.gpu_memory_gb",
        "speculative.mode",
        "speculative.n_max",
        "speculative.n_min",
        "speculative.p_min",
        "cache.reuse_chunk",
        "cache.exact_ms",
        "cache.infill_layout",
        "cache.ring_attention",
        "log.level",
        "log.format",
        "log.requests",
        "telemetry",
    ]
    assert set(wanted) <= set(st.KEYS)
    assert len({info.env_name for info in st.KEYS.values()}) == len(st.KEYS)


# --- security --------------------------------------------------------------------------------


def _settings(**server) -> st.Settings:
    return st.Settings.model_validate({"server": server})


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_start_without_a_key(host: str) -> None:
    assert st.check_security(_settings(host=host)) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "devbox.example", "::"])
def test_non_loopback_host_without_key_is_refused(host: str) -> None:
    with pytest.raises(st.SettingsError, match="reachable from other machines"):
        st.check_security(_settings(host=host))


def test_key_required_without_key_is_refused() -> None:
    with pytest.raises(st.SettingsError, match="api_key_required"):
        st.check_security(_settings(api_key_required=True))


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    key_file = _write(tmp_path / "key", "sk-123\n")
    key_file.chmod(0o644)
    with pytest.raises(st.SettingsError, match="chmod 600"):
        st.check_security(_settings(host="0.0.0.0", api_key_file=str(key_file)))
    key_file.chmod(0o600)
    assert st.check_security(_settings(host="0.0.0.0", api_key_file=str(key_file))) == "sk-123"


def test_inline_key_allows_non_loopback() -> None:
    assert st.check_security(_settings(host="0.0.0.0", api_key="k")) == "k"


def test_a_blank_inline_key_is_no_key() -> None:
    with pytest.raises(st.SettingsError, match="reachable from other machines"):
        st.check_security(_settings(host="0.0.0.0", api_key="  "))


def test_a_bracketed_ipv6_host_is_the_address() -> None:
    assert _settings(host="[::1]").server.host == "::1"
    assert st.check_security(_settings(host="[::1]")) is None


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_a_key_file_that_is_a_directory_or_not_utf8_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "keydir"
    folder.mkdir(mode=0o700)
    with pytest.raises(st.SettingsError, match=f"server.api_key_file: cannot read {folder}"):
        st.check_security(_settings(host="0.0.0.0", api_key_file=str(folder)))
    utf16 = tmp_path / "key16"
    utf16.write_bytes("sk-123".encode("utf-16"))
    utf16.chmod(0o600)
    with pytest.raises(st.SettingsError, match="is not UTF-8 text"):
        st.check_security(_settings(host="0.0.0.0", api_key_file=str(utf16)))
