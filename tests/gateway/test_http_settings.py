"""The HTTP server's flags under vLLM's names (gateway/http_settings.py): parsed into ServeConfig with errors
naming the flag, and seen working on a real uvicorn serving the gateway's app with the options `pdserve serve`
gives it: HTTPS with a certificate made here, CORS preflights, the proxy prefix in the OpenAPI description.
No fleet: the app runs without its lifespan (the routes tried here need none)."""

from __future__ import annotations

import ssl
import threading
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import ServeConfig
from gateway.fleet_supervisor import StartedFleet
from gateway.lifespans import FrontendSpec
from gateway.serve_settings import uvicorn_options
from pdserve.main import build_parser
from pdserve.serve import load_serve_config, run_serve
from tests.helpers.servers import free_port
from tests.helpers.tls import client_certificate, self_signed


def parsed(*argv: str) -> ServeConfig:
    return typing.cast(ServeConfig, load_serve_config(build_parser().parse_args(["serve", *argv])))


@contextmanager
def app_server(config: ServeConfig) -> Iterator[str]:
    """The gateway's app on a real uvicorn with `pdserve serve`'s options for `config`, no lifespan (no
    fleet); yields its base URL."""
    no_fleet = FrontendSpec(fleet_actor="", ray_address="", num_frontends=1)  # never joined: no lifespan
    server = uvicorn.Server(uvicorn.Config(create_app(config, no_fleet), host=config.host, port=config.port,
                                           lifespan="off", **uvicorn_options(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"{'https' if config.ssl_certfile else 'http'}://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_vllms_spellings_parse_into_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    config = parsed("--uvicorn-log-level", "warning", "--ssl-keyfile", str(keyfile), "--ssl-certfile",
                    str(certfile), "--root-path", "/llm/", "--allowed-origins", '["https://app.example"]',
                    "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization"]',
                    "--allow-credentials")
    assert (config.uvicorn_log_level, config.ssl_keyfile, config.ssl_certfile, config.root_path) == (
        "warning", str(keyfile), str(certfile), "/llm")
    cors = (config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials)
    assert cors == (["https://app.example"], ["GET", "POST"], ["Authorization"], True)
    # pdserve's own form of a list flag, and the environment's.
    assert parsed("--allowed-origins", "https://a.example", "https://b.example").allowed_origins == [
        "https://a.example", "https://b.example"]
    monkeypatch.setenv("PDSERVE_ALLOWED_ORIGINS", '["*"]')
    assert parsed().allowed_origins == ["*"]
    monkeypatch.setenv("PDSERVE_ALLOWED_ORIGINS", "https://a.example https://b.example")
    assert parsed().allowed_origins == ["https://a.example", "https://b.example"]
    monkeypatch.delenv("PDSERVE_ALLOWED_ORIGINS")
    options = uvicorn_options(config)
    assert {k: options[k] for k in ("log_level", "ssl_keyfile", "ssl_certfile", "access_log")} == {
        "log_level": "warning", "ssl_keyfile": str(keyfile), "ssl_certfile": str(certfile),
        "access_log": True}
    assert uvicorn_options(parsed())["log_level"] == "info"  # as before: uvicorn's access log shows


def test_a_bad_value_is_a_sentence_naming_the_flag(tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_key, _ = self_signed(tmp_path / "other")
    cases: list[tuple[list[str], str]] = [
        (["--ssl-keyfile", str(tmp_path / "missing.pem"), "--ssl-certfile", str(certfile)],
         rf"^--ssl-keyfile: {tmp_path}/missing.pem does not exist"),
        (["--ssl-keyfile", str(keyfile)], r"^--ssl-keyfile serves HTTPS only with --ssl-certfile too"),
        (["--ssl-certfile", str(certfile)], r"^--ssl-certfile serves HTTPS only with --ssl-keyfile too"),
        (["--ssl-keyfile", str(other_key), "--ssl-certfile", str(certfile)],
         r"^--ssl-certfile .* with --ssl-keyfile .*: not a PEM certificate and its private key"),
        (["--ssl-keyfile", str(certfile), "--ssl-certfile", str(keyfile)], r"not a PEM certificate"),
        (["--uvicorn-log-level", "loud"], r"^--uvicorn-log-level: Input should be 'critical'"),
        (["--root-path", "llm"], r"^--root-path: 'llm' is not a path"),
        (["--allowed-origins", '["https://a.example"'], r"^--allowed-origins: not a JSON list of strings"),
        (["--allowed-methods", '["GET"]'], r"^--allowed-methods qualifies CORS, which is off without "
                                           r"--allowed-origins"),
        (["--allow-credentials"], r"^--allow-credentials qualifies CORS"),
        (["--ssl-ca-certs", str(certfile)], r"^--ssl-ca-certs checks client certificates over HTTPS: give "
                                            r"--ssl-keyfile and --ssl-certfile too"),
        (["--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile), "--ssl-cert-reqs", "2"],
         r"^--ssl-cert-reqs 2 checks client certificates against --ssl-ca-certs"),
        (["--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile), "--ssl-ca-certs", str(keyfile)],
         r"^--ssl-ca-certs .*key.pem: not PEM certificates"),
        (["--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile), "--ssl-cert-reqs", "3",
          "--ssl-ca-certs", str(certfile)], r"^--ssl-cert-reqs: Input should be less than or equal to 2"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message):
            parsed(*argv)


def test_pdserve_serve_hands_uvicorn_these_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import gateway.frontends
    import gateway.startup

    keyfile, certfile = self_signed(tmp_path)
    given: dict[str, Any] = {}

    @contextmanager
    def no_fleet(config: ServeConfig) -> Iterator[StartedFleet]:  # no Ray, no fleet actor
        yield StartedFleet(typing.cast(Any, None), FrontendSpec("", "", 1), lambda _: None, lambda: None,
                           config)

    def run(server: uvicorn.Server) -> None:
        given.update(vars(server.config), app=server.config.app)
        server.started = True

    monkeypatch.setattr(gateway.frontends, "fleet_started", no_fleet)
    monkeypatch.setattr(gateway.frontends, "watch_fleet", lambda *args: None)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(gateway.startup, "resolve_model_dir", lambda config: str(tmp_path))  # no model read
    argv = ["serve", "--uvicorn-log-level", "debug", "--ssl-keyfile", str(keyfile), "--ssl-certfile",
            str(certfile), "--ssl-ca-certs", str(certfile), "--ssl-cert-reqs", "1", "--root-path", "/llm",
            "--disable-uvicorn-access-log", "--device", "cpu"]
    assert run_serve(build_parser().parse_args(argv)) == 0
    chosen = ("log_level", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "access_log")
    assert {k: given[k] for k in chosen} == {
        "log_level": "debug", "ssl_keyfile": str(keyfile), "ssl_certfile": str(certfile),
        "ssl_ca_certs": str(certfile), "ssl_cert_reqs": 1, "access_log": False}
    assert given["app"].root_path == "/llm"


def test_https_is_served_with_the_given_certificate(tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    config = ServeConfig(port=free_port(), ssl_keyfile=str(keyfile), ssl_certfile=str(certfile))
    with app_server(config) as url:
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(certfile))
        assert httpx.get(f"{url}/openapi.json", verify=trusting).status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/openapi.json")  # the system's CAs do not know it: it is this certificate
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://{config.host}:{config.port}/openapi.json")  # no plain HTTP beside it


def test_client_certificates_are_required_when_asked(tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    (tmp_path / "ca").mkdir()
    ca_keyfile, ca_certfile = self_signed(tmp_path / "ca")
    client_keyfile, client_certfile = client_certificate(tmp_path, ca_keyfile, ca_certfile)
    config = ServeConfig(port=free_port(), ssl_keyfile=str(keyfile), ssl_certfile=str(certfile),
                         ssl_ca_certs=str(ca_certfile), ssl_cert_reqs=ssl.CERT_REQUIRED)
    with app_server(config) as url:
        trusting = ssl.create_default_context(cafile=str(certfile))
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake is refused
            httpx.get(f"{url}/openapi.json", verify=trusting)
        trusting.load_cert_chain(str(client_certfile), str(client_keyfile))
        assert httpx.get(f"{url}/openapi.json", verify=trusting).status_code == 200


def test_the_access_log_can_be_turned_off(capsys: pytest.CaptureFixture[str]) -> None:
    for is_disabled in (False, True):
        with app_server(ServeConfig(port=free_port(), disable_uvicorn_access_log=is_disabled)) as url:
            httpx.get(f"{url}/openapi.json")
        logged = capsys.readouterr()
        assert ('"GET /openapi.json HTTP/1.1" 200' in logged.out + logged.err) is not is_disabled


def test_cors_answers_the_allowed_origins_only(tmp_path: Path) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    config = ServeConfig(port=free_port(), allowed_origins=["https://app.example"], api_key="sk-key")
    with app_server(config) as url:
        answer = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://app.example"})
        assert answer.status_code == 200, answer.text  # answered before the key is asked for
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        elsewhere = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert elsewhere.status_code == 400 and "access-control-allow-origin" not in elsewhere.headers
        # A refusal by the app (no key: 401) carries the header too, so the page can read why.
        refused = httpx.post(f"{url}/v1/chat/completions", json={}, headers={"Origin": "https://app.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
    with app_server(ServeConfig(port=free_port())) as url:  # no --allowed-origins: no CORS at all
        answer = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://app.example"})
        assert "access-control-allow-origin" not in answer.headers


def test_root_path_reaches_the_openapi_description() -> None:
    config = ServeConfig(port=free_port(), root_path="/llm")
    with app_server(config) as url:
        # A proxy serving under /llm strips the prefix; a client going around it may keep it: both answer.
        for path in ("/openapi.json", "/llm/openapi.json"):
            description = httpx.get(f"{url}{path}").json()
            assert description["servers"] == [{"url": "/llm"}], path
        assert "/llm/openapi.json" in httpx.get(f"{url}/docs").text
    with app_server(ServeConfig(port=free_port())) as url:
        assert "servers" not in httpx.get(f"{url}/openapi.json").json()


def test_the_docs_can_be_turned_off() -> None:
    with app_server(ServeConfig(port=free_port(), disable_fastapi_docs=True)) as url:
        assert [httpx.get(f"{url}{path}").status_code for path in ("/openapi.json", "/docs", "/redoc")] == [
            404, 404, 404]
