"""A shared team server: the plan for N developers on a datacenter machine, as the launch
command of the engine that will serve it (llama.cpp's llama-server, vLLM or SGLang), and the
profile that points the developers' localspec at it.

Pure: the catalog, the machine's facts and the settings go in, a :class:`TeamServer` comes
out. The plan is ``make_plan``'s with ``concurrent_sessions = developers`` (slots sized by
memory and the per-token latency bound, sessions held at p95: ``planning/capacity.py``).
vLLM and SGLang serve the original weights, so they choose among the quants they can
express: Q8_0 becomes FP8 (same bytes per weight), F16 stays 16-bit (bf16).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from localspec.planning.candidates import candidates_from_catalog
from localspec.planning.inputs import PlanSettings
from localspec.planning.result import Plan
from localspec.planning.search import make_plan
from localspec.planning.types import PlanError, StepCosts

# llama-server's flags for one KV buffer shared by its slots; why --cache-ram 0 goes with it is
# the plan's own note in _llama_server (docs/team-server.md has the measurement)
UNIFIED_KV = ("-kvu", "--cache-ram", "0")

Engine = Literal["llama-server", "vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("llama-server", "vllm", "sglang")
DEFAULT_PORTS: dict[Engine, int] = {"llama-server": 8012, "vllm": 8000, "sglang": 30000}
# the catalog quants vLLM and SGLang can serve from the original weights, and as what
WEIGHT_FORMATS: dict[str, str | None] = {"Q8_0": "fp8", "F16": None}
GPU_MEMORY_SHARE = 0.90  # vLLM's --gpu-memory-utilization (SGLang's static share: 0.85)
NGRAM_TOKENS = 4  # tokens an n-gram drafter proposes per step
KEY_FILE = "/etc/localspec/team.key"  # where the examples keep the server's API key


@dataclass(frozen=True)
class TeamServer:
    engine: Engine
    developers: int
    plan: Plan
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # variables the command needs (the API key)
    port: int
    profile: str  # the IT profile (TOML) that points workstations at this server
    notes: tuple[str, ...] = ()

    def command(self) -> str:
        """The launch command, one flag per line, ready to paste into a shell (a
        ``$(...)`` value stays a command substitution: it reads the key file)."""
        env = [f"{k}={v}" for k, v in self.env]
        n_head = next((i for i, a in enumerate(self.argv) if a.startswith("--")), 1)
        if self.argv[0] == "llama-server":
            n_head = 1
        parts = [" ".join([*env, *map(_shell, self.argv[:n_head])])]
        args = list(self.argv[n_head:])
        i = 0
        while i < len(args):
            flag = args[i]
            if i + 1 < len(args) and not args[i + 1].startswith("-"):
                parts.append(f"{flag} {_shell(args[i + 1])}")
                i += 2
            else:
                parts.append(_shell(flag))
                i += 1
        return " \\\n  ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "developers": self.developers,
            "argv": list(self.argv),
            "env": dict(self.env),
            "port": self.port,
            "command": self.command(),
            "profile": self.profile,
            "notes": list(self.notes),
            "plan": self.plan.to_json(),
        }


def _shell(word: str) -> str:
    return f'"{word}"' if word.startswith("$(") else shlex.quote(word)


def team_plan(
    catalog: Any,
    facts: Any,
    settings: PlanSettings | None = None,
    *,
    developers: int,
    engine: Engine = "llama-server",
    server_url: str | None = None,
    step_costs: Mapping[tuple[str, str], StepCosts] | None = None,
) -> TeamServer:
    """The plan for ``developers`` concurrent sessions on ``facts`` (sized as a datacenter
    machine whatever its kind), as ``engine``'s launch command; ``step_costs`` as for
    ``make_plan`` (measured on that machine)."""
    if developers < 1:
        raise PlanError(f"a team has at least one developer, not {developers}")
    if engine not in ENGINES:
        raise PlanError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    ps = replace(settings or PlanSettings(), concurrent_sessions=developers)
    facts = replace(facts, kind="datacenter")
    candidates: Any = catalog
    if engine != "llama-server":
        candidates = [
            c
            for c in candidates_from_catalog(catalog, ps)
            if c.target.quant in WEIGHT_FORMATS and catalog.model(c.target.model_id).hf_model
        ]
        if not candidates:
            raise PlanError(
                f"{engine} serves the original weights (Q8_0 as FP8, F16): no allowed catalog "
                "pair has one of those quants and a hub model (hf_model)"
            )
    plan = make_plan(candidates, facts, ps, step_costs=step_costs)
    port = DEFAULT_PORTS[engine]
    build = {"llama-server": _llama_server, "vllm": _vllm, "sglang": _sglang}[engine]
    argv, env, notes = build(plan, catalog, facts, port)
    url = server_url or f"https://team-llm.example.com:{port}"
    return TeamServer(
        engine=engine,
        developers=developers,
        plan=plan,
        argv=tuple(argv),
        env=tuple(env),
        port=port,
        profile=workstation_profile(plan, catalog, engine, url),
        notes=tuple(notes),
    )


def _draft_tokens(plan: Plan) -> int:
    return plan.best_draft_len or plan.speculative.n_max


def _llama_server(
    plan: Plan, catalog: Any, facts: Any, port: int
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    target = catalog.model(plan.target[0]).quants[plan.target[1]]
    argv = ["llama-server", "-hf", str(target.repo), "-hff", target.main_file.filename]
    argv += ["-ngl", str(plan.target_ngl), "-a", plan.pair_id]
    if plan.draft is not None:
        draft = catalog.model(plan.draft[0]).quants[plan.draft[1]]
        argv += ["-hfd", str(draft.repo), "-md", draft.main_file.filename]
        argv += ["-ngld", str(plan.draft_ngl), "--spec-type", "draft-simple"]
        argv += ["--spec-draft-n-max", str(plan.speculative.n_max)]
        argv += ["--spec-draft-n-min", str(plan.speculative.n_min)]
        argv += ["--spec-draft-p-min", f"{plan.speculative.p_min:g}"]
    else:
        argv += ["--spec-type", "ngram-simple"]
    argv += ["-c", str(plan.n_ctx * plan.n_slots), "-np", str(plan.n_slots), *UNIFIED_KV]
    argv += ["--cache-reuse", str(plan.cache_reuse or 256)]
    argv += ["-b", str(plan.n_batch), "-ub", str(plan.n_ubatch)]
    argv += ["-fa", "on" if plan.flash_attn else "off"]
    argv += ["-ctk", plan.type_k, "-ctv", plan.type_v]
    if plan.tensor_split:
        argv += ["-ts", ",".join(f"{s:.3f}" for s in plan.tensor_split)]
    argv += ["--host", "0.0.0.0", "--port", str(port), "--api-key-file", KEY_FILE]
    argv += ["--metrics", "--slots", "--no-webui"]
    notes = [
        f"-kvu: one KV buffer of {plan.n_ctx * plan.n_slots} cells shared by the "
        f"{plan.n_slots} slots (-np), as the plan sized it ({plan.n_ctx} per slot); each "
        "developer's localspec keeps to one slot (a stable id_slot), so its cache survives",
        "--cache-ram 0: with -kvu, llama-server's host-memory prompt cache (on by default) "
        "drops a slot's cached prompt whenever another slot has run, and every developer's "
        "next request would evaluate its whole prompt again",
        "--cache-reuse 256: the editors' sliding windows and ring chunks move in the KV "
        "instead of being evaluated again",
        "serve it behind TLS (a reverse proxy, or llama-server's --ssl-key-file/--ssl-cert-file)",
    ]
    return argv, [], notes


def _speculative_config(plan: Plan, catalog: Any) -> tuple[dict[str, Any], str | None]:
    """vLLM's --speculative-config, and the draft's hub model (None: n-grams)."""
    if plan.draft is not None:
        draft = catalog.model(plan.draft[0]).hf_model
        if draft:
            config = {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": _draft_tokens(plan),
            }
            return config, draft
    config = {
        "method": "ngram",
        "num_speculative_tokens": NGRAM_TOKENS,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    return config, None


def _n_gpus(facts: Any) -> int:
    return max(1, len(facts.gpus))


def _vllm(
    plan: Plan, catalog: Any, facts: Any, port: int
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    model = catalog.model(plan.target[0])
    argv = ["vllm", "serve", str(model.hf_model), "--served-model-name", model.id]
    argv += ["--host", "0.0.0.0", "--port", str(port)]
    argv += ["--max-model-len", str(plan.n_ctx), "--max-num-seqs", str(plan.n_slots)]
    argv += ["--gpu-memory-utilization", f"{GPU_MEMORY_SHARE:.2f}"]
    argv += ["--tensor-parallel-size", str(_n_gpus(facts))]
    weight = WEIGHT_FORMATS[plan.target[1]]
    argv += ["--quantization", weight] if weight else ["--dtype", "bfloat16"]
    if plan.type_k != "f16":
        argv += ["--kv-cache-dtype", "fp8"]
    argv += ["--enable-prefix-caching"]
    config, draft = _speculative_config(plan, catalog)
    argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    notes = [
        f"weights: {plan.target[1]} in the plan = "
        + (f"{weight.upper()} in vLLM" if weight else "bf16 in vLLM")
        + "; KV "
        + ("FP8 (the plan's q8_0)" if plan.type_k != "f16" else "16-bit"),
        "--enable-prefix-caching: each developer's ring and file prefix stay cached while "
        "localspec keeps the prompt's head stable (the typed text goes last)",
        *(
            [
                f"--tensor-parallel-size {_n_gpus(facts)}: vLLM splits each layer over the "
                "GPUs where llama.cpp splits the layers (the memory table); the totals agree"
            ]
            if _n_gpus(facts) > 1
            else []
        ),
        "draft-model speculation needs a vLLM whose V1 engine supports method draft_model; "
        "otherwise use the n-gram form: "
        + json.dumps(
            {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS, "prompt_lookup_max": 4},
            separators=(",", ":"),
        )
        if draft
        else "n-gram speculation: proposals come from the prompt (the editor's own code)",
    ]
    if weight == "fp8" and not _fp8_native(facts):
        notes.append(
            "these GPUs predate FP8 (compute capability < 8.9): vLLM runs FP8 weights "
            "weight-only (Marlin kernels); if your vLLM refuses --kv-cache-dtype fp8 here, "
            "drop it (the KV then takes twice the plan's memory: lower --max-num-seqs)"
        )
    env = [("VLLM_API_KEY", f'"$(cat {KEY_FILE})"')]
    return argv, env, notes


def _fp8_native(facts: Any) -> bool:
    def capability(gpu: Any) -> float:
        try:
            return float(gpu.compute_capability or 0)
        except ValueError:
            return 0.0

    return bool(facts.gpus) and all(capability(g) >= 8.9 for g in facts.gpus)


def _sglang(
    plan: Plan, catalog: Any, facts: Any, port: int
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    model = catalog.model(plan.target[0])
    argv = ["python", "-m", "sglang.launch_server", "--model-path", str(model.hf_model)]
    argv += ["--served-model-name", model.id, "--host", "0.0.0.0", "--port", str(port)]
    argv += ["--api-key", f"$(cat {KEY_FILE})"]
    argv += ["--context-length", str(plan.n_ctx), "--max-running-requests", str(plan.n_slots)]
    argv += ["--mem-fraction-static", "0.85", "--tp-size", str(_n_gpus(facts))]
    weight = WEIGHT_FORMATS[plan.target[1]]
    argv += ["--quantization", weight] if weight else ["--dtype", "bfloat16"]
    if plan.type_k != "f16":
        argv += ["--kv-cache-dtype", "fp8_e5m2"]
    draft = catalog.model(plan.draft[0]).hf_model if plan.draft else None
    k = _draft_tokens(plan)
    if draft:
        argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft]
        argv += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
        argv += ["--speculative-num-draft-tokens", str(k + 1)]
    else:
        argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens"]
        argv += [str(NGRAM_TOKENS)]
    notes = [
        "RadixAttention keeps every developer's prompt prefix cached (no flag needed)",
        "STANDALONE speculation runs a small draft model; NGRAM needs CUDA",
    ]
    return argv, [], notes


def workstation_profile(plan: Plan, catalog: Any, engine: Engine, url: str) -> str:
    """The system profile IT installs on every workstation (``<site config dir>/*.toml``)."""
    lines = [
        "# points this workstation's localspec at the team server; locked: a developer's",
        "# own settings cannot change it (`localspec profile explain` shows where from)",
        'locked = ["backend"]',
        "",
        "[backend]",
    ]
    if engine == "llama-server":
        lines += ['kind = "llama-server"', f'url = "{url}"']
    else:
        model = catalog.model(plan.target[0])
        lines += ['kind = "openai"', f'url = "{url}"', f'model = "{model.id}"']
        lines += [f'fim_model = "{model.id}"']
    lines += [
        'api_key_file = "/etc/localspec/team.key"  # mode 600, the server\'s key',
        '# ca_bundle = "/etc/ssl/certs/corp-ca.pem"  # a private CA',
        'fallback = "local"  # the laptop\'s own model answers while the server is away',
        "fallback_ms = 2000",
    ]
    return "\n".join(lines) + "\n"
