"""localspec.chat without a model: templates as the models ship them, messages checked with
llama-server's texts, tool calls parsed from whole answers and from every cut of a stream."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localspec.chat import (
    ChatTemplate,
    MessageError,
    StreamParser,
    TemplateError,
    parse_chat_input,
    parse_message,
    tool_call_format,
)
from localspec.chat.toolcalls import StreamDelta

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
QWEN25 = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
QWEN3_CODER = (TEMPLATES / "qwen3-coder.jinja").read_text()
# SmolLM2-135M-Instruct's, as its GGUF carries it (tests/test_server_chat.py reads the file)
SMOLLM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def render(source: str, messages: list, **kw: object) -> str:
    chat = parse_chat_input(messages, tools=kw.pop("tools", None))
    text = ChatTemplate(source).render(chat.messages, tools=chat.tools or None, **kw)  # type: ignore[arg-type]
    return text + (chat.prefill or "")


# ---------------------------------------------------------------- templates


def test_smollm_template_renders_chatml_with_its_default_system_message() -> None:
    text = render(SMOLLM, [{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = render(SMOLLM, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_qwen_tools_are_written_as_plain_json_not_html_escaped() -> None:
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["description"] = "temperature <in> C & F"
    text = render(QWEN25, [{"role": "user", "content": "Paris?"}], tools=[tool])
    assert "\n<tools>\n" + json.dumps(tool, ensure_ascii=False) + "\n</tools>" in text
    assert "\\u003c" not in text and "<in> C & F" in text
    assert text.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_call_history_renders_in_each_models_format() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    qwen25 = render(QWEN25, history, tools=[WEATHER])
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
    ) in qwen25
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in qwen25
    coder = render(QWEN3_CODER, history, tools=[WEATHER])
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    ) in coder
    assert "<name>get_weather</name>" in coder


def test_template_errors_are_request_errors_and_the_sandbox_holds() -> None:
    refuses = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(TemplateError, match="System role not supported"):
        refuses.render([{"role": "user", "content": "x"}])
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="unsafe"):
        escape.render([])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_strftime_now_and_kwargs_reach_the_template() -> None:
    text = ChatTemplate("{{ strftime_now('%Y') }}|{{ enable_thinking }}").render(
        [], extra={"enable_thinking": False}
    )
    year, flag = text.split("|")
    assert year.isdigit() and len(year) == 4 and flag == "False"


def test_a_bos_the_tokenizer_adds_is_not_rendered_twice() -> None:
    tmpl = ChatTemplate("{{ bos_token }}[{{ messages[0]['content'] }}]", bos_token="<s>")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "<s>[x]"
    tmpl = ChatTemplate(tmpl.source, bos_token="<s>", add_bos=True)
    assert tmpl.render([{"role": "user", "content": "x"}]) == "[x]"


def test_a_last_assistant_message_is_continued() -> None:
    text = render(
        SMOLLM, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel")


def test_template_caps_and_tool_formats_come_from_the_source() -> None:
    assert ChatTemplate(QWEN25).caps.supports_tools and tool_call_format(QWEN25) == "hermes"
    assert tool_call_format(QWEN3_CODER) == "qwen3-coder"
    assert tool_call_format(SMOLLM) is None
    assert not ChatTemplate(SMOLLM).caps.supports_tool_calls


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("messages", "kw", "text"),
    [
        (None, {}, "'messages' is required"),
        ("hi", {}, "Expected 'messages' to be an array"),
        ([], {}, "'messages' must not be empty"),
        ([1], {}, "Failed to parse messages: Expected 'message' to be an object, got 1"),
        ([{"content": "x"}], {}, "Failed to parse messages: Missing 'role' in message"),
        ([{"role": "user"}], {}, "All non-assistant messages must contain 'content'"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant"}],
            {},
            "Assistant message must contain either 'content' or 'tool_calls'!",
        ),
        ([{"role": "user", "content": 3}], {}, "Expected 'content' to be a string or an array"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "image input is not supported - hint: if this is unexpected, you may need to "
            "provide the mmproj",
        ),
        (
            [{"role": "user", "content": [{"text": "x"}]}],
            {},
            "Failed to parse messages: Missing content part type",
        ),
        ([{"role": "user", "content": [{"type": "file"}]}], {}, "unsupported content[].type"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
             {"role": "assistant", "content": "b"}],
            {},
            "Cannot have 2 or more assistant messages at the end of the list.",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"continue_final_message": True},
            "Cannot set both add_generation_prompt and continue_final_message to true.",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}],
            {},
            "Failed to parse messages: Missing tool call name",
        ),
        ([{"role": "user", "content": "x"}], {"tools": {"a": 1}}, "Failed to parse tools"),
        (
            [{"role": "user", "content": "x"}],
            {"tools": [{"type": "retrieval"}]},
            "Failed to parse tools: Unsupported tool type",
        ),
    ],
)  # fmt: skip
def test_bad_messages_get_llama_servers_texts(messages: object, kw: dict, text: str) -> None:
    with pytest.raises(MessageError) as caught:
        parse_chat_input(messages, **kw)
    assert str(caught.value).startswith(text)


def test_messages_are_normalised_as_llama_cpp_hands_them_to_templates() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = {"type": "function", "id": "x", "function": {"name": "f", "arguments": '{"k": 1}'}}
    chat = parse_chat_input(
        [
            {"role": "developer", "content": parts},
            {"role": "user", "content": None},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok", "tool_call_id": "x"},
        ],
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    system, user, assistant, tool = chat.messages
    assert system == {"role": "system", "content": "a\nb"}
    assert user["content"] == ""
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"k": 1}}
    assert tool["tool_call_id"] == "x"
    assert chat.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert chat.parse_tool_calls
    assert not parse_chat_input([{"role": "user", "content": "x"}], tools=[WEATHER],
                                tool_choice="none").parse_tool_calls  # fmt: skip


# ---------------------------------------------------------------- tool calls

HERMES_ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)
CODER_ANSWER = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
SCHEMAS = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}}}


def test_hermes_tool_calls_become_openai_tool_calls() -> None:
    msg = parse_message(HERMES_ANSWER, "hermes", SCHEMAS)
    assert msg.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert msg.tool_calls[0].arguments == '{"city":"Paris","days":2}'
    assert len({c.id for c in msg.tool_calls}) == 2 and all(len(c.id) == 32 for c in msg.tool_calls)
    assert msg.to_json()["tool_calls"][0]["type"] == "function"


def test_qwen3_coder_parameters_are_typed_by_the_tool_schema() -> None:
    msg = parse_message(CODER_ANSWER, "qwen3-coder", SCHEMAS)
    assert msg.content == "I will look it up."
    (call,) = msg.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "1984", "days": 3}  # a string stays a string


def test_text_that_is_not_a_call_stays_content() -> None:
    for text in ("a <tool_call>not json</tool_call> b", "use <tool_ tags", "x</tool_call>"):
        assert parse_message(text, "hermes").content == text
        assert not parse_message(text, "hermes").tool_calls
    assert parse_message(HERMES_ANSWER, None).content == HERMES_ANSWER  # tools not offered
    # an answer cut off inside the call's block (EOS before the closing tag) still counts
    unclosed = parse_message('<tool_call>\n{"name": "f", "arguments": {}}', "hermes")
    assert [c.name for c in unclosed.tool_calls] == ["f"] and unclosed.content == ""


def _stream(text: str, fmt: str | None, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser = StreamParser(fmt, SCHEMAS)  # type: ignore[arg-type]
    deltas: list[StreamDelta] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        deltas.append(parser.feed(text[a:b]))
    deltas.append(parser.finish())
    calls = [(c.name, c.arguments) for d in deltas for _, c in d.tool_calls]
    indexes = [i for d in deltas for i, _ in d.tool_calls]
    assert indexes == list(range(len(indexes)))
    return "".join(d.content for d in deltas), calls


@pytest.mark.parametrize("fmt", ["hermes", "qwen3-coder"])
@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 11])
def test_streams_cut_anywhere_give_the_whole_answers_message(fmt: str, piece: int) -> None:
    text = HERMES_ANSWER if fmt == "hermes" else CODER_ANSWER
    text = "  " + text + "\n\nDone.  "
    whole = parse_message(text, fmt, SCHEMAS)  # type: ignore[arg-type]
    content, calls = _stream(text, fmt, list(range(0, len(text), piece)))
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(
            ["a", " ", "\n", "<tool_call>", "</tool_call>", "<tool_", "call>",
             '{"name": "f", "arguments": {"x": 1}}', "{bad", "<function=g>", "<parameter=x>",
             "</parameter>", "</function>", "7"]
        ),
        max_size=14,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    fmt=st.sampled_from(["hermes", "qwen3-coder", None]),
)  # fmt: skip
def test_any_text_streams_to_its_whole_parse(parts: list[str], cuts: list[int], fmt: str) -> None:
    text = "".join(parts)
    whole = parse_message(text, fmt, SCHEMAS)  # type: ignore[arg-type]
    content, calls = _stream(text, fmt, [c for c in cuts if c <= len(text)])
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


def test_the_stream_holds_back_what_may_start_a_call() -> None:
    parser = StreamParser("hermes")
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed("_call>").content == ""  # a block opens: nothing new to show
    delta = parser.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert delta.content == "" and [c.name for _, c in delta.tool_calls] == ["f"]
    assert parser.feed(" tail").content == "tail"
    assert parser.finish().content == ""
