"""Tool calling on /v1/chat/completions: ``tools`` and ``tool_choice`` in, OpenAI's
``tool_calls`` out.

Rendering. A chat template that reads ``tools`` (its source mentions them) gets
them through ``apply_chat_template(tools=...)``. The default model's
(SmolLM2-135M-Instruct's) template does not, so the tools go into the system
message as an instruction that lists them as JSON (``tool_instruction``), added
to the conversation's own system message or as a new first one.

Format of a call. The model answers with one JSON object
``{"name": <function name>, "arguments": {...}}``, or a JSON list of them for
several calls; the object may be wrapped in ``<tool_call>...</tool_call>``
(Hermes / Qwen style). Text after the calls is ignored. Earlier calls in the
conversation (an assistant message's ``tool_calls``) are rendered the same way,
and tool results as ``tool`` messages. ``server/tool_calls.py`` reads the format,
whole or as it is written (streams send each call piece by piece).

``tool_choice``:
- ``"none"``: the tools are not rendered; the answer is text.
- ``"auto"`` (the default with tools): the answer is parsed as calls when it has
  the format above and names a given tool, else it is text.
- ``"required"``: the answer is constrained to the JSON schema of a call of any
  given tool (an ``anyOf``), so it always parses (unless cut by max_tokens).
- ``{"type": "function", "function": {"name": ...}}``: constrained to a call of
  that function.
A parsed answer has ``content: null``, ``tool_calls`` and finish_reason "tool_calls".
"""

import json
from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from api.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from engine.sampling_params import GuidedDecoding
from server.tool_calls import NotACall, new_call_id, scan


@dataclass(frozen=True)
class Tools:
    """The request's tools (OpenAI's ``function`` objects) and its ``tool_choice``."""

    functions: tuple[dict[str, Any], ...]
    choice: str  # "auto" | "required" | "named"
    named: str | None = None

    @property
    def guided(self) -> GuidedDecoding | None:
        """The grammar of a required call; None in "auto"."""
        if self.choice == "auto":
            return None
        calls = [call_schema(f) for f in self.functions if self.choice == "required" or f["name"] == self.named]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return GuidedDecoding("json", json.dumps(schema), "tool_choice")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text`` (format in the module doc), or None when it is not one."""
        try:
            scanned = scan(text, self.names)
        except NotACall:
            return None
        calls = []
        for call in scanned:
            try:
                args = json.loads(call.arguments(text)) if call.closed else None
            except json.JSONDecodeError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(id=new_call_id(), function=FunctionCall(
                name=call.name, arguments=json.dumps(args, ensure_ascii=False))))
        return calls or None


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of ``function``."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
    }


def request_tools(req: ChatCompletionRequest) -> Tools | None:
    """The checked tools of ``req``; None without tools or with ``tool_choice: "none"``."""
    if req.functions:
        raise bad_request("'functions' is deprecated and not supported; use 'tools'", param="functions")
    choice, named = _tool_choice(req.tool_choice)
    if not req.tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = tuple(_function(t, i) for i, t in enumerate(req.tools))
    if choice == "none":
        return None
    if named is not None and named not in {f["name"] for f in functions}:
        raise bad_request(f"tool_choice names the function {named!r}, which is not in tools", param="tool_choice")
    return Tools(functions, choice, named)


def _tool_choice(value: Any) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        param="tool_choice",
    )


def _function(tool: Any, index: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(
            f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}",
            param="tools",
        )
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_request(f"tools[{index}].function.parameters must be a JSON schema object", param="tools")
    return {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}


def tool_instruction(tools: Tools) -> str:
    """The system instruction that lists the tools, for templates that do not render them."""
    listing = json.dumps(list(tools.functions), ensure_ascii=False)
    return (
        "You can call functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <object of arguments>}. '
        f"The functions: {listing}"
    )


def render_call_history(message: dict[str, Any], tool_calls: list[dict[str, Any]], param: str) -> str:
    """An assistant message's earlier ``tool_calls`` (the request's field ``param``) as
    text in the call format; a call whose ``function`` is not an object is a 400."""
    rendered = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") or {}
        if not isinstance(fn, dict):
            raise bad_request(f"{param}.{j}.function must be an object {{\"name\": ..., \"arguments\": ...}}", param=param)
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        rendered.append({"name": fn.get("name"), "arguments": args})
    text = json.dumps(rendered[0] if len(rendered) == 1 else rendered, ensure_ascii=False)
    return (message.get("content") or "") + text
