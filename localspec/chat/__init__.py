"""Chat as the model knows it: its own chat template, the messages it reads, the tool calls it
writes. Pure Python (jinja2, json): no llama.cpp and no HTTP here, so the server, the
benchmarks and the tests share one rendering and one parser.

- ``template.py``: ``ChatTemplate``, the GGUF's ``tokenizer.chat_template`` rendered with jinja2
  in a sandbox, with the variables Hugging Face and llama.cpp templates expect.
- ``messages.py``: OpenAI ``messages`` and ``tools`` checked and normalised, with llama-server's
  error texts.
- ``toolcalls.py``: tool calls in the model's own format (Qwen2.5's ``<tool_call>{json}``,
  Qwen3-Coder's ``<function=...>``) parsed into OpenAI ``tool_calls``, also while streaming.
"""

from localspec.chat.messages import ChatInput, MessageError, parse_chat_input
from localspec.chat.template import ChatTemplate, TemplateError
from localspec.chat.toolcalls import (
    ChatMessage,
    StreamParser,
    ToolCall,
    ToolCallFormat,
    parse_message,
    tool_call_format,
)

__all__ = [
    "ChatInput",
    "ChatMessage",
    "ChatTemplate",
    "MessageError",
    "StreamParser",
    "TemplateError",
    "ToolCall",
    "ToolCallFormat",
    "parse_chat_input",
    "parse_message",
    "tool_call_format",
]
