"""What the daemon needs to know of its upstream (translated from the ``backend`` settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from localspec.catalog import FimText

UpstreamKind = Literal["llama-server", "openai"]


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
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 60.0
    fallback: bool = True  # a local model answers while the upstream is down or slow
    fallback_ms: float = 2000.0  # 0: never give up on a healthy upstream before read timeout
    health_interval_s: float = 5.0
    slow_strikes: int = 3  # answers late in a row before the upstream is skipped for a while

    def check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL {self.url!r} is not http:// or https://")
        if self.kind == "openai" and self.fim is None:
            raise ValueError("the openai upstream kind needs the FIM tokens' texts")
        if self.fallback_ms < 0 or self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("upstream timeouts must be positive (fallback_ms: 0 or more)")

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
