"""Loading: clear errors for bad files, the pair check, the vocabulary's special ids."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    ModelLoadError,
    ModelSettings,
    PairMismatchError,
    PromptTooLongError,
    SamplingParams,
    SpecSettings,
    Task,
)
from localspec.engine.slot import SlotState
from tests.test_house import assert_serves

QWEN_FIM = (151659, 151661, 151660, 151662, 151663, 151664)


def small(path: Path, **model: Any) -> ModelSettings:
    return ModelSettings(str(path), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=1, **model)


def settings(target: Path, draft: Path | None = None, **kw: Any) -> EngineSettings:
    return EngineSettings(target=small(target), draft=None if draft is None else small(draft), **kw)


@pytest.fixture(scope="module")
def qwen_pair(qwen_target: Path, qwen_draft: Path) -> Engine:
    with Engine.load(settings(qwen_target, qwen_draft, n_slots=2)) as eng:
        yield eng


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=r"not found: .*nope\.gguf"):
        Engine.load(settings(path))


def test_not_gguf_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "page.gguf"
    path.write_text("<html>rate limited</html>")
    with pytest.raises(ModelLoadError, match=r"not a GGUF file: .*page\.gguf"):
        Engine.load(settings(path))


def test_truncated_file_names_the_path(tmp_path: Path, qwen_target: Path) -> None:
    path = tmp_path / "cut.gguf"
    with qwen_target.open("rb") as src:
        path.write_bytes(src.read(3_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        Engine.load(settings(path))


def test_bad_draft_file_is_a_load_error(tmp_path: Path, qwen_target: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing-draft"):
        Engine.load(settings(qwen_target, tmp_path / "missing-draft.gguf"))


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_pair_check_accepts_151936_with_152064(
    qwen_target: Path, qwen_target_152064: Path, pipeline: bool
) -> None:
    # the tiny draft is as fast as the tiny target: a pipelined target waits for its tokens.
    # Mode "draft": the draft model drafts every step, wherever auto's cost model (measured
    # times) or the random target's output (n-gram matches) would have put it
    spec = SpecSettings(mode="draft", pipeline=pipeline, pipeline_wait=2)
    with Engine.load(settings(qwen_target_152064, qwen_target, spec=spec)) as eng:
        assert eng.vocab.n_vocab == 152064
        assert eng.draft_path == str(qwen_target)
        prompt = eng.vocab.tokenize("def add(a, b):\n    return a + b\n")
        res = eng.generate(
            GenerationRequest(
                slot=0, prompt=prompt, n_predict=8, sampling=SamplingParams(top_k=1), spec_p_min=0.0
            )
        )
        assert len(res.tokens) == 8 and res.drafted["draft"].drafted > 0
        # a target-only padding id in the prompt turns the draft model off, not the request
        res = eng.generate(
            GenerationRequest(
                slot=0,
                prompt=[*prompt, 152000],
                n_predict=4,
                sampling=SamplingParams(top_k=1),
                spec_p_min=0.0,
            )
        )
        assert len(res.tokens) == 4 and "draft" not in res.drafted


def test_pair_check_rejects_a_changed_token(qwen_target: Path, qwen_changed_vocab: Path) -> None:
    with pytest.raises(PairMismatchError, match="token 1000 differs"):
        Engine.load(settings(qwen_target, qwen_changed_vocab))


def test_vocab_exposes_fim_eog_and_tokenizes_without_special(qwen_pair: Engine) -> None:
    v = qwen_pair.vocab
    f = v.fim
    assert (f.pre, f.suf, f.mid, f.pad, f.rep, f.sep) == QWEN_FIM
    assert {151643, 151662, 151663, 151664} <= v.eog
    assert not v.add_bos
    literal = v.tokenize("x = '<|fim_prefix|>'")
    assert 151659 not in literal
    assert v.tokenize("<|fim_prefix|>", special=True) == [151659]
    assert v.detokenize(literal) == "x = '<|fim_prefix|>'"
    assert v.piece(151659) == b"" and v.piece(151659, special=True) == b"<|fim_prefix|>"
    assert qwen_pair.n_ctx == 512 and qwen_pair.n_slots == 2 and qwen_pair.n_ctx_train > 0


def test_the_engine_serves_as_the_server_holds_it(qwen_pair: Engine) -> None:
    assert_serves(qwen_pair)


def test_a_slot_reports_its_request_from_queued_to_done(qwen_pair: Engine) -> None:
    """The slot object is what /slots, /metrics and slot choice read: its state through the
    request, then what its cache holds and what it served."""
    slot = qwen_pair.slots[1]
    assert slot.state is SlotState.IDLE and not slot.is_processing
    n_before = slot.n_requests
    states: list[SlotState] = []

    class Watch:  # checked between prompt pieces and before each token goes out
        def is_set(self) -> bool:
            states.append(slot.state)
            return False

    def run(prompt: list[int], n_predict: int) -> Task:
        req = GenerationRequest(slot=1, prompt=prompt, n_predict=n_predict, cache_prompt=False)
        task = Task([req], prefill_cancel=Watch(), on_token=lambda _i, _e: Watch().is_set())
        qwen_pair.submit(task)
        assert slot.state is SlotState.WAITING and slot.running == prompt
        while not task.done:
            qwen_pair.step()
        assert task.error is None
        return task

    warm = qwen_pair.vocab.tokenize("import os\nimport sys\n")
    run(warm, 0)
    assert states and set(states) == {SlotState.WARMING}
    assert slot.tokens == warm and slot.state is SlotState.IDLE
    states.clear()
    prompt = qwen_pair.vocab.tokenize("def add(a, b):\n    return")
    task = run(prompt, 4)
    assert SlotState.PROMPT in states and states[-1] is SlotState.GENERATING
    assert slot.state is SlotState.IDLE and not slot.running
    assert slot.tokens == qwen_pair.slot_tokens(1) and slot.tokens[: len(prompt)] == prompt
    assert slot.n_requests == n_before + 2 and slot.last_used > 0
    assert (slot.last_prompt_n, slot.last_cache_n) == (
        task.results[0].n_evaluated,
        task.results[0].n_cached,
    )
    qwen_pair.clear_slot(1)
    assert slot.tokens == [] == qwen_pair.slot_tokens(1)


def test_bad_requests_are_value_errors(qwen_pair: Engine) -> None:
    with pytest.raises(ValueError, match=r"Unknown sampler.* 'nope'"):
        qwen_pair.generate(
            GenerationRequest(slot=0, prompt=[1, 2], sampling=SamplingParams(samplers=("nope",)))
        )
    with pytest.raises(PromptTooLongError):
        qwen_pair.generate(GenerationRequest(slot=0, prompt=[1] * 600))
    with pytest.raises(ValueError, match="slot 5"):
        qwen_pair.generate(GenerationRequest(slot=5, prompt=[1]))
    with pytest.raises(ValueError, match="empty prompt"):
        qwen_pair.generate(GenerationRequest(slot=0, prompt=[]))


def test_generation_stops_when_the_slot_context_is_full(qwen_pair: Engine) -> None:
    prompt = qwen_pair.vocab.tokenize("x = 1\n" * 200)[:490]
    res = qwen_pair.generate(
        GenerationRequest(slot=1, prompt=prompt, n_predict=-1, sampling=SamplingParams(top_k=1))
    )
    assert res.stop_type in ("limit", "eos")
    assert len(qwen_pair.slot_tokens(1)) < qwen_pair.n_ctx
    if res.stop_type == "limit":
        assert len(prompt) + len(res.tokens) >= qwen_pair.n_ctx - 1


def test_n_predict_zero_fills_the_cache_only(qwen_pair: Engine) -> None:
    prompt = qwen_pair.vocab.tokenize("def f():\n    pass\n")
    res = qwen_pair.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    assert res.tokens == [] and res.text == "" and res.n_evaluated == len(prompt)
    assert qwen_pair.slot_tokens(0) == prompt


def test_flash_attention_is_off_on_the_cpu_unless_the_kv_cache_is_quantized(
    qwen_pair: Engine, qwen_target: Path, smollm_q4: Path
) -> None:
    """This build has no GPU: one slot takes the KQ matmul path (faster drafts to verify);
    several slots share one KV buffer, whose masked cells only flash attention skips, and a
    quantized V cache needs flash attention, so it is on there."""
    assert qwen_pair.n_slots == 2 and qwen_pair.flash_attn is True
    with Engine.load(EngineSettings(target=small(qwen_target))) as eng:
        assert eng.flash_attn is False
    # blocks of 32: SmolLM2's 64-wide heads, not Qwen's 16
    quantized = EngineSettings(target=small(smollm_q4, type_k="q8_0", type_v="q8_0"))
    with Engine.load(quantized) as eng:
        assert eng.flash_attn is True
    forced = EngineSettings(target=small(qwen_target, flash_attn=True))
    with Engine.load(forced) as eng:
        assert eng.flash_attn is True


def test_a_prefill_rule_apart_from_the_cancel_evaluates_the_prompt_then_stops(
    qwen_pair: Engine,
) -> None:
    """The server evaluates a left client's prompt on (the next keystroke needs it); nothing
    is generated for it. Without the separate rule a set cancel stops within one chunk."""
    prompt = qwen_pair.vocab.tokenize("def f(x):\n    return x + 1\n" * 40)
    assert len(prompt) > 2 * 128  # several prefill chunks
    gone = threading.Event()
    gone.set()
    req = GenerationRequest(slot=1, prompt=prompt, n_predict=8, cache_prompt=True)
    res = qwen_pair.generate(req, cancel=gone, prefill_cancel=threading.Event())
    assert res.cancelled and res.tokens == [] and res.n_evaluated == len(prompt)
    assert qwen_pair.slot_tokens(1) == prompt
    qwen_pair.clear_slot(1)
    res = qwen_pair.generate(req, cancel=gone)
    assert res.cancelled and res.tokens == [] and res.n_evaluated < len(prompt)


def test_a_quantized_model_decodes_batches_on_any_cpu(smollm_q4: Path) -> None:
    """A batch of several tokens on quantized weights, with the engine's default load
    parameters. On a CPU whose llama.cpp runs AMX kernels (Sapphire Rapids), the AMX weight
    buffer crashed the process here (llama.cpp #20824): the engine leaves it off there."""
    from localspec.engine.llama import cpu_runs_amx, model_params

    assert model_params(small(smollm_q4)).use_extra_bufts == (not cpu_runs_amx())
    with Engine.load(settings(smollm_q4)) as eng:
        prompt = eng.vocab.tokenize("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
        res = eng.generate(
            GenerationRequest(slot=0, prompt=prompt, n_predict=4, sampling=SamplingParams(top_k=1))
        )
        assert res.n_evaluated == len(prompt) > 2 and len(res.tokens) == 4
