"""
The broker's counters (L{dallal.broker.counters}): one object holds them,
only its methods change them, and they keep the order STATS lists them in.
"""

import ast
import pathlib

import pytest
from twisted.internet.task import Clock

from dallal.broker.core import Broker
from dallal.broker.counters import COUNTERS, Counters
from dallal.limits import PAYLOAD

PACKAGE = pathlib.Path(__file__).parent.parent / "dallal"


def test_everyCounterStartsAtZeroInTheListedOrder():
    """
    A new broker's C{STATS} lists every counter, at 0, in the order of
    L{COUNTERS}: connections first, then the limits' refusals, the
    deliveries and flow control.
    """
    stats = Broker(Clock()).stats()
    del stats["uptime"]
    assert list(stats) == list(COUNTERS)
    assert set(stats.values()) == {0}
    assert COUNTERS[:2] == ("connections", "connections_total")
    assert COUNTERS[-1] == "publishes_busy"


def test_theCountersCannotBeWrittenFromOutside():
    """
    The broker's counters are a read-only mapping: a module that tries to
    write one fails at once instead of changing it behind the counters'
    back.
    """
    broker = Broker(Clock())
    with pytest.raises(TypeError):
        broker.counters["published"] += 1
    with pytest.raises(TypeError):
        broker.counters["published"] = 5
    assert broker.counters["published"] == 0


def test_countRefusesANameThatIsNoCounter():
    counters = Counters()
    counters.count("logins")
    with pytest.raises(KeyError):
        counters.count("loginz")
    assert counters["logins"] == 1
    assert "loginz" not in counters


def test_deliveriesKeepTheInvariant():
    """
    C{matched = acked + fired + replaced + dropped + inflight} whichever
    way the deliveries end.
    """
    counters = Counters()
    for _ in range(5):
        counters.matched()
    counters.settled("acked")
    counters.settled("fired")
    counters.settled("replaced")
    counters.dropped("queue_full", True)
    ended = sum(counters[name] for name in ("acked", "fired", "replaced", "dropped"))
    assert (counters["matched"], ended, counters["inflight"]) == (5, 4, 1)
    assert (counters["dropped_queue_full"], counters["bridged_dropped"]) == (1, 1)


def test_sentCountsFirstAttemptsRedeliveriesAndBridges():
    counters = Counters()
    counters.sent(10, True, False)
    counters.sent(20, True, True)
    counters.sent(30, False, True)
    assert {
        name: counters[name]
        for name in ("bytes_out", "delivered", "bridged_delivered", "redelivered")
    } == {"bytes_out": 60, "delivered": 2, "bridged_delivered": 1, "redelivered": 1}


@pytest.mark.parametrize(
    "countTogether, outcome", [("firedTogether", "fired"), ("sentTogether", None)]
)
def test_deliveriesCountedTogetherCountAsEachOnItsOwn(countTogether, outcome):
    """
    Deliveries fired, or sent to be acked, together -- as they were
    offered or after they waited matched in a queue -- count as the same
    number matched and sent, then fired or in flight, as one by one would.
    """
    together = Counters()
    getattr(together, countTogether)(3, 30, 1, offered=True)
    together.matched(2)
    getattr(together, countTogether)(2, 20, 0, offered=False)
    oneByOne = Counters()
    for bridge in (True, False, False, False, False):
        oneByOne.matched()
        oneByOne.sent(10, True, bridge)
        if outcome is not None:
            oneByOne.settled(outcome)
    assert dict(together) == dict(oneByOne)
    assert (together["matched"], together["delivered"]) == (5, 5)


def test_flowControlCountsPausesAndWhoIsHeldNow():
    counters = Counters()
    counters.publisherHeld()
    counters.publisherHeld()
    counters.publisherReleased()
    assert (counters["publishers_paused"], counters["publishers_held"]) == (2, 1)


def test_sessionsAndSubscriptions():
    counters = Counters()
    counters.connected()
    counters.connected()
    counters.count("subscriptions", 3)
    counters.disconnected(2)
    assert {
        name: counters[name] for name in ("connections", "connections_total", "subscriptions")
    } == {"connections": 1, "connections_total": 2, "subscriptions": 1}


def test_aRefusalCountsItsLimit():
    counters = Counters()
    counters.refused(PAYLOAD)
    assert counters["refused_payload"] == 1


def _countersWritten(tree):
    """
    The lines of a module that assign to an item of something named
    C{counters} (or C{_values}): C{counters["x"] += 1}, C{counters[x] = 0}.
    """
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Subscript):
                owner = target.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("counters", "_values"):
                    lines.append(node.lineno)
    return lines


def test_noModuleButTheCountersWritesACounter():
    """
    Apart from L{dallal.broker.counters}, no module of the broker, the
    servers or the rest of Dallal writes a counter's item: they call the
    counters' methods.
    """
    writers = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "broker" / "counters.py":
            continue
        lines = _countersWritten(ast.parse(path.read_text(), str(path)))
        if lines:
            writers[str(path.relative_to(PACKAGE))] = lines
    assert writers == {}


def test_theCheckFindsAWrite():
    """
    The check of L{test_noModuleButTheCountersWritesACounter} catches the
    ways a module wrote the shared counters.
    """
    source = (
        "self.broker.counters['duplicates'] += 1\ncounters[limit.counter] = 0\nx = counters['a']\n"
    )
    assert _countersWritten(ast.parse(source)) == [1, 2]
