"""The daemon's state shared by the routes: settings, the worker, metrics, and answer shaping."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from localspec import __version__
from localspec.engine.api import ServedEngine
from localspec.engine.types import EngineSettings, SamplingParams, SpecSettings, TokenEvent
from localspec.rejections import RejectionFile
from localspec.server import dispatch, keep, prompts, results
from localspec.server.chatmodel import chat_model
from localspec.server.errors import ApiError, Unavailable
from localspec.server.metrics import Metrics, Probes, Restores
from localspec.server.options import ServerSettings
from localspec.server.prompts import Prepare, TokenCache
from localspec.server.requests import GenerationFields, TaskParams, sampling_json, task_params
from localspec.server.speculation import LANG_KEY, SpecStats
from localspec.server.worker import EngineThread, Job, JobResult, Worker

log = logging.getLogger("localspec.server")


def _probes(worker: Worker, restores: Restores) -> Probes:
    def model_files() -> dict[str, str]:
        engine = worker.engine
        if engine is None:
            return {}
        files = {"target": str(engine.model_path)}
        if engine.draft_path is not None:
            files["draft"] = str(engine.draft_path)
        return files

    def cpu() -> tuple[int, float] | None:
        engine = worker.engine
        governor = None if engine is None else engine.governor
        return None if governor is None else (governor.free, governor.other_busy)

    def kv() -> tuple[int, int] | None:
        engine = worker.engine
        return None if engine is None else engine.kv_holes  # (none before the model loads)

    return Probes(
        cpu=cpu,
        kv=kv,
        host_cache=lambda: getattr(worker.engine, "host_cache", None),
        restores=restores.totals,
        queued=lambda: worker.queued,
        busy=lambda: worker.busy,
        cancelled=lambda: worker.n_cancelled,
        prompt_evaluated=lambda: worker.n_prompt_evaluated,
        slots=lambda: list(worker.slots),
        model_files=model_files,
    )


PARAMS_CACHE = 64  # distinct parameter sets remembered (clients send one or two)
# fields task_params() ignores (and that may hold anything, unhashable included)
_UNUSED_FIELDS = frozenset({"model", "lora", "language", "filename"})


def _params_key(body: GenerationFields) -> tuple[Any, ...]:
    """Everything task_params() reads of the body (every generation field, lists as tuples,
    nested JSON such as ``logit_bias`` or ``json_schema`` as its text, key order kept: a
    schema's property order is its grammar's): hashable, or a TypeError."""
    values = body.__dict__
    key: list[Any] = []
    for name in GenerationFields.model_fields:
        if name not in _UNUSED_FIELDS:
            value = values[name]
            if isinstance(value, dict) or (
                isinstance(value, list) and any(isinstance(v, (list, dict)) for v in value)
            ):
                value = ("json", json.dumps(value))
            elif isinstance(value, list):
                value = tuple(value)
            key.append(value)
    out = tuple(key)
    hash(out)
    return out


def accept_json(spec: SpecSettings, prefix: str = "") -> dict[str, Any]:
    """The acceptance rule, said in every answer's settings and in /props: relaxed acceptance
    (``topk``) makes output that is not the target's own."""
    out: dict[str, Any] = {"accept": spec.accept, "bit_identical": spec.accept == "exact"}
    if spec.accept != "exact":
        out |= {"accept_top_k": spec.accept_top_k, "accept_p_min": spec.accept_p_min}
    return {prefix + k: v for k, v in out.items()}


@dataclass
class Service:
    settings: ServerSettings
    engine_settings: EngineSettings
    worker: Worker
    metrics: Metrics | None
    model_name: str
    started: float
    token_cache: TokenCache
    _params_cache: dict[tuple[Any, ...], TaskParams] = field(default_factory=dict)
    chat_service: Service | None = None  # a second pair loaded for chat (its own worker)
    spec: SpecStats = field(default_factory=lambda: SpecStats(None))  # by language, position
    # contexts restored from a slot file or at start (/metrics; the host cache counts its own)
    restores: Restores = field(default_factory=Restores)

    @classmethod
    def create(
        cls,
        settings: ServerSettings,
        engine_settings: EngineSettings,
        load: Callable[[], ServedEngine],
        *,
        on_ready: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        engine_thread: EngineThread | None = None,
    ) -> Service:
        """``engine_thread``: the thread that runs this model's llama.cpp calls (a chat pair
        shares the completion pair's)."""
        before_close = None
        restores = Restores()
        root = settings.context_dir
        if root is not None:  # the slots' contexts kept across a restart (server/keep.py)
            load = keep.keeping(load, root, functools.partial(restores.add, "restart"))
            max_bytes = settings.context_bytes
            before_close = lambda engine: keep.save_contexts(engine, root, max_bytes)  # noqa: E731
        worker = Worker(
            load,
            queue_limit=settings.queue_limit,
            slot_choice=settings.slot_choice,
            on_ready=on_ready,
            on_failure=on_failure,
            engine_thread=engine_thread,
            before_close=before_close,
            jump_policy=settings.jump_policy,
        )
        metrics = Metrics(_probes(worker, restores)) if settings.metrics else None
        name = settings.model_alias or Path(engine_settings.target.path).name
        rejections = None
        if settings.rejections_path:
            path, cap = Path(settings.rejections_path), settings.rejections_max_bytes
            rejections = RejectionFile(path, cap)
        spec = SpecStats(metrics.registry if metrics is not None else None, rejections=rejections)
        return cls(
            settings,
            engine_settings,
            worker,
            metrics,
            name,
            time.time(),
            TokenCache(),
            spec=spec,
            restores=restores,
        )

    # ------------------------------------------------------------------ state

    @property
    def engine(self) -> ServedEngine:
        """The loaded engine (a route asks ``not_ready`` first)."""
        engine = self.worker.engine
        if engine is None:
            raise Unavailable("Loading model")
        return engine

    def not_ready(self) -> ApiError | None:
        state = self.worker.state
        if state == "ready":
            chat = self.chat_service
            if chat is None or chat.worker.state == "failed":  # chat says so; FIM serves on
                return None
            return chat.not_ready()
        if state == "loading":
            return Unavailable("Loading model")
        if state == "failed":
            return ApiError(f"The model failed to load: {self.worker.error}")
        return Unavailable("Server is stopping")

    def for_model(self, name: Any) -> Service:
        """The served model a request names (``model``, ``/props?model=``): the chat pair when
        it is that one's name, else this one (other names are ignored, as llama-server)."""
        chat = self.chat_service
        return chat if chat is not None and name == chat.model_name else self

    @property
    def serves_chat(self) -> bool:
        return (
            self.chat_service is None
            and not self.settings.chat_refusal
            and chat_model(self.engine).serves_chat
        )

    def capabilities(self) -> list[str]:
        """What this model answers: completion, infill (FIM tokens), chat, tools."""
        caps = ["completion"]
        if self.engine.vocab.fim.supported:
            caps.append("infill")
        if self.serves_chat:
            caps.append("chat")
            if chat_model(self.engine).tool_format is not None:
                caps.append("tools")
        return caps

    # ------------------------------------------------------------------ requests

    def params(self, body: GenerationFields) -> TaskParams:
        """The body's generation parameters; an editor sends the same ones with every
        keystroke, so they are parsed once per distinct set (TaskParams is immutable, and its
        ``settings_json`` is only ever read)."""
        try:
            key = _params_key(body)
        except TypeError:  # an unhashable value: nothing to remember it by
            return self._params(body)
        found = self._params_cache.get(key)
        if found is None:
            found = self._params(body)
            if len(self._params_cache) >= PARAMS_CACHE:
                self._params_cache.pop(next(iter(self._params_cache)))
            self._params_cache[key] = found
        return found

    def _params(self, body: GenerationFields) -> TaskParams:
        params = task_params(
            body,
            n_ctx=self.engine.n_ctx,
            # as llama-server's n_parallel: the completions decode at the same time
            n_cmpl_max=min(self.settings.n_cmpl_max, self.engine.max_completions),
            default_sampling=SamplingParams(),
            vocab=self.engine.vocab,
        )
        spec = self.engine_settings.spec
        settings_json = params.settings_json
        for key, default in (("n_max", spec.n_max), ("n_min", spec.n_min), ("p_min", spec.p_min)):
            if settings_json[f"speculative.{key}"] is None:
                settings_json[f"speculative.{key}"] = default
        settings_json.update(accept_json(spec, "speculative."))
        return params

    def job(self, params: TaskParams, prepare: Prepare, *, truncate: bool = False) -> Job:
        """A job for the worker; ``truncate``: cut a too-long prompt instead of a 400."""
        wants_prompt = not params.response_fields or any(
            f == "prompt" or f.startswith("prompt/") for f in params.response_fields
        )
        vocab, cache = self.engine.vocab, self.token_cache
        detok = (lambda tokens: cache.detokenize(vocab, tokens)) if wants_prompt else None
        return Job(params, prepare, detokenize=detok, truncate=truncate)

    def _recorder(self, endpoint: str, request: Request) -> Callable[[JobResult], None]:
        def record(result: JobResult) -> None:
            runs = [done.result for done in result.completions]
            # the prompt is evaluated once for all completions (the others share its KV and
            # say so as cached), and they decode in the same steps: the prompt's figures are
            # the first's, the generation's wall time the longest one's, its tokens the sum
            first = runs[0] if runs else None
            dispatch.note(
                request,
                outcome="cancelled" if result.cancelled else "",
                slot=result.completions[0].id_slot if result.completions else None,
                n_prompt=result.n_prompt,
                evaluated=first.n_evaluated if first else 0,
                reused=first.n_cached if first else 0,
                approx=first.n_approx if first else 0,
                predicted=sum(len(r.tokens) for r in runs),
                drafted=sum(r.draft_n for r in runs),
                accepted=sum(r.draft_n_accepted for r in runs),
                followed=sum(r.n_followed for r in runs) if len(runs) > 1 else None,
                threads="/".join(map(str, runs[-1].threads)) if runs else None,
                queue_ms=result.t_queue_ms,
                prompt_ms=first.prompt_ms if first else 0.0,
                gen_ms=max((r.predicted_ms for r in runs), default=0.0),
            )
            if result.budget is not None:  # answered from the nearest lines (server/jump.py)
                dispatch.note(request, budget=1, budget_ctx=result.budget.n_ctx_tokens)
            recall = result.recall  # the host cache's work before it ran (engine/hostcache.py)
            if recall is not None and (recall.restored or recall.stashed):
                dispatch.note(
                    request,
                    restored=recall.restored,
                    restore_ms=recall.restore_ms,
                    stashed=recall.stashed,
                )
            if log.isEnabledFor(logging.DEBUG):
                for done in result.completions:
                    r = done.result
                    log.debug(
                        "%s slot=%d prompt=%d cached=%d evaluated=%d predicted=%d stop=%s "
                        "drafted=%d accepted=%d engine=%.1fms queue=%.1fms prep=%.1fms",
                        endpoint, done.id_slot, r.n_prompt, r.n_cached, r.n_evaluated,
                        len(r.tokens), r.stop_type, r.draft_n, r.draft_n_accepted,
                        result.t_engine_ms, result.t_queue_ms, result.t_prep_ms,
                    )  # fmt: skip
            wall = time.perf_counter() - dispatch.request_t0(request)
            self.spec.record(request, endpoint, runs, latency_s=wall)
            if self.metrics is None:
                return
            m = self.metrics
            m.child(m.requests, endpoint, "cancelled" if result.cancelled else "ok").inc()
            m.child(m.latency, endpoint).observe(wall)
            m.child(m.queue_time, endpoint).observe(result.t_queue_ms / 1e3)
            m.overhead.observe(max(0.0, wall - result.t_engine_ms / 1e3))
            if result.budget is not None:
                m.child(m.budget_answers, endpoint).inc()
            for index, r in enumerate(runs):
                m.record(r, endpoint, prompt=index == 0)

        return record

    def pending(self, request: Request, endpoint: str, job: Job) -> dispatch.Pending:
        """``job`` for ``request`` on this service's worker, within its timeout, logged and
        counted under ``endpoint`` once it ends (``dispatch.respond`` runs it)."""
        recorder = self._recorder(endpoint, request)
        job.language = request.scope.get(LANG_KEY)
        return dispatch.Pending(
            request, self.worker, job, self.settings.request_timeout_s, recorder
        )

    async def native(self, request: Request, endpoint: str, job: Job) -> Response:
        """llama-server's own answer shape (/infill, /completion), streamed or not."""
        params = job.params
        fields = params.response_fields

        def shape(obj: dict[str, Any]) -> dict[str, Any]:
            language = self.spec.language(request)
            if language is not None:
                obj["language"] = language
            return results.pick_fields(fields, obj) if fields else obj

        def finals(result: JobResult, *, stream: bool) -> list[dict[str, Any]]:
            return [
                shape(
                    results.final_object(
                        done,
                        model=self.model_name,
                        settings_json=params.settings_json,
                        stream=stream,
                        piece=self.engine.vocab.piece,
                    )
                )
                for done in dispatch.answered(result)
            ]

        if not params.stream:

            def render(result: JobResult) -> Any:
                objs = finals(result, stream=False)
                return objs[0] if len(objs) == 1 else objs

            return await dispatch.respond(self.pending(request, endpoint, job), render)

        counts: dict[int, int] = {}

        def partial(index: int, event: TokenEvent) -> dict[str, Any]:
            counts[index] = counts.get(index, 0) + 1
            return results.partial_object(
                index=index,
                content=event.text,
                tokens=[event.token],
                id_slot=job.slot,
                n_decoded=counts[index],
                n_prompt=job.n_prompt,
                probs=results.completion_probabilities(
                    [event.token], [event.probs], self.engine.vocab.piece
                )
                if event.probs is not None
                else None,
            )

        pending = self.pending(request, endpoint, job)
        return await dispatch.respond_stream(
            pending, partial, lambda result: finals(result, stream=True)
        )

    async def openai(self, request: Request, job: Job) -> Response:
        """OpenAI's text_completion shape (/v1/completions)."""
        cmpl_id = results.openai_id()
        endpoint = "v1/completions"
        if not job.params.stream:

            def render(result: JobResult) -> Any:
                return results.openai_completion(
                    dispatch.answered(result), model=self.model_name, cmpl_id=cmpl_id
                )

            return await dispatch.respond(self.pending(request, endpoint, job), render)

        def partial(index: int, event: TokenEvent) -> dict[str, Any]:
            return results.openai_chunk(
                text=event.text, index=index, model=self.model_name, cmpl_id=cmpl_id, finish=None
            )

        def final(result: JobResult) -> list[Any]:
            return [
                results.openai_final_chunk(done, model=self.model_name, cmpl_id=cmpl_id)
                for done in dispatch.answered(result)
            ]

        pending = self.pending(request, endpoint, job)
        return await dispatch.respond_stream(pending, partial, final, b"data: [DONE]\n\n")

    # ------------------------------------------------------------------ info

    def props(self) -> dict[str, Any]:
        engine = self.engine
        spec = self.engine_settings.spec
        defaults = SamplingParams()
        return {
            "default_generation_settings": {
                "n_ctx": engine.n_ctx,
                "params": {
                    **sampling_json(defaults),
                    "n_predict": -1,
                    "max_tokens": -1,
                    "speculative.n_max": spec.n_max,
                    "speculative.n_min": spec.n_min,
                    "speculative.p_min": spec.p_min,
                },
            },
            "n_ctx": engine.n_ctx,
            "n_batch": engine.n_batch,
            # /infill's prefix + suffix tokens (llama-server's n_batch; cache.infill_window)
            "infill_window": self.settings.infill_window,
            "jump_policy": self.settings.jump_policy,  # t_max_prompt_ms: wait, or budget
            "total_slots": engine.n_slots,
            "model_alias": self.model_name,
            "model_path": str(engine.model_path),
            "draft_model_path": None if engine.draft_path is None else str(engine.draft_path),
            "speculative": {
                "mode": spec.mode,
                "n_max": spec.n_max,
                "n_min": spec.n_min,
                "p_min": spec.p_min,
                # speculative.pipeline: the draft model on its own thread (auto: when the
                # threads of both models fit the free cores)
                "pipeline": {None: "auto", True: "on", False: "off"}[spec.pipeline],
                "draft_model": None if engine.draft_path is None else str(engine.draft_path),
                "cache_reuse": self.engine_settings.cache_reuse,
                "cache_exact_ms": self.engine_settings.exact_ms,
                "ring_attention": prompts.ring_attention_in_effect(
                    self.settings.infill_layout, self.settings.ring_attention
                ),
                **accept_json(spec),
            },
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": self.metrics is not None,
            **self._chat_props(),
            "capabilities": self.capabilities(),
            "build_info": f"localspec {__version__}",
            "llama_cpp": engine.memory_report(),  # backends; planned vs allocated per device
            "is_sleeping": False,
        }

    def _chat_props(self) -> dict[str, Any]:
        """llama-server's template fields; an empty ``chat_template``: this model answers no
        chat (a completion-only model, or chat is served by the other pair)."""
        template = chat_model(self.engine).template
        if template is None or not self.serves_chat:
            return {"chat_template": ""}
        return {
            "chat_template": template.source,
            "chat_template_caps": template.caps.to_json(),
            "bos_token": template.bos_token,
            "eos_token": template.eos_token,
        }

    def models(self) -> dict[str, Any]:
        """Every served model (the chat pair too, when one is loaded), with what each does."""
        served = [self] if self.chat_service is None else [self, self.chat_service]
        return {
            "models": [
                {
                    "name": svc.model_name,
                    "model": svc.model_name,
                    "type": "model",
                    "capabilities": svc.capabilities(),
                }
                for svc in served
            ],
            "object": "list",
            "data": [
                {
                    "id": svc.model_name,
                    "object": "model",
                    "created": int(self.started),
                    "owned_by": "localspec",
                    "capabilities": svc.capabilities(),
                    "meta": {
                        "n_ctx": svc.engine.n_ctx,
                        "n_vocab": svc.engine.vocab.n_vocab,
                        "n_ctx_train": svc.engine.n_ctx_train,
                    },
                }
                for svc in served
            ],
        }

    def slots(self) -> list[dict[str, Any]]:
        speculative = self.engine.draft_path is not None or self.engine_settings.spec.mode != "off"
        return [results.slot_json(s, speculative=speculative) for s in list(self.worker.slots)]
