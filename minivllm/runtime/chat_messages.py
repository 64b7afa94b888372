"""OpenAI-style chat messages read as the chat template reads them: vLLM's parse_chat_messages
for a template that takes string content (Qwen3's), shared by LLM.chat and the server's chat
endpoint, so that both refuse and render a message alike."""

from __future__ import annotations

import json

# The content parts vLLM's chat parser reads as text, and the key each holds its text under.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}


def chat_message(message, where: str) -> dict:
    """One OpenAI-style chat message as the chat template reads it: vLLM's parse_chat_messages
    for a template that takes string content (Qwen3's). Content None or missing is "", a list
    of text parts (or strings) is their texts joined by newlines (an empty or null text is no
    part); an assistant's "reasoning" is also its "reasoning_content" (the name Qwen3's
    template reads); earlier tool calls' JSON string arguments become objects (null, "" or a
    number: {}), and an empty or null tool_calls is dropped. Other keys (name,
    tool_call_id, ...) pass through. `where` names the message in errors ("messages[2]"): one
    that is not a dict, or whose role or content has the wrong type, is a TypeError; a missing
    role, a part that is not text (this engine reads text only) or arguments that are not
    JSON, a ValueError."""
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be an object with 'role' and 'content', got "
                        f"{type(message).__name__}")
    if "role" not in message:
        raise ValueError(f"{where} has no 'role'")
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError(f"{where}.role must be a string, got {type(role).__name__}")
    out = {**message, "content": _content_text(message.get("content"), where)}
    if role == "assistant" and isinstance(out.get("reasoning"), str):
        out["reasoning_content"] = out["reasoning"]  # vLLM's: "reasoning" wins
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    else:
        out["tool_calls"] = _history_calls(out["tool_calls"], where)
    return out


def read_conversations(messages) -> list[list[dict]]:
    """LLM.chat's messages, one conversation (a list of messages) or a list of them (told apart
    as vLLM does: by whether the first item is a list), as conversations of chat_message's
    messages; all checked before any is rendered."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a "
                         "list of such lists")
    if not isinstance(messages[0], (list, tuple)):
        return [[chat_message(m, f"messages[{k}]") for k, m in enumerate(messages)]]
    conversations = []
    for i, conv in enumerate(messages):
        if not isinstance(conv, (list, tuple)):
            raise TypeError(f"messages[{i}] must be a conversation (a list of messages), as "
                            f"messages[0] is, got {type(conv).__name__}")
        conversations.append([chat_message(m, f"messages[{i}][{k}]")
                              for k, m in enumerate(conv)])
    return conversations


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{where}.content must be a string, an array of text parts or null, "
                        f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            shown = repr(kind) if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: only text parts are supported (this "
                             f"model reads text only), got {shown}")
        text = part.get(_TEXT_PARTS[kind])
        if text is not None and not isinstance(text, str):
            raise TypeError(f"{where}.content[{j}].{_TEXT_PARTS[kind]} must be a string, got "
                            f"{type(text).__name__}")
        texts.append(text)
    return "\n".join(t for t in texts if t)  # vLLM's: an empty or null text is no part


def _history_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, their arguments as objects for the chat
    template (Qwen3's writes them as JSON; vLLM parses them the same way)."""
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"{where}.tool_calls must be an array, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', "
                             f"'function': {{'name', 'arguments'}}}}")
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):  # broken, or nested too deep
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments is not JSON: "
                                 f"{arguments!r:.80}") from None
        elif not isinstance(arguments, (dict, list)):  # null, "", a number: none (vLLM's)
            arguments = {}
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out
