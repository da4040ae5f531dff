"""A named consumer's processes against a model (hypothesis, stateful): puts;
polls by up to three processes (Subscribers) of one consumer, their
read-ahead budget changed; a process closed; the consumer reset to its start
or its end, or dropped and subscribed anew, while processes hold its ranges.
After each poll, a process holds only ranges whose lease the catalog gives
it; a process of a dropped consumer cannot poll; whenever the processes are
drained, every change written since the last reset to the start (since the
last reset to the end: after it) was handled since that reset: at least
once, whatever the order of the steps; each change comes with its body.

SQLite and MariaDB, each run on a kind and a consumer of its own in one store.
A few runs here (fixed seed); ``BAGSTORE_CONSUMER_RUNS=N`` runs N."""

from __future__ import annotations

import itertools
import os

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

import bagstore
from bagstore.changes import Change
from bagstore.subscriber import Subscriber
from tests.conftest import Topology
from tests.test_model import run_model

_runs = itertools.count()


class Consumers(RuleBasedStateMachine):
    """One kind's consumer and its processes; what they handled."""

    ds: bagstore.Datastore  # set per run (below)

    def __init__(self) -> None:
        super().__init__()
        self.name = f"c{next(_runs)}"
        self.written: set[bytes] = set()
        self.expected_from: set[bytes] = set()  # written before the last reset to the end
        self.since_reset: set[bytes] = set()  # handled since the last reset
        self.procs: dict[int, Subscriber] = {}
        self.numbers = itertools.count()
        self.subscribe()

    def subscribe(self) -> None:
        def handle(changes: list[Change]) -> None:
            # each with its own body (read ahead without it under a small budget)
            assert all(c.entity is not None and c.entity["id"] == c.id for c in changes)
            self.since_reset.update(c.id for c in changes)

        self.procs[next(self.numbers)] = self.ds.subscribe(self.name, handle, batch=7)

    def teardown(self) -> None:
        for proc in self.procs.values():
            proc.close()
        self.ds.close()  # (a run's connections: MariaDB's 151 are soon taken)

    @rule(n=st.integers(1, 15))
    def put(self, n: int) -> None:
        self.written.update(self.ds.put_many([{"n": i} for i in range(n)]))

    @rule(budget=st.sampled_from([0, 2_000, 32 * 2**20]))
    def read_ahead(self, budget: int) -> None:
        """The memory the processes' reads may hold ahead, together."""
        self.ds.feed.read_ahead_bytes = budget

    @rule()
    def another_process(self) -> None:
        if len(self.procs) < 3:
            self.subscribe()

    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        proc = self.procs[data.draw(st.sampled_from(sorted(self.procs)))]
        proc.poll()
        mine = {no for no, _, owner, _, _ in proc._rows() if owner == proc.member}
        assert set(proc.held) <= mine, (sorted(proc.held), sorted(mine))

    @rule(data=st.data())
    def close_one(self, data: st.DataObject) -> None:
        if len(self.procs) > 1:
            self.procs.pop(data.draw(st.sampled_from(sorted(self.procs)))).close()

    @rule(to=st.sampled_from(["start", "end"]))
    def reset(self, to: str) -> None:
        self.ds.feed.reset_consumer(self.name, to=to)
        self.since_reset = set()
        self.expected_from = set(self.written) if to == "end" else set()

    @rule()
    def drop_and_subscribe_again(self) -> None:
        self.ds.feed.drop_consumer(self.name)
        for proc in self.procs.values():
            try:
                proc.poll()
            except bagstore.InvalidQuery as exc:
                assert "no longer exists" in str(exc)
            else:
                raise AssertionError("a process of a dropped consumer polled")
        self.procs = {}
        self.since_reset, self.expected_from = set(), set()
        self.subscribe()

    @rule()
    def drain(self) -> None:
        for _ in range(500):
            if sum(proc.poll() for proc in self.procs.values()) == 0:
                break
        else:
            raise AssertionError("the processes did not drain")
        missing = self.written - self.expected_from - self.since_reset
        assert not missing, f"{len(missing)} changes never handled"


def test_a_consumers_processes_behave_as_their_model(topo: Topology) -> None:
    examples = int(os.environ.get("BAGSTORE_CONSUMER_RUNS", 6 if topo.is_mysql else 15))

    class Run(Consumers):
        def __init__(self) -> None:
            self.ds = topo.open(kind=f"consumed{next(_runs)}", buckets=32)
            self.ds.feed.enable(bodies=True)
            super().__init__()

    run_model(Run, examples, 25)
