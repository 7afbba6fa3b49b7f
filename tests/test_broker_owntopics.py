"""
The broker's own topics (L{dallal.broker.owntopics}): their last values,
published to their subscribers and offered to new ones.
"""

from helpers import RecordingSubscriber
from twisted.internet.task import Clock

from dallal.broker.core import Broker
from dallal.modes import FIRE


def test_aValueNobodySubscribesToIsKeptButNotPublished():
    broker = Broker(Clock())
    broker.publishOwn("$SYS/broker/uptime", b"1")
    broker.publishOwn("$SYS/broker/uptime", b"2")
    assert (broker.counters["published"], broker.counters["sys_published"]) == (0, 0)
    client = RecordingSubscriber("127.0.0.1:1")
    broker.attach(client)
    subscription = broker.subscribe(client, "$SYS/#", "s", FIRE)
    broker.sendRetained(client, subscription)
    assert client.takePayloads() == [b"2"]
    broker.publishOwn("$SYS/broker/uptime", b"3")
    assert client.takePayloads() == [b"3"]
    assert (broker.counters["published"], broker.counters["sys_published"]) == (1, 1)
