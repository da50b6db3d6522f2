"""How the HTTP daemon is exposed: address, auth, queue and timeouts (the engine has its own).

``localspec.settings_to.server_settings`` builds a ServerSettings from the user's Settings,
whose model checks every value; the defaults here are that model's own (for tests and
programmatic use), so a default lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localspec.settings import (
    CacheSettings,
    InfillLayout,
    JumpPolicy,
    RingAttention,
    ServerSection,
    SlotRule,
    is_loopback,
)

_SERVER = ServerSection()  # the settings model's defaults
_CACHE = CacheSettings()


@dataclass(frozen=True)
class ServerSettings:
    host: str = _SERVER.host  # "localhost" binds both 127.0.0.1 and ::1
    port: int = _SERVER.port  # 0: any free port (tests)
    api_key: str | None = None  # required for any non-loopback host
    queue_limit: int = _SERVER.queue_limit  # waiting requests past this answer 503 + Retry-After
    slot_choice: SlotRule = _SERVER.slot_choice  # pinned: id_slot picks the slot (else a hint)
    request_timeout_s: float = _SERVER.request_timeout_s  # queued + running, then cancelled
    metrics: bool = _SERVER.metrics  # expose /metrics (Prometheus text)
    cors_origins: tuple[str, ...] = tuple(_SERVER.cors_origins)
    model_alias: str | None = None  # the "model" name in answers; default: the GGUF file name
    spm_infill: bool = _SERVER.spm_infill  # llama-server's --spm-infill: suffix before prefix
    # where /infill puts the cursor line, and how its extra-context chunks attend (see
    # server/prompts.py: infill_prompt, ring_attention_in_effect)
    infill_layout: InfillLayout = _CACHE.infill_layout
    ring_attention: RingAttention = _CACHE.ring_attention
    # /infill's prefix (3/4) and suffix (1/4) window, whatever the engine's n_batch
    infill_window: int = _CACHE.infill_window
    # a cold /infill past its t_max_prompt_ms: wait for it, or answer from what fits (jump.py)
    jump_policy: JumpPolicy = _CACHE.jump_policy
    # where POST /slots/{id}?action=save|restore keeps its files; None: refused (as llama-server)
    slot_save_path: Path | None = _SERVER.slot_save_path
    # the slots' contexts written here at a clean shutdown and read back at start (at most
    # context_bytes; server/keep.py); None: not kept
    context_dir: Path | None = None
    context_bytes: int = int(_CACHE.restart_gb * (1 << 30))
    n_cmpl_max: int = _SERVER.n_cmpl_max  # most completions one request may ask for
    infill_room: int = 256  # /infill prompts leave this many tokens (at most n_ctx/4) to generate
    max_body_bytes: int = _SERVER.max_body_bytes  # larger request bodies answer 413
    body_timeout_s: float = _SERVER.body_timeout_s  # a body not fully received by then: 408
    max_connections: int = _SERVER.max_connections  # open connections past this answer 503
    # why this daemon answers no chat (the 501's message: what to change); None: chat is
    # served by the chat model, or by the completion model when its GGUF has a chat template
    chat_refusal: str | None = None
    chat_alias: str | None = None  # the chat model's name in answers (a second pair); None: file
    # where rejected drafts are recorded (speculative.record_rejections); None: not recorded
    rejections_path: str | None = None
    rejections_max_bytes: int = 64 * 1024 * 1024

    def check(self) -> None:
        """Refuse to expose an open completion endpoint. ``localspec up`` has applied the same
        rule (``settings.check_security``) before; this guards a programmatic ``serve``."""
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"refusing to listen on {self.host!r} without an API key: anyone on the network "
                "could use the model. Set an API key, or bind localhost"
            )
