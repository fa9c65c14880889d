"""scripts/bench/publishers.py measures confirmed publishes from several producer threads on a
real server (a tiny run: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

from scripts.bench.peers import Peer
from scripts.bench.publishers import publish_from_threads
from scripts.servers import Server


def test_producer_threads_publish_and_the_probe_counts_their_requests(valkey_server: Server) -> None:
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    base = f"127.0.0.1:{valkey_server.port}"
    ours = publish_from_threads(Peer("lua", f"redislua://{base}/0"), threads=3, n=20, size=100)
    no_group = Peer("lua-no-group", f"redislua://{base}/2", options={"group_commit": False})
    single = publish_from_threads(no_group, threads=3, n=20, size=100)
    stock = publish_from_threads(Peer("stock", f"redis://{base}/1"), threads=1, n=20, size=100)
    for result in (ours, single, stock):
        assert result["cpu_us"] > 0 and result["per_s"] > 0
    # a script call per publish without group commit (and the odd route lookup or keep-alive)
    assert 1.0 <= single["requests"] < 1.2
    assert 0 < ours["requests"] <= single["requests"]
    assert stock["requests"] >= 1.0
    client.close()
