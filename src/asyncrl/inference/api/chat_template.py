"""A chat body's messages and tools rendered by the served model's chat template: the one place it is done, in
the server's process or in a chat-body worker process (chat_processes.py)."""

from __future__ import annotations

from typing import Any

from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.protocol import ChatBody, check_unicode


def render_chat(tokenizer: Any, body: ChatBody) -> str:
    messages = [message.for_template() for message in body.messages]
    check_unicode({"messages": messages, "tools": body.tools}, "messages")
    try:
        return tokenizer.apply_chat_template(messages, tools=body.tools, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"messages do not fit the chat template: {error}", "messages") from None
