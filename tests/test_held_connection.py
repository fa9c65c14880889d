"""A kombu channel's single script calls go over a connection the channel holds (runner.py's
HeldConnection), outside the client's pool: no pool checkout per publish.

What must hold with it: the pool's max_connections is never made short by it; a lost or
timed-out call is never sent again and its late reply is never read as the next call's;
threads that share one library each get their own replies; a forked child never talks on
its parent's socket; a closed channel lets its connection go.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.connections import packed
from helpers import wait_until
from scripts.servers import Server

NAMES = itertools.count()


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    server = request.getfixturevalue(f"{request.param}_server")
    server.client().flushall()
    server.name = f"crl-held-{next(NAMES)}"  # this test's connections, by CLIENT SETNAME
    yield server


def held_lib(server: Server, **pool_options: object) -> ScriptLibrary:
    pool = redis.BlockingConnectionPool(host="127.0.0.1", port=server.port, client_name=server.name,
                                        **{"max_connections": 4, "timeout": 2, **pool_options})
    return ScriptLibrary(redis.Redis(connection_pool=pool), Keyspace(), hold_connection=True)


def ours(server: Server, command: str | None = None) -> list[dict[str, object]]:
    return [c for c in server.client().client_list()
            if c["name"] == server.name and (command is None or c["cmd"] == command)]


def stored(lib: ScriptLibrary, queue: str, message_id: str) -> bytes | None:
    return lib.client.hget(lib.keys.message(queue), message_id)


def test_single_calls_take_no_connection_from_the_pool(server: Server) -> None:
    lib = held_lib(server, max_connections=1, timeout=0.5)
    taken = lib.client.connection_pool.get_connection()  # the pool's only one
    try:
        ids = [lib.publish("held", f"m{i}") for i in range(200)]
        assert lib.size("held") == 200
    finally:
        lib.client.connection_pool.release(taken)
    assert [stored(lib, "held", i) for i in ids] == [f"m{i}".encode() for i in range(200)]
    assert len(ours(server, "evalsha")) == 1  # one connection ran all 201 calls
    lib.close()
    wait_until(lambda: not ours(server, "evalsha"), what="the held connection is closed")


def test_a_lost_call_is_not_sent_again_and_the_next_one_reconnects(server: Server) -> None:
    lib = held_lib(server)
    first = lib.publish("lost", "first")
    (held,) = ours(server, "evalsha")
    server.client().client_kill_filter(_id=held["id"])
    with pytest.raises(redis.ConnectionError):
        lib.publish("lost", "never stored")
    third = lib.publish("lost", "third")
    assert lib.size("lost") == 2
    assert [stored(lib, "lost", i) for i in (first, third)] == [b"first", b"third"]
    lib.close()


def test_a_reply_a_timeout_cut_off_is_never_read_as_the_next_calls(server: Server) -> None:
    lib = held_lib(server, socket_timeout=0.2)
    lib.publish("late", "warm")  # the held connection exists (CLIENT PAUSE spares it no time)
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
    try:
        with pytest.raises(redis.TimeoutError):
            lib.publish("late", "paused")  # its reply (if it runs at all) comes too late
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    after = lib.publish("late", "after")
    # The reply read is this call's own: the id the queue issued last, holding "after".
    assert admin.hget(lib.keys.meta("late"), "last_id") == after.encode()
    assert stored(lib, "late", after) == b"after"
    lib.close()


def test_threads_sharing_one_library_each_get_their_own_replies(server: Server) -> None:
    lib = held_lib(server)
    replies: dict[str, str] = {}
    errors: list[BaseException] = []

    def publish(thread: int) -> None:
        try:
            for i in range(300):
                payload = f"t{thread}-{i}"
                replies[payload] = lib.publish("shared", payload)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=publish, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert len(replies) == 1200 and len(set(replies.values())) == 1200
    assert all(stored(lib, "shared", message_id) == payload.encode()
               for payload, message_id in replies.items())
    lib.close()


def test_a_forked_child_never_talks_on_its_parents_connection(server: Server) -> None:
    lib = held_lib(server)
    lib.publish("forked", "parent before")  # the parent's held connection exists
    child = os.fork()
    if child == 0:  # the child: every reply must be its own
        code = 1
        try:
            mine = {f"child {i}": lib.publish("forked", f"child {i}") for i in range(300)}
            code = 0 if all(stored(lib, "forked", m) == p.encode() for p, m in mine.items()) else 3
        finally:
            os._exit(code)
    parents = {f"parent {i}": lib.publish("forked", f"parent {i}") for i in range(300)}
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(stored(lib, "forked", m) == p.encode() for p, m in parents.items())
    assert lib.size("forked") == 601
    lib.close()


def test_a_closed_channel_lets_its_held_connection_go(server: Server) -> None:
    url = f"redislua://127.0.0.1:{server.port}/0"
    with Connection(url, transport_options={"client_name": server.name}) as connection:
        channel = connection.channel()
        queue = connection.SimpleQueue("closing", channel=channel)
        queue.put("one")
        held = str(channel.lib.runner.held.execute(channel.client, "CLIENT", "ID"))
        assert held in {c["id"] for c in ours(server)}
        channel.close()
        wait_until(lambda: held not in {c["id"] for c in ours(server)},
                   what="the channel's held connection is closed")
        assert ours(server)  # the transport's pool keeps its own


def test_a_batch_goes_in_one_write_on_the_held_connection_each_reply_in_its_place(server: Server) -> None:
    lib = held_lib(server)
    lib.client.set(lib.keys.message("wrongtype"), "not a hash")  # its publish meets WRONGTYPE
    calls = [lib.calls.publish("batched", "one"), lib.calls.publish("wrongtype", "refused"),
             lib.calls.publish("batched", "two")]
    first, refused, second = lib.run_many(calls, raise_on_error=False)
    assert isinstance(refused, redis.ResponseError) and "WRONGTYPE" in str(refused)
    assert [stored(lib, "batched", i) for i in (first, second)] == [b"one", b"two"]
    assert len(ours(server, "evalsha")) == 1  # the held connection; no pool pipeline
    assert lib.publish("batched", "after") > second  # still in step
    lib.close()


def test_a_batch_a_timeout_cut_off_leaves_no_reply_for_the_next_batch(server: Server) -> None:
    lib = held_lib(server, socket_timeout=0.2)
    lib.publish("late-batch", "warm")
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
    try:
        with pytest.raises(redis.TimeoutError):
            lib.run_many([lib.calls.publish("late-batch", f"paused {i}") for i in range(3)])
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    after = lib.run_many([lib.calls.publish("late-batch", f"after {i}") for i in range(2)])
    assert [stored(lib, "late-batch", m) for m in after] == [b"after 0", b"after 1"]
    assert admin.hget(lib.keys.meta("late-batch"), "last_id") == after[-1].encode()
    lib.close()


@pytest.mark.parametrize("command", [
    ("EVALSHA", "e16099e555ed9dc82fc3312214a70ed590388be4", 2, "queue:{q}", "message:{q}", "é", 0, -1, ""),
    ("SCRIPT", "LOAD", "return 1"),
    ("EVALSHA", "0" * 40, 0, b"\x00\xffbytes", 255, 9999999999999),
])
def test_the_packer_writes_what_redis_py_writes(command: tuple[object, ...]) -> None:
    """runner.packed uses hiredis's packer directly (skipping redis-py's per-argument checks):
    the bytes must be redis-py's own, for every argument type the scripts take."""
    connection = redis.Connection()
    assert packed(connection, command) == b"".join(connection.pack_command(*command))
