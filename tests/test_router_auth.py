"""`kvstore router` with API keys: a request without a key it knows gets an OpenAI 401 and
reaches no engine; the tenant is the key's, whatever header the client sends; with
``salt_from_tenant`` each tenant's requests carry a cache salt of the router's making, so
tenants never share KV. A real router process in front of a recording replica
(test_router_validation.py)."""

from __future__ import annotations

import json
import re
import signal

import httpx
import pytest
from daemon_harness import eventually
from test_router_validation import CHAT, COMPLETIONS, MODEL, NAMESPACE, RecordingReplica, running_router

from kvstore.config import ConfigError
from kvstore.gateway.config import ReplicaConfig, RouterConfig, load_router_config

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-fedcba9876543210"
KEY_C = "sk-tenant-c-00112233445566778899"
SECRET = "router-salt-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def replica():
    server = RecordingReplica()
    yield server
    server.close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, redis_server, replica):
    """A router with a TOML key file (team-a) and a key from its environment (team-b), salting by tenant."""
    workdir = tmp_path_factory.mktemp("keyed")
    keys = workdir / "keys.toml"
    keys.write_text(f'"{KEY_A}" = "team-a"\n')
    settings = f'api_keys_file = "{keys}"\nsalt_from_tenant = true\n'
    env = {"KVSTORE_ROUTER_API_KEYS": f"team-b:{KEY_B}", "KVSTORE_ROUTER_SALT_SECRET": SECRET}
    with running_router(workdir, redis_server.url, replica, settings, env) as router:
        yield router


def complete(router, headers: dict[str, str], **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 1, **fields}
    return httpx.post(f"{router.url}{COMPLETIONS}", json=body, headers=headers, timeout=30)


def tenant_tokens(router, tenant: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    found = re.search(rf'^kvstore_router_tenant_prompt_tokens_total{{tenant="{re.escape(tenant)}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-not-a-key-of-this-router"},
        {"authorization": f"Bearer {KEY_A}x"},
        {"authorization": KEY_A},  # not a Bearer credential
        {"x-api-key": "sk-not-a-key-of-this-router"},
        {"x-tenant-id": "team-a"},
    ],
)
def test_a_request_without_a_known_key_gets_an_openai_401_and_reaches_no_engine(keyed, replica, headers):
    asked = len(replica.received)
    for path, body in ((CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}), (COMPLETIONS, {"model": MODEL})):
        response = httpx.post(f"{keyed.url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.json() == {
            "error": {
                "message": response.json()["error"]["message"],
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert "sk-" not in response.text  # the presented key is not echoed
    assert httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=10).status_code == 401
    assert len(replica.received) == asked
    assert "sk-" not in keyed.log.read_text()  # nor logged


def test_health_and_metrics_need_no_key(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=10).status_code == 200


def test_the_router_prints_its_security_posture(keyed):
    log = keyed.log.read_text()
    assert re.search(r"security posture: router API .*an API key is required", log), log[-2000:]
    assert "security posture: router metrics" in log and "[OPEN]" not in log


def test_the_tenant_is_the_keys_and_its_salt_the_routers(keyed, replica):
    a_before, b_before = tenant_tokens(keyed, "team-a"), tenant_tokens(keyed, "team-b")
    answers = [
        complete(keyed, {"authorization": f"Bearer {KEY_A}", "x-tenant-id": "team-b", "x-session-id": "s1"}, cache_salt="chosen-by-client"),
        complete(keyed, {"x-api-key": KEY_A, "x-session-id": "s1"}),
        complete(keyed, {"authorization": f"Bearer {KEY_B}", "x-tenant-id": "team-a", "x-session-id": "s1"}),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    received = replica.generations()[-3:]
    salts = [r.json().get("cache_salt") for r in received]
    assert salts[0] == salts[1] != salts[2]  # one salt per tenant, the client's own replaced
    assert all(salt and "chosen" not in salt and "team" not in salt for salt in salts)
    assert answers[0].headers["x-kvstore-prompt-digest"] == answers[1].headers["x-kvstore-prompt-digest"]
    # a session is the tenant's: another tenant naming the same id neither joins nor moves it
    sessions = [a.headers["x-kvstore-session"] for a in answers]
    assert sessions[0] == sessions[1] != sessions[2]
    # the engine sees neither the tenant's key nor the header naming another tenant
    assert not any(KEY_A in json.dumps(r.headers) or KEY_B in json.dumps(r.headers) or "x-tenant-id" in r.headers for r in received)
    assert eventually(lambda: tenant_tokens(keyed, "team-a") == a_before + 80 and tenant_tokens(keyed, "team-b") == b_before + 40)


def test_a_reload_adopts_the_changed_key_file(keyed):
    assert complete(keyed, {"authorization": f"Bearer {KEY_C}"}).status_code == 401
    (keyed.config.parent / "keys.toml").write_text(f'"{KEY_C}" = "team-c"\n')
    keyed.process.send_signal(signal.SIGHUP)
    assert eventually(lambda: complete(keyed, {"authorization": f"Bearer {KEY_C}"}).status_code == 200), keyed.log.read_text()
    assert complete(keyed, {"authorization": f"Bearer {KEY_A}"}).status_code == 401  # no longer in the file
    assert complete(keyed, {"authorization": f"Bearer {KEY_B}"}).status_code == 200  # from the environment, still there
    assert "sk-" not in keyed.log.read_text()


def test_key_files_in_toml_json_and_lines_name_tenants(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_ROUTER_API_KEYS", f"team-b:{KEY_B}")
    texts = {
        "keys.toml": f'"{KEY_A}" = "team-a"\n"{KEY_C}" = "team-c"\n',
        "keys.json": json.dumps({KEY_A: "team-a", KEY_C: "team-c"}),
        "keys.txt": f"# key tenant\n{KEY_A} team-a\n\n{KEY_C}   team-c\n",
    }
    for name, text in texts.items():
        path = tmp_path / name
        path.write_text(text)
        keys = load(tmp_path, {"api_keys_file": str(path)}).api_keys
        assert [keys.tenant_of(k) for k in (KEY_A, KEY_B, KEY_C, "sk-unknown-0123456789")] == ["team-a", "team-b", "team-c", None]
        assert KEY_A not in repr(keys)


@pytest.mark.parametrize(
    "text, env, words",
    [
        ("short team-a\n", {}, "line 1: an API key must have at least 16 characters"),
        (f"{KEY_A} team-a\n{KEY_A} team-b\n", {}, "line 2"),
        (f"{KEY_A} team a b\n", {}, "line 1"),
        (f"{KEY_A} team/a\n", {}, "line 1: the tenant name"),
        ("", {"KVSTORE_ROUTER_API_KEYS": KEY_A}, "KVSTORE_ROUTER_API_KEYS"),
    ],
)
def test_a_bad_key_file_is_refused_with_a_sentence_that_names_the_place(tmp_path, monkeypatch, text, env, words):
    monkeypatch.delenv("KVSTORE_ROUTER_API_KEYS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(words)) as raised:
        load(tmp_path, {"api_keys_file": str(path)})
    assert KEY_A not in str(raised.value)


def test_salting_by_tenant_needs_keys_and_a_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTORE_ROUTER_API_KEYS", raising=False)
    monkeypatch.delenv("KVSTORE_ROUTER_SALT_SECRET", raising=False)
    with pytest.raises(ConfigError, match="API keys"):
        load(tmp_path, {"salt_from_tenant": "true"})
    monkeypatch.setenv("KVSTORE_ROUTER_API_KEYS", f"team-a:{KEY_A}")
    with pytest.raises(ConfigError, match="KVSTORE_ROUTER_SALT_SECRET"):
        load(tmp_path, {"salt_from_tenant": "true"})
    monkeypatch.setenv("KVSTORE_ROUTER_SALT_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        load(tmp_path, {"salt_from_tenant": "true"})


def load(tmp_path, overrides: dict[str, str]) -> RouterConfig:
    """The configuration of a router in front of one replica, ``overrides`` over its file."""
    path = tmp_path / "router.toml"
    path.write_text(f'[router]\nindex = "redis://127.0.0.1:1/0"\n{NAMESPACE}')
    return load_router_config(path, overrides, [ReplicaConfig("http://127.0.0.1:1", "replica-a")])
