"""The server's admission rules (docs/SECURITY.md, docs/RELIABILITY.md) on the pure policy object: no sockets,
no threads, no clock; each test feeds decoded metadata, connections and times and reads the decisions.
The same rules end to end, over sockets: tests/test_hostile_peers.py and tests/test_transport.py."""

from __future__ import annotations

import pytest

import learner.serve.admission as admission_rules
from learner.serve.admission import (
    ACTIVE_S,
    ACTOR_IDLE_S,
    CONNECTIONS_S,
    GO,
    MAX_UNKNOWN_REPORTED,
    SILENT_S,
    Admission,
)

FP = {"fingerprint": {}}


def _refuse_bad(actor, info):
    return None if info.get("ok", True) else "bad fingerprint"


def _accepted(*ids, now=0.0, **kw) -> Admission:
    policy = Admission(_refuse_bad, **kw)
    for actor in ids:
        assert policy.hello(actor, {**FP, "num_envs": 2}, None, now).verdict == "accepted"
    return policy


def test_a_hello_is_accepted_once_and_keeps_only_small_typed_fields():
    policy = Admission(_refuse_bad)
    first = policy.hello(7, {"pid": 12, "num_envs": 4, "fingerprint": "junk", "extra": "x" * 10}, None, 1.0)
    assert (first.verdict, first.joined, first.fresh) == ("accepted", True, True)
    assert policy.accepted[7] == {"pid": 12, "num_envs": 4} and policy.last_seen[7] == 1.0
    again = policy.hello(7, {"num_envs": "4", "resumed": True}, None, 2.0)
    # said again mid-run: not a newcomer, and its envs are mid-episode
    assert (again.verdict, again.joined, again.fresh) == ("accepted", False, False)
    assert policy.accepted[7] == {} and policy.joined == 1


def test_a_refused_hello_evicts_the_id_and_is_told_back_with_its_nonce():
    policy = _accepted(3)
    out = policy.hello(3, {"ok": False, "nonce": "abc"}, None, 1.0)
    assert (out.verdict, out.reason) == ("refused", "bad fingerprint")
    assert 3 not in policy.accepted and 3 not in policy.last_seen and policy.refused[3] == "bad fingerprint"
    assert policy.reports_changed and policy.reports() == ([], [[3, "abc", "bad fingerprint"]])
    assert not policy.reports_changed  # taken into a weights message
    # accepted again: the refusal is forgotten
    assert policy.hello(3, FP, None, 2.0).verdict == "accepted"
    assert 3 not in policy.refused and policy.reports() == ([], [])


def test_a_bad_hello_in_a_verified_local_actors_name_is_ignored_not_obeyed():
    policy = _accepted(0, protected_ids={0})
    out = policy.hello(0, {"ok": False}, None, 1.0)
    assert out.verdict == "ignored" and 0 in policy.accepted and policy.refused_hellos == 1
    assert 0 not in policy.refused and policy.reports() == ([], [])


def test_refused_ids_are_a_bounded_lru_and_take_no_actor_slot(monkeypatch):
    monkeypatch.setattr(admission_rules, "MAX_REFUSED", 16)
    monkeypatch.setattr(admission_rules, "MAX_ACTORS", 4)
    policy = Admission(_refuse_bad)
    for i in range(50):
        assert policy.hello(1000 + i, {"ok": False}, None, 0.0).verdict == "refused"
    assert len(policy.refused) == 16 and list(policy.refused)[0] == 1034 and policy.refused_hellos == 50
    assert len(policy.refused_nonces) == 16
    for actor in range(4):
        assert policy.hello(actor, FP, None, 0.0).verdict == "accepted"


def test_a_full_table_turns_newcomers_away_until_an_idle_actor_gives_its_slot_up(monkeypatch):
    monkeypatch.setattr(admission_rules, "MAX_ACTORS", 3)
    policy = _accepted(0, 1, 2, protected_ids={0})
    out = policy.hello(99, FP, None, ACTOR_IDLE_S)  # nobody silent long enough yet
    assert (out.verdict, out.drop) == ("dropped", "unknown_actor") and 99 not in policy.accepted
    policy.seen(1, ACTOR_IDLE_S)  # actor 1 keeps sending; 0 and 2 go quiet
    out = policy.hello(99, FP, None, ACTOR_IDLE_S + 1)
    # the idle remote actor 2 gives its slot up; the verified local actor 0 never does
    assert out.verdict == "accepted" and out.expired == (2,)
    assert set(policy.accepted) == {0, 1, 99}


def test_with_curve_an_id_belongs_to_the_key_that_claimed_it_first():
    policy = Admission(_refuse_bad)
    assert policy.check_key(5, "hello", FP, "key-a") is GO
    assert policy.hello(5, FP, "key-a", 0.0).verdict == "accepted" and policy.owners[5] == "key-a"
    hello = policy.check_key(5, "hello", {"nonce": "n2"}, "key-b")
    unroll = policy.check_key(5, "unroll", {}, "key-b")
    assert (hello.drop, unroll.drop) == ("wrong_key", "wrong_key")
    assert 5 in policy.accepted and policy.refused_hellos == 1  # the owner is not evicted
    assert policy.reports()[1] == [[5, "n2", "actor id 5 belongs to another client key"]]
    assert policy.check_key(5, "unroll", {}, "key-a") is GO and policy.check_key(5, "unroll", {}, None) is GO


def test_an_unknown_id_is_told_to_say_hello_and_another_runs_orphan_is_not():
    policy = Admission(_refuse_bad)
    policy.run_info = {"run_id": "current"}
    orphan = policy.known_sender(77, {"run_id": "a-killed-run"})
    stranger = policy.known_sender(78, {"run_id": "current"})
    assert (orphan.drop, stranger.drop) == ("other_run", "unknown_actor")
    assert stranger.detail == "no hello received"
    assert policy.reports() == ([78], [])
    for actor in range(100, 100 + 2 * MAX_UNKNOWN_REPORTED):
        policy.known_sender(actor, {})
    assert len(policy.reports()[0]) == MAX_UNKNOWN_REPORTED  # the newest ones


def test_a_refused_id_still_sending_keeps_its_refusal_reported_through_a_flood_of_others():
    policy = Admission(_refuse_bad)
    policy.hello(1000, {"ok": False, "nonce": "mine"}, None, 0.0)
    for actor in range(2000, 2000 + 2 * MAX_UNKNOWN_REPORTED):
        policy.hello(actor, {"ok": False}, None, 0.0)
    assert 1000 not in policy.refused_recent  # pushed out by the newer refusals ...
    out = policy.known_sender(1000, {})
    assert (out.drop, out.detail) == ("unknown_actor", "bad fingerprint")
    assert policy.refused_recent[1000] == ("mine", "bad fingerprint")  # ... and told again while it sends


def test_an_id_over_its_share_is_dropped_only_when_it_sends_over_several_connections():
    policy = _accepted(1)
    policy.run_info = {"envs_per_worker": 1}
    share = policy.fair_share(4)
    assert share == 4 + 2  # the equal part plus two bursts of one unroll per env
    # one connection: never dropped, whatever it holds (back pressure holds it instead)
    assert policy.within_share(1, {}, 10, lambda: 100, share, 0.0) is GO
    assert policy.within_share(1, {}, None, lambda: 100, share, 0.0) is GO
    # a second connection within CONNECTIONS_S: under its share it goes on, at its share it is dropped
    assert policy.within_share(1, {}, 11, lambda: share - 1, share, 1.0) is GO
    first = policy.within_share(1, {"env": 0}, 11, lambda: share, share, 1.0)
    second = policy.within_share(1, {"env": 0}, 10, lambda: share, share, 1.0)
    assert (first.drop, first.quiet, first.lose_episode) == ("over_share", True, True)
    assert "2 connections" in first.warn and second.warn is None  # said once per id
    assert policy.unrolls_by_actor[1][3] == 2
    # the old connection went quiet: one connection again
    assert policy.within_share(1, {}, 11, lambda: share, share, 1.0 + CONNECTIONS_S + 1) is GO


def test_the_equal_part_counts_recent_senders_and_ids_with_unrolls_waiting():
    policy = _accepted(1, 2, 3)
    policy.last_seen.update({1: 10.0, 2: 10.0, 3: 10.0 - 2 * ACTIVE_S})
    assert policy.equal_part(10.0, 8, lambda: set()) == 4  # 2 active: ceil(8 / 2)
    assert policy.equal_part(10.01, 8, lambda: {3}) == 4  # recounted at most every ACTIVE_RECOUNT_S
    assert policy.equal_part(11.0, 8, lambda: {3}) == 8  # nobody sent lately; 3 has unrolls waiting
    assert policy.equal_part(12.0, 8, lambda: set()) == 8  # never below one active id
    policy.run_info = {"envs_per_worker": "4"}  # a bad value: one unroll per burst
    assert policy.fair_share(3) == 5


def test_a_decoded_unroll_must_fit_its_hello_its_task_its_run_its_token_and_the_published_version():
    policy = _accepted(0, 9, protected_ids={0}, local_token="t0ken", task_of=lambda actor, env: env)
    policy.run_info = {"run_id": "current"}
    ours = {"run_id": "current", "env": 1}
    assert policy.after_decoding(9, ours, 1, 0) is GO
    checks = [
        ((9, {**ours, "env": 2}, 1, 0), "schema", "env index 2 outside [0, 2)"),
        ((9, {**ours, "env": "1"}, 1, 0), "schema", "env index '1'"),
        ((9, ours, 0, 0), "schema", "labelled task 0, but env 1 of actor 9 plays task 1"),
        ((9, {**ours, "run_id": "old"}, 1, 0), "other_run", "another learner run"),
        ((0, ours, 1, 0), "unverified_local", "without its token"),
        ((0, {**ours, "local_token": "wrong"}, 1, 0), "unverified_local", "without its token"),
        ((9, ours, 1, 1), "future_version", "policy version 1 > published 0"),
    ]
    for args, reason, detail in checks:
        out = policy.after_decoding(*args)
        assert out.drop == reason and detail in out.detail, (args, out)
    assert policy.after_decoding(0, {**ours, "local_token": "t0ken"}, 1, 0) is GO
    policy.published_version = 1
    assert policy.after_decoding(9, ours, 1, 1) is GO


def test_a_dropped_unroll_in_a_local_actors_name_is_part_of_its_stream_only_with_its_token():
    policy = _accepted(0, 9, protected_ids={0}, local_token="t0ken")
    assert policy.after_decoding(9, {"env": 5}, 0, 0).lose_episode  # an accepted remote actor's gap
    assert not policy.after_decoding(0, {"env": 5}, 0, 0).lose_episode  # someone else's, in 0's name
    assert policy.after_decoding(0, {"env": 5, "local_token": "t0ken"}, 0, 0).lose_episode


def test_silence_is_said_once_and_a_return_is_noticed():
    policy = _accepted(42, now=0.0)
    assert policy.newly_silent(SILENT_S / 2) == []
    assert policy.newly_silent(SILENT_S + 1) == [(42, pytest.approx(SILENT_S + 1))]
    assert policy.newly_silent(SILENT_S + 2) == []  # said once, not every second
    assert policy.seen(42, SILENT_S + 3) is True and policy.seen(42, SILENT_S + 4) is False


def test_the_actor_report_ranks_ids_by_accepted_unrolls():
    policy = _accepted(1, 2)
    for t in range(4):
        policy.count_accepted(2, float(t))
    policy.count_accepted(1, 0.0)
    assert policy.actor_report().startswith("actor 2: 4 unrolls in 3.0s (1.3/s, 0 over its share), actor 1")
