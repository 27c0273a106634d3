"""Security settings: with --api-key every /v1 route needs the key (and /metrics
with --protect-metrics), /health stays open, the key never reaches a log line;
CORS is off unless --allowed-origins names origins; weights load only through
safetensors or GGUF, never through pickle."""

import logging
import pickle

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from api.routes import router
from engine.worker import loader
from server.app import create_app
from server.cli import build_parser
from server.settings import ServerSettings
from tests.server.conftest import LiveServer, settings

KEY = "sk-reliability-4f8a1c"
ORIGIN = "https://app.example"


def v1_routes() -> list[tuple[str, str]]:
    """(method, path) of every /v1 route of the API router (the app includes it whole)."""
    return sorted(
        (method, route.path)
        for route in router.routes
        if route.path.startswith("/v1")
        for method in getattr(route, "methods", ()) or ()
        if method != "HEAD"
    )


def test_every_v1_route_needs_the_key_and_the_schema_says_so(rel_engine):
    with LiveServer(settings(api_key=KEY), rel_engine) as live, live.http() as http:
        routes = v1_routes()
        assert {p for _, p in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for method, path in routes + [("GET", "/v1/unknown"), ("GET", "/v1")]:
            for headers in ({}, {"Authorization": "Bearer " + KEY[:-1]}, {"Authorization": "Bearer"}):
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
        ok = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/v1/models", headers=ok).status_code == 200
        r = http.post("/v1/completions", headers=ok, json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200
        for path in ("/health", "/version", "/metrics", "/openapi.json"):
            assert http.get(path).status_code == 200, path
        schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in schema["paths"].items():
        for op in item.values():
            assert ("security" in op) == path.startswith("/v1"), path


def test_protect_metrics_puts_metrics_behind_the_key(rel_engine):
    with LiveServer(settings(api_key=KEY, protect_metrics=True), rel_engine) as live, live.http() as http:
        assert http.get("/metrics").status_code == 401
        r = http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "vllm:request_success_total" in r.text
        assert http.get("/health").status_code == 200


def test_the_key_never_appears_in_logs(rel_engine, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    config = settings(api_key=KEY, log_level="debug")
    assert KEY not in repr(config) and KEY not in str(config.model_dump()) and KEY not in config.model_dump_json()
    with LiveServer(config, rel_engine) as live, live.http() as http:
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"Authorization": f"Bearer {KEY}"})
        http.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": f"Bearer {KEY}x"})
        http.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert "http request" in caplog.text  # the access lines were captured
    assert KEY not in caplog.text
    out = capsys.readouterr()
    assert KEY not in out.out + out.err
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert KEY not in help_text


def test_cors_is_off_by_default(rel_engine):
    with LiveServer(settings(), rel_engine) as live, live.http() as http:
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = http.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allows_only_the_configured_origins(rel_engine):
    with LiveServer(settings(allowed_origins=[ORIGIN], api_key=KEY), rel_engine) as live, live.http() as http:
        preflight = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        r = http.options("/v1/completions", headers=preflight)  # a preflight carries no key: not a 401
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = http.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = http.get("/v1/models", headers={"Origin": ORIGIN})  # the key is still required
        assert r.status_code == 401


def test_settings_parse_origins_and_refuse_protect_metrics_without_a_key(monkeypatch):
    monkeypatch.setenv("SPECSERVE_ALLOWED_ORIGINS", f"{ORIGIN}, https://b.example")
    assert ServerSettings().allowed_origins == [ORIGIN, "https://b.example"]
    assert ServerSettings(allowed_origins=None).allowed_origins is None
    parser = build_parser()
    for argv in (
        ["--allowed-origins", f"{ORIGIN},https://b.example"],
        ["--allowed-origins", ORIGIN, "https://b.example"],
    ):
        flags = vars(parser.parse_args(["serve", *argv]))
        assert ServerSettings(allowed_origins=flags["allowed_origins"]).allowed_origins == [ORIGIN, "https://b.example"]
    with pytest.raises(ValueError, match="protect_metrics needs an api_key"):
        ServerSettings(protect_metrics=True)
    app = create_app(ServerSettings(allowed_origins=None))
    assert not any("CORS" in m.cls.__name__ for m in app.user_middleware)


# ---- weights: safetensors or GGUF only ----


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any call of torch.load or pickle's loaders fails the test."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a checkpoint was unpickled")

    for target, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, refuse)
    return calls


def tiny_hf_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.pt", "model.pth", "consolidated.00.pth"])
def test_the_loader_refuses_pickle_checkpoints(tmp_path, no_unpickling, file_name):
    tiny_hf_config().save_pretrained(tmp_path)
    with open(tmp_path / file_name, "wb") as f:  # a pickle that would run code if loaded
        f.write(pickle.dumps({"weight": [1.0]}))
    for path in (tmp_path, tmp_path / file_name):
        with pytest.raises((FileNotFoundError, OSError, ValueError)):
            loader.load_model(path, torch.float32, torch.device("cpu"))
    assert no_unpickling == []


def test_the_loader_reads_safetensors_without_unpickling(tmp_path, no_unpickling):
    hf = HFLlama(tiny_hf_config())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"decoy": 1}))  # present, and ignored
    model = loader.load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert no_unpickling == []
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)  # the weights really loaded
