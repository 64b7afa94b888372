"""A chat completion's text as the message vLLM's server answers with: the reasoning split from
the answer (runtime/reasoning.py, with a reasoning parser), then the answer as content or as tool
calls (runtime/tool_calls.py, by the request's tool_choice). One ChatOutput per completion, fed
its text as it grows: a stream sends what each feed returns, a whole response merges the same
pieces (merge_deltas) of one last feed, so the two agree.

"auto" tool calls stream as vLLM's do: a call's first delta carries its index, id, type and
name (and its first arguments piece, or ""), later ones index and an arguments piece; at the
end, what the whole answer's parse has beyond what was streamed (vLLM's "remaining call"). A
stream cannot take back what it sent: where the answer turns out to be no call after a call
began streaming (its JSON broken or cut by max_tokens, a hermes block after it broken, an
unreadable qwen3_coder parameter), the stream's content still ends as the whole response's, and
the streamed calls stay as they were (vLLM's stream keeps them too).

With a reasoning parser each ChatOutput also counts its completion's reasoning tokens from their
ids (ReasoningTokens): vLLM's usage.completion_tokens_details.reasoning_tokens."""

from __future__ import annotations

from . import reasoning
from .reasoning import ANSWER, REASONING, UNDECIDED, ThinkTags
from .tool_calls import answer_split, call_json, new_call_id, parse_required


class ReasoningTokens:
    """A completion's reasoning tokens, counted from its token ids as they come: vLLM's
    usage.completion_tokens_details.reasoning_tokens, which its qwen3 parser engine counts as
    the tokens of the reasoning chunks it emits (vLLM PR #45802). So the tags that bound the
    reasoning (<think>, </think>) are not among them, nor are special tokens (EOS, ...): vLLM's
    parser drops those, as a text without special tokens has none. The reasoning starts where
    the text's split starts it (reasoning.ReasoningSplit, the same phase): inside it where the
    prompt opened it, at a first <think> where the prompt left it undecided, never where the
    prompt closed it; it ends at the first </think>."""

    def __init__(self, phase: str, tags: ThinkTags):
        self.phase = phase
        self.tags = tags
        self.opening = phase in (UNDECIDED, REASONING)  # the first token may still be <think>
        self.count = 0

    def feed(self, token_ids) -> int:
        """The count with `token_ids`, the completion's next tokens, added."""
        tags = self.tags
        for token in token_ids:
            if token in tags.turn_marks:  # no text: as vLLM's parser, neither counted nor deciding
                continue
            if self.opening:
                self.opening = False
                if token == tags.start:
                    self.phase = REASONING
                    continue
                if self.phase == UNDECIDED:
                    self.phase = ANSWER
            if self.phase != REASONING:
                break
            if token == tags.end:
                self.phase = ANSWER
            elif token != tags.start:  # a <think> inside is a tag vLLM's parser drops too
                self.count += 1
        return self.count


class ChatOutput:
    """phase: where the completion starts (ThinkTags.prompt_phase), None without a reasoning
    parser; tool_mode: "none", "auto" (calls read from the answer by tool_parser's rules:
    hermes or qwen3_coder, whose values the request's tools type), "required" or
    "function:NAME" (check_tool_choice); include_reasoning: false drops the reasoning (vLLM's
    request field); parallel_tool_calls: false keeps only an answer's first call (vLLM's);
    tags: the tokenizer's ThinkTags, with which a reasoning parser's ChatOutput counts its
    reasoning tokens (count, reasoning_tokens). feed and finish return a delta's fields:
    "reasoning" (also as "reasoning_content", the name of vLLM's earlier versions, which clients
    such as Qwen-Agent read), "content", "tool_calls"; only those with something in them."""

    def __init__(self, phase: str | None, tool_mode: str = "none", include_reasoning: bool = True,
                 parallel_tool_calls: bool = True, tool_parser: str = "hermes",
                 tools: list[dict] | None = None, tags: ThinkTags | None = None):
        self.split = reasoning.ReasoningSplit(phase) if phase is not None else None
        self.tokens = (ReasoningTokens(phase, tags) if phase is not None and tags is not None
                       else None)
        self.tool_mode = tool_mode
        self.include_reasoning = include_reasoning
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoned = False  # some reasoning came, sent or not
        self.tools = answer_split(tool_parser, tools) if tool_mode == "auto" else None
        self.answer = ""  # a "required" answer, parsed at the end
        self.named_started = False
        self.called = False  # tool calls were sent (finish_reason "tool_calls" in "auto")
        self.streamed: list[str] = []  # each "auto" call streamed: the arguments it was sent

    @property
    def reasoning_parser(self) -> bool:
        return self.split is not None

    @property
    def reasoning_tokens(self) -> int | None:
        """The reasoning tokens counted so far; None without a reasoning parser's tags."""
        return self.tokens.count if self.tokens is not None else None

    def count(self, token_ids) -> None:
        """Count the reasoning among the completion's next tokens (a stream's each delta, a
        whole response's all at once)."""
        if self.tokens is not None:
            self.tokens.feed(token_ids)

    def feed(self, text: str, last: bool = False) -> dict:
        """The delta `text` makes; last: finish() comes next (a whole response, a stream's last
        piece), so calls are not streamed from it: finish() sends them as parsed whole."""
        r, a = self.split.feed(text) if self.split is not None else ("", text)
        return self._fields(r, self._answer(a, last))

    def finish(self) -> dict:
        r, a = self.split.finish() if self.split is not None else ("", "")
        fields = self._fields(r, self._answer(a, True))
        if self.tools is not None:
            content, calls = self.tools.finish()
            self._add(fields, content, self._calls(calls))
        elif self.tool_mode == "required":
            calls = parse_required(self.answer)
            if calls is None:  # cut short: the text as it is
                self._add(fields, self.answer, [])
            else:
                self._add(fields, "", self._calls(calls))
        return fields

    def _answer(self, text: str, last: bool = False) -> tuple[str, list[dict]]:
        """The answer's piece as (content, tool call deltas)."""
        if self.tools is not None:
            content = self.tools.feed(text)
            events, self.tools.events = self.tools.events, []
            return content, [] if last else self._stream(events)
        if self.tool_mode == "required":
            self.answer += text
            return "", []
        if self.tool_mode.startswith("function:") and text:
            if self.named_started:
                return "", [{"index": 0, "function": {"arguments": text}}]
            self.named_started = self.called = True
            return "", [{"index": 0, "id": new_call_id(), "type": "function",
                         "function": {"name": self.tool_mode[len("function:"):],
                                      "arguments": text}}]
        return text, []

    def _stream(self, events: list[tuple[int, str | None, str]]) -> list[dict]:
        """The split's call events (index, name on a call's first, arguments piece) as deltas,
        one per call."""
        deltas: dict[int, dict] = {}
        for index, name, piece in events:
            if index > 0 and not self.parallel_tool_calls:
                continue
            if name is not None:
                if index != len(self.streamed):  # its calls come in order, each named once
                    continue
                self.streamed.append("")
                self.called = True
                deltas[index] = {"index": index, "id": new_call_id(), "type": "function",
                                 "function": {"name": name, "arguments": ""}}
            elif index >= len(self.streamed):
                continue
            self.streamed[index] += piece
            delta = deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
            delta["function"]["arguments"] += piece
        return [d for d in deltas.values() if "id" in d or d["function"]["arguments"]]

    def _calls(self, calls: list[dict]) -> list[dict]:
        """The whole answer's calls as the deltas that end them: each streamed call's arguments
        beyond what it was sent (nothing where that is no prefix of them: the stream cannot
        mend it), and the calls not streamed whole."""
        if not self.parallel_tool_calls:
            calls = calls[:1]
        if calls:
            self.called = True
        deltas = []
        for k, c in enumerate(calls):
            if k >= len(self.streamed):
                deltas.append({"index": k, **call_json(c["name"], c["arguments"])})
                continue
            sent, args = self.streamed[k], c["arguments"]
            if len(args) > len(sent) and args.startswith(sent):
                deltas.append({"index": k, "function": {"arguments": args[len(sent):]}})
        return deltas

    def _fields(self, r: str, answer: tuple[str, list[dict]]) -> dict:
        fields = {}
        self.reasoned |= bool(r)
        if r and self.include_reasoning:
            fields["reasoning"] = fields["reasoning_content"] = r
        self._add(fields, *answer)
        return fields

    @staticmethod
    def _add(fields: dict, content: str, calls: list[dict]) -> None:
        if content:
            fields["content"] = fields.get("content", "") + content
        if calls:
            fields["tool_calls"] = fields.get("tool_calls", []) + calls


def merge_deltas(deltas: list[dict]) -> dict:
    """Deltas' fields joined: texts concatenated, each tool call's pieces (by index) into one
    call, its arguments concatenated."""
    out: dict = {}
    calls: dict[int, dict] = {}
    for d in deltas:
        for key in ("reasoning", "reasoning_content", "content"):
            if key in d:
                out[key] = out.get(key, "") + d[key]
        for piece in d.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in piece:
                    call[key] = piece[key]
            fn = piece.get("function", {})
            if "name" in fn:
                call["function"]["name"] = fn["name"]
            call["function"]["arguments"] += fn.get("arguments", "")
    if calls:
        out["tool_calls"] = [{"id": c["id"], "type": c["type"],
                              "function": {"name": c["function"]["name"],
                                           "arguments": c["function"]["arguments"]}}
                             for _, c in sorted(calls.items())]
    return out


def message(parser: ChatOutput, text: str) -> dict:
    """A whole completion's message: role, content (None where the answer is all tool calls or
    the completion all reasoning, "" for a constrained tool call, as vLLM), the reasoning fields
    with a reasoning parser, tool_calls where any."""
    fields = merge_deltas([parser.feed(text, last=True), parser.finish()])
    content = fields.get("content")
    if content is None:
        if parser.tool_mode == "required" or parser.tool_mode.startswith("function:"):
            content = ""
        elif not (parser.called or parser.reasoned):
            content = ""
    msg = {"role": "assistant", "content": content}
    if parser.reasoning_parser:
        msg["reasoning"] = msg["reasoning_content"] = fields.get("reasoning")
    if "tool_calls" in fields:
        msg["tool_calls"] = fields["tool_calls"]
    return msg
