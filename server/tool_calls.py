"""The tool-call format read from a growing answer, so that a stream can send each
call as it is written: its name once the name's string closes, then its arguments'
text piece by piece (OpenAI's delta shape).

The format (server/tools.py): one call object ``{"name": ..., "arguments": {...}}``
(``"parameters"`` also read), or a JSON list of them, optionally wrapped in
``<tool_call>...</tool_call>``. ``scan`` walks the text once and returns, per call
begun so far, its name (None until the string closes) and the span of its
arguments value (open-ended while it is being written). A stream sends a call's
first piece (id, name) once its arguments have opened with "{" (or the call has
closed without any), so that a call it has begun is never taken back. It raises ``NotACall`` as
soon as the text cannot be one: another opening, a name that is not a given tool,
arguments that are not an object. Text after the last call is not read: small
models often say more after a call, and the call stands.

Worked example, ``{"name": "add", "arguments": {"a": 1`` so far::

    [ScannedCall(name="add", args_start=30, args_end=None)]   # arguments text: {"a": 1
"""

import json
import uuid
from dataclasses import dataclass

from api.protocol import DeltaFunctionCall, DeltaToolCall

OPEN_TAG = "<tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


class NotACall(Exception):
    """The text cannot be (the start of) a call of a given tool."""


class _End(Exception):
    """The text ends inside the part being read."""


@dataclass
class ScannedCall:
    name: str | None = None
    args_start: int | None = None  # index of the arguments' "{"
    args_end: int | None = None  # one past its "}", once written
    closed: bool = False  # the call object's "}" is written

    def arguments(self, text: str) -> str:
        """The arguments' text written so far ("{}" for a closed call without any)."""
        if self.args_start is None:
            return "{}" if self.closed else ""
        return text[self.args_start : len(text) if self.args_end is None else self.args_end]


def scan(text: str, names: frozenset[str]) -> list[ScannedCall]:
    """The calls begun in ``text`` (see the module doc); raises ``NotACall``."""
    scanner = _Scanner(text, names)
    try:
        scanner.answer()
    except _End:
        pass
    return scanner.calls


class _Scanner:
    def __init__(self, text: str, names: frozenset[str]):
        self.s, self.i, self.names = text, 0, names
        self.calls: list[ScannedCall] = []

    def answer(self) -> None:
        self.ws()
        rest = self.s[self.i :]
        if rest.startswith(OPEN_TAG):
            self.i += len(OPEN_TAG)
            self.ws()
        elif OPEN_TAG.startswith(rest):
            raise _End
        if self.peek() == "[":
            self.i += 1
            while True:
                self.ws()
                self.call()
                self.ws()
                if self.take() == "]":
                    return
                if self.s[self.i - 1] != ",":
                    raise NotACall
        self.call()

    def call(self) -> None:
        self.expect("{")
        call = ScannedCall()
        self.calls.append(call)
        while True:
            self.ws()
            if self.peek() == "}":
                break
            key = self.string()
            self.ws()
            self.expect(":")
            self.ws()
            if key == "name":
                call.name = self.string()
                if call.name not in self.names:
                    raise NotACall
            elif key in _ARGUMENT_KEYS and call.args_start is None:
                if self.peek() != "{":
                    raise NotACall
                call.args_start = self.i
                self.value()
                call.args_end = self.i
            else:
                self.value()
            self.ws()
            if self.peek() != ",":
                break
            self.i += 1
        self.expect("}")
        if call.name is None:
            raise NotACall
        call.closed = True

    def value(self) -> None:
        """Skips one JSON value: strings and nesting are followed, scalars read to their end."""
        c = self.peek()
        if c == '"':
            self.string()
            return
        if c not in "{[":
            while self.peek() not in ",}] \t\r\n":
                self.i += 1
            return
        depth = 0
        while True:
            c = self.peek()
            if c == '"':
                self.string()
                continue
            self.i += 1
            depth += (c in "{[") - (c in "}]")
            if depth == 0:
                return

    def string(self) -> str:
        start = self.i
        self.expect('"')
        while (c := self.take()) != '"':
            if c == "\\":
                self.take()
        try:
            return json.loads(self.s[start : self.i])
        except json.JSONDecodeError:
            raise NotACall from None

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _End
        return self.s[self.i]

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c

    def expect(self, c: str) -> None:
        if self.take() != c:
            raise NotACall


class CallStream:
    """One streamed choice's answer while it is, or may become, tool calls: ``feed``
    the new text, get the pieces of the calls to send."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.text = ""
        self.rejected = False  # the answer is not a call
        self._sent: list[int] = []  # per call: characters of its arguments sent

    @property
    def started(self) -> bool:
        """A call's first piece has gone out: the answer is a tool call (even if what
        follows turns out malformed, e.g. cut by max_tokens)."""
        return bool(self._sent)

    def feed(self, new_text: str) -> list[DeltaToolCall]:
        self.text += new_text
        if self.rejected:
            return []
        try:
            calls = scan(self.text, self.names)
        except NotACall:
            self.rejected = not self.started
            return []
        pieces = []
        for index, call in enumerate(calls):
            if call.name is None or (call.args_start is None and not call.closed):
                break  # the first piece waits until the arguments are known to be an object
            if index == len(self._sent):
                self._sent.append(0)
                function = DeltaFunctionCall(name=call.name, arguments="")
                pieces.append(DeltaToolCall(index=index, id=new_call_id(), type="function", function=function))
            args = call.arguments(self.text)
            if len(args) > self._sent[index]:
                pieces.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=args[self._sent[index] :])))
                self._sent[index] = len(args)
        return pieces


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
