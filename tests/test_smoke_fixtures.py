from tools.servers import server_version


def test_every_target_answers_and_runs_a_script(target, lib):
    message_id = lib.publish("fixture-check", "payload")
    consumed = lib.consume(["fixture-check"], 5)
    assert [d.id for d in consumed.deliveries] == [message_id]
    if not target.is_cluster:
        version = server_version(target.client)
        assert version.split()[0] == target.name
