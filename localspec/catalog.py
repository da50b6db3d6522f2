"""The model catalog: which GGUF files exist, where to get them, and how they pair up.

The catalog is data (``models/*.toml`` shipped with localspec, plus TOML files in profile
directories) validated here once into frozen pydantic models. Planning reads the architecture
numbers before anything is downloaded; fetching reads repos, revisions, sizes and sha256.

Draft/target compatibility follows llama.cpp's rule (``common_speculative_are_compatible``):
same vocab type, same add_bos (and BOS id when added), same add_eos (and EOS id when added),
vocab sizes within 128, and identical token texts. The catalog cannot hold 150k token texts,
so a model names its ``tokenizer.family``: models of one family share every token text over
the ids both have (padding aside). A pair's ``compatible`` claim is checked against these
facts at load time, so a wrong claim is a load error rather than a silent slow server.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from localspec.resources import data_dir

SCHEMA_VERSION = 1
QUANT_ORDER = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "F32")
"""Smallest to largest; the planner walks this ladder."""

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp common/speculative.cpp

_SHA256 = r"^[0-9a-f]{64}$"


class CatalogError(ValueError):
    """A catalog file is malformed or inconsistent; the message names file, entry and key."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileEntry(_Frozen):
    """One GGUF file (a quant may be split into several; llama.cpp is given the first)."""

    filename: str = Field(min_length=1)
    size: int | None = Field(default=None, gt=0)  # exact bytes, from the hub's metadata
    sha256: str | None = Field(default=None, pattern=_SHA256)
    path: str | None = None  # a local file (profile entries); relative to the TOML file


class QuantEntry(_Frozen):
    """One quantization of a model: a hub repo (or local paths) and its files."""

    repo: str | None = Field(default=None, pattern=r"^[\w.\-]+/[\w.\-]+$")
    revision: str | None = Field(default=None, min_length=1)  # a commit sha pins the bytes
    files: tuple[FileEntry, ...] = Field(min_length=1)
    size_bytes: int | None = Field(default=None, gt=0)  # approximate when file sizes are unknown
    note: str = ""

    @model_validator(mode="after")
    def _has_source(self) -> QuantEntry:
        if self.repo is None and any(f.path is None for f in self.files):
            raise ValueError("needs a 'repo', or a 'path' for every file")
        sizes = [f.size for f in self.files]
        if self.size_bytes is not None and None not in sizes:
            total = sum(s for s in sizes if s is not None)
            if total != self.size_bytes:
                raise ValueError(f"size_bytes {self.size_bytes} != the files' sizes ({total})")
        names = [f.filename for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        return self

    @property
    def total_size(self) -> int | None:
        """Exact bytes when every file size is known, else the approximate ``size_bytes``."""
        sizes = [f.size for f in self.files]
        if all(s is not None for s in sizes):
            return sum(s for s in sizes if s is not None)
        return self.size_bytes

    @property
    def main_file(self) -> FileEntry:
        """The file llama.cpp is given (the first shard of a split GGUF)."""
        return self.files[0]


class Arch(_Frozen):
    """Architecture numbers for memory planning before any download."""

    n_layer: int = Field(gt=0)
    n_embd: int = Field(gt=0)
    n_head: int = Field(gt=0)
    n_head_kv: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    n_vocab: int = Field(gt=0)
    n_ctx_train: int = Field(gt=0)
    tied_embeddings: bool
    n_expert: int = Field(default=0, ge=0)
    n_expert_used: int = Field(default=0, ge=0)
    active_params_b: float | None = Field(default=None, gt=0)  # MoE: parameters used per token

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * bytes_per_elem


class FimText(_Frozen):
    """The FIM control tokens as text, for an upstream that takes a text prompt (the openai
    backend kind: localspec lays the prompt out and the upstream tokenizes it, special tokens
    parsed). ``end``: texts that end a completion (end-of-text, the FIM pad/repo/file tokens)."""

    pre: str = Field(min_length=1)
    suf: str = Field(min_length=1)
    mid: str = Field(min_length=1)
    pad: str | None = None
    rep: str | None = None
    sep: str | None = None
    end: tuple[str, ...] = ()


class Tokenizer(_Frozen):
    """The vocabulary facts llama.cpp compares before it lets a draft speculate for a target."""

    model: str = "gpt2"  # tokenizer.ggml.model (llama.cpp's vocab type)
    family: str  # same family = same token text for every id both models have
    add_bos: bool = False
    bos_id: int | None = None
    add_eos: bool = False
    eos_id: int | None = None
    fim: bool = False  # FIM tokens present (prefix/suffix/middle), so /infill works
    fim_text: FimText | None = None  # those tokens' texts (a text-prompt upstream needs them)


Capability = Literal["fim", "chat"]


class ModelEntry(_Frozen):
    id: str
    family: str
    role: Literal["target", "draft", "both"]
    params_b: float = Field(gt=0)
    # what the model was trained for: "fim" (code completion: base models, and Qwen3-Coder)
    # and "chat" (instruct models: chat, instruction editing, tool calls)
    capabilities: tuple[Capability, ...] = Field(default=("fim",), min_length=1)
    arch: Arch
    tokenizer: Tokenizer
    quants: dict[str, QuantEntry] = Field(min_length=1)
    # the original weights on the hub (safetensors), which vLLM and SGLang serve
    hf_model: str | None = Field(default=None, pattern=r"^[\w.\-]+/[\w.\-]+$")
    note: str = ""
    source: str = Field(default="", exclude=True)  # the TOML file it came from

    @property
    def can_target(self) -> bool:
        return self.role in ("target", "both")

    @property
    def can_draft(self) -> bool:
        return self.role in ("draft", "both")

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def quant_ladder(self) -> list[str]:
        """This model's quants, smallest first (unknown names last, alphabetically)."""
        rank = {q: i for i, q in enumerate(QUANT_ORDER)}
        return sorted(self.quants, key=lambda q: (rank.get(q, len(rank)), q))


class PairEntry(_Frozen):
    id: str
    target: str
    draft: str | None = None  # None: n-gram drafting only
    compatible: bool = True
    note: str = ""
    source: str = Field(default="", exclude=True)


class _CatalogFile(_Frozen):
    schema_version: int = SCHEMA_VERSION
    models: dict[str, ModelEntry] = {}
    pairs: dict[str, PairEntry] = {}


def vocab_compatibility(target: ModelEntry, draft: ModelEntry) -> tuple[bool, str]:
    """llama.cpp's draft/target vocabulary rule, decided from the catalog's facts.

    Returns (compatible, reason); the reason explains a refusal in words a user can act on.
    """
    t, d = target.tokenizer, draft.tokenizer
    if t.model != d.model:
        return False, f"vocab types differ ({t.model} vs {d.model})"
    if t.add_bos != d.add_bos or (t.add_bos and t.bos_id != d.bos_id):
        return False, f"BOS handling differs ({t.add_bos}/{t.bos_id} vs {d.add_bos}/{d.bos_id})"
    if t.add_eos != d.add_eos or (t.add_eos and t.eos_id != d.eos_id):
        return False, f"EOS handling differs ({t.add_eos}/{t.eos_id} vs {d.add_eos}/{d.eos_id})"
    diff = abs(target.arch.n_vocab - draft.arch.n_vocab)
    if diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return False, (
            f"vocab sizes differ by {diff} ({target.arch.n_vocab} vs {draft.arch.n_vocab}; "
            f"llama.cpp allows {SPEC_VOCAB_MAX_SIZE_DIFFERENCE})"
        )
    if t.family != d.family:
        return False, f"token texts differ (tokenizer family {t.family} vs {d.family})"
    return True, "same vocabulary"


class Catalog:
    """Models and pairs from the built-in catalog and any profile directories."""

    def __init__(self, models: dict[str, ModelEntry], pairs: dict[str, PairEntry]) -> None:
        self.models = models
        self.pairs = pairs

    def model(self, model_id: str) -> ModelEntry:
        try:
            return self.models[model_id]
        except KeyError:
            raise CatalogError(_unknown("model", model_id, self.models)) from None

    def pair(self, pair_id: str) -> PairEntry:
        try:
            return self.pairs[pair_id]
        except KeyError:
            raise CatalogError(_unknown("pair", pair_id, self.pairs)) from None

    def match_model(self, name: str) -> ModelEntry | None:
        """The catalog model a server's model name means: its id, its ``hf_model``, or a name
        that starts with its id once the organisation, case and Ollama's ``:`` tag separator
        are set aside (``Qwen/Qwen2.5-Coder-7B-Instruct-AWQ`` and ``qwen2.5-coder:7b`` both
        mean ``qwen2.5-coder-7b``). The longest id wins; None when nothing matches."""
        lowered = name.strip().lower()
        for entry in self.models.values():
            if entry.id == lowered or (entry.hf_model or "").lower() == lowered:
                return entry
        key = lowered.rsplit("/", 1)[-1].replace(":", "-").replace("_", "-")
        found = [
            m
            for m in self.models.values()
            if key == m.id or (key.startswith(m.id) and not key[len(m.id)].isalnum())
        ]
        return max(found, key=lambda m: len(m.id), default=None)

    def pair_can(self, pair_id: str, capability: Capability) -> bool:
        """Whether the pair's target was trained for ``capability`` (a model unknown to the
        catalog can nothing)."""
        pair = self.pairs.get(pair_id)
        target = self.models.get(pair.target) if pair is not None else None
        return target is not None and target.can(capability)

    def pairs_for(self, target_id: str) -> list[PairEntry]:
        """Compatible pairs whose target is ``target_id`` (n-gram-only pairs included)."""
        return [p for p in self.pairs.values() if p.target == target_id and p.compatible]

    def targets(self) -> list[ModelEntry]:
        return [m for m in self.models.values() if m.can_target]

    def drafts(self) -> list[ModelEntry]:
        return [m for m in self.models.values() if m.can_draft]


def _unknown(kind: str, name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {kind} {name!r}{hint} (`localspec models` lists the catalog)"


def _error_lines(path: Path, err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        if len(loc) >= 2 and loc[0] in ("models", "pairs"):
            where = f"entry {loc[0]}.{loc[1]!r}"
            key = ".".join(loc[2:]) or "(the entry)"
        else:
            where, key = "top level", ".".join(loc) or "(the file)"
        lines.append(f"{path}: {where}: key {key!r}: {e['msg']}")
    return lines


def load_catalog_file(path: Path) -> tuple[dict[str, ModelEntry], dict[str, PairEntry]]:
    """Parse and validate one TOML file; ids come from the table keys."""
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc}") from exc
    version = raw.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise CatalogError(
            f"{path}: top level: key 'schema_version': {version!r} is not supported "
            f"(this localspec reads version {SCHEMA_VERSION})"
        )
    for section in ("models", "pairs"):
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise CatalogError(f"{path}: top level: key {section!r}: must be a table")
        for entry_id, entry in table.items():
            if isinstance(entry, dict):
                if "id" in entry and entry["id"] != entry_id:
                    raise CatalogError(
                        f"{path}: entry {section}.{entry_id!r}: key 'id': "
                        f"{entry['id']!r} differs from the table name"
                    )
                entry["id"] = entry_id
                entry["source"] = str(path)
                if section == "models":
                    _resolve_local_paths(entry, path.parent)
    try:
        parsed = _CatalogFile.model_validate(raw)
    except ValidationError as exc:
        raise CatalogError("\n".join(_error_lines(path, exc))) from None
    return dict(parsed.models), dict(parsed.pairs)


def _resolve_local_paths(entry: dict[str, Any], base: Path) -> None:
    quants = entry.get("quants")
    if not isinstance(quants, dict):
        return
    for quant in quants.values():
        files = quant.get("files") if isinstance(quant, dict) else None
        for f in files if isinstance(files, list) else []:
            if isinstance(f, dict) and isinstance(f.get("path"), str):
                f["path"] = str((base / Path(f["path"]).expanduser()).resolve())


def _toml_files(location: Path) -> list[Path]:
    if location.is_file():
        return [location]
    if location.is_dir():
        return sorted(location.glob("*.toml"))
    return []


def load_catalog(extra_dirs: Sequence[Path] = (), *, builtin: bool = True) -> Catalog:
    """Load the built-in catalog, then each profile directory (or file) in order.

    A later directory replaces an earlier entry with the same id (an IT profile can point a
    model at an internal mirror); two files in one directory defining one id is an error.
    Missing profile directories are skipped: profiles name them whether or not they exist.
    """
    locations = ([data_dir("models")] if builtin else []) + [Path(d) for d in extra_dirs]
    models: dict[str, ModelEntry] = {}
    pairs: dict[str, PairEntry] = {}
    for location in locations:
        seen: dict[str, str] = {}
        for path in _toml_files(location):
            file_models, file_pairs = load_catalog_file(path)
            for kind, entries in (("models", file_models), ("pairs", file_pairs)):
                for entry_id in entries:
                    key = f"{kind}.{entry_id}"
                    if key in seen:
                        raise CatalogError(
                            f"{path}: entry {kind}.{entry_id!r}: also defined in {seen[key]}"
                        )
                    seen[key] = str(path)
            models.update(file_models)
            pairs.update(file_pairs)
    _check_pairs(models, pairs)
    return Catalog(models, pairs)


def _check_pairs(models: dict[str, ModelEntry], pairs: dict[str, PairEntry]) -> None:
    errors: list[str] = []
    for pair in pairs.values():
        where = f"{pair.source}: entry pairs.{pair.id!r}"
        target = models.get(pair.target)
        draft = models.get(pair.draft) if pair.draft is not None else None
        if target is None:
            errors.append(f"{where}: key 'target': {_unknown('model', pair.target, models)}")
            continue
        if not target.can_target:
            errors.append(f"{where}: key 'target': {target.id} has role {target.role!r}")
        if pair.draft is None:
            if not pair.compatible:
                errors.append(f"{where}: key 'compatible': an n-gram-only pair is compatible")
            continue
        if draft is None:
            errors.append(f"{where}: key 'draft': {_unknown('model', pair.draft, models)}")
            continue
        if not draft.can_draft:
            errors.append(f"{where}: key 'draft': {draft.id} has role {draft.role!r}")
        ok, reason = vocab_compatibility(target, draft)
        if ok != pair.compatible:
            errors.append(
                f"{where}: key 'compatible': says {pair.compatible} but the models' "
                f"tokenizer facts say {ok} ({reason})"
            )
    if errors:
        raise CatalogError("\n".join(errors))
