"""Sessions on the real server: auth → principals, caps → 429, operator API, metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.harness import ADMIN_KEY, ALICE_KEY, LIMITED_KEY, http_client

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

LONG = ("This sentence is long enough to keep the talker busy for a while. " * 61)[:4000]
# seeded: the random tiny talker may sample its end-of-speech token at any point, and
# these tests need audio (a clean-clone run once got an empty answer)
SHORT = {"model": "tts", "voice": "tara", "input": "Short and sweet.", "response_format": "pcm", "seed": 7}


def headers(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"authorization": f"{scheme} {key}"}


@pytest.fixture(scope="module")
def as_(server):
    """One reused HTTP client per key (a new client per call costs a TLS context, which
    is slow on a machine whose cores are busy generating)."""
    clients = {
        key: http_client(server.url, headers(key)) for key in (ADMIN_KEY, ALICE_KEY, LIMITED_KEY)
    }
    yield clients
    for c in clients.values():
        c.close()


def sessions_of(client: httpx.Client) -> list[dict]:
    r = client.get("/v1/sessions")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def wait_no_sessions(client: httpx.Client, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    left = sessions_of(client)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = sessions_of(client)
    return left


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/sessions"), ("POST", "/v1/audio/speech"), ("GET", "/v1/nothing")],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key-123", "Basic dGVzdA==", f"Bearer{ADMIN_KEY}", "Api-Key"])
def test_every_route_needs_a_valid_key(server, method, path, auth):
    h = {"authorization": auth} if auth else {}
    r = httpx.request(method, f"{server.url}{path}", headers=h, json=SHORT if method == "POST" else None)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "Api-Key" in err["message"]


def test_health_is_open_and_both_key_forms_work(server):
    for path in ("/health", "/healthz"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200 and r.json()["sessions"]["store"]["backend"] == "memory"
    assert httpx.get(f"{server.url}/v1/models", headers=headers(ALICE_KEY, "Api-Key")).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=headers(ALICE_KEY, "bearer")).status_code == 200


def test_sdk_with_a_wrong_key_gets_authentication_error(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model="tts", voice="tara", input="hi")


def test_speech_over_cap_is_429_with_retry_after_and_the_slot_comes_back(server, as_):
    import openai

    admin, alice, limited = as_[ADMIN_KEY], as_[ALICE_KEY], as_[LIMITED_KEY]
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key=LIMITED_KEY, max_retries=0)
    assert wait_no_sessions(admin) == []
    refused = 'omni_rt_sessions_rejected_total{kind="oneshot",reason="principal"}'

    def refusals() -> float:  # (other tests' refusals count too: compare before and after)
        line = next((x for x in admin.get("/metrics").text.splitlines() if x.startswith(refused + " ")), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    refused_before = refusals()
    with limited.stream("POST", "/v1/audio/speech", json={**SHORT, "input": LONG}) as held:
        assert held.status_code == 200
        chunks = held.iter_bytes()  # keep it: a dropped iterator closes the connection
        assert next(chunks)
        sid = held.headers["x-session-id"]
        # the principal "limited" may hold one session: the next call is refused
        r = limited.post("/v1/audio/speech", json=SHORT)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "session_limit" and err["type"] == "requests" and "principal" in err["message"]
        with pytest.raises(openai.RateLimitError) as exc:
            sdk.audio.speech.create(model="tts", voice="tara", input="hi")
        assert exc.value.response.headers["retry-after"] == "1"
        assert exc.value.body["code"] == "session_limit"
        # the held one-shot session is visible to its owner and to admins only
        mine = sessions_of(limited)
        assert [(s["id"], s["kind"], s["principal"], s["state"]) for s in mine] == [(sid, "oneshot", "limited", "active")]
        assert mine[0]["turn"] == 1 and mine[0]["epoch"] == 0
        assert sid in [s["id"] for s in sessions_of(admin)]
        assert sid not in [s["id"] for s in sessions_of(alice)]
        # leaving the block disconnects mid-stream
    assert wait_no_sessions(admin) == []
    again = limited.post("/v1/audio/speech", json=SHORT)
    assert again.status_code == 200 and len(again.content) > 0
    m = admin.get("/metrics").text
    assert refusals() == refused_before + 2
    assert 'omni_rt_sessions_active{kind="oneshot"} 0.0' in m
    assert 'omni_rt_sessions_ended_total{kind="oneshot",reason="completed"}' in m
    for name in (
        'omni_rt_stage_inflight_requests{stage="talker"}',
        'omni_rt_stage_queue_depth{stage="code2wav"}',
        "omni_rt_session_admission_seconds_count",
        'omni_rt_request_e2e_seconds_count{api="speech"}',
        'omni_rt_time_to_first_packet_seconds_count{api="speech"}',
    ):
        assert name in m, name


def test_operator_closes_a_running_session(server, as_):
    admin, alice, limited = as_[ADMIN_KEY], as_[ALICE_KEY], as_[LIMITED_KEY]
    with limited.stream("POST", "/v1/audio/speech", json={**SHORT, "input": LONG}) as held:
        chunks = held.iter_bytes()
        assert next(chunks)
        sid = held.headers["x-session-id"]
        # not visible to another principal; its owner needs the session token (a
        # one-shot session has none); an admin may close it
        r = alice.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = limited.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_resume_token"
        r = admin.get(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.json()["state"] == "active"
        r = admin.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.json() == {"id": sid, "object": "session.deleted", "deleted": True}
        with pytest.raises(httpx.HTTPError):
            for _ in chunks:  # the body ends early: the response is cut, not completed
                pass
    r = admin.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 410 and r.json()["error"]["code"] == "session_gone" and "operator" in r.json()["error"]["message"]
    r = admin.get("/v1/sessions/sess_unknown")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert admin.get("/health").json()["running_requests"] == 0
