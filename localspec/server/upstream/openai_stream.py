"""An OpenAI completion stream turned into llama-server's answers (pure: no HTTP).

Each streamed text piece goes through the same stop rules local serving applies
(``engine/stops.py``: stop strings, ``n_indent``, ``t_max_predict_ms``), one set per choice,
started at the choice's first piece (llama-server times ``t_max_predict_ms`` from the start of
generation). Once every choice has stopped the caller closes the stream, and the upstream
stops generating.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localspec.engine.stops import StopRules
from localspec.engine.types import GenerationResult, StopType
from localspec.server import results
from localspec.server.requests import TaskParams
from localspec.server.results import FinishedCompletion

Clock = Callable[[], float]


@dataclass
class Choice:
    index: int
    rules: StopRules | None = None  # from the first piece on
    pieces: int = 0  # streamed pieces (one token each, as vLLM and llama-server stream)
    text: str = ""  # the final text (once done)
    stop_type: StopType = "none"
    stopping_word: str = ""
    done: bool = False
    by_upstream: bool = False  # the upstream ended it (finish_reason), not a rule here
    t_first: float = 0.0
    t_end: float = 0.0


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int | None = None


@dataclass
class Collector:
    """The choices of one upstream stream, fed chunk by chunk."""

    params: TaskParams
    end: tuple[str, ...] = ()  # texts that end a completion (reported as "eos")
    clock: Clock = time.perf_counter
    t_sent: float = field(default_factory=time.perf_counter)
    usage: Usage = field(default_factory=Usage)
    choices: dict[int, Choice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in range(self.params.n_cmpl):
            self.choices[i] = Choice(i)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices.values())

    @property
    def upstream_finished(self) -> bool:
        """Every choice ended by the upstream itself: its usage report is on its way (worth
        the few bytes); otherwise the stream is closed at once and the upstream stops."""
        return all(c.by_upstream for c in self.choices.values())

    def feed(self, chunk: dict[str, Any]) -> list[tuple[int, str]]:
        """One parsed ``data:`` object; returns the text that became final, per choice."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        out: list[tuple[int, str]] = []
        for item in chunk.get("choices") or ():
            if not isinstance(item, dict):
                continue
            choice = self.choices.get(int(item.get("index") or 0))
            if choice is None or choice.done:
                continue
            text = item.get("text")
            if isinstance(text, str) and text:
                final = self._piece(choice, text)
                if final:
                    out.append((choice.index, final))
            reason = item.get("finish_reason")
            if reason and not choice.done:
                choice.by_upstream = True
                tail = self._finish(choice, "eos" if reason == "stop" else "limit")
                if tail:
                    out.append((choice.index, tail))
        return out

    def close(self) -> list[tuple[int, str]]:
        """The stream ended ([DONE]): every choice still open ends here."""
        out = []
        for choice in self.choices.values():
            if not choice.done:
                tail = self._finish(choice, "none")
                if tail:
                    out.append((choice.index, tail))
        return out

    def _piece(self, choice: Choice, text: str) -> str:
        now = self.clock()
        r = self.params.request
        if choice.rules is None:
            choice.t_first = now
            choice.rules = StopRules(  # n_predict: the upstream's max_tokens (it counts tokens)
                stop=(*r.stop, *self.end),
                n_indent=r.n_indent,
                t_max_predict_ms=r.t_max_predict_ms,
                clock=self.clock,
            )
        choice.pieces += 1
        if r.n_predict == 0:  # a warm-up: the prompt is evaluated, the token is not wanted
            choice.done, choice.stop_type, choice.t_end = True, "limit", now
            return ""
        step = choice.rules.push(text.encode("utf-8"), is_eog=False)
        if not step.stop:
            return step.text
        out = step.text + choice.rules.flush()  # as the engine: held-back text is final now
        self._finish(choice, choice.rules.stop_type)
        return out

    def _finish(self, choice: Choice, stop_type: StopType) -> str:
        """End a choice: the upstream finished it (``stop_type`` from its finish_reason), the
        stream ended, or a stop rule here did (the rule's type wins)."""
        tail = ""
        rules = choice.rules
        if rules is not None:
            if rules.stop_type == "none":
                tail = rules.flush()
            else:
                stop_type, choice.stopping_word = rules.stop_type, rules.stopping_word
            choice.text = rules.text
        if stop_type == "word" and choice.stopping_word in self.end:
            stop_type, choice.stopping_word = "eos", ""  # an end token the upstream rendered
        choice.stop_type = stop_type
        choice.done = True
        choice.t_end = self.clock()
        return tail

    def _usage(self, usage: dict[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.usage.prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.usage.cached_tokens = details["cached_tokens"]
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            self.usage.completion_tokens = completion

    # ------------------------------------------------------------------ answers

    def _result(self, choice: Choice) -> tuple[GenerationResult, int]:
        t_first = choice.t_first or choice.t_end or self.clock()
        u = self.usage
        result = GenerationResult(
            tokens=[],
            text=choice.text,
            stop_type=choice.stop_type,
            stopping_word=choice.stopping_word,
            n_prompt=u.prompt_tokens,
            n_cached=u.cached_tokens,
            n_evaluated=max(0, u.prompt_tokens - u.cached_tokens),
            prompt_ms=(t_first - self.t_sent) * 1e3,
            predicted_ms=max(0.0, ((choice.t_end or t_first) - t_first) * 1e3),
        )
        n_predicted = 0 if self.params.request.n_predict == 0 else choice.pieces
        if u.completion_tokens is not None and self.params.n_cmpl == 1 and choice.done:
            n_predicted = min(n_predicted, u.completion_tokens) if n_predicted else 0
        return result, n_predicted

    def finals(
        self, *, model: str, stream: bool, prompt_text: str = "", id_slot: int = 0
    ) -> list[dict[str, Any]]:
        """llama-server's final object per choice (``results.final_object``)."""
        out = []
        for choice in self.choices.values():
            result, n_predicted = self._result(choice)
            done = FinishedCompletion(
                result,
                choice.index,
                id_slot,
                tokens_cached=result.n_prompt + n_predicted,
                prompt_text=prompt_text,
            )
            obj = results.final_object(
                done,
                model=model,
                settings_json=self.params.settings_json,
                stream=stream,
                n_predicted=n_predicted,
            )
            fields = self.params.response_fields
            out.append(results.pick_fields(fields, obj) if fields else obj)
        return out

    def partial(self, index: int, text: str, *, id_slot: int = 0) -> dict[str, Any]:
        choice = self.choices[index]
        return results.partial_object(
            index=index,
            content=text,
            tokens=[],
            id_slot=id_slot,
            n_decoded=choice.pieces,
            n_prompt=self.usage.prompt_tokens,
        )
