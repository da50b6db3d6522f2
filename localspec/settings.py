"""One settings model, built from layers, with keys that IT can lock.

Layers, lowest first: built-in defaults → system profiles (``*.toml`` in
:func:`localspec.paths.system_config_dir`, sorted by name) → the user's ``config.toml`` →
``LOCALSPEC_*`` environment → command-line flags. Each layer is a flat mapping of dotted keys
(``server.port``) to raw values with the place they came from, so ``profile explain`` can say
where every effective value was set and which attempts a lock ignored.

A system profile may say ``locked = ["server.host", "hub"]``: those keys (a section name locks
all its keys) keep the value they had after that profile; a higher layer that tries to change
one is recorded as a :class:`LockViolation` and ignored, never an error, so an IT policy never
stops a developer's daemon from starting.
"""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from localspec import paths
from localspec.planning.types import MAX_SLOTS

# settings whose values the server takes as they are (server/options.py, server/prompts.py)
SlotRule = Literal["cache", "pinned"]
InfillLayout = Literal["typed-in-middle", "llama-server"]
RingAttention = Literal["causal", "blocks"]
JumpPolicy = Literal["wait", "budget"]
Fallback = Literal["local", "none"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_NUMBERS = (int, float, int | None, float | None)
LAYER_KINDS = ("default", "system", "user", "env", "flag")
SECRET_KEYS = frozenset({"server.api_key", "backend.api_key"})
ENV_PREFIX = "LOCALSPEC_"
# Environment variables other tools already define, read as a lower-precedence spelling of a key.
ENV_ALIASES: dict[str, str] = {"HF_ENDPOINT": "hub.endpoint", "HF_HUB_OFFLINE": "hub.offline"}
# LOCALSPEC_* variables that are not settings: directory overrides (localspec.paths),
# LOCALSPEC_LLAMA_LOG, which lets llama.cpp's own log through (localspec.engine.llama),
# LOCALSPEC_FIXTURE_CACHE, where the test suite keeps its fixture models (tests/fixtures), and
# the launcher's (launcher/bootstrap.sh), which stay in the environment of the daemon it starts.
ENV_NOT_SETTINGS = frozenset(
    {
        "CONFIG_DIR",
        "SYSTEM_CONFIG_DIR",
        "DATA_DIR",
        "MODELS_DIR",
        "STATE_DIR",
        "CACHE_DIR",
        "LLAMA_LOG",
        "FIXTURE_CACHE",
        "VENV",
        "PYTHON",
        "WHEELHOUSE",
    }
)


class _Section(BaseModel):
    # inf and NaN are never a limit anyone means (inf GB of GPU memory crashed the planner)
    model_config = ConfigDict(
        extra="forbid", validate_default=True, frozen=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``port = true`` is a mistake, not port 1 (pydantic would take it as one)."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation in _NUMBERS:
                raise ValueError("must be a number, not true or false")
        return value


class ModelsSettings(_Section):
    allowed: list[str] = Field(
        default_factory=list,
        description="catalog pairs (or fnmatch patterns of pair and GGUF file names) that may "
        "run; empty allows all",
    )
    dirs: list[Path] = Field(
        default_factory=list, description="extra model directories searched before downloading"
    )
    pair: str | None = Field(None, description="catalog pair to serve; unset lets the plan pick")
    chat: Literal["auto", "off"] = Field(
        "auto",
        description="chat (/v1/chat/completions): auto lets the plan serve it with the "
        "completion pair or a second, instruct pair; off answers chat with a 501",
    )
    chat_pair: str | None = Field(
        None, description="catalog instruct pair for chat; unset lets the plan pick"
    )


class HubSettings(_Section):
    endpoint: str | None = Field(None, description="Hugging Face hub URL or mirror")
    offline: bool = Field(False, description="never touch the network; use local files only")
    proxy: str | None = Field(None, description="HTTP(S) proxy URL for downloads")
    ca_bundle: Path | None = Field(None, description="PEM file of CA certificates to trust")
    token_file: Path | None = Field(None, description="file holding a hub access token")

    @field_validator("endpoint", "proxy")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and (
            not value.startswith(("http://", "https://")) or not urlsplit(value).hostname
        ):
            raise ValueError("must be an http:// or https:// URL with a host")
        return value.rstrip("/") if value else value


class ServerSection(_Section):
    host: str = Field(
        "localhost",
        description="address to bind (localhost: 127.0.0.1 and ::1); loopback unless a key is set",
    )
    port: int = Field(8012, ge=1, le=65535, description="TCP port (llama-vscode expects 8012)")

    @field_validator("host")
    @classmethod
    def _bare_host(cls, value: str) -> str:
        """``[::1]`` (as in a URL) is the address ``::1``."""
        value = value.strip()
        if value.startswith("[") and value.endswith("]"):
            value = value[1:-1]
        if not value:
            raise ValueError("must be an address or host name")
        return value

    api_key: SecretStr | None = Field(None, description="Bearer key clients must send")
    api_key_file: Path | None = Field(None, description="file holding the API key (mode 600)")
    api_key_required: bool = Field(False, description="refuse to start without an API key")
    slots: int | None = Field(
        None, ge=1, le=MAX_SLOTS, description="parallel slots; unset: the plan"
    )
    queue_limit: int = Field(16, ge=0, description="requests waiting beyond the slots; 0: none")
    slot_choice: SlotRule = Field(
        "cache",
        description="with several slots: a request's id_slot only breaks ties and the slot "
        "whose cache holds most of its prompt answers (two editors both send id_slot 0); "
        "pinned: id_slot picks the slot, as in llama-server",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="cancel a request after this")
    metrics: bool = Field(True, description="serve Prometheus metrics at /metrics")
    cors_origins: list[str] = Field(default_factory=list, description="allowed CORS origins")
    n_cmpl_max: int = Field(16, ge=1, le=256, description="most completions one request may ask")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="larger request bodies are refused (413)"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body not fully received by then is refused (408)"
    )
    max_connections: int = Field(
        256, ge=1, description="open connections past this are refused (503)"
    )
    spm_infill: bool = Field(
        False,
        description="/infill puts the suffix block before the prefix (llama-server's "
        "--spm-infill, for models trained suffix-prefix-middle)",
    )
    slot_save_path: Path | None = Field(
        None,
        description="directory of POST /slots/{id}?action=save|restore files (llama-server's "
        "--slot-save-path); unset: slot actions are refused",
    )


class LimitsSettings(_Section):
    context: int | None = Field(None, ge=256, description="context tokens per slot; unset: plan")
    gpu_memory_gb: float | None = Field(None, gt=0, description="cap on GPU memory to use")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama.cpp; unset: auto")


class SpeculativeSettings(_Section):
    mode: Literal["off", "draft", "ngram", "hybrid", "auto"] = Field(
        "auto", description="drafter: a draft model, n-grams of the prompt, both, or auto"
    )
    n_max: int = Field(16, ge=0, le=128, description="most tokens drafted per step")
    n_min: int = Field(0, ge=0, le=128, description="skip drafts shorter than this")
    p_min: float = Field(0.75, ge=0.0, le=1.0, description="stop drafting below this prob.")
    pipeline: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the draft model drafts ahead on its own thread while the target verifies: "
        "auto when both models' threads fit the free cores; off: draft, then verify (the "
        "drafts then do not depend on either thread's timing)",
    )
    record_rejections: bool = Field(
        False,
        description="keep drafts the target rejected in a local file (data dir; never sent "
        "anywhere) for `localspec spec export`",
    )
    rejections_max_mb: int = Field(64, ge=1, le=65536, description="cap of the rejections file")
    accept: Literal["exact", "topk"] = Field(
        "exact",
        description="exact: the target's own output; topk: also accept a drafted token among "
        "the target's accept_top_k likeliest above accept_p_min (faster, not bit-identical)",
    )
    accept_top_k: int = Field(3, ge=1, le=1000, description="topk acceptance: rank limit")
    accept_p_min: float = Field(0.1, ge=0.0, le=1.0, description="topk acceptance: prob. floor")
    by_language: bool = Field(
        False, description="draft lengths from each language's own recent acceptance"
    )
    entropy_max: float = Field(
        0.0,
        ge=0.0,
        le=20.0,
        description="skip drafting while the target's entropy (nats) is above this; 0: never",
    )
    ngram_agree: bool = Field(
        False,
        description="an n-gram draft stops where the earlier occurrences of its match went on "
        "differently",
    )
    draft_cost_max: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="auto: the draft model drafts only while its token costs less than this "
        "share of a target step (n-gram drafts otherwise); 0: any cost the cost model accepts",
    )
    weigh_sources: bool = Field(
        False,
        description="auto: each step takes the n-gram draft or the draft model's, whichever "
        "is expected to yield more per ms (the model's catch-up priced in)",
    )
    learn_p_min: bool = Field(
        False,
        description="auto: the draft model drafts past a token it is less than p_min sure of "
        "while the target recently accepted such tokens often enough to pay for them",
    )

    @model_validator(mode="after")
    def _min_below_max(self) -> SpeculativeSettings:
        if self.n_min > self.n_max:
            raise ValueError(f"n_min ({self.n_min}) is larger than n_max ({self.n_max})")
        return self


class CacheSettings(_Section):
    reuse_chunk: int = Field(
        256, ge=0, description="min chunk moved by KV shift (llama-server --cache-reuse); 0: off"
    )
    exact_ms: float = Field(
        100.0,
        ge=0,
        description="keep the KV exact (as a cold evaluation) instead of a KV shift when that "
        "costs at most this many ms more per request; 0: always shift, as llama-server",
    )
    infill_layout: InfillLayout = Field(
        "typed-in-middle",
        description="where /infill puts the typed cursor line: after FIM_MID (each keystroke "
        "extends the cached prompt) or llama-server's place, ending the prefix",
    )
    infill_window: int = Field(
        1024,
        ge=16,
        description="tokens of the cursor's file an /infill prompt keeps: 3/4 prefix, 1/4 "
        "suffix (llama-server takes its batch size; 1024 is the editors' recommended presets' "
        "-b 1024), the same whatever batch the engine runs",
    )
    jump_policy: JumpPolicy = Field(
        "wait",
        description="an /infill prompt whose uncached part cannot be evaluated within the "
        "request's t_max_prompt_ms at the measured prefill speed: wait (evaluate it all, "
        "exact) or budget (answer from the cursor's nearest lines that fit, evaluated apart, "
        "while the full context fills on the slot for the next keystroke)",
    )
    ram_gb: float | None = Field(
        None,
        ge=0,
        description="host memory for slot contexts a new prompt overwrites, restored when a "
        "prompt comes back to them (llama-server's --cache-ram); unset: the plan's size, half "
        "the memory left free after the models, at most 8 GiB; 0: off",
    )
    restart_gb: float = Field(
        2.0,
        ge=0,
        description="the slots' contexts written (at most this much) under the cache directory "
        "at a clean shutdown and read back at start, so the first keystrokes after a restart "
        "find their context; 0: off",
    )
    ring_attention: RingAttention = Field(
        "blocks",
        description="how /infill's extra-context chunks attend: blocks (each sees the "
        "repository header and itself, the cursor's code sees all: a ring rotation moves KV "
        "exactly) or causal (llama-server's: each sees the chunks before it, and a rotation "
        "moves KV approximately); with infill_layout typed-in-middle",
    )


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    format: Literal["text", "json"] = Field("text", description="log line format")
    requests: bool = Field(False, description="log one line per request (no prompt text)")


class BackendSettings(_Section):
    """Where completions are computed: this machine (local) or a shared team server."""

    kind: Literal["local", "llama-server", "openai"] = Field(
        "local",
        description="local: this machine's model; llama-server: forward to a llama-server (or "
        "another localspec); openai: build the FIM prompt here, send it to an OpenAI-style "
        "/v1/completions (vLLM, SGLang, Ollama, LM Studio)",
    )
    url: str | None = Field(None, description="the upstream's base URL, e.g. https://llm.corp:8443")
    api_key: SecretStr | None = Field(
        None, description="Bearer key for the upstream (prefer api_key_file)"
    )
    api_key_file: Path | None = Field(
        None, description="file holding the upstream's Bearer key (mode 600)"
    )
    ca_bundle: Path | None = Field(
        None, description="PEM file of CA certificates trusted for the upstream's TLS"
    )
    allow_insecure_http: bool = Field(
        False,
        description="allow plain http:// to a host that is not loopback (the code and the key "
        "cross the network unencrypted)",
    )
    model: str | None = Field(
        None,
        description="the upstream's model name (sent as 'model'); openai: this or fim_model "
        "is required",
    )
    fim_model: str | None = Field(
        None,
        description="openai: catalog model whose FIM tokens lay out the prompt; unset: the "
        "catalog model backend.model names (Qwen/Qwen2.5-Coder-7B -> qwen2.5-coder-7b)",
    )
    slot: int | None = Field(
        None,
        ge=-1,
        description="llama-server: upstream slot to pin; unset: a stable hash of this machine's "
        "id and the user; -1: let the upstream choose",
    )
    connect_timeout_s: float = Field(3.0, gt=0, description="connecting to the upstream")
    read_timeout_s: float = Field(
        60.0, gt=0, description="the upstream going silent mid-answer for this long is a failure"
    )
    fallback: Fallback = Field(
        "local",
        description="who answers while the upstream is down or slow: this machine's model "
        "(planned, downloaded and loaded as for kind local) or nobody (a 503)",
    )
    fallback_ms: float = Field(
        2000.0,
        ge=0,
        description="an answer (its first chunk when streamed) not started by the upstream "
        "within this many ms comes from the local model instead; 0: wait for read_timeout_s",
    )
    health_interval_s: float = Field(
        5.0, gt=0, description="how often the upstream's health is checked"
    )

    @field_validator("url")
    @classmethod
    def _upstream_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        if "@" in value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "must not carry credentials (user:password@): put the key in backend.api_key_file"
            )
        return value.rstrip("/")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> BackendSettings:
        if self.kind != "local" and self.url is None:
            raise ValueError(f"kind {self.kind!r} needs backend.url (the upstream's base URL)")
        if self.kind == "openai" and not (self.model or self.fim_model):
            raise ValueError(
                "kind 'openai' needs backend.model (the upstream's model name) or "
                "backend.fim_model (the catalog model whose FIM tokens lay out prompts)"
            )
        return self


class Settings(_Section):
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    hub: HubSettings = Field(default_factory=HubSettings)
    server: ServerSection = Field(default_factory=ServerSection)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    telemetry: bool = Field(False, description="always off: localspec sends nothing anywhere")

    @field_validator("telemetry")
    @classmethod
    def _no_telemetry(cls, value: bool) -> bool:
        if value:
            raise ValueError("localspec has no telemetry; only false is accepted")
        return value

    def allows_model(self, *names: str) -> bool:
        """models.allowed: fnmatch patterns over pair ids, model ids and GGUF file names."""
        patterns = self.models.allowed
        return not patterns or any(fnmatch.fnmatch(n, p) for n in names for p in patterns)

    def get(self, key: str) -> Any:
        """The value at a dotted key (``server.port``)."""
        value: Any = self
        for part in key.split("."):
            value = getattr(value, part)
        return value


# --- the key table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyInfo:
    key: str
    annotation: Any
    description: str

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.key.replace(".", "_").upper()

    @property
    def is_list(self) -> bool:
        return get_origin(self.annotation) is list

    @property
    def type_name(self) -> str:
        return _type_name(self.annotation)

    @property
    def holds_paths(self) -> bool:
        return Path in (self.annotation, *get_args(self.annotation))


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if origin is list:
        return f"list of {_type_name(get_args(annotation)[0])}"
    args = [a for a in get_args(annotation) if a is not type(None)]
    if args and origin is not None:
        return " | ".join(_type_name(a) for a in args)
    if annotation is SecretStr:
        return "str (secret)"
    return getattr(annotation, "__name__", str(annotation))


def _walk(model: type[BaseModel], prefix: str = "") -> Iterable[KeyInfo]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _walk(annotation, f"{prefix}{name}.")
        else:
            yield KeyInfo(f"{prefix}{name}", annotation, info.description or "")


KEYS: dict[str, KeyInfo] = {k.key: k for k in _walk(Settings)}
SECTIONS = frozenset(k.split(".", 1)[0] for k in KEYS if "." in k)
ENV_KEYS: dict[str, str] = {info.env_name: key for key, info in KEYS.items()}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a near miss, else an empty string."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


# --- layers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where a value came from: ``kind`` is one of LAYER_KINDS, ``label`` says which one."""

    kind: str
    label: str

    def __str__(self) -> str:
        return {
            "default": "default",
            "system": f"system profile {self.label}",
            "user": f"user config {self.label}",
            "env": f"env {self.label}",
            "flag": f"flag {self.label}",
        }[self.kind]


DEFAULT_ORIGIN = Origin("default", "built-in")


@dataclass
class Layer:
    origin: Origin  # the layer as a whole (a file, "environment", "command line")
    values: dict[str, tuple[Any, Origin]] = field(default_factory=dict)
    locks: list[str] = field(default_factory=list)  # system profiles only


@dataclass(frozen=True)
class LockViolation:
    key: str
    attempted: Any
    by: Origin
    locked_by: Origin

    def __str__(self) -> str:
        shown = "<secret>" if self.key in SECRET_KEYS else _show(self.attempted)
        return (
            f"{self.key}: {self.by} tried to set {shown}, but {self.locked_by} locks it; "
            "using the locked value"
        )


class SettingsError(ValueError):
    """Bad settings: every problem found, each naming its file/env/flag and key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def _flatten(table: Mapping[str, Any], origin: Origin, prefix: str = "") -> tuple[dict, list]:
    values: dict[str, tuple[Any, Origin]] = {}
    problems: list[str] = []
    for name, value in table.items():
        key = f"{prefix}{name}"
        if key in KEYS:
            values[key] = (value, origin)
        elif isinstance(value, dict) and key in SECTIONS:
            sub_values, sub_problems = _flatten(value, origin, f"{key}.")
            values.update(sub_values)
            problems += sub_problems
        elif key in SECTIONS:
            problems.append(f"{origin}: '{key}' is a section; write [{key}] with keys under it")
        elif isinstance(value, dict):
            sub_values, sub_problems = _flatten(value, origin, f"{key}.")
            problems += sub_problems or [f"{origin}: unknown section '{key}'"]
        else:
            problems.append(f"{origin}: unknown key '{key}'{did_you_mean(key, KEYS)}")
    return values, problems


def _check_key_list(names: Any, origin: Origin, what: str) -> tuple[list[str], list[str]]:
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return [], [f"{origin}: '{what}' must be a list of key names"]
    good: list[str] = []
    problems: list[str] = []
    for name in names:
        if name in KEYS or name in SECTIONS:
            good.append(name)
        else:
            hint = did_you_mean(name, [*KEYS, *SECTIONS])
            problems.append(f"{origin}: '{what}' names unknown key '{name}'{hint}")
    return good, problems


def read_toml_layer(path: Path, kind: Literal["system", "user"]) -> tuple[Layer, list[str]]:
    """One profile or config file as a layer; problems name the file and the key."""
    origin = Origin(kind, str(path))
    try:  # utf-8-sig: Notepad's byte order mark is not a TOML error
        table = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except tomllib.TOMLDecodeError as exc:
        return Layer(origin), [f"{origin}: not valid TOML: {exc}"]
    except UnicodeDecodeError as exc:
        return Layer(origin), [
            f"{origin}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8"
        ]
    except RecursionError:
        return Layer(origin), [f"{origin}: not valid TOML: nested too deeply"]
    except OSError as exc:
        return Layer(origin), [f"{origin}: cannot read: {exc.strerror or exc}"]
    locked = table.pop("locked", None)
    values, problems = _flatten(table, origin)
    layer = Layer(origin, _anchored(values, path.parent))
    if locked is not None:
        if kind != "system":
            problems.append(
                f"{origin}: 'locked' is honoured only in system profiles "
                f"({paths.system_config_dir()})"
            )
        else:
            layer.locks, lock_problems = _check_key_list(locked, origin, "locked")
            problems += lock_problems
    return layer, problems


def _anchored(values: dict[str, tuple[Any, Origin]], base: Path) -> dict[str, tuple[Any, Origin]]:
    """A file's relative paths are relative to the file (the daemon, a login service, runs
    from any directory); ``~`` stays for the model to expand."""

    def anchor(value: Any) -> Any:
        if isinstance(value, str) and value and not value.startswith("~"):
            return str(base / value)  # an absolute value stays as it is
        return value

    out = dict(values)
    for key, (value, origin) in values.items():
        if KEYS[key].holds_paths:
            out[key] = (
                [anchor(v) for v in value] if isinstance(value, list) else anchor(value),
                origin,
            )
    return out


def _parse_text(info: KeyInfo, text: str) -> Any:
    """A value given as text (env, --set): TOML literal when it parses, else the string."""
    stripped = text.strip()
    if info.is_list and not stripped.startswith("["):
        return [part.strip() for part in stripped.split(",") if part.strip()]
    try:
        return tomllib.loads(f"v = {stripped}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def env_layer(environ: Mapping[str, str]) -> tuple[Layer, list[str]]:
    layer = Layer(Origin("env", "environment"))
    problems: list[str] = []
    for name, key in ENV_ALIASES.items():
        if environ.get(name):
            layer.values[key] = (_parse_text(KEYS[key], environ[name]), Origin("env", name))
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name[len(ENV_PREFIX) :] in ENV_NOT_SETTINGS:
            continue
        key = ENV_KEYS.get(name)
        if key is None:
            problems.append(f"env {name}: not a localspec setting{did_you_mean(name, ENV_KEYS)}")
            continue
        layer.values[key] = (_parse_text(KEYS[key], text), Origin("env", name))
    return layer, problems


def flag_layer(flags: Mapping[str, tuple[Any, str]]) -> tuple[Layer, list[str]]:
    """Flags as ``{key: (value, flag_label)}``; string values from ``--set`` are parsed."""
    layer = Layer(Origin("flag", "command line"))
    problems: list[str] = []
    for key, (value, label) in flags.items():
        origin = Origin("flag", label)
        if key not in KEYS:
            problems.append(f"{origin}: unknown key '{key}'{did_you_mean(key, KEYS)}")
            continue
        if key in SECRET_KEYS:  # it would show in ps, and in a detached daemon's command line
            problems.append(f"{origin}: a key on the command line shows in ps; set {key}_file")
            continue
        if isinstance(value, str) and label.startswith("--set"):
            value = _parse_text(KEYS[key], value)
        layer.values[key] = (value, origin)
    return layer, problems


def parse_set_options(items: Iterable[str]) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """``--set key=value`` options as flag-layer entries."""
    flags: dict[str, tuple[Any, str]] = {}
    problems: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"flag --set {item}: expected KEY=VALUE, e.g. --set server.port=8013")
        else:
            flags[key] = (value, f"--set {key}")
    return flags, problems


def system_profile_paths(directory: Path | None = None) -> list[Path]:
    directory = directory if directory is not None else paths.system_config_dir()
    if not directory.is_dir():
        return []
    # dotfiles are an editor's lock or a file put aside (.#10-corp.toml, .old.toml)
    return sorted(p for p in directory.glob("*.toml") if not p.name.startswith("."))


def user_config_path() -> Path:
    return paths.user_config_dir() / "config.toml"


# --- resolution ------------------------------------------------------------------------------


@dataclass
class ResolvedSettings:
    settings: Settings
    origins: dict[str, Origin]  # where each effective value came from
    locks: dict[str, Origin]  # key -> the system profile that locks it
    violations: list[LockViolation]
    layers: list[Layer]


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return nested


def _validation_problems(
    exc: ValidationError,
    origin_of: Mapping[str, Origin],
    fallback: Origin,
    *,
    keys_only: bool = False,
) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = [str(p) for p in error["loc"] if isinstance(p, str)]
        key = ".".join(loc)
        while key and key not in KEYS and key not in SECTIONS and "." in key:
            key = key.rsplit(".", 1)[0]
        if keys_only and key not in KEYS:
            continue
        message = error["msg"].removeprefix("Value error, ")
        where = origin_of.get(key)
        if where is None:  # a cross-field rule: name every origin inside the section
            inside = sorted(
                {
                    str(o)
                    for k, o in origin_of.items()
                    if k.startswith(f"{key}.") and o.kind != "default"
                }
            )
            where_text = ", ".join(inside) if inside else str(fallback)
        else:
            where_text = str(where)
        problems.append(f"{where_text}: {key or 'settings'}: {message}")
    return problems


def validate_layer(layer: Layer) -> list[str]:
    """Type-check one layer on its own, so a bad value names its own file even when a higher
    layer happens to override it."""
    try:
        Settings.model_validate(_nest({k: v for k, (v, _) in layer.values.items()}))
    except ValidationError as exc:
        origins = {k: o for k, (_, o) in layer.values.items()}
        # Cross-field rules (located at a section, not a key) need the other layers' values:
        # the merged check reports those.
        return _validation_problems(exc, origins, layer.origin, keys_only=True)
    return []


def resolve(layers: list[Layer]) -> ResolvedSettings:
    """Merge layers (lowest first), apply locks, validate. Raises SettingsError."""
    problems: list[str] = []
    for layer in layers:
        problems += validate_layer(layer)
    if problems:
        raise SettingsError(problems)
    defaults = Settings()
    flat: dict[str, Any] = {key: defaults.get(key) for key in KEYS}
    origins: dict[str, Origin] = dict.fromkeys(KEYS, DEFAULT_ORIGIN)
    locks: dict[str, Origin] = {}
    violations: list[LockViolation] = []
    for layer in layers:
        for key, (value, origin) in layer.values.items():
            if key in locks:
                if _normalise(key, value) != _normalise(key, flat[key]):
                    violations.append(LockViolation(key, value, origin, locks[key]))
                continue
            flat[key], origins[key] = value, origin
        for name in layer.locks:
            for key in KEYS:
                if (key == name or key.startswith(f"{name}.")) and key not in locks:
                    locks[key] = layer.origin
    try:
        settings = Settings.model_validate(_nest(flat))
    except ValidationError as exc:
        raise SettingsError(_validation_problems(exc, origins, DEFAULT_ORIGIN)) from None
    return ResolvedSettings(settings, origins, locks, violations, layers)


def _normalise(key: str, value: Any) -> Any:
    """Compare raw and validated values alike (a TOML "8012" vs 8012 is still a change)."""
    try:
        section = Settings.model_validate(_nest({key: value}))
        return section.get(key)
    except ValidationError:
        return value


def load(
    *,
    flags: Mapping[str, tuple[Any, str]] | None = None,
    environ: Mapping[str, str] | None = None,
    system_dir: Path | None = None,
    user_file: Path | None = None,
) -> ResolvedSettings:
    """Read every layer from disk, the environment and the flags; raise SettingsError."""
    problems: list[str] = []
    layers = [Layer(DEFAULT_ORIGIN)]
    for path in system_profile_paths(system_dir):
        layer, layer_problems = read_toml_layer(path, "system")
        layers.append(layer)
        problems += layer_problems
    user_file = user_file if user_file is not None else user_config_path()
    if user_file.is_file():
        layer, layer_problems = read_toml_layer(user_file, "user")
        layers.append(layer)
        problems += layer_problems
    layer, layer_problems = env_layer(os.environ if environ is None else environ)
    layers.append(layer)
    problems += layer_problems
    layer, layer_problems = flag_layer(flags or {})
    layers.append(layer)
    problems += layer_problems
    try:
        resolved = resolve(layers)
    except SettingsError as exc:
        raise SettingsError(problems + exc.problems) from None
    if problems:
        raise SettingsError(problems)
    return resolved


# --- explain ---------------------------------------------------------------------------------


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, SecretStr):
        return "<secret>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return redact_url(str(value))


def redact_url(text: str) -> str:
    """``text`` with a URL's password and query hidden (a proxy's ``user:password@``, a
    mirror's ``?token=``); anything else as it is."""
    if not text.startswith(("http://", "https://")):
        return text
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return text
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username}:<secret>@{netloc.rpartition('@')[2]}"
    query = "<secret>" if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


@dataclass(frozen=True)
class ExplainRow:
    key: str
    value: str
    origin: str
    locked_by: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "value": self.value,
            "origin": self.origin,
            "locked_by": self.locked_by,
        }


def explain(resolved: ResolvedSettings) -> list[ExplainRow]:
    """Every effective value and its origin; secrets show only whether they are set."""
    rows = []
    for key in KEYS:
        value = resolved.settings.get(key)
        origin = str(resolved.origins[key])
        if key in SECRET_KEYS:
            shown = f"set (from {origin})" if value is not None else "not set"
        else:
            shown = _show(value)
        locked = resolved.locks.get(key)
        rows.append(ExplainRow(key, shown, origin, str(locked) if locked else None))
    return rows


def to_toml_dict(settings: Settings) -> dict[str, Any]:
    """The effective settings as a TOML-ready table (secrets redacted, unset keys left out)."""
    flat: dict[str, Any] = {}
    for key in KEYS:
        value = settings.get(key)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = "<secret>"
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, str):
            value = redact_url(value)
        elif isinstance(value, list):
            value = [str(v) if isinstance(v, Path) else v for v in value]
        flat[key] = value
    return _nest(flat)


# --- security --------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_secret_file(path: Path, key: str) -> str:
    """A secret's file: must exist, be non-empty and, on POSIX, unreadable by group/others."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise SettingsError([f"{key}: cannot read {path}: {exc.strerror or exc}"]) from None
    if os.name == "posix" and mode & 0o044:
        raise SettingsError(
            [
                f"{key}: {path} is readable by group or others (mode {mode & 0o777:o}); "
                f"run: chmod 600 {path}"
            ]
        )
    try:
        text = path.read_text(encoding="utf-8-sig").strip()
    except OSError as exc:
        raise SettingsError([f"{key}: cannot read {path}: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError:
        raise SettingsError([f"{key}: {path} is not UTF-8 text; save the key as UTF-8"]) from None
    if not text:
        raise SettingsError([f"{key}: {path} is empty"])
    return text


def _section_key(section: str, inline: SecretStr | None, file: Path | None) -> str | None:
    """A section's key: ``<section>.api_key_file`` (permission-checked) or ``api_key``."""
    if inline is not None and file is not None:
        raise SettingsError([f"{section}: set api_key or api_key_file, not both"])
    if file is not None:
        return read_secret_file(file.expanduser(), f"{section}.api_key_file")
    if inline is not None:
        return inline.get_secret_value().strip() or None
    return None


def resolve_api_key(settings: Settings) -> str | None:
    server = settings.server
    return _section_key("server", server.api_key, server.api_key_file)


def check_security(settings: Settings) -> str | None:
    """The API key to serve with, after the start-up rules; raises SettingsError to refuse."""
    api_key = resolve_api_key(settings)
    host = settings.server.host
    if api_key is None and settings.server.api_key_required:
        raise SettingsError(
            [
                "server.api_key_required is true but no key is set: "
                "set server.api_key_file (a mode-600 file holding the key)"
            ]
        )
    if api_key is None and not is_loopback(host):
        raise SettingsError(
            [
                f"server.host = {host} is reachable from other machines and no API key is set; "
                "set server.api_key_file, or bind localhost"
            ]
        )
    if settings.hub.token_file is not None:
        read_secret_file(settings.hub.token_file.expanduser(), "hub.token_file")
    return api_key


def check_backend_url(settings: Settings) -> None:
    """The rule for the upstream's URL alone (no file read: ``profile validate`` applies it
    to a profile meant for other machines); raises SettingsError to refuse.

    Plain http to a host that is not loopback would send the code being edited, and the key,
    across the network in the clear: refused unless backend.allow_insecure_http says so.
    """
    backend = settings.backend
    if backend.kind == "local":
        return
    assert backend.url is not None  # the section's own rule
    parts = urlsplit(backend.url)
    host = parts.hostname or ""
    if parts.scheme == "http" and not is_loopback(host) and not backend.allow_insecure_http:
        raise SettingsError(
            [
                f"backend.url = {backend.url} is plain http to {host}, which is not this "
                "machine: the code you edit and the key would cross the network unencrypted. "
                "Use https:// (with backend.ca_bundle for a private CA), or set "
                "backend.allow_insecure_http = true to accept that"
            ]
        )


def check_backend(settings: Settings) -> str | None:
    """The upstream's key, after every rule for talking to it (``up``, ``service install``
    and ``profile validate`` of this machine's settings apply the same); raises SettingsError
    to refuse."""
    check_backend_url(settings)
    backend = settings.backend
    if backend.kind == "local":
        return None
    if backend.ca_bundle is not None:
        bundle = backend.ca_bundle.expanduser()
        if not bundle.is_file():
            raise SettingsError([f"backend.ca_bundle: {bundle} is not a file"])
    return _section_key("backend", backend.api_key, backend.api_key_file)
