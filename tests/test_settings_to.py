"""The one translation of the settings model into each part's settings, and the rules it
keeps in one place: the defaults (the model's), the loopback rule, the direction of imports."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import paths, settings_to
from localspec import settings as st
from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.plan import PlanSettings, Speculation
from localspec.server import ServerSettings, UpstreamSettings

PACKAGE = Path(__file__).resolve().parents[1] / "localspec"


def _settings(**sections: object) -> st.Settings:
    return st.Settings.model_validate(sections)


def test_defaults_of_each_part_are_the_settings_models() -> None:
    """Each part's defaults (for tests and programmatic use) equal what the default Settings
    translate to: a default changed in the model changes it everywhere."""
    defaults = st.Settings()
    # but one: the daemon keeps its slots' contexts under the user's cache directory, where a
    # programmatic server (a test's) writes nothing unless asked
    kept = dataclasses.replace(ServerSettings(), context_dir=paths.cache_dir() / "contexts")
    assert settings_to.server_settings(defaults, api_key=None) == kept
    off = _settings(cache={"restart_gb": 0})
    assert settings_to.server_settings(off, api_key=None).context_dir is None
    assert settings_to.plan_inputs(defaults) == PlanSettings()
    assert settings_to.speculation(defaults) == Speculation()
    target, draft = ModelSettings(path="t.gguf"), ModelSettings(path="d.gguf")
    # but the host cache: `up` has it sized when the models load (an engine built in code has
    # none unless it asks)
    assert settings_to.file_engine_settings(defaults, target, draft) == EngineSettings(
        target=target, draft=draft, host_cache_bytes=None
    )
    assert settings_to.spec_settings(Speculation(), has_draft=True) == SpecSettings()
    remote = _settings(backend={"kind": "llama-server", "url": "https://team:8443"})
    assert settings_to.upstream_settings(remote, api_key=None) == UpstreamSettings(
        kind="llama-server", url="https://team:8443"
    )
    assert settings_to.upstream_settings(defaults, api_key=None) is None  # kind local


def test_server_settings_carry_every_server_key() -> None:
    settings = _settings(
        server={"host": "127.0.0.2", "port": 9000, "queue_limit": 3, "request_timeout_s": 5,
                "metrics": False, "cors_origins": ["http://a"], "n_cmpl_max": 2,
                "max_body_bytes": 4096, "body_timeout_s": 7, "max_connections": 9,
                "spm_infill": True, "slots": 3, "slot_choice": "pinned",
                "slot_save_path": "/s"},
        cache={"infill_layout": "llama-server", "ring_attention": "causal",
               "infill_window": 512, "restart_gb": 0.5},
    )  # fmt: skip
    got = settings_to.server_settings(settings, api_key="k", model_alias="m", chat_alias="c")
    assert got == ServerSettings(
        host="127.0.0.2", port=9000, api_key="k", queue_limit=3,
        request_timeout_s=5, metrics=False, cors_origins=("http://a",), model_alias="m",
        spm_infill=True, infill_layout="llama-server", ring_attention="causal", n_cmpl_max=2,
        max_body_bytes=4096, body_timeout_s=7, max_connections=9, chat_alias="c",
        slot_choice="pinned", slot_save_path=Path("/s"), infill_window=512,
        context_dir=paths.cache_dir() / "contexts", context_bytes=1 << 29,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
     ("[::1]", True), ("0.0.0.0", False), ("10.1.2.3", False), ("dev.example.com", False)],
)  # fmt: skip
def test_one_loopback_rule_for_the_settings_and_the_server(host: str, loopback: bool) -> None:
    """``up`` (settings.check_security) and ``serve`` (ServerSettings.check) agree on which
    hosts need an API key: 127.0.0.2 is loopback for both."""
    assert st.is_loopback(host) is loopback
    settings = _settings(server={"host": host})
    server = settings_to.server_settings(settings, api_key=None)
    if loopback:
        assert st.check_security(settings) is None
        server.check()
    else:
        with pytest.raises(st.SettingsError, match="reachable from other machines"):
            st.check_security(settings)
        with pytest.raises(ValueError, match="without an API key"):
            server.check()
    settings_to.server_settings(settings, api_key="k").check()  # a key opens any host


def test_files_on_the_command_line_become_engine_settings(tmp_path: Path) -> None:
    settings = _settings(
        limits={"context": 2048, "threads": 3},
        server={"slots": 2},
        speculative={"mode": "hybrid", "n_max": 5},
        cache={"reuse_chunk": 64, "exact_ms": 0},
    )
    target = settings_to.file_model_settings(
        settings, tmp_path / "t.gguf", gpu_layers=-1, flash_attn=None
    )
    assert target == ModelSettings(
        path=str(tmp_path / "t.gguf"), n_gpu_layers=-1, n_ctx=2048, n_threads=3,
        n_threads_batch=3,
    )  # fmt: skip
    alone = settings_to.file_engine_settings(settings, target, None)
    assert alone.spec == SpecSettings(mode="ngram", n_max=5)  # no draft model: n-grams
    assert (alone.n_slots, alone.cache_reuse, alone.exact_ms) == (2, 64, 0)
    paired = settings_to.file_engine_settings(settings, target, target)
    assert paired.spec.mode == "hybrid"
    # the host cache: sized when the models load (None) unless cache.ram_gb says; none for a
    # chat pair
    assert alone.host_cache_bytes is None
    asked = _settings(cache={"ram_gb": 0.5})
    assert settings_to.file_engine_settings(asked, target, None).host_cache_bytes == 1 << 29
    chat = settings_to.file_engine_settings(settings, target, None, host_cache=False)
    assert chat.host_cache_bytes == 0
    default = settings_to.file_model_settings(
        st.Settings(), "x.gguf", gpu_layers=0, flash_attn=True
    )
    assert default.n_ctx == ModelSettings(path="x").n_ctx and default.flash_attn is True


@pytest.mark.parametrize(
    ("argv", "env", "pipeline"),
    [([], {}, None), (["--spec-pipeline", "off"], {}, False),
     (["--spec-pipeline", "on"], {}, True), ([], {"LOCALSPEC_SPECULATIVE_PIPELINE": "off"}, False),
     (["--spec-pipeline", "auto"], {"LOCALSPEC_SPECULATIVE_PIPELINE": "off"}, None)],
)  # fmt: skip
def test_speculative_pipeline_reaches_the_engine(
    argv: list[str],
    env: dict[str, str],
    pipeline: bool | None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``speculative.pipeline`` (``--spec-pipeline``, the env, a file): auto leaves the choice
    to the engine (SpecSettings.pipeline None: on when both models' threads fit the cores),
    on and off force it; the other speculative settings stay as they were."""
    from localspec import cli
    from localspec.commands import common

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["up", "--spec-mode", "draft", *argv])
    loaded = common.load_settings(args, quiet=True).settings
    assert loaded.speculative.pipeline == {None: "auto", True: "on", False: "off"}[pipeline]
    target = ModelSettings(path="t.gguf")
    engine = settings_to.file_engine_settings(loaded, target, target)
    served = settings_to.with_speculation_extras(engine, loaded)
    assert served.spec == dataclasses.replace(engine.spec, pipeline=pipeline)
    assert served.spec.mode == "draft"


def test_speculative_depth_rules_reach_the_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The opt-in depth rules (``speculative.ngram_agree``, ``draft_cost_max``,
    ``weigh_sources``, ``learn_p_min``) reach the engine's SpecSettings from the environment;
    the defaults leave them off."""
    target = ModelSettings(path="t.gguf")
    default = st.Settings()
    engine = settings_to.file_engine_settings(default, target, target)
    off = settings_to.with_speculation_extras(engine, default).spec
    assert (off.ngram_agree, off.draft_cost_max) == (False, 0.0)
    assert (off.weigh_sources, off.learn_p_min) == (False, False)
    from localspec import cli
    from localspec.commands import common

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("LOCALSPEC_SPECULATIVE_NGRAM_AGREE", "true")
    monkeypatch.setenv("LOCALSPEC_SPECULATIVE_DRAFT_COST_MAX", "0.5")
    monkeypatch.setenv("LOCALSPEC_SPECULATIVE_WEIGH_SOURCES", "true")
    monkeypatch.setenv("LOCALSPEC_SPECULATIVE_LEARN_P_MIN", "true")
    args = cli.build_parser().parse_args(["up"])
    loaded = common.load_settings(args, quiet=True).settings
    on = settings_to.with_speculation_extras(engine, loaded).spec
    assert (on.ngram_agree, on.draft_cost_max) == (True, 0.5)
    assert (on.weigh_sources, on.learn_p_min) == (True, True)
    with pytest.raises(ValueError, match=r"draft_cost_max"):
        st.Settings.model_validate({"speculative": {"draft_cost_max": -1}})


def test_speculative_pipeline_refuses_other_values() -> None:
    with pytest.raises(ValueError, match=r"speculative\.pipeline"):
        st.Settings.model_validate({"speculative": {"pipeline": "sometimes"}})
    with pytest.raises(SystemExit):  # argparse names the choices
        from localspec import cli

        cli.build_parser().parse_args(["up", "--spec-pipeline", "maybe"])


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_planner_imports_nothing_above_it() -> None:
    """planning/ is pure and below the engine, the server and the CLI (docs/architecture.md):
    none of its modules imports them, and importing the planner loads no llama.cpp."""
    above = ("localspec.engine", "localspec.server", "localspec.commands", "localspec.settings")
    for path in sorted((PACKAGE / "planning").glob("*.py")):
        bad = {name for name in _imports(path) if name.startswith(above)}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    code = (
        "import sys, localspec.plan, localspec.planning.team, localspec.settings_to; "
        "print(sorted(m for m in sys.modules if m == 'llama_cpp' or m == 'fastapi' "
        "or m.startswith(('localspec.engine', 'localspec.server'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
