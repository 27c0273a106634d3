"""Schemathesis hooks of ``bench.schemathesis`` (loaded with ``SCHEMATHESIS_HOOKS``).

- ``before_load_schema``: vLLM's ``ErrorInfo.code`` is the HTTP status (an integer);
  specserve's is OpenAI's (a string such as ``"invalid_value"``, or null). That field
  is widened to accept both, so that every other part of vLLM's error schema still
  applies.
- ``before_load_schema`` also makes a completion's ``prompt`` required, not null and
  not empty, and chat's ``messages`` not empty. vLLM's document leaves ``prompt``
  optional because vLLM takes ``prompt_embeds`` instead (specserve takes no
  embeddings), and sets no minimum length; OpenAI refuses both empty. Left as they
  are, most generated bodies vary the other fields around a missing or empty prompt
  and are refused before they reach the engine.
- ``openai_error``: a check that every 4xx body is an OpenAI error object.
- ``after_call``: appends each response's operation, status and error message to the file
  ``SPECSERVE_FUZZ_STATUS_LOG`` names, for the report's tally.
"""

import json
import os

import schemathesis


@schemathesis.hook
def before_load_schema(context, raw_schema: dict) -> None:
    schemas = raw_schema["components"]["schemas"]
    schemas["ErrorInfo"]["properties"]["code"] = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}
    completion = schemas["CompletionRequest"]
    completion["required"] = sorted({*completion.get("required", []), "prompt"})
    prompt = completion["properties"]["prompt"]
    prompt["anyOf"] = [{**t, "minItems" if t["type"] == "array" else "minLength": 1}
                       for t in prompt["anyOf"] if t["type"] != "null"]
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1


def error_problem(status: int, content_type: str, text: str) -> str | None:
    """Why a 4xx answer is not an OpenAI error object (None when it is)."""
    if not 400 <= status < 500:
        return None
    if not content_type.startswith("application/json"):
        return f"content type {content_type!r}, not JSON"
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return "the body is not a JSON object"
    if not isinstance(err, dict):
        return "no 'error' object"
    if not (isinstance(err.get("message"), str) and err["message"]):
        return "no error message"
    if not isinstance(err.get("type"), str):
        return "no error type"
    if any(not (v is None or isinstance(v, str)) for v in (err.get("param"), err.get("code"))):
        return "param and code must be strings or null"
    return None


@schemathesis.check
def openai_error(ctx, response, case):
    """A 4xx answer carries an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    content_type = (response.headers.get("content-type") or [""])[0]
    problem = error_problem(response.status_code, content_type, response.text)
    if problem:
        raise AssertionError(f"[{response.status_code}] not an OpenAI error object: {problem}")


def error_message(text: str) -> str:
    """An error body's message on one line, cut to 80 characters ("" for any other body)."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return " ".join(str(message).split())[:80]


@schemathesis.hook
def after_call(context, case, response) -> None:
    path = os.environ.get("SPECSERVE_FUZZ_STATUS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{case.operation.label}\t{response.status_code}\t{error_message(response.text)}\n")
