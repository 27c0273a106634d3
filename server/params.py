"""Protocol request -> the engine ``SamplingParams`` of each of its choices, in one pass.

``choice_params`` reads a request once: its n and the server's limit, the fields we
refuse, the request-level rules (no ``prompt_logprobs`` in a stream, one grammar at
most), then the values. Value ranges are the engine's (``SamplingParams.__post_init__``
raises ``InvalidParameter`` naming the field); this module adds what only a request
has: n, OpenAI's null-means-default, the fields we refuse, and the structured-output
fields turned into one ``GuidedDecoding`` (whose grammar the engine compiles at the
door: an invalid schema or regex is a 400 there).
"""

import dataclasses
import json
from typing import Any

from api.errors import APIError, bad_request
from api.protocol import SamplingRequest
from engine.sampling_params import GuidedDecoding, InvalidParameter, SamplingParams


def unsupported(param: str, why: str = "") -> APIError:
    return bad_request(f"'{param}' is not supported by this server{why}", param=param, code="unsupported_parameter")


def choice_params(
    req: SamplingRequest, *, max_n: int, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
    tool_guided: GuidedDecoding | None = None, defaults: dict | None = None,
) -> list[SamplingParams]:
    """The engine parameters of each of the request's n choices (with a seed, choice i gets
    seed + i: the choices differ but stay reproducible); a 400 ``APIError`` naming the first
    bad field. ``tool_guided``: the grammar a chat's ``tool_choice`` asks for. ``defaults``:
    what an unset temperature, top_p, top_k, min_p or repetition_penalty takes (the
    checkpoint's generation config), else OpenAI's defaults."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {n}", param="n")
    if getattr(req, "suffix", None) is not None:  # legacy completions' fields
        raise unsupported("suffix")
    if getattr(req, "best_of", None) not in (None, n):
        raise unsupported("best_of", " (other than best_of == n)")
    if req.prompt_logprobs is not None and req.stream:  # vLLM's rule: they come in the whole response
        raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    params = _build(req, max_tokens, logprobs, prompt_logprobs, _guided(req, tool_guided), defaults or {})
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Keys are token ids written in ASCII digits ("50256"); Python's ``int`` would also
    take " 1", "1_0" or other scripts' digits, which OpenAI refuses."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise bad_request(
            f"logit_bias keys must be token ids (non-negative integers as strings), got {bad[:40]!r}",
            param="logit_bias",
        )
    return {int(k): float(v) for k, v in bias.items()}


def _build(req: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
           guided: GuidedDecoding | None, defaults: dict) -> SamplingParams:
    d = defaults
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, d.get("temperature", 1.0)),
            top_p=_or(req.top_p, d.get("top_p", 1.0)),
            top_k=_or(req.top_k, d.get("top_k", 0)),
            min_p=_or(req.min_p, d.get("min_p", 0.0)),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
            logit_bias=_logit_bias(req.logit_bias),
            seed=req.seed,
            stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=_or(req.skip_special_tokens, True),
            speculate=_or(req.speculative_decoding, True),
            guided=guided,
        )
    except InvalidParameter as e:
        raise bad_request(str(e), param=e.param) from None


def _guided(req: SamplingRequest, tool_guided: GuidedDecoding | None) -> GuidedDecoding | None:
    """The grammar asked by ``tool_choice``, ``response_format`` (chat) or vLLM's ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one of them. Shapes only: the
    grammar itself is checked when the engine compiles it."""
    found = [g for g in (_response_format(getattr(req, "response_format", None)), _vllm_guided(req)) if g]
    if len(found) > 1:
        raise bad_request("response_format and guided_* cannot be combined", param="response_format")
    if tool_guided is not None and found:
        raise bad_request("tool_choice 'required' or a named function cannot be combined with "
                          "response_format or guided_*", param="tool_choice")
    return tool_guided or (found[0] if found else None)


def _response_format(fmt: dict[str, Any] | None) -> GuidedDecoding | None:
    kind = (fmt or {}).get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", "", "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="response_format"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request(
            "response_format.json_schema must be an object whose 'schema' is a JSON schema object",
            param="response_format",
        )
    return GuidedDecoding("json", json.dumps(spec.get("schema", {"type": "object"})), "response_format")


def _vllm_guided(req: SamplingRequest) -> GuidedDecoding | None:
    fields = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    asked = [f for f in fields if getattr(req, f) is not None]
    if len(asked) > 1:
        raise bad_request(f"at most one of {', '.join(fields)}, got {asked}", param=asked[1])
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad_request(f"guided_json is not valid JSON: {e}", param="guided_json") from None
        if not isinstance(schema, dict):
            raise bad_request("guided_json must be a JSON schema object", param="guided_json")
        return GuidedDecoding("json", json.dumps(schema), "guided_json")
    if req.guided_regex is not None:
        return GuidedDecoding("regex", req.guided_regex, "guided_regex")
    if req.guided_choice is not None:
        if not req.guided_choice or not all(req.guided_choice):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings", param="guided_choice")
        return GuidedDecoding("choice", json.dumps(req.guided_choice), "guided_choice")
    if req.guided_grammar is not None:
        if not req.guided_grammar.strip():
            raise bad_request("guided_grammar must not be empty", param="guided_grammar")
        return GuidedDecoding("grammar", req.guided_grammar, "guided_grammar")
    return None


def _or(value, default):
    return default if value is None else value
