"""HTTPS through uvicorn's own TLS options (`--ssl-certfile`, `--ssl-keyfile`, or the [gateway]
table's `ssl_certfile`/`ssl_keyfile`): a real gateway process with a certificate from a test
authority (trustme), called by a client that trusts only that authority."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from tests.support import prefork
from tests.support.cli import ROOT
from tests.support.ports import free_port
from tests.support.waiting import until_blocking


@contextlib.contextmanager
def tls_gateway(tmp_path: Path, ca: trustme.CA) -> Iterator[int]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp_path / "gateway.crt", tmp_path / "gateway.key"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    # The config file's table, as the systemd unit gives it (flags and table read the same).
    config = tmp_path / "flowmesh.toml"
    config.write_text(f'[gateway]\nssl_certfile = "{certfile}"\nssl_keyfile = "{keyfile}"\n')
    port = free_port()
    log = tmp_path / "gateway.log"
    # No broker listens there: liveness needs none, readiness says so.
    argv = ["--broker", f"tcp://127.0.0.1:{free_port()}", "--port", str(port)]
    proc = prefork.spawn("gateway", [*argv, "--config", str(config)], log, ROOT)
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the gateway exited {proc.returncode}: {log.read_text()}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            return False

        until_blocking(listening, f"the gateway to listen on {port}", poll=0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_gateway_serves_https_with_the_configured_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    with tls_gateway(tmp_path, ca) as port:
        url = f"https://127.0.0.1:{port}"
        live = httpx.get(f"{url}/v2/health/live", verify=trusting, timeout=10)
        assert (live.status_code, live.json()) == (200, {"live": True})
        assert live.http_version == "HTTP/1.1"
        ready = httpx.get(f"{url}/v2/health/ready", verify=trusting, timeout=30)
        assert ready.status_code == 503
        # A client that does not trust the test authority refuses the certificate, and plain
        # HTTP to the TLS port gets no answer.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/v2/health/live", timeout=10)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=10)
