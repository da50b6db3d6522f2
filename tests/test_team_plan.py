"""`localspec plan --team N --emit ENGINE`: the shared server the planner chooses for N
developers, as llama-server's, vLLM's or SGLang's launch command, with the workstation
profile that points localspec at it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from localspec import hardware
from localspec import settings as st
from localspec.catalog import load_catalog
from localspec.plan import PlanError, PlanSettings
from localspec.planning.team import team_plan

CATALOG = load_catalog()


def _flags(argv: tuple[str, ...]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, (*argv[1:], ""), strict=True) if a.startswith("-")}


def test_llama_server_command_follows_the_plan() -> None:
    facts = hardware.load_hardware_profile("h100-80gb")
    team = team_plan(CATALOG, facts, developers=50, engine="llama-server")
    plan = team.plan
    assert plan.capacity is not None and plan.capacity.sessions_held >= 50
    flags = _flags(team.argv)
    assert flags["-np"] == str(plan.n_slots) and flags["-c"] == str(plan.n_ctx * plan.n_slots)
    assert "-kvu" in flags and flags["--cache-reuse"] == "256"
    assert flags["--cache-ram"] == "0"  # else a slot loses its prompt once another has run
    assert flags["-ctk"] == plan.type_k and flags["-fa"] == ("on" if plan.flash_attn else "off")
    target = CATALOG.model(plan.target[0]).quants[plan.target[1]]
    assert flags["-hf"] == target.repo and flags["-hff"] == target.main_file.filename
    assert plan.draft is not None  # a big GPU: the 0.5B draft
    assert flags["--spec-type"] == "draft-simple" and flags["-md"].endswith(".gguf")
    assert flags["--api-key-file"] and "--metrics" in flags
    text = team.command()
    assert text.startswith("llama-server \\\n  -hf ") and " -np " not in text.split("\n")[0]


def test_vllm_serves_fp8_with_a_draft_and_splits_over_two_gpus() -> None:
    facts = hardware.load_hardware_profile("2xh100-80gb")
    team = team_plan(CATALOG, facts, developers=500, engine="vllm")
    plan = team.plan
    assert plan.target[1] in ("Q8_0", "F16")  # vLLM serves the original weights
    flags = _flags(team.argv)
    assert team.argv[:3] == ("vllm", "serve", CATALOG.model(plan.target[0]).hf_model)
    assert flags["--max-num-seqs"] == str(plan.n_slots)
    assert flags["--max-model-len"] == str(plan.n_ctx)
    assert flags["--tensor-parallel-size"] == "2"
    if plan.target[1] == "Q8_0":
        assert flags["--quantization"] == "fp8"
    else:
        assert flags["--dtype"] == "bfloat16"
    config = json.loads(flags["--speculative-config"])
    assert config["method"] == "draft_model" and config["model"] == "Qwen/Qwen2.5-Coder-0.5B"
    assert config["num_speculative_tokens"] == plan.best_draft_len
    assert dict(team.env)["VLLM_API_KEY"] == '"$(cat /etc/localspec/team.key)"'
    assert "--enable-prefix-caching" in flags


def test_ngram_only_plans_emit_ngram_speculation(tmp_path: Path) -> None:
    facts = hardware.load_hardware_profile("a100-80gb")
    ngram = PlanSettings(draft_models=False)
    vllm = team_plan(CATALOG, facts, ngram, developers=30, engine="vllm")
    assert vllm.plan.draft is None
    assert json.loads(_flags(vllm.argv)["--speculative-config"])["method"] == "ngram"
    llama = team_plan(CATALOG, facts, ngram, developers=30, engine="llama-server")
    assert _flags(llama.argv)["--spec-type"] == "ngram-simple" and "-md" not in llama.argv
    sglang = team_plan(CATALOG, facts, ngram, developers=30, engine="sglang")
    assert _flags(sglang.argv)["--speculative-algorithm"] == "NGRAM"
    assert '--api-key "$(cat /etc/localspec/team.key)"' in sglang.command()


def test_vllm_never_gets_a_k_quant() -> None:
    facts = hardware.load_hardware_profile("a100-40gb")
    llama = team_plan(CATALOG, facts, developers=20, engine="llama-server")
    vllm = team_plan(CATALOG, facts, developers=20, engine="vllm")
    # llama.cpp fits the 32B on 40 GB with a K-quant; vLLM has none and takes what it can serve
    assert llama.plan.target[1] not in ("Q8_0", "F16")
    assert vllm.plan.target[1] in ("Q8_0", "F16")


@pytest.mark.parametrize("engine", ["llama-server", "vllm", "sglang"])
def test_the_workstation_profile_loads_and_names_a_fim_model(engine: str, tmp_path: Path) -> None:
    facts = hardware.load_hardware_profile("h100-80gb")
    team = team_plan(
        CATALOG, facts, developers=40, engine=engine, server_url="https://llm.corp:8443"
    )
    system = tmp_path / "system"
    system.mkdir()
    (system / "50-team.toml").write_text(team.profile)
    resolved = st.load(environ={}, system_dir=system, user_file=tmp_path / "none.toml")
    backend = resolved.settings.backend
    assert backend.url == "https://llm.corp:8443" and backend.fallback == "local"
    assert resolved.locks["backend.kind"].kind == "system"
    assert backend.kind == ("llama-server" if engine == "llama-server" else "openai")
    if backend.kind == "openai":
        entry = CATALOG.match_model(backend.model or "")
        assert entry is not None and entry.id == team.plan.target[0]
        assert entry.tokenizer.fim_text is not None


def test_a_team_needs_developers() -> None:
    facts = hardware.load_hardware_profile("h100-80gb")
    with pytest.raises(PlanError, match="at least one developer"):
        team_plan(CATALOG, facts, developers=0)


def test_the_cli_prints_arithmetic_command_and_profile() -> None:
    argv = [sys.executable, "-m", "localspec", "plan", "--team", "50", "--hardware"]
    out = subprocess.run(
        [*argv, "h100-80gb", "--emit", "vllm"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "team server for 50 developers, served by vllm" in out.stdout
    assert "concurrent sessions" in out.stdout and "sessions:" in out.stdout
    assert "vllm serve Qwen/" in out.stdout and "--speculative-config" in out.stdout
    assert 'kind = "openai"' in out.stdout
    data = json.loads(
        subprocess.run(
            [*argv, "h100-80gb", "--emit", "llama-server", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    assert data["argv"][0] == "llama-server" and data["plan"]["capacity"]["sessions_held"] >= 50
