"""Tool calls in the Qwen / Hermes convention, which our built-in ChatML template uses too: the assistant writes
each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen's templates put a newline inside
each tag, ours does not; both read the same).

`ToolCallParser` turns an assistant's text into OpenAI's `content` and `tool_calls`, piece by piece as a stream
delivers it or all at once, with the same result either way. `ToolCallFormat` is what the server learns of a
chat template: whether it uses the convention at all, and how it opens a call (to start the assistant's turn
with one, for `tool_choice` "required" or a named function).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPENER, CLOSER = "<tool_call>", "</tool_call>"
PROBE_NAME = "asyncrl_probe"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(block: str, names: frozenset[str]) -> ToolCall | None:
    """The call a `<tool_call>...</tool_call>` block holds: a JSON object with the `name` of one of the request's
    tools and an object of `arguments` (or `parameters`, as some models write). Anything else is not a call."""
    try:
        value = json.loads(block[len(OPENER) : -len(CLOSER)])
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """An assistant's text, fed in pieces, split into content and tool calls. The content is the text with each
    valid call block cut out; a block that is not a valid call stays in it as written, and so does a block left
    open when the text ends. Content that is only whitespace is dropped when there are calls (the newlines
    around them), so a stream holds whitespace back until it is followed by other text. Text that may still
    become an opening tag is held back too, until it is settled."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        self._held = ""  # text not settled yet: a possible or open call block
        self._blank = ""  # whitespace seen before any other content
        self._started = False  # some content other than whitespace was given out

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add text; returns the content now settled, and the calls now complete."""
        self._held += text
        content, calls = [], []
        while True:
            start = self._held.find(OPENER)
            if start < 0:
                keep = _partial_opener(self._held)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            end = self._held.find(CLOSER, start)
            content.append(self._held[:start])
            if end < 0:
                self._held = self._held[start:]
                break
            block = self._held[start : end + len(CLOSER)]
            call = read_call(block, self.names)
            if call is None:
                content.append(block)
            else:
                calls.append(call)
            self._held = self._held[end + len(CLOSER) :]
        self.calls += calls
        return self._content("".join(content)), calls

    def finish(self) -> str:
        """The text ends: the content still held back."""
        held, self._held = self._held, ""
        content = self._content(held)
        if not self._started and not self.calls:
            content, self._blank = self._blank + content, ""
        return content

    def _content(self, text: str) -> str:
        if self._started:
            return text
        if not text.strip():
            self._blank += text
            return ""
        self._started = True
        text, self._blank = self._blank + text, ""
        return text


def split_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """The content (None when calls leave none) and the calls of a whole assistant text."""
    parser = ToolCallParser(names)
    content, _ = parser.feed(text)
    content += parser.finish()
    return (content or None) if parser.calls else content, parser.calls


def _partial_opener(text: str) -> int:
    """The length of the longest end of `text` that OPENER starts with."""
    for length in range(min(len(OPENER) - 1, len(text)), 0, -1):
        if text.endswith(OPENER[:length]):
            return length
    return 0


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat template writes tool calls: `opening` is the text before a call's JSON (`<tool_call>` for our
    template, `<tool_call>\\n` for Qwen's)."""

    opening: str

    @classmethod
    def of(cls, tokenizer: Any) -> ToolCallFormat | None:
        """The format of the tokenizer's chat template, or None when it does not use `<tool_call>`. The opening
        is learnt by rendering a probe conversation with one call; a template that lists tools but does not
        write an assistant's calls gets the bare tag."""
        template = tokenizer.chat_template
        if not isinstance(template, str) or OPENER not in template:
            return None
        call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": {}}}
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe writes no calls of its own
            return cls(OPENER)
        start = text.rfind(OPENER)
        end = text.find("{", start)
        if start < 0 or end < 0 or text[start + len(OPENER) : end].strip():
            return cls(OPENER)
        return cls(text[start:end])

    def prefill(self, function: str | None) -> str:
        """The start of an assistant turn that calls a tool: any tool (`function` None) or the named one, whose
        arguments the model then writes."""
        if function is None:
            return self.opening
        return f'{self.opening}{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments": '
