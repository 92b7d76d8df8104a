"""The reads a triggerer's triggers share (llmops.jobs.backends.shared): one call answers for
many triggers, no answer is older than a trigger allows, what an answer lacks is read by its own
trigger, a failed read fails every trigger that waited on it without each sending its own, and
the budget of log reads holds. The services themselves are in tests/test_triggerer_scale.py."""

from __future__ import annotations

import threading
import time

import pytest

from llmops.jobs.backends import shared


class Service:
    """A batch read that records each call and can be made to fail or hold."""

    def __init__(self, values=None, fail=None, hold=0.0):
        self.values, self.fail, self.hold = values, fail, hold
        self.calls: list[list] = []
        self.lock = threading.Lock()

    def read_many(self, keys):
        with self.lock:
            self.calls.append(list(keys))
        time.sleep(self.hold)
        if self.fail is not None:
            raise self.fail
        return {k: f"value of {k}" for k in keys if self.values is None or k in self.values}


def ask_all(board, keys, max_age):
    results, errors = {}, {}

    def ask(key):
        try:
            results[key] = board.get(key, max_age)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to look at
            errors[key] = exc

    threads = [threading.Thread(target=ask, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_one_read_answers_for_the_keys_asked_lately_and_serves_them_while_fresh():
    service = Service()
    board = shared.SharedReads(service.read_many, batch=100)
    for key in range(250):   # 250 triggers polled once each: every read carries one key
        board.get(key, max_age=10)
    assert len(service.calls) == 250
    service.calls.clear()
    time.sleep(0.05)
    # their next polls, now that every key has been asked for: 100 keys a read, oldest first
    assert board.get(0, max_age=0.01) == "value of 0"
    assert len(service.calls[0]) == 100 and service.calls[0][0] == 0
    for key in range(1, 100):     # answered by that read: no call
        assert board.get(key, max_age=10) == f"value of {key}"
    assert len(service.calls) == 1
    assert board.get(150, max_age=0.01) == "value of 150"   # not in it: the next read takes it
    assert len(service.calls) == 2 and 150 in service.calls[1]


def test_concurrent_triggers_wait_for_the_read_under_way_instead_of_sending_their_own():
    service = Service(hold=0.3)
    board = shared.SharedReads(service.read_many, batch=100)
    for key in range(50):
        board._asked[key] = time.monotonic()   # asked for before: the first read takes them all
    results, errors = ask_all(board, range(50), max_age=5)
    assert not errors and results == {k: f"value of {k}" for k in range(50)}
    assert len(service.calls) == 1


def test_a_key_the_answer_lacks_is_none_and_asked_once_not_in_every_read():
    service = Service(values={1, 2})
    board = shared.SharedReads(service.read_many, batch=100)
    for key in (1, 2, 3):
        board._asked[key] = time.monotonic()
    assert board.get(1, max_age=5) == "value of 1"
    assert board.get(3, max_age=5) is None   # its trigger reads it on its own
    assert len(service.calls) == 1


def test_a_failed_read_fails_every_trigger_that_waited_on_it_and_is_not_repeated_by_each():
    throttled = RuntimeError("ThrottlingException: Rate exceeded")
    service = Service(fail=throttled, hold=0.3)
    board = shared.SharedReads(service.read_many, batch=100)
    for key in range(40):
        board._asked[key] = time.monotonic()
    results, errors = ask_all(board, range(40), max_age=5)
    assert not results and set(errors) == set(range(40))
    assert all(e is throttled for e in errors.values())
    assert len(service.calls) == 1   # one call failed; forty triggers back off, none calls again


class Listing:
    """A SageMaker-like account: descriptions by name, and what changed since when."""

    def __init__(self):
        self.jobs = {f"job-{i}": {"TrainingJobStatus": "InProgress", "LastModifiedTime": 1.0} for i in range(30)}
        self.modified = {name: 0.0 for name in self.jobs}
        self.lists, self.describes = [], []

    def change(self, name, status):
        self.jobs[name] = {"TrainingJobStatus": status, "LastModifiedTime": time.time()}
        self.modified[name] = time.time()

    def list_changed(self, since):
        self.lists.append(since)
        return {n: dict(d) for n, d in self.jobs.items() if self.modified[n] > since}

    def describe(self, name):
        self.describes.append(name)
        return dict(self.jobs[name]) if name in self.jobs else None


def board_of(account):
    return shared.ChangedSince(account.list_changed, account.describe,
                               lambda summary, seen: summary == seen)


def test_only_the_jobs_the_list_says_changed_are_described_again():
    account = Listing()
    changes = board_of(account)
    for name in account.jobs:
        assert changes.get(name, max_age=10)["TrainingJobStatus"] == "InProgress"
    assert len(account.describes) == 30 and not account.lists
    account.describes.clear()
    time.sleep(0.02)
    account.change("job-7", "Completed")
    for name in account.jobs:     # every trigger's next poll, past max_age: one list for all
        changes.get(name, max_age=0.01)
    assert len(account.lists) == 1 and account.describes == ["job-7"]
    assert changes.get("job-7", max_age=10)["TrainingJobStatus"] == "Completed"
    # the list looked back past what every description covered, by the overlap
    assert account.lists[0] <= time.time() - shared.OVERLAP_SECONDS


def test_a_description_the_list_has_vouched_for_too_long_is_read_again(monkeypatch):
    account = Listing()
    changes = board_of(account)
    changes.get("job-1", max_age=10)
    monkeypatch.setattr(shared, "TRUST_SECONDS", 0.0)
    time.sleep(0.01)
    changes.get("job-1", max_age=10)
    assert account.describes == ["job-1", "job-1"] and not account.lists


def test_a_failed_list_fails_the_triggers_that_waited_on_it():
    account = Listing()
    changes = board_of(account)
    for name in account.jobs:
        changes.get(name, max_age=10)
    slow = threading.Event()

    def failing(since):
        slow.wait(0.3)
        raise RuntimeError("ThrottlingException")

    changes._list_changed = failing
    time.sleep(0.02)
    results, errors = ask_all(changes, list(account.jobs), max_age=0.01)
    assert not results and len(errors) == 30 and changes.lists == 1


def test_the_log_budget_refuses_past_its_rate_and_a_waiting_read_gets_a_token():
    budget = shared.RateBudget(rate=5)
    taken = sum(budget.take() for _ in range(20))
    assert taken == 5 and budget.refused == 15
    started = time.monotonic()
    assert budget.take(wait=True)   # the read after a job's end waits for its token
    assert 0.1 <= time.monotonic() - started < 1.0
    assert shared.RateBudget(rate=0).take()   # 0: no budget


@pytest.mark.parametrize("interval, max_age", [(30, 10.0), (5, 5 / 3), (0.3, 0.5)])
def test_a_shared_value_serves_a_third_of_the_poll_interval(interval, max_age):
    assert shared.max_age_for(interval) == pytest.approx(max_age)
