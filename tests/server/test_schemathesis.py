"""Schemathesis with vLLM's OpenAPI document (completions, chat, models) against a
``specserve serve`` of the default model with prompt lookup on: ``bench.schemathesis``
(its docstring lists the phases and checks), bounded to a few minutes here (the fuzzing phase only).
``python -m bench schemathesis`` runs it longer and commits the summary."""

import json

import pytest

from bench.schemathesis import fuzz
from bench.schemathesis_hooks import error_problem

OPENAI_ERROR = {"error": {"message": "n must be between 1 and 4, got 9", "type": "invalid_request_error",
                          "param": "n", "code": "invalid_value"}}


@pytest.mark.parametrize("status, content_type, body, problem", [
    (400, "application/json", json.dumps(OPENAI_ERROR), None),
    (200, "text/event-stream", "data: [DONE]", None),
    (422, "application/json", json.dumps({"detail": [{"loc": ["body"], "msg": "Field required"}]}), "no 'error' object"),
    (404, "text/plain", "Not Found", "content type 'text/plain', not JSON"),
    (400, "application/json", json.dumps({"error": {**OPENAI_ERROR["error"], "message": ""}}), "no error message"),
    (400, "application/json", json.dumps({"error": {**OPENAI_ERROR["error"], "code": 400}}), "param and code"),
])
def test_openai_error_check(status, content_type, body, problem):
    """The run's 4xx check flags FastAPI's own error shapes and passes OpenAI's."""
    found = error_problem(status, content_type, body)
    assert (found is None) if problem is None else problem in found


@pytest.mark.slow
def test_schemathesis_vllm_document(tmp_path):
    result = fuzz(max_model_len=64, seed=53, max_examples=25, request_timeout=60, timeout=300, log_dir=str(tmp_path),
                  phases="examples,fuzzing")
    assert result.returncode == 0 and result.server_errors == 0, result.output[-6000:]
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):  # the fuzz reached the engine
        assert result.statuses[op].get(200, 0) >= 3, result.statuses
    assert result.seconds < 300
