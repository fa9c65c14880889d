import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.servers import server_version

ROOT = Path(__file__).resolve().parents[1]


def test_every_target_answers_and_runs_a_script(target, lib):
    message_id = lib.publish("fixture-check", "payload")
    consumed = lib.consume(["fixture-check"], 5)
    assert [d.id for d in consumed.deliveries] == [message_id]
    if not target.is_cluster:
        version = server_version(target.client)
        assert version.split()[0] == target.name


# A process that starts a server, writes to it, prints the server's directory and exits
# without stopping it (as a test run does with whatever a fixture left running).
_LEAVES_A_SERVER = """
from scripts.servers import Server
server = Server("valkey").start()
server.client().set("k", "v")
print(server.directory, flush=True)
"""


@pytest.mark.parametrize("keep", [False, True])
def test_a_server_s_directory_goes_with_the_process_that_made_it(keep: bool) -> None:
    env = {key: value for key, value in os.environ.items() if key != "CRL_KEEP_SERVER_DIRS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT)])
    if keep:
        env["CRL_KEEP_SERVER_DIRS"] = "1"
    done = subprocess.run([sys.executable, "-c", _LEAVES_A_SERVER], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    directory = Path(done.stdout.strip())
    assert directory.name.startswith("crl-valkey-")
    try:
        assert directory.exists() is keep
        if keep:
            assert (directory / "server.log").exists()
    finally:
        if keep:
            shutil.rmtree(directory)


def test_a_fixture_port_is_never_one_a_client_could_be_given() -> None:
    """A client connecting to a port of the ephemeral range where nothing listens yet can be
    given that port as its own and connect to itself: a starting server's PING probe read its
    own PING back, held the port, and the server could not bind (CI: "Connection refused" right
    after a start that had "answered"). Fixture ports stay below the range."""
    from scripts.servers import free_port
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ephemeral = range(low, high + 1)
    plain = [free_port() for _ in range(200)]
    bus = [free_port(cluster_bus=True) for _ in range(200)]
    assert not [port for port in plain if port in ephemeral]
    assert not [port for port in bus if port in ephemeral or port + 10000 in ephemeral]
