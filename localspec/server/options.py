"""How the HTTP daemon is exposed: address, auth, queue and timeouts (the engine has its own)."""

from __future__ import annotations

from dataclasses import dataclass

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


@dataclass(frozen=True)
class ServerSettings:
    host: str = "localhost"  # "localhost" binds both 127.0.0.1 and ::1
    port: int = 8012
    api_key: str | None = None  # required for any non-loopback host
    n_parallel: int = 1  # slots, i.e. EngineSettings.n_slots: separate KV caches
    queue_limit: int = 16  # waiting requests past this answer 503 + Retry-After
    request_timeout_s: float = 600  # queued + running; past it the request is cancelled
    metrics: bool = True  # expose /metrics (Prometheus text)
    cors_origins: tuple[str, ...] = ()
    model_alias: str | None = None  # the "model" name in answers; default: the GGUF file name
    spm_infill: bool = False  # llama-server's --spm-infill: suffix block before prefix
    # the cursor line goes behind FIM_MID (each keystroke appends to the cached prompt);
    # False: llama-server's layout, the line ends the prefix (see server/fim.py)
    typed_in_middle: bool = True
    # /infill's extra-context chunks evaluated each on its own (engine blocks, docs/engine.md);
    # with typed_in_middle only (llama-server's layout stays token for token and causal)
    ring_blocks: bool = True
    n_cmpl_max: int = 16  # most completions one request may ask for
    infill_room: int = 256  # /infill prompts leave this many tokens (at most n_ctx/4) to generate
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies answer 413
    body_timeout_s: float = 30.0  # a body not fully received by then answers 408
    max_connections: int = 256  # open connections past this answer 503 (uvicorn's cap)
    # why this daemon answers no chat (the 501's message: what to change); None: chat is
    # served by the chat model, or by the completion model when its GGUF has a chat template
    chat_refusal: str | None = None
    chat_alias: str | None = None  # the chat model's name in answers (a second pair); None: file

    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    @property
    def blocks_in_effect(self) -> bool:
        """Whether /infill's ring chunks are evaluated as blocks (only in localspec's layout)."""
        return self.ring_blocks and self.typed_in_middle

    def check(self) -> None:
        """Refuse settings that would expose an open completion endpoint or cannot work."""
        if not self.is_loopback() and not self.api_key:
            raise ValueError(
                f"refusing to listen on {self.host!r} without an API key: anyone on the network "
                "could use the model. Set an API key, or bind localhost"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range 0-65535")
        if self.n_parallel < 1:
            raise ValueError(f"n_parallel must be at least 1, got {self.n_parallel}")
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit must be 0 or more, got {self.queue_limit}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
