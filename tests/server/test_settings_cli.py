"""ServerSettings from flags and SPECSERVE_* variables; the CLI's subcommands."""

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from server.cli import build_parser, main
from server.settings import ServerSettings
from tests.server.conftest import settings_from


def test_defaults_serve_the_default_model_on_all_interfaces(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    s = settings_from([])
    assert (s.host, s.port, s.model, s.max_model_len, s.api_key) == ("0.0.0.0", 8000, None, None, None)
    assert s.model_names == ["SmolLM2-135M-Instruct"]
    assert s.engine_config() == EngineConfig()


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("SPECSERVE_PORT", "9000")
    monkeypatch.setenv("SPECSERVE_SERVED_MODEL_NAME", "a, b")
    monkeypatch.setenv("SPECSERVE_API_KEY", "secret")
    s = settings_from(["--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32"])
    assert s.max_model_len == 512 and s.port == 9000 and s.max_num_seqs == 8
    assert s.model_names == ["a", "b"] and s.api_key.get_secret_value() == "secret"
    assert "secret" not in repr(s)
    cfg = s.engine_config()
    assert cfg.model.max_model_len == 512 and cfg.model.dtype == "float32" and cfg.scheduler.max_num_seqs == 8


def test_vllm_flag_names():
    s = settings_from(
        [
            "--model",
            "/m",
            "--served-model-name",
            "x",
            "y",
            "--host",
            "127.0.0.1",
            "--port",
            "1",
            "--api-key",
            "k",
            "--max-num-batched-tokens",
            "64",
            "--disable-log-requests",
        ]
    )
    assert s.model == "/m" and s.model_names == ["x", "y"] and s.disable_log_requests
    assert s.engine_config().scheduler.max_num_batched_tokens == 64


def test_prefix_caching_is_on_by_default_and_follows_flag_then_environment(monkeypatch):
    monkeypatch.delenv("SPECSERVE_ENABLE_PREFIX_CACHING", raising=False)
    assert settings_from([]).engine_config().cache.enable_prefix_caching
    assert not settings_from(["--no-enable-prefix-caching"]).engine_config().cache.enable_prefix_caching
    monkeypatch.setenv("SPECSERVE_ENABLE_PREFIX_CACHING", "false")
    assert not settings_from([]).engine_config().cache.enable_prefix_caching
    assert settings_from(["--enable-prefix-caching"]).engine_config().cache.enable_prefix_caching


def test_settings_are_frozen_and_validated():
    s = ServerSettings()
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ServerSettings(max_num_seqs=0)


def test_bad_flag_values_exit_2(capsys):
    assert main(["serve", "--port", "99999"]) == 2
    assert "port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--dtype", "int3"])
    assert e.value.code == 2


def test_other_subcommands_are_kept():
    parser = build_parser()
    assert parser.parse_args(["fetch-model"]).command == "fetch-model"
    args = parser.parse_args(["generate", "hi", "--max-tokens", "3"])
    assert args.prompt == "hi" and args.max_tokens == 3
