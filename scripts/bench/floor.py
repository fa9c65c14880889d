"""The floor under a script call: what EVALSHA costs the server with a publish's keys and
arguments when the script does nothing, one call, a publish's commands bare, and publish.lua.

Counted in instructions under callgrind (script_ab's CallgrindServer: only inside
``evalShaCommand``, so the request's reading and the reply's writing are not in it), per
call, on a flushed server, each probe run twice and the second round kept (the first grows
the server's hashes). What it tells: how much of a script's cost is the shell every EVALSHA
pays, how much each ``redis.call`` adds beyond its command, and how much is the script's
own Lua; so what merging calls or trimming Lua can and cannot buy (docs/performance.md,
"The floor under a script call").

    python -m scripts.bench.floor --kind valkey -n 1000
    python -m scripts.bench.floor --kind valkey --ops    # what single Lua operations cost
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.bench.script_ab import PAYLOAD, CallgrindServer, measured, queue_keys

ROOT = Path(__file__).resolve().parents[2]

# The publish's common path (a task id, no TTL, no ETA, the token armed), written bare: the
# same commands on the same keys, with no checks, no formatting and no id of its own.
BARE_PUBLISH = """\
local r = redis.call
r('TIME')
r('HMGET', KEYS[4], 'expires', 'message_ttl', 'max_priority', 'last_id', 'paused', 'limits', 'fair', 'fair:')
r('HGET', KEYS[7], 'task:' .. ARGV[6])
r('LLEN', KEYS[8])
r('HSET', KEYS[6], ARGV[6], ARGV[1])
r('HSET', KEYS[7], ARGV[6], 'ready 0 0 - ' .. ARGV[6], 'task:' .. ARGV[6], ARGV[6])
r('ZADD', KEYS[1], 2550000000000000, ARGV[6])
r('HSET', KEYS[4], 'last_id', ARGV[6])
return ARGV[6]
"""

PROBES = {  # name -> the script run with the publish's 8 keys and 6 arguments
    "no-op (return 1)": "return 1",
    "one call (TIME)": "return redis.call('TIME')[1]",
    "publish's 8 commands, bare": BARE_PUBLISH,
    "publish.lua": (ROOT / "lua" / "publish.lua").read_text(),
}


# What one Lua operation costs inside a script (`--ops`): each run 100 times in a loop, per
# call, less the empty loop; ARGV[1] is '60000' and ARGV[2] a queue key, as a script gets them.
OPERATIONS = {
    "empty loop": "",
    "string.match of an integer": "local x = string.match(ARGV[1], '^%-?%d+$')",
    "string.find of an integer": "local x = string.find(ARGV[1], '^%-?%d+$')",
    "tonumber of a string": "local x = tonumber(ARGV[1])",
    "a string + 0": "local x = ARGV[1] + 0",
    "string.format('%d')": "local x = string.format('%d', 1765000000000)",
    "a 3-part concatenation": "local x = ARGV[1] .. ' ' .. ARGV[2]",
    "an empty table": "local x = {}",
    "a table of 6 fields": "local x = {a = 1, b = 2, c = 3, d = 4, e = 5, f = 6}",
    "a state line parsed (6 captures)":
        "local a, b, c, d, e, f = string.match('unacked 1 0 -:ab task-1',"
        " '^(%a+) (%d+) (%d+) ([^%s:]+):?(%x*) ?(.*)$')",
    "a closure": "local function f(a) return a end",
    "redis.call('TIME')": "local x = redis.call('TIME')",
}


def operations(kind: str, calls: int = 200, loops: int = 100) -> dict[str, float]:
    """Instructions per Lua operation of OPERATIONS, on a server of ``kind``."""
    CallgrindServer.require()
    costs: dict[str, float] = {}
    with CallgrindServer(kind) as server:
        client = server.client(socket_timeout=60)
        for name, body in OPERATIONS.items():
            sha = client.script_load(f"for i = 1, {loops} do {body} end return 1")
            pipe = client.pipeline(transaction=False)
            for _ in range(calls):
                pipe.evalsha(sha, 0, "60000", "queue:{q}")
            costs[name] = measured(client, pipe.execute, server)
        client.close()
    empty = costs.pop("empty loop")
    return {name: (cost - empty) / loops for name, cost in costs.items()}


def measure(kind: str, n: int) -> dict[str, float]:
    """Instructions per EVALSHA of each probe, on a server of ``kind``."""
    CallgrindServer.require()
    costs: dict[str, float] = {}
    with CallgrindServer(kind) as server:
        client = server.client(socket_timeout=60)
        for name, source in PROBES.items():
            sha = client.script_load(source)
            for warm in (True, False):
                client.flushall()
                pipe = client.pipeline(transaction=False)
                for i in range(n):
                    pipe.evalsha(sha, 8, *queue_keys("q"), PAYLOAD, 0, "", "", 60_000, f"task-{i}")
                cost = measured(client, pipe.execute, server)
                if not warm:
                    costs[name] = cost
        client.close()
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--kind", choices=["valkey", "redis"], default="valkey")
    parser.add_argument("-n", type=int, default=1000, help="calls per probe")
    parser.add_argument("--ops", action="store_true", help="what single Lua operations cost instead")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("-n must be >= 1")
    if args.ops:
        print(f"{args.kind}: instructions per Lua operation inside a script")
        for name, cost in operations(args.kind).items():
            print(f"  {name:<34} {cost:>8,.0f}")
        return
    costs = measure(args.kind, args.n)
    shell = costs["no-op (return 1)"]
    print(f"{args.kind}: instructions per EVALSHA (publish's 8 keys and 6 arguments), {args.n} calls")
    for name, cost in costs.items():
        print(f"  {name:<28} {cost:>10,.0f}  ({cost - shell:>+10,.0f} over the no-op)")


if __name__ == "__main__":
    main()
