"""ServerSettings from flags and SPECSERVE_* variables; the CLI's subcommands; configuration
errors refused at the door."""

import json
import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.spec_decode.registry import DRAFTERS, NEEDS_MODEL
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


def test_an_unknown_method_is_refused_before_the_model_loads():
    """One line on stderr and exit 2, from a real ``specserve serve`` process (it would load the
    default model, for minutes, if the door let the typo through)."""
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--speculative-config", '{"method": "ngramm"}'],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "SPECSERVE_PORT": "0"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "specserve serve: error: --speculative-config: unknown speculative method 'ngramm'; known: "
        + ", ".join(DRAFTERS)
    ]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle3"}, 'speculative method "eagle3" needs "model"'),
    ({"method": "ngram+eagle"}, 'speculative method "ngram+eagle" needs "model"'),
    ({"method": "draft_model", "model": "/no/such/draft"}, "speculative \"model\" '/no/such/draft' does not exist"),
    ({"method": "eagle", "model": "/no/such/head"}, "speculative \"model\" '/no/such/head' does not exist"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "wrong type"),
    ({"method": "ngram", "lookup": 3}, "unknown speculative-config keys ['lookup']"),
])
def test_bad_speculative_configs_exit_2_with_one_line(capsys, config, message):
    assert main(["serve", "--speculative-config", json.dumps(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("specserve serve: error: --speculative-config: ") and message in err[0]


def test_a_method_with_weights_is_let_through_with_an_existing_path(tmp_path):
    spec = settings_from(["--speculative-config", json.dumps({"method": "eagle3", "model": str(tmp_path)})])
    assert spec.engine_config().speculative.model == str(tmp_path)


def test_every_method_needing_weights_is_registered():
    assert NEEDS_MODEL <= set(DRAFTERS)


def test_the_engine_checks_the_method_before_loading_the_target():
    """The target path does not exist either: the speculative config is refused first."""
    config = EngineConfig(ModelConfig(model="/no/such/model"), speculative=SpeculativeConfig(method="ngramm"))
    with pytest.raises(ValueError, match="unknown speculative method 'ngramm'"):
        LLMEngine(config)


def test_help_lists_every_method(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f'"{method}"' in help_text for method in DRAFTERS)
