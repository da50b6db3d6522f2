"""The one translation of the user's Settings (``localspec/settings.py``) into what each part
takes: the planner's PlanSettings, the engine's EngineSettings (from a Plan or from GGUF files
given on the command line), the daemon's ServerSettings and the team backend's
UpstreamSettings.

Each part keeps plain values of its own and reads no settings model; this module is the only
place that reads one to build them, so every default lives in the model and every rule is
checked once, by the model's validators. It sits above the planner, the engine's data and
the server's (``localspec up`` and ``localspec plan`` call it).
"""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any

from localspec import paths
from localspec.planning.host_cache import host_cache_budget, plan_free_bytes
from localspec.planning.inputs import PlanSettings, Speculation, is_allowed
from localspec.planning.result import Plan
from localspec.planning.types import PlanError
from localspec.settings import Settings

# The engine's package loads llama.cpp and the server's FastAPI: each is imported where its
# settings are built, so the CLI starts without them.
if TYPE_CHECKING:
    from localspec.catalog import FimText
    from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
    from localspec.server.options import ServerSettings
    from localspec.server.upstream.config import UpstreamSettings

FilePath = str | PathLike[str]


def speculation(settings: Settings) -> Speculation:
    """The ``speculative`` section as the plan carries it."""
    spec = settings.speculative
    return Speculation(mode=spec.mode, n_max=spec.n_max, n_min=spec.n_min, p_min=spec.p_min)


def plan_inputs(settings: Settings, **overrides: Any) -> PlanSettings:
    """What the settings ask of a plan (models.*, limits.*, server.slots, speculative.*,
    cache.reuse_chunk, cache.exact_ms). A pinned models.pair is the only pair considered.
    ``overrides`` set PlanSettings fields no settings key holds (concurrent_sessions=500).
    Raises PlanError when models.pair or models.chat_pair is outside models.allowed."""
    models, limits, spec = settings.models, settings.limits, settings.speculative
    allowed = tuple(models.allowed)
    chat_pair = models.chat_pair
    if chat_pair and not is_allowed(allowed, chat_pair):
        raise PlanError(f"models.chat_pair {chat_pair!r} is not in models.allowed {list(allowed)}")
    if models.pair:
        if not is_allowed(allowed, models.pair):
            raise PlanError(f"models.pair {models.pair!r} is not in models.allowed {list(allowed)}")
        allowed = (models.pair,)
    cap = limits.gpu_memory_gb
    return PlanSettings(
        allowed=allowed,
        pair=models.pair,
        context=limits.context,
        min_context=min(4096, limits.context) if limits.context else 4096,
        n_slots=settings.server.slots,
        gpu_memory_cap_bytes=int(cap * 1e9) if cap else None,
        threads=limits.threads,
        spec_n_max=spec.n_max,
        draft_models=spec.mode not in ("off", "ngram"),
        speculative=speculation(settings),
        cache_reuse=settings.cache.reuse_chunk,
        cache_exact_ms=settings.cache.exact_ms,
        chat=models.chat,
        chat_pair=chat_pair,
        chat_allowed=tuple(models.allowed),
        **overrides,
    )


def spec_settings(asked: Speculation, *, has_draft: bool) -> SpecSettings:
    """The engine's speculative settings; without a draft model, n-grams stand in for it."""
    from localspec.engine.types import SpecSettings

    if not has_draft:
        asked = asked.without_draft_model()
    return SpecSettings(mode=asked.mode, n_max=asked.n_max, n_min=asked.n_min, p_min=asked.p_min)


# ``speculative.pipeline`` as SpecSettings.pipeline (None: the engine decides from the cores)
PIPELINE: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def with_speculation_extras(engine: EngineSettings, settings: Settings) -> EngineSettings:
    """The engine's settings with what the plan does not carry: recording rejected drafts,
    the acceptance rule (``speculative.record_rejections``, ``speculative.accept*``) and
    whether the draft runs on its own thread (``speculative.pipeline``)."""
    import dataclasses

    spec = settings.speculative
    return dataclasses.replace(
        engine,
        spec=dataclasses.replace(
            engine.spec,
            record_rejections=spec.record_rejections,
            accept=spec.accept,
            accept_top_k=spec.accept_top_k,
            accept_p_min=spec.accept_p_min,
            by_language=spec.by_language,
            entropy_max=spec.entropy_max,
            ngram_agree=spec.ngram_agree,
            draft_cost_max=spec.draft_cost_max,
            weigh_sources=spec.weigh_sources,
            learn_p_min=spec.learn_p_min,
            pipeline=PIPELINE[spec.pipeline],
        ),
    )


def plan_engine_settings(
    plan: Plan,
    target_path: FilePath,
    draft_path: FilePath | None = None,
    *,
    n_slots: int | None = None,
    host_cache_gb: float | None = None,
) -> EngineSettings:
    """What the engine loads for ``plan``. n_ctx is per slot (the engine multiplies by
    n_slots); the draft lives whole on one GPU: a split with all of it on ``draft_gpu``.
    ``n_slots``: the plan's, unless given (a chat pair serves as many slots as the completion
    pair it stands beside). ``host_cache_gb`` is ``cache.ram_gb`` (None: sized from the memory
    the plan leaves free)."""
    from localspec.engine.types import EngineSettings, ModelSettings

    def model(path: FilePath, ngl: int, split: tuple[float, ...] | None, gpu: int) -> ModelSettings:
        return ModelSettings(
            path=str(path),
            n_gpu_layers=ngl,
            n_ctx=plan.n_ctx,
            n_batch=plan.n_batch,
            n_ubatch=plan.n_ubatch,
            flash_attn=plan.flash_attn,
            type_k=plan.type_k,
            type_v=plan.type_v,
            n_threads=plan.n_threads,
            n_threads_batch=plan.n_threads_batch,
            main_gpu=gpu,
            tensor_split=split,
        )

    if plan.draft is not None and draft_path is None:
        raise PlanError(f"the plan uses the draft {plan.draft[0]}; give its GGUF path")
    draft = None
    if plan.draft and draft_path:
        n_gpus = len(plan.tensor_split or ())
        gpu = plan.draft_gpu or 0
        pin = tuple(float(i == gpu) for i in range(n_gpus)) if n_gpus > 1 else None
        draft = model(draft_path, plan.draft_ngl, pin, gpu)
    return EngineSettings(
        target=model(target_path, plan.target_ngl, plan.tensor_split, 0),
        draft=draft,
        n_slots=plan.n_slots if n_slots is None else n_slots,
        spec=spec_settings(plan.speculative, has_draft=draft is not None),
        cache_reuse=plan.cache_reuse,
        exact_ms=plan.cache_exact_ms,
        host_cache_bytes=host_cache_budget(plan_free_bytes(plan.memory), host_cache_gb),
    )


def file_model_settings(
    settings: Settings, path: FilePath, *, gpu_layers: int, flash_attn: bool | None
) -> ModelSettings:
    """A GGUF given on the command line (``up --target``): the plan's choices left to
    llama.cpp's defaults, the context and threads from ``limits``."""
    from localspec.engine.types import ModelSettings

    limits = settings.limits
    return ModelSettings(
        path=str(path),
        n_gpu_layers=gpu_layers,
        flash_attn=flash_attn,
        n_ctx=limits.context or ModelSettings.n_ctx,
        n_threads=limits.threads,
        n_threads_batch=limits.threads,
    )


def file_engine_settings(
    settings: Settings,
    target: ModelSettings,
    draft: ModelSettings | None,
    *,
    host_cache: bool = True,
) -> EngineSettings:
    """What the engine loads for GGUF files given on the command line (no plan); without
    ``cache.ram_gb`` the host cache is sized when the models are loaded, from the memory
    free then (``host_cache`` False: none, for a second, chat pair)."""
    from localspec.engine.types import EngineSettings

    ram_gb = settings.cache.ram_gb
    return EngineSettings(
        target=target,
        draft=draft,
        n_slots=settings.server.slots or 1,
        spec=spec_settings(speculation(settings), has_draft=draft is not None),
        cache_reuse=settings.cache.reuse_chunk,
        exact_ms=settings.cache.exact_ms,
        gpu_memory_cap=gpu_memory_cap(settings),
        host_cache_bytes=(
            (None if ram_gb is None else host_cache_budget(0, ram_gb)) if host_cache else 0
        ),
    )


def gpu_memory_cap(settings: Settings) -> int | None:
    """``limits.gpu_memory_gb`` in bytes (decimal GB, as the plan reads it); None: no cap."""
    cap = settings.limits.gpu_memory_gb
    return int(cap * 1e9) if cap else None


def server_settings(
    settings: Settings,
    *,
    api_key: str | None,
    model_alias: str | None = None,
    chat_alias: str | None = None,
    chat_refusal: str | None = None,
) -> ServerSettings:
    """The daemon's settings: ``api_key`` as ``settings.check_security`` resolved it,
    the names and the chat refusal as ``up`` decided them. (``server.slots`` goes to the plan,
    or to the engine's settings: the engine's slot count is the server's.)"""
    from localspec import rejections
    from localspec.server.options import ServerSettings

    server, cache = settings.server, settings.cache
    return ServerSettings(
        host=server.host,
        port=server.port,
        api_key=api_key,
        queue_limit=server.queue_limit,
        slot_choice=server.slot_choice,
        request_timeout_s=server.request_timeout_s,
        metrics=server.metrics,
        cors_origins=tuple(server.cors_origins),
        model_alias=model_alias,
        n_cmpl_max=server.n_cmpl_max,
        max_body_bytes=server.max_body_bytes,
        body_timeout_s=server.body_timeout_s,
        max_connections=server.max_connections,
        spm_infill=server.spm_infill,
        infill_layout=cache.infill_layout,
        ring_attention=cache.ring_attention,
        infill_window=cache.infill_window,
        jump_policy=cache.jump_policy,
        slot_save_path=server.slot_save_path,
        context_dir=paths.cache_dir() / "contexts" if cache.restart_gb > 0 else None,
        context_bytes=int(cache.restart_gb * (1 << 30)),
        chat_refusal=chat_refusal,
        chat_alias=chat_alias,
        rejections_path=str(rejections.default_path())
        if settings.speculative.record_rejections
        else None,
        rejections_max_bytes=settings.speculative.rejections_max_mb * 1024 * 1024,
    )


def upstream_settings(
    settings: Settings,
    *,
    api_key: str | None,
    fim: FimText | None = None,
    fim_model: str | None = None,
) -> UpstreamSettings | None:
    """The ``backend`` section as the server takes it; None for kind local. ``api_key`` as
    ``settings.check_backend`` resolved it; ``fim``/``fim_model``: the catalog model whose
    FIM tokens lay out the openai kind's prompts."""
    from localspec.server.upstream.config import UpstreamSettings

    backend = settings.backend
    if backend.kind == "local":
        return None
    assert backend.url is not None  # the settings' own rule
    return UpstreamSettings(
        kind=backend.kind,
        url=backend.url,
        api_key=api_key,
        ca_bundle=str(backend.ca_bundle.expanduser()) if backend.ca_bundle else None,
        model=backend.model,
        fim=fim,
        fim_model=fim_model,
        slot=backend.slot,
        connect_timeout_s=backend.connect_timeout_s,
        read_timeout_s=backend.read_timeout_s,
        fallback=backend.fallback,
        fallback_ms=backend.fallback_ms,
        health_interval_s=backend.health_interval_s,
    )
