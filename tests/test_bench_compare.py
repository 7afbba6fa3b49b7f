"""
The pure logic of bench/compare.py, without a broker: how its load generator
counts MQTT and Dallal deliveries (and what it answers), when it pauses to
read in batches, and how the table of ratios to Mosquitto and the targets of
the issues are judged from the measurements.
"""

import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))

import compare  # noqa: E402
from brokerproc import BenchError  # noqa: E402
from protocols import (  # noqa: E402
    DallalClient,
    MqttClient,
    lastPayload,
    mqttPacket,
    payload,
)

TOPIC = b"bench0"


def mqttPublishes(qos, count, size=64):
    """
    C{count} PUBLISH packets as compare.py's firehose encodes them, the last
    one marked as such.
    """
    return compare.firehoseFrames(MqttClient(qos), TOPIC, count, size)


def feedInPieces(stream, data, pieceSize):
    replies = b""
    for start in range(0, len(data), pieceSize):
        replies += stream.feed(data[start : start + pieceSize])
    return replies


@pytest.mark.parametrize("pieceSize", [1, 7, 72, 1000, 10**6])
def test_mqttPublishesCountedWhateverTheReads(pieceSize):
    """
    Every QoS 0 PUBLISH is counted once, and the last one's marker seen,
    whether a read ends inside the fixed header, the topic or the payload,
    or holds them all.
    """
    stream = MqttClient(0).stream()
    replies = feedInPieces(stream, mqttPublishes(0, 500), pieceSize)
    assert (stream.messages, stream.lastMarkers, replies) == (500, 1, b"")


@pytest.mark.parametrize("pieceSize", [3, 1000, 10**6])
def test_mqttQos1PublishesAckedInOrder(pieceSize):
    """
    At QoS 1 every PUBLISH gets a PUBACK with its packet id, in order,
    whether it was parsed alone or counted in a batch of same-length
    packets.
    """
    stream = MqttClient(1).stream()
    replies = feedInPieces(stream, mqttPublishes(1, 300), pieceSize)
    expected = b"".join(bytes([0x40, 2]) + number.to_bytes(2, "big") for number in range(1, 301))
    assert stream.messages == 300
    assert replies == expected


def test_mqttLongRemainingLength():
    """
    A packet whose remaining length takes two bytes (a 200-byte payload)
    is measured by its length, not mistaken for two packets.
    """
    stream = MqttClient(0).stream()
    data = mqttPublishes(0, 50, size=200)
    assert data[1] & 0x80  # the length's continuation bit
    feedInPieces(stream, data, 2)
    assert (stream.messages, stream.lastMarkers) == (50, 1)


def test_mqttPubacksCountedAsAcks():
    stream = MqttClient(1).stream()
    stream.feed(b"".join(bytes([0x40, 2, 0, number]) for number in range(1, 101)))
    assert (stream.acks, stream.messages) == (100, 0)


def test_mqttRefusedConnection():
    """
    A CONNACK with a non-zero return code stops the measurement with what
    the broker said.
    """
    with pytest.raises(BenchError, match="refused the connection"):
        MqttClient(0).stream().feed(mqttPacket(2, 0, b"\x00\x05"))


def test_dallalFireCounted():
    client = DallalClient("fire")
    stream = client.stream()
    data = (
        b"".join(b"MSG bench0 64 sub=s0-0 seq=%d\r\n%s\r\n" % (n, payload(64)) for n in range(99))
        + b"MSG bench0 64 sub=s0-0 seq=99\r\n"
        + lastPayload(64)
        + b"\r\n"
    )
    replies = feedInPieces(stream, data, 333)
    assert (stream.messages, stream.lastMarkers, replies) == (100, 1, b"")


def test_dallalAllAcked():
    stream = DallalClient("all").stream()
    replies = stream.feed(
        b"".join(b"MSG t 2 sub=s seq=%d id=%d\r\nxx\r\n" % (n, n + 10) for n in range(3))
    )
    assert replies == b"ACK 10\r\nACK 11\r\nACK 12\r\n"


def test_pausesOnlyAfterATrickle(monkeypatch):
    """
    The generator pauses after reads that brought little each, longer the
    more connections it read, up to a bound; after full reads it does not.
    """
    pauses = []
    monkeypatch.setattr(compare.time, "sleep", pauses.append)
    compare.pauseAfterTrickle(compare.TRICKLE_BYTES, 1)
    compare.pauseAfterTrickle(0, 0)
    assert pauses == []
    compare.pauseAfterTrickle(100, 1)
    compare.pauseAfterTrickle(100 * 75, 100)
    assert pauses == [compare.TRICKLE_PAUSE, compare.LONGEST_PAUSE]


# The comparisons, from made-up measurements.


def measurement(contender, perCpuSecond, rate=None, scenario="a", style=compare.FIREHOSE, lost=0):
    """
    A measurement of 100,000 expected deliveries with the given figures.
    """
    delivered = 100_000 - lost
    return compare.Measurement(
        run=1,
        scenario=compare.SCENARIOS_BY_KEY[scenario],
        style=style,
        contender=compare.CONTENDERS_BY_KEY[contender],
        expected=100_000,
        deliveries=delivered,
        seconds=delivered / (rate or perCpuSecond),
        brokerCpu=delivered / perCpuSecond,
        brokerWait=0.0,
        generatorCpu=0.0,
        peakMemory=0,
        latencies=[],
    )


def groupsOf(*measurements):
    groups = {}
    for m in measurements:
        groups.setdefault((m.scenario.key, m.style, m.contender.key), []).append(m)
    return groups


def test_measurementFigures():
    m = measurement("mosquitto-qos0", 200_000, rate=50_000, lost=1000)
    assert m.lost == 1000
    assert m.perCpuSecond == pytest.approx(200_000)
    assert m.rate == pytest.approx(50_000)


def test_referenceIsTheStrongerMosquitto():
    """
    Ratios are taken to whichever Mosquitto configuration at the same QoS
    delivered more per CPU-second: the bounded one when it does better, the
    unbounded one when the bound made it lose messages.
    """
    groups = groupsOf(
        measurement("mosquitto-qos0", 200_000),
        measurement("mosquitto-qos0-unbounded", 150_000),
        measurement("mosquitto-qos1", 80_000, lost=50_000),
        measurement("mosquitto-qos1-unbounded", 100_000),
    )
    assert compare.mosquittoReference(groups, "a", compare.FIREHOSE, 0) == "mosquitto-qos0"
    assert (
        compare.mosquittoReference(groups, "a", compare.FIREHOSE, 1) == "mosquitto-qos1-unbounded"
    )
    assert compare.mosquittoReference(groups, "b", compare.FIREHOSE, 0) is None


def test_ratiosToMosquitto():
    """
    Each broker is compared with the Mosquitto reference of its own QoS, in
    medians, per CPU-second and per second; the reference is not compared
    with itself.
    """
    groups = groupsOf(
        *[measurement("mosquitto-qos0", 100_000, rate=50_000)] * 3,
        measurement("mosquitto-qos1", 50_000),
        measurement("dallal-fire", 150_000, rate=100_000),
        measurement("dallal-fire", 50_000, rate=100_000),
        measurement("dallal-fire", 250_000, rate=100_000),
        measurement("dallal-all", 25_000),
    )
    contenders = [compare.CONTENDERS_BY_KEY[key] for key in compare.DEFAULT_CONTENDERS]
    ratios = {
        ratio.contender: ratio
        for ratio in compare.ratiosToMosquitto(groups, ["a"], [compare.FIREHOSE], contenders)
    }
    assert sorted(ratios) == ["dallal-all", "dallal-fire"]
    fire = ratios["dallal-fire"]
    assert (fire.peer, fire.perCpuSecond, fire.perSecond) == ("mosquitto-qos0", 1.5, 2.0)
    assert fire.perCpuSecondRuns == (0.5, 2.5)  # run by run
    assert (ratios["dallal-all"].peer, ratios["dallal-all"].perCpuSecond) == (
        "mosquitto-qos1",
        0.5,
    )


def test_targetsJudgedPerCpuSecond():
    """
    A target is met when the contender's median deliveries per CPU-second
    reach its factor times the peer's, in each style measured, whatever the
    deliveries per second; "more than" targets need strictly more.
    """
    groups = groupsOf(
        measurement("mosquitto-qos0", 100_000, rate=10_000),
        measurement("dallal-fire", 99_000, rate=900_000),
        measurement("mosquitto-qos0", 100_000, style=compare.WINDOWED),
        measurement("dallal-fire", 100_000, style=compare.WINDOWED),
        measurement("dallal-mqtt-qos0", 100_000),
        measurement("amqtt-qos0", 10_000),
    )
    verdicts = {
        (verdict.target.contender, verdict.style): verdict
        for verdict in compare.judgeTargets(groups, [compare.FIREHOSE, compare.WINDOWED])
    }
    assert not verdicts["dallal-fire", compare.FIREHOSE].met
    assert "0.99x: not met" in verdicts["dallal-fire", compare.FIREHOSE].describe()
    assert verdicts["dallal-fire", compare.WINDOWED].met
    # Exactly 10x amqtt is not "more than 10x".
    mqtt = [v for v in compare.judgeTargets(groups, [compare.FIREHOSE]) if v.peer == "amqtt-qos0"]
    assert [(v.ratio, v.met) for v in mqtt] == [(10.0, False)]


def test_everyTargetOfTheIssues():
    """
    The targets of issues 25 and 28, per CPU-second, as the brief lists them.
    """
    described = {(target.scenario, target.describe()) for target in compare.TARGETS}
    assert described == {
        ("a", "Dallal fire >= 1x Mosquitto (issue 25)"),
        ("b", "Dallal fire >= 2x Mosquitto (issue 25)"),
        ("c", "Dallal fire >= 1x Mosquitto (issue 25)"),
        ("a", "Dallal all >= 1x Mosquitto (issue 25)"),
        ("a", "Dallal MQTT QoS 0 >= 1x Mosquitto (issue 28)"),
        ("b", "Dallal MQTT QoS 0 >= 2x Mosquitto (issue 28)"),
        *(
            (scenario, f"Dallal MQTT QoS {qos} > 10x amqtt QoS {qos} (issue 28)")
            for qos in (0, 1)
            for scenario in "abc"
        ),
    }


def test_defaultRun():
    """
    One invocation measures scenarios a, b and c in both styles against
    every broker but Redis and NATS.
    """
    arguments = compare.parseArguments([])
    assert arguments.scenarios == ["a", "b", "c"]
    assert arguments.styles == ["firehose", "windowed"]
    assert "redis" not in arguments.brokers and "nats" not in arguments.brokers
    assert {"dallal-mqtt-qos1", "mosquitto-qos0-unbounded", "amqtt-qos1"} <= set(arguments.brokers)
