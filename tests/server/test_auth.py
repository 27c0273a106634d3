"""--api-key: /v1/* needs the bearer token; /health, /version and /metrics stay open."""

import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, settings

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server(llm_engine):
    with LiveServer(settings(api_key=KEY), llm_engine) as s:
        yield s


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY}x"},
    ],
    ids=["missing", "wrong", "not-bearer", "no-scheme", "longer"],
)
def test_missing_or_wrong_key_is_401(server, headers):
    with server.http() as http:
        for path in ("/v1/models", "/v1/completions"):
            r = http.request("GET" if path == "/v1/models" else "POST", path, headers=headers, json={"prompt": "x"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json() == {
                "error": {
                    "message": "missing or incorrect API key",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }


def test_right_key_works_and_open_routes_need_none(server):
    r = server.client(api_key=KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert r.choices[0].text is not None
    with server.http() as http:
        for path in ("/health", "/version", "/metrics"):
            assert http.get(path).status_code == 200


def test_openai_client_with_a_wrong_key(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="nope").models.list()
    assert e.value.status_code == 401
