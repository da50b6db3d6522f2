"""``/v1/chat/completions`` and ``/apply-template``: the messages, rendered with the model's own
chat template, become prompt tokens of the same job ``/completion`` runs. The worker, the
engine's speculation (n-gram drafts from the prompt: an edit mostly repeats the code it was
given), the slot cache, cancellation, metrics and the request log all apply unchanged.

Which model answers: a second pair loaded for chat when the plan chose one, else the
completion model when its GGUF has a chat template; otherwise a 501 that says what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from localspec.chat import (
    ChatInput,
    MessageError,
    StreamParser,
    TemplateError,
    parse_chat_input,
    parse_message,
)
from localspec.engine.types import TokenEvent
from localspec.server import chatresults, dispatch, prompts
from localspec.server.chatmodel import ChatModel, chat_model
from localspec.server.errors import InvalidRequest, NotSupported
from localspec.server.requests import N_PROBS_LIMIT, ChatCompletionRequest
from localspec.server.results import CompactJSONResponse, completion_probabilities, timings
from localspec.server.worker import Job, JobResult

if TYPE_CHECKING:
    from localspec.server.state import Service

ENDPOINT = "v1/chat/completions"
DEFAULT_TOP_LOGPROBS = 20  # llama-server's, when logprobs is asked without top_logprobs
DONE = b"data: [DONE]\n\n"


def chat_side(svc: Service) -> tuple[Service, ChatModel]:
    """The service that answers chat and its chat model, or a 501 naming what to change."""
    if svc.chat_service is not None:
        side = svc.chat_service
        if side.worker.state == "failed":
            raise NotSupported(
                f"Chat is not available: the chat model ({side.model_name}) failed to load: "
                f"{side.worker.error}"
            )
    elif svc.settings.chat_refusal:
        raise NotSupported(svc.settings.chat_refusal)
    else:
        side = svc
    model = chat_model(side.engine)
    if not model.serves_chat:
        why = (
            f"its chat template is unusable ({model.problem})"
            if model.problem
            else ("its GGUF has no chat template (a completion-only model)")
        )
        raise NotSupported(
            f"Chat is not supported by this model ({side.model_name}): {why}. Serve an "
            "instruct model for chat: `localspec up --chat-target INSTRUCT.gguf`, or set "
            "models.chat_pair to an instruct pair (`localspec models` lists them)"
        )
    return side, model


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    """What a client may ask that localspec cannot do is a 400 that says so (as an unknown
    sampler name is): silently ignoring it would break its caller."""
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in (None, "", "text", "json_object", "json_schema"):
            raise InvalidRequest(
                f'response_format type must be one of "text" or "json_object", but got: {kind}'
            )
    if body.json_schema is not None and body.grammar:
        raise InvalidRequest("Cannot use both json_schema and grammar")
    if body.tools and (body.grammar or _schema(body) is not None):
        # the tool-call format is the template's, not the grammar's (llama-server's text)
        raise InvalidRequest("Cannot use custom grammar constraints with tools.")
    if body.logprobs and body.tools and body.stream:
        raise InvalidRequest("logprobs is not supported with tools + stream")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be set to true")


def _schema(body: ChatCompletionRequest) -> Any:
    """The JSON schema the answer must match, as llama-server reads it: ``json_schema``, or
    ``response_format`` ``json_object`` (its ``schema``, else any object) or ``json_schema``
    (``json_schema.schema``, else any object); None: no schema."""
    schema = body.json_schema
    fmt = body.response_format
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        if "schema" in fmt or schema is None:
            schema = fmt.get("schema") or {}
    elif kind == "json_schema":
        wrapper = fmt.get("json_schema")
        schema = (wrapper.get("schema") if isinstance(wrapper, dict) else None) or {}
    return schema


def _constrained(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """The body with its response format as the ``json_schema`` the sampler's grammar comes
    from (``Service.params`` converts and checks it once per distinct schema)."""
    schema = _schema(body)
    if schema is body.json_schema:
        return body
    return body.model_copy(update={"json_schema": schema})


def chat_input(body: ChatCompletionRequest) -> ChatInput:
    """The request's messages and tools, checked (400 with llama-server's texts)."""
    _refuse_unsupported(body)
    try:
        return parse_chat_input(
            body.messages,
            tools=body.tools,
            tool_choice=body.tool_choice,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
    except MessageError as exc:
        raise InvalidRequest(str(exc)) from None


def render(model: ChatModel, chat: ChatInput, body: ChatCompletionRequest) -> str:
    """The prompt text: the template's rendering, then the continued assistant text."""
    assert model.template is not None
    try:
        text = model.template.render(
            chat.messages,
            tools=chat.tools or None,
            add_generation_prompt=chat.add_generation_prompt,
            extra=body.chat_template_kwargs,
        )
    except TemplateError as exc:
        raise InvalidRequest(str(exc)) from None
    return text + (chat.prefill or "")


def _with_logprobs(body: ChatCompletionRequest) -> ChatCompletionRequest:
    if not body.logprobs:
        return body
    n = DEFAULT_TOP_LOGPROBS if body.top_logprobs is None else body.top_logprobs
    return body.model_copy(update={"n_probs": min(max(n, 1), N_PROBS_LIMIT)})


async def apply_template(body: ChatCompletionRequest, request: Request, svc: Service) -> Response:
    """llama-server's ``/apply-template``: the prompt a chat request would run, as text."""
    try:
        _side, model = chat_side(svc)
        prompt = render(model, chat_input(body), body)
    except Exception as exc:
        return dispatch.error_response(exc, request)
    return CompactJSONResponse({"prompt": prompt})


async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Service) -> Response:
    try:
        side, model = chat_side(svc)
        chat = chat_input(body)
        prompt = render(model, chat, body)
        params = side.params(_with_logprobs(_constrained(body)))
    except Exception as exc:
        return dispatch.error_response(exc, request)
    side.spec.begin(request, body)
    # the prompt as llama-server tokenizes a chat prompt: special tokens parsed, BOS added
    # when the vocabulary adds one; too long for the context: a 400 (exceed_context_size)
    job = Job(params, prompts.completion(prompt, cache=side.token_cache))
    fmt = model.tool_format if chat.parse_tool_calls else None
    schemas = chat.tool_schemas()
    cmpl_id = chatresults.chat_id()
    name = side.model_name
    piece = side.engine.vocab.piece

    # a continued assistant message: the answer carries its text, as llama-server's does
    prefill = chat.prefill or ""

    if not params.stream:

        def render_answer(result: JobResult) -> Any:
            done = dispatch.answered(result)
            messages = [parse_message(prefill + d.result.text, fmt, schemas) for d in done]
            return chatresults.chat_completion(
                done, messages, model=name, cmpl_id=cmpl_id, piece=piece
            )

        return await dispatch.respond(side.pending(request, ENDPOINT, job), render_answer)

    parsers: dict[int, StreamParser] = {}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def events(index: int, delta: Any, logprobs: list[dict[str, Any]] | None) -> list[Any]:
        out = []
        if index not in parsers:  # the first event of a completion names the role
            parsers[index] = StreamParser(fmt, schemas)
            out.append(chatresults.ROLE_DELTA)
            if prefill:
                begun = parsers[index].feed(prefill)
                out += chatresults.deltas(begun.content, begun.tool_calls)
        if delta is not None:
            out += chatresults.deltas(delta.content, delta.tool_calls)
        return [
            chatresults.chunk(
                cmpl_id=cmpl_id,
                model=name,
                index=index,
                delta=d,
                logprobs=logprobs if k == len(out) - 1 else None,
            )
            for k, d in enumerate(out)
        ]

    def partial(index: int, event: TokenEvent) -> list[Any]:
        first = index not in parsers
        head = events(index, None, None) if first else []
        delta = parsers[index].feed(event.text)
        probs = (
            completion_probabilities([event.token], [event.probs], piece)
            if event.probs is not None
            else None
        )
        return head + events(index, delta, probs)

    def final(result: JobResult) -> list[Any]:
        done = dispatch.answered(result)
        out: list[Any] = []
        for d in done:
            head = events(d.index, None, None) if d.index not in parsers else []
            parser = parsers[d.index]
            tail = events(d.index, parser.finish(), None)
            out += head + tail
            out.append(
                chatresults.chunk(
                    cmpl_id=cmpl_id,
                    model=name,
                    index=d.index,
                    delta={},
                    finish=chatresults.finish_reason(d.result, parser.message()),
                )
            )
        if include_usage:
            out.append(chatresults.usage_chunk(done, cmpl_id=cmpl_id, model=name))
        if out and done:
            out[-1]["timings"] = timings(done[0].result)
        return out

    return await dispatch.respond_stream(side.pending(request, ENDPOINT, job), partial, final, DONE)
