"""The upper bound of every number a script stores or adds to a time, one per kind.

The scripts hold the same values (each file runs on its own: ``MAX_DURATION_MS``,
``MAX_ETA_MS`` and the limits' ``MAX`` are defined in every script that needs one, and
tests/test_lua_constants.py keeps them identical); Python refuses an out-of-range value
first, naming it in the caller's terms (a queue argument, a transport option in seconds,
a message property).

Why bounds at all: Lua numbers are doubles, exact to 2^53, and ``string.format('%d')``
overflows past 2^63, so an unbounded duration stored once (a queue argument of 10^19 ms)
would be added to the clock by every later call and come out as garbage scores and expiry
times. A ready message's score is ``(255 - priority) * 10^13 + ready_at_ms``, so every time
a script computes (an ETA, a TTL deadline, a retry's due time) must stay below 10^13 ms
after the epoch (the year 2286): the clock (about 1.8 * 10^12 in 2026) plus the longest
duration (3.2 * 10^11) is far below it, and every sum stays exact.
"""

from __future__ import annotations

# Ten years of 365 days in ms: the longest x-expires, x-message-ttl, message expiration,
# x-delayed-retry-min/max and visibility timeout. Nobody waits longer on a broker queue.
MAX_DURATION_MS = 315_360_000_000
MAX_DURATION_SECONDS = MAX_DURATION_MS // 1000  # the same bound for options given in seconds
# The latest ETA the publish script takes (unix ms, year 2286): one later would overflow
# into the next priority band of the ready score.
MAX_ETA_MS = 10**13 - 1
# The largest in-flight cap and rate count of the limit script (N of N/s, N/m, N/h), and
# the largest delivery_limit.
MAX_LIMIT = 1_000_000
# The longest cap of a stream (dead letters, fanout), far more than anyone keeps: the scripts
# pass it to XADD MAXLEN, which refuses 2^63 or more ("value is not an integer or out of
# range", checked on Valkey 9 and Redis 7) in the middle of a script that may have written
# other things already (reject's earlier ids).
MAX_STREAM_LENGTH = 1_000_000_000
