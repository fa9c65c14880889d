"""The layout experiment (scripts/bench/layouts.py, docs/decisions.md "Candidate layouts"): it
replays what the real publish stored, every message in every layout, so its figures compare
layouts of the same messages. The experiment itself is not run by the suite."""

from __future__ import annotations

from scripts.bench import layouts
from scripts.servers import Server

COUNT = 600


def test_the_rows_are_what_publish_stored_one_per_message(scratch_server: Server) -> None:
    rows = layouts.published_rows(scratch_server, COUNT, 100)
    assert len(rows) == len({r.id for r in rows}) == COUNT
    assert len({r.task_id for r in rows}) == COUNT  # each message's own task id, read back
    assert all(r.state.startswith("ready 0 0 ") and r.priority == 0 for r in rows)
    assert all(f'"headers":{{"id":"{r.task_id}"}}' in r.payload for r in rows)
    assert scratch_server.client().dbsize() == 0  # left empty for the layouts


def test_every_layout_holds_every_message(scratch_server: Server) -> None:
    rows = layouts.published_rows(scratch_server, COUNT, 100)
    client = scratch_server.client(decode_responses=True)
    for name, layout in layouts.LAYOUTS.items():
        layouts.flush(client)
        pipe = client.pipeline(transaction=False)
        for command in layout(rows):
            pipe.execute_command(*command)
        pipe.execute()
        # Every id is stored exactly once as a ready entry: a ZSET member, a list element, or
        # the head of a whole message in its list.
        if client.exists(layouts.KEYS.queue):
            ready = client.zrange(layouts.KEYS.queue, 0, -1)
        else:
            elements = client.lrange(layouts.ready_key(0), 0, -1)
            ready = [element.split(" ", 1)[0] for element in elements]
        assert sorted(ready) == [r.id for r in rows], name
        if "no task index" not in name:
            assert client.hget(layouts.KEYS.state, f"task:{rows[0].task_id}") == rows[0].id, name


def test_a_whole_message_in_a_list_takes_less_memory_than_today_s_layout(scratch_server: Server) -> None:
    rows = layouts.published_rows(scratch_server, COUNT, 100)
    client = scratch_server.client()
    today = layouts.memory_per_message(client, layouts.today(rows), COUNT)
    packed = layouts.memory_per_message(client, layouts.message_in_list(rows), COUNT)
    assert packed < today - 200, (packed, today)
