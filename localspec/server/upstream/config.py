"""What the daemon needs to know of its upstream: built from the ``backend`` settings by
``localspec.settings_to.upstream_settings``; the defaults are the settings model's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from localspec.catalog import FimText
from localspec.settings import BackendSettings, Fallback

UpstreamKind = Literal["llama-server", "openai"]

_BACKEND = BackendSettings()  # the settings model's defaults


@dataclass(frozen=True)
class UpstreamSettings:
    kind: UpstreamKind
    url: str  # base URL, no trailing slash, no credentials (settings refuse them)
    api_key: str | None = field(default=None, repr=False)  # never in a repr, a log or /props
    ca_bundle: str | None = None  # PEM file trusted for the upstream's TLS
    model: str | None = None  # sent as "model"
    fim: FimText | None = None  # openai: the FIM tokens as text (from the catalog)
    fim_model: str | None = None  # the catalog model ``fim`` came from (shown in /props)
    slot: int | None = None  # llama-server: pinned slot; None: stable hash; -1: upstream picks
    connect_timeout_s: float = _BACKEND.connect_timeout_s
    read_timeout_s: float = _BACKEND.read_timeout_s
    fallback: Fallback = _BACKEND.fallback  # local: a local model answers while it cannot
    fallback_ms: float = _BACKEND.fallback_ms  # 0: wait for read_timeout_s
    no_local: str = ""  # why no local model stands in although backend.fallback = local
    health_interval_s: float = _BACKEND.health_interval_s
    slow_strikes: int = 3  # answers late in a row before the upstream is skipped for a while

    def check(self) -> None:
        """The one rule the settings model cannot check: the openai kind lays prompts out
        with a catalog model's FIM tokens (the model's values are checked there)."""
        if self.kind == "openai" and self.fim is None:
            raise ValueError("the openai upstream kind needs the FIM tokens' texts")

    def refused_message(self) -> str:
        """Why the upstream answers 401/403, for the editor, the log and ``localspec status``."""
        if not self.api_key:
            return (
                f"the upstream {self.url} asks for a key and localspec has none: "
                "set backend.api_key_file"
            )
        return (
            f"the upstream {self.url} refuses localspec's key (backend.api_key_file): "
            "check the key with the server's administrator"
        )
