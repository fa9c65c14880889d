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
