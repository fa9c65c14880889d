"""Valkey's io-threads and our transport (issue 41): the main thread's CPU per confirmed
publish and per consume+ack, with io-threads 1 (off) and more, interleaved.

    python -m scripts.bench.iothreads                 # io-threads 1,2,4; 3 repeats
    python -m scripts.bench.iothreads --levels 1,2 -n 5000 --publishers 8

Each level runs a throwaway Valkey with ``--io-threads N``. One job: ``--publishers``
producer threads (each with its own kombu connection) publish ``-n`` messages in all, then
one kombu consumer (prefetch 100) takes and acks them. Reported: the main thread's CPU
(INFO used_cpu_*_main_thread) and the whole process's, µs per message, for each phase.
The main thread is what io-threads relieves: reading requests and writing replies move to
the I/O threads, the scripts stay on the main thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from scripts.servers import Server

from . import kombu_level
from .peers import Peer
from .publishers import publish_from_threads
from .server_cost import Probe


def one_level(io_threads: int, publishers: int, n: int, size: int) -> dict[str, float]:
    with Server("valkey", args=("--io-threads", str(io_threads))) as server:
        peer = Peer("lua", f"redislua://127.0.0.1:{server.port}/0")
        probe = Probe(peer)
        try:
            before = probe.snapshot()
            publish_from_threads(peer, publishers, n // publishers, size)
            published = probe.cost(before, probe.snapshot(), n)
            consumed = kombu_level.run(peer, n, 100, size)["consume"]["server"]
        finally:
            probe.close()
    return {"publish_main": published["cpu_main_us_per_msg"],
            "publish_all": published["cpu_us_per_msg"],
            "consume_main": consumed["cpu_main_us_per_msg"], "consume_all": consumed["cpu_us_per_msg"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.iothreads",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--levels", default="1,2,4", help="comma-separated io-threads settings")
    p.add_argument("--publishers", type=int, default=8, help="producer threads")
    p.add_argument("-n", type=int, default=4000, help="messages per job")
    p.add_argument("--size", type=int, default=300, help="message body bytes")
    p.add_argument("--repeat", type=int, default=3)
    o = p.parse_args(argv)
    levels = [int(x) for x in o.levels.split(",") if x.strip()]
    results: dict[int, list[dict[str, Any]]] = {level: [] for level in levels}
    for r in range(o.repeat):
        for level in levels[r % len(levels):] + levels[:r % len(levels)]:
            one = one_level(level, o.publishers, o.n, o.size)
            results[level].append(one)
            print(f"repeat {r + 1} io-threads {level}: " + ", ".join(f"{k} {v:.1f}" for k, v in one.items()),
                  file=sys.stderr)
    print(f"Valkey io-threads, {o.publishers} publishers, {o.n} messages, medians of {o.repeat}: "
          "server µs per message")
    print(f"{'io-threads':>10} {'publish: main':>14} {'all':>7} {'consume+ack: main':>18} {'all':>7}")
    for level in levels:
        med = {k: statistics.median(x[k] for x in results[level]) for k in results[level][0]}
        print(f"{level:>10} {med['publish_main']:14.1f} {med['publish_all']:7.1f} "
              f"{med['consume_main']:18.1f} {med['consume_all']:7.1f}")


if __name__ == "__main__":
    main()
