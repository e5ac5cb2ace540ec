"""Redis URLs (redis://, rediss://, unix://, password, ACL user) and the embedded server."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from batchery import Client, ConfigError
from batchery.connection import RedisSettings, redact
from tests.conftest import RedisServer, free_port, newest_redis_server, run_cli, tls_missing
from tests.test_client import BackgroundWorker


def roundtrip(url: str, queue: str) -> None:
    """Enqueue through a Client and get the result back from a worker, over ``url``."""
    with Client(url, queue) as client, BackgroundWorker(url, queue):
        assert client.enqueue("over this url").result(timeout=15).output["echo"] == "over this url"


@pytest.mark.parametrize("url, message", [
    ("http://localhost:6379", "scheme must be redis://"),
    ("localhost:6379", "scheme must be redis://"),
])
def test_bad_urls_are_refused_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RedisSettings.from_url(url)
    with pytest.raises(ConfigError, match="Cluster needs"):
        RedisSettings.from_url("unix:///tmp/x.sock", cluster=True)


def test_passwords_never_show_in_messages() -> None:
    assert redact("redis://alice:s3cret@host:6379/0") == "redis://alice:***@host:6379/0"
    result = run_cli("queue", "stats", redis_url=f"redis://:s3cret@127.0.0.1:{free_port()}/0", timeout=120)
    assert result.returncode == 1 and "cannot reach Redis" in result.stderr
    assert "s3cret" not in result.stderr and "Traceback" not in result.stderr


def test_unix_socket_url(tmp_path: Path, queue_name: str) -> None:
    socket = tmp_path / "r.sock"
    server = RedisServer("--unixsocket", str(socket), "--unixsocketperm", "700")
    try:
        roundtrip(f"unix://{socket}", queue_name)
    finally:
        server.close()


def test_acl_user_and_password_in_the_url(queue_name: str) -> None:
    server = RedisServer("--user", "default", "off", "--user", "alice", "on", ">s3cret", "~*",
                         "&*", "+@all")
    try:
        roundtrip(f"redis://alice:s3cret@127.0.0.1:{server.port}/0", queue_name)
        denied = run_cli("queue", "stats", redis_url=f"redis://alice:wrong@127.0.0.1:{server.port}/0")
        assert denied.returncode == 1 and "refused the credentials" in denied.stderr
        assert "Traceback" not in denied.stderr
    finally:
        server.close()


def make_certificates(folder: Path) -> dict[str, Path]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
            "server.key", "-out", "server.csr")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "server.crt")
    return {name: folder / f"{name}" for name in ("ca.crt", "server.crt", "server.key")}


def test_tls_url(tmp_path: Path, queue_name: str) -> None:
    binary = newest_redis_server()
    if reason := tls_missing(binary):
        pytest.skip(reason)
    certs = make_certificates(tmp_path)
    tls_port = free_port()
    server = RedisServer("--tls-port", str(tls_port), "--tls-cert-file", str(certs["server.crt"]),
                         "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file",
                         str(certs["ca.crt"]), "--tls-auth-clients", "no",
                         binary=binary)
    try:
        roundtrip(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca.crt']}", queue_name)
    finally:
        server.close()


def test_one_client_serves_more_than_a_hundred_threads_at_once(redis_url: str,
                                                               queue_name: str) -> None:
    """redis-py 8 caps a connection pool at 100 unless told otherwise; a Client shared by
    more threads in a Redis call at once (waiters polling their results) must not fail."""
    with Client(redis_url, queue_name) as client:
        errors: list[BaseException] = []

        def hold_a_connection() -> None:  # a blocking read holds its connection for 1 s
            try:
                client.queue.client.blpop([f"test:{queue_name}:nothing"], timeout=1)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hold_a_connection) for _ in range(150)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
