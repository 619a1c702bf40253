"""TLS: `server.ssl_certfile` / `ssl_keyfile` (and `--ssl-certfile/--ssl-keyfile`) serve
https and wss on every route — pages, JSON, WebSockets, WebRTC offers — and a missing,
unreadable or malformed file is a start-up error naming it, before anything loads.
(`omni-rt serve` itself over https in Chromium: tests/test_pages.py.)"""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest

from omni_rt.specs import SpecError, parse_overlay
from omni_server.app import ssl_context
from omni_server.cli import main
from testkit import serve
from tests.tls import self_signed


def spec(cert: Path | str, key: Path | str):
    return parse_overlay({"server": {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}}, "deploy.yaml").server


def contexts(cert: Path, key: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl_context(spec(cert, key), "test")
    assert server is not None
    client = ssl.create_default_context(cafile=str(cert))
    return server, client


def test_a_bad_certificate_or_key_is_an_error_naming_it(tmp_path):
    cert, key = self_signed(tmp_path / "good")
    other_cert, _ = self_signed(tmp_path / "other")
    _, locked = self_signed(tmp_path / "locked", encrypt=b"secret")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (tmp_path / "nope.pem", key, "server.ssl_certfile: cannot read " + str(tmp_path / "nope.pem")),
        (cert, tmp_path / "gone.key", "server.ssl_keyfile: cannot read " + str(tmp_path / "gone.key")),
        (junk, key, f"server.ssl_certfile: {junk} is not a PEM certificate"),
        (cert, junk, f"server.ssl_keyfile: {junk} is not a PEM private key"),
        (other_cert, key, "do not load as a certificate and its unencrypted private key"),
        (cert, locked, "do not load as a certificate and its unencrypted private key"),
        (tmp_path, key, "server.ssl_certfile: cannot read"),
    ]
    for c, k, message in cases:
        with pytest.raises(SpecError) as err:
            ssl_context(spec(c, k), "deploy.yaml")
        assert message in str(err.value) and str(err.value).startswith("deploy.yaml: "), (c, k, str(err.value))
    with pytest.raises(SpecError, match="ssl_certfile is set but ssl_keyfile is not"):
        parse_overlay({"server": {"ssl_certfile": str(cert)}}, "deploy.yaml")
    assert ssl_context(parse_overlay({}, "x").server, "x") is None  # plain http by default


def test_serve_and_check_refuse_a_missing_file_before_loading_anything(tmp_path, capsys):
    cert, key = self_signed(tmp_path)
    missing = tmp_path / "missing.pem"
    assert main(["serve", "--port", "0", "--ssl-certfile", str(missing), "--ssl-keyfile", str(key)]) == 2
    err = capsys.readouterr().err
    assert f"server.ssl_certfile: cannot read {missing}" in err and "No such file" in err
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(json.dumps({"server": {"ssl_certfile": str(cert), "ssl_keyfile": str(tmp_path / "k.pem")}}))
    assert main(["check", "--deploy", str(deploy)]) == 2
    assert "server.ssl_keyfile: cannot read" in capsys.readouterr().err


async def test_every_kind_of_route_is_served_over_https_and_wss(tmp_path):
    from aiortc import RTCConfiguration, RTCPeerConnection

    cert, key = self_signed(tmp_path)
    async with serve(["world", "voice"], tls=contexts(cert, key)) as h:
        assert h.url("/").startswith("https://") and h.url("/v1/world", ws=True).startswith("wss://")
        r = await h.client.get("/")
        assert r.status == 200 and 'href="/demo/world"' in await r.text()
        assert (await h.client.get("/v1/models")).status == 200
        world = await h.client.ws_connect("/v1/world")
        assert json.loads((await world.receive()).data)["type"] == "session.created"
        await world.close()
        rt = await h.client.ws_connect("/v1/realtime")
        assert json.loads((await rt.receive()).data)["type"] == "session.created"
        await rt.close()
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        r = await h.client.post("/v1/realtime/calls", data=pc.localDescription.sdp, headers={"content-type": "application/sdp"})
        assert r.status == 201 and "m=audio" in await r.text()
        assert (await h.client.delete(r.headers["location"])).status == 204
        await pc.close()
        # a client that does not trust the certificate is refused by TLS itself
        import aiohttp

        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await plain.get(h.url("/health"))
