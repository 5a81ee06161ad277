"""``cluster.election.Election`` on a real redis-server: one leader at a time, a leader
renews while it leads, a waiting candidate takes over once the leader's TTL lapses (it
was killed or hung) or at once when it resigns, a leader whose lock lapsed learns it
lost, and the note a leader leaves is read by the next."""

from __future__ import annotations

import time

from cluster.election import Election
from deploy.redis_server import RedisServer

TTL_S = 0.6


def _pair(server: RedisServer) -> tuple[Election, Election]:
    return (Election(server.url, name="planner", holder="a", ttl_s=TTL_S),
            Election(server.url, name="planner", holder="b", ttl_s=TTL_S))


def test_one_leads_and_the_other_takes_over_when_its_ttl_lapses(
        redis_server: RedisServer) -> None:
    a, b = _pair(redis_server)
    try:
        assert a.lead() and not b.lead() and a.leader() == "a"
        for _ in range(3):  # renewed within the TTL: a keeps it well past one TTL
            time.sleep(TTL_S / 2)
            assert a.lead() and not b.lead()
        time.sleep(TTL_S * 1.5)  # a stops renewing (killed, hung)
        assert b.lead() and b.leader() == "b"
        assert not a.lead()  # it learns it lost
    finally:
        a.close()
        b.close()


def test_a_resigning_leader_hands_over_at_once(redis_server: RedisServer) -> None:
    a, b = _pair(redis_server)
    try:
        assert a.lead()
        a.resign()
        assert a.leader() is None and b.lead()
    finally:
        a.close()
        b.close()


def test_the_next_leader_reads_the_note_the_last_one_left(redis_server: RedisServer) -> None:
    a, b = _pair(redis_server)
    try:
        assert a.note() is None
        assert a.lead() and a.leave_note('{"last_change_at": 12.5}')
        assert not b.lead() and not b.leave_note("not the leader's")  # only the leader's
        a.resign()
        assert b.lead() and b.note() == '{"last_change_at": 12.5}'
    finally:
        a.close()
        b.close()


def test_without_redis_nobody_leads() -> None:
    election = Election("redis://127.0.0.1:1", name="planner", holder="a", ttl_s=TTL_S,
                        timeout_s=0.5)
    assert not election.lead() and election.leader() is None
    election.close()
