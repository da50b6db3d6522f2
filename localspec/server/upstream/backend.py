"""The upstream as the daemon holds it: its client, its health, which routes go to it and how.

Route plans per kind (``route``):

- ``llama-server``: every editor route is relayed (``relay``); ``/props`` gets localspec's
  ``backend`` section added.
- ``openai``: /infill and /completion are translated (:mod:`.openai_kind`); the OpenAI routes
  (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) are relayed with
  ``backend.model`` (else the upstream's first listed model) in place of the editor's;
  ``/props`` is localspec's own; routes that need the model's tokenizer (``/tokenize``,
  ``/detokenize``, ``/apply-template``) and ``/slots`` go to the local model
  (501 without one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from localspec import __version__
from localspec.server.results import dumps
from localspec.server.upstream.answer import JSON, Answer
from localspec.server.upstream.client import UpstreamFailure, make_client
from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.health import Health
from localspec.server.upstream.identity import workstation
from localspec.server.upstream.metrics import BackendMetrics
from localspec.server.upstream.openai_kind import Limits, OpenAIBackend
from localspec.server.upstream.relay import (
    CHAT,
    GENERATION,
    open_upstream,
    pinned_slot,
    prepare,
    props_with,
)

Plan = Literal["relay", "props", "infill", "completion", "local"]

_POSTS = ("/infill", "/completion", "/completions", "/v1/completions", "/v1/chat/completions",
          "/chat/completions", "/apply-template", "/tokenize", "/detokenize")  # fmt: skip
_GETS = ("/props", "/slots", "/v1/models", "/models")
LLAMA_SERVER_ROUTES: dict[tuple[str, str], Plan] = {
    **{("POST", p): "relay" for p in _POSTS},
    **{("GET", p): "relay" for p in _GETS},
    ("GET", "/props"): "props",
}
OPENAI_ROUTES: dict[tuple[str, str], Plan] = {
    ("POST", "/infill"): "infill",
    ("POST", "/completion"): "completion",
    ("POST", "/completions"): "completion",
    ("POST", "/v1/completions"): "relay",
    ("POST", "/v1/chat/completions"): "relay",
    ("POST", "/chat/completions"): "relay",
    ("GET", "/v1/models"): "relay",
    ("GET", "/models"): "relay",
    ("GET", "/props"): "props",
    ("POST", "/tokenize"): "local",
    ("POST", "/detokenize"): "local",
    ("POST", "/apply-template"): "local",
    ("GET", "/slots"): "local",
}
_OPENAI_PATHS = {"/completions": "/v1/completions", "/chat/completions": "/v1/chat/completions",
                 "/models": "/v1/models"}  # fmt: skip


class Upstream:
    def __init__(
        self,
        cfg: UpstreamSettings,
        *,
        limits: Limits | None = None,
        registry: CollectorRegistry | None = None,
        identity: str | None = None,
    ) -> None:
        cfg.check()
        self.cfg = cfg
        self.client = make_client(cfg)
        self.health = Health(cfg, self.client)
        self.identity = identity if identity is not None else workstation()
        self.routes = LLAMA_SERVER_ROUTES if cfg.kind == "llama-server" else OPENAI_ROUTES
        self.openai = (
            OpenAIBackend(cfg, self.client, self.health, limits or Limits())
            if cfg.kind == "openai"
            else None
        )
        self.metrics = (
            BackendMetrics(registry, cfg, lambda: self.health.state) if registry else None
        )
        self.local_model: str | None = None  # the local model standing in (set by the app)
        self.local_state: Callable[[], Any] = lambda: None  # its not_ready probe (the app's)
        self.answered: Counter[str] = Counter()  # completions: "upstream" / "local"
        self.fallbacks: Counter[str] = Counter()  # completions the local model took, by reason

    async def start(self) -> None:
        """The first check now (so the first request knows where to go), then in the
        background."""
        await self.health.check()
        self.health.start()

    async def aclose(self) -> None:
        await self.health.stop()
        await self.client.aclose()

    # ------------------------------------------------------------------ requests

    def plan(self, method: str, path: str) -> Plan | None:
        return self.routes.get((method, path))

    @property
    def model(self) -> str | None:
        """The ``model`` a generation request carries upstream, whatever the editor sent:
        ``backend.model``; else (openai) the model the upstream lists first, as OpenAI servers
        need one; else none (a llama-server answers with its own)."""
        if self.cfg.kind == "openai":
            return self.cfg.model or self.health.state.model
        return self.cfg.model

    @property
    def slot(self) -> int:
        return pinned_slot(self.cfg, self.health.state.n_slots, self.identity)

    async def open(self, plan: Plan, method: str, path: str, query: str, raw: bytes) -> Answer:
        """The upstream's committed answer to one request (an UpstreamFailure before that)."""
        if plan == "infill":
            assert self.openai is not None
            return await self.openai.infill(raw)
        if plan == "completion":
            assert self.openai is not None
            return await self.openai.completion(raw)
        if plan == "props" and self.cfg.kind == "openai":
            return Answer(200, JSON, self.openai_props())
        content: bytes | None = None
        stream, n_choices = False, 1
        if method == "POST":
            generation = path in GENERATION
            slot = None
            if self.cfg.kind == "llama-server" and generation:
                slot = -1 if path in CHAT else self.slot
            model = self.model if generation else None
            content, stream, n_choices = prepare(
                raw, slot=slot, model=model, replace_model=generation
            )
        if self.cfg.kind == "openai":
            path = _OPENAI_PATHS.get(path, path)
        answer = await open_upstream(
            self.client, self.cfg, method, path, query, content, stream=stream, n_choices=n_choices
        )
        if plan == "props" and not answer.streamed:  # an error too: status shows why
            answer.body = props_with(answer.body, self.info("upstream"))
        return answer

    def record(
        self,
        backend: str,
        route: str,
        *,
        reason: str = "",
        upstream_s: float = 0.0,
        status: int = 200,
    ) -> None:
        """One request's outcome: who answered (``none``: nobody could, a 503 or 501 said
        why), why the local model did, and an upstream's error answer passed on (``status``
        >= 400: counted as an error, not as an answer)."""
        completion = route in GENERATION  # not /props or /slots
        answered = backend != "none" and status < 400
        if completion and answered:
            self.answered[backend] += 1
            if reason:
                self.fallbacks[reason] += 1
        m = self.metrics
        if m is None:
            return
        if answered:
            m.answers.labels(backend, route).inc()
        else:
            m.unanswered.labels(backend, route, str(status)).inc()
        if reason and completion and answered:
            m.fallbacks.labels(reason).inc()
        if upstream_s:
            m.upstream_seconds.labels(route).observe(upstream_s)

    def failed(self, exc: UpstreamFailure, *, started: bool) -> None:
        """A request's failure: the health takes note, the metrics count it (``started``: the
        answer had begun, so the editor got an error event, not the local model's answer)."""
        self.health.mark_failed(exc)
        if self.metrics is not None:
            self.metrics.failures.labels(exc.reason, "stream" if started else "before").inc()

    # ------------------------------------------------------------------ info

    def info(self, answering: str) -> dict[str, Any]:
        """localspec's ``backend`` section of /props: where answers come from now and why.
        No key, no credentials: the URL carries none (the settings refuse them)."""
        state = self.health.state
        local_model = self.local_model
        return {
            "kind": self.cfg.kind,
            "url": self.cfg.url,
            "status": self.health.why_not() if not self.health.usable else state.status,
            "since": state.since,
            "checked": state.checked,
            "error": state.error,
            "answering": answering,
            "fallback": "local" if local_model else "none",
            "no_local": self.cfg.no_local or None,  # why none, when one was asked for
            "fallback_ms": self.cfg.fallback_ms,
            "local_model": local_model,
            "local_state": self._local_state(),
            "id_slot": self.slot if self.cfg.kind == "llama-server" else None,
            "upstream_slots": state.n_slots,
            "upstream_model": state.model,
            "fim_model": self.cfg.fim_model,
            "answered": {"upstream": self.answered["upstream"], "local": self.answered["local"]},
            "fallbacks": dict(self.fallbacks),
        }

    def _local_state(self) -> str:
        if self.local_model is None:
            return "none"
        why = self.local_state()
        return "ready" if why is None else str(why.message)

    def openai_props(self) -> bytes:
        """/props for an OpenAI upstream, in llama-server's shape (llama-vscode reads n_ctx)."""
        assert self.openai is not None
        n_ctx = self.openai.n_ctx
        body = {
            "default_generation_settings": {"n_ctx": n_ctx, "params": {"n_predict": -1}},
            "n_ctx": n_ctx,
            "total_slots": 1,
            "model_alias": self.openai.model_name,
            "model_path": "",
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": False,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "chat_template": "",
            "build_info": f"localspec {__version__} (openai upstream)",
            "is_sleeping": False,
            "backend": self.info("upstream"),
        }
        return dumps(body)

    def unavailable(self, local: str | None) -> str:
        """Why nobody answers: the upstream's state and the local model's."""
        state = self.health.state
        why = self.health.why_not()
        detail = f" ({state.error})" if state.error else ""
        head = f"the upstream {self.cfg.url} is {why}{detail}"
        if self.local_model is None and self.cfg.no_local:
            return f"{head}, and there is no local model to answer ({self.cfg.no_local})"
        if self.local_model is None:
            return f"{head}, and backend.fallback = none: no local model answers"
        return f"{head}, and the local model cannot answer ({local or 'not available'})"
