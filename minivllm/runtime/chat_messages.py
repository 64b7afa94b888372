"""OpenAI-style chat messages read as the chat template reads them: vLLM's parse_chat_messages
for a template that takes string content (Qwen3's), shared by LLM.chat and the server's chat
endpoint, so that both refuse and render a message alike."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("minivllm")

# The content parts vLLM's chat parser reads as text, and the key each holds its text under.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}


def chat_message(message, where: str) -> dict:
    """One OpenAI-style chat message as the chat template reads it: vLLM's parse_chat_messages
    for a template that takes string content (Qwen3's). Content None or missing is "", a list
    of text parts (or strings) is their texts joined by newlines (an empty or null text is no
    part); an assistant's "reasoning" is also its "reasoning_content" (the name Qwen3's
    template reads); an assistant's earlier tool calls' arguments become objects
    (_call_arguments: a JSON string parsed; broken JSON, or anything but an object, {} with a
    warning, as vLLM), and an empty or null tool_calls is dropped, as is any tool_calls of
    another role, unread. Only the keys vLLM's _parse_chat_message_content
    (renderers/chat_utils) carries reach the template: role, content, a string name or task of
    any role, an assistant's tool_calls and reasoning, a tool message's tool_call_id and a
    developer message's tools (null when not given); any other key (an assistant's own
    reasoning_content, a user's tool_call_id, ...) is dropped.
    `where` names the message in errors ("messages[2]"): one that is not a dict, or whose role
    or content has the wrong type, is a TypeError; a missing role, a part that is not text
    (this engine reads text only), an assistant's tool call that is not a function's or
    arguments nested past what Python's JSON decoder reads, a ValueError."""
    if not isinstance(message, dict):
        raise TypeError(f"{where} must be an object with 'role' and 'content', got "
                        f"{type(message).__name__}")
    if "role" not in message:
        raise ValueError(f"{where} has no 'role'")
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError(f"{where}.role must be a string, got {type(role).__name__}")
    out = {"role": role, "content": _content_text(message.get("content"), where)}
    if role == "assistant":
        # Another role's tool_calls never reach the template and are not read (whatever they
        # hold, vLLM refuses nothing for them).
        if message.get("tool_calls"):
            out["tool_calls"] = _history_calls(message["tool_calls"], where)
        if message.get("reasoning") is not None:
            # Qwen3's template reads reasoning_content: vLLM fills it from "reasoning" alone.
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
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
        if call.get("type", "function") != "function":  # vLLM's refusal
            raise ValueError(f"{where}.tool_calls[{j}]: chat completions only support "
                             f"assistant tool_calls of type 'function', got {call['type']!r}")
        arguments = _call_arguments(fn["name"], fn.get("arguments"), f"{where}.tool_calls[{j}]")
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def _call_arguments(name: str, arguments, where: str) -> dict:
    """An earlier call's arguments as the object the template reads: vLLM's
    _postprocess_messages (entrypoints/chat_utils). A JSON string is parsed; none (null, "",
    0, []) is {}; arguments that are broken JSON, or JSON that is not an object, are {} with a
    warning rather than a refusal: they live in the conversation's history, so refusing them
    would refuse every later turn of that conversation too."""
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            log.warning("Tool call %r has arguments that are not valid JSON (%d chars); "
                        "coercing to an empty object so the conversation can continue.",
                        name, len(arguments))
            return {}
        except RecursionError:  # valid, maybe; Python's decoder cannot read it (vLLM: a 500)
            raise ValueError(f"{where}.function.arguments is not JSON Python can read: it nests "
                             f"too deep") from None
    if not isinstance(arguments, dict):
        log.warning("Tool call %r arguments decoded to %s, not a JSON object; coercing to an "
                    "empty object.", name, type(arguments).__name__)
        return {}
    return arguments
