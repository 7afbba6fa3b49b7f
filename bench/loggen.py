"""
Generate the twistd log of a busy Dallal broker, for the analytics bench.

    python bench/loggen.py --lines 1000000 --out /tmp/dallal-logs [--seed 1]

The log follows docs/EVENTS.md exactly, as `twistd --logfile=PATH dallal`
writes it, rotated like twistd's LogFile at 1 MB: twistd.log is the newest
file, twistd.log.1 the newest rotated one, the highest number the oldest.

It simulates rather than samples, so the log is consistent: every
(message, subscriber) story ends once (ack, fire, replace or drop) or is
still in flight, sessions connect before they act, and each broker stop
logs a `stats` event whose counters equal what its events add up to.  The
mix: publishes on Zipf-distributed topics to subscribers in the three
modes, acks after a log-normal latency, some redeliveries, replacements in
`latest` mode and drops, session churn over TCP and UDP, clients that miss
pings (most recover, some are dropped), refused requests, broker restarts,
and a few tracebacks and lines of other namespaces.
"""

import argparse
import heapq
import itertools
import math
import os
import random
import time
from pathlib import Path

ROTATE_BYTES = 1_000_000
START = 1795219200.0  # 2026-11-21T00:00:00Z
# The name this broker logs as the origin of its clients' messages (hops=0).
BROKER_NAME = "dallal-bench"
PING_INTERVAL = 10.0
SUBSCRIBERS = 150
PUBLISHERS = 40
MAX_MISSED = 3
MODES = ("all", "latest", "fire")
MODE_WEIGHTS = (0.6, 0.25, 0.15)
DROP_REASONS = (
    "queue_full",
    "slow_consumer",
    "disconnected",
    "redelivery_limit",
    "superseded",
    "too_large",
)
ERROR_CODES = (
    ("BAD_TOPIC", False),
    ("BAD_ARGUMENTS", False),
    ("PAYLOAD_TOO_LARGE", False),
    ("BAD_COMMAND", False),
    ("BAD_FRAMING", True),
)
COUNTERS = (
    "connections",
    "connections_total",
    "subscriptions",
    "published",
    "matched",
    "delivered",
    "fired",
    "redelivered",
    "acked",
    "replaced",
    "dropped",
    *(f"dropped_{reason}" for reason in DROP_REASONS),
    "inflight",
    "bytes_in",
    "bytes_out",
    "errors",
    "pings_missed",
    "clients_dropped",
    "duplicates",
    "unsent",
)
TRACEBACK = (
    "\tTraceback (most recent call last):\n"
    '\t  File "/usr/lib/python3/site-packages/twisted/internet/tcp.py", line 250, in doRead\n'
    "\t    return self._dataReceived(data)\n"
    "\tbuiltins.ConnectionResetError: [Errno 104] Connection reset by peer\n"
)


class RotatingLog:
    """
    twistd's LogFile: an entry goes whole into the current file, which is
    rotated once it has reached the rotation size.
    """

    def __init__(self, directory, rotateBytes=ROTATE_BYTES):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rotateBytes = rotateBytes
        self.files = []
        self.lines = 0
        self._chunks = []
        self._size = 0
        self._stamps = (None, None)
        self.lastTime = 0.0

    def stamp(self, t):
        second = int(t)
        if self._stamps[0] != second:
            self._stamps = (second, time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(second)))
        return self._stamps[1]

    def entry(self, t, system, text):
        """
        One log entry; C{text} may hold continuation lines (tab-indented).
        """
        self.lastTime = max(self.lastTime, t)
        line = f"{self.stamp(t)} [{system}] {text}\n"
        self._chunks.append(line)
        self._size += len(line)
        self.lines += line.count("\n")
        if self._size >= self.rotateBytes:
            self._flush()

    def _flush(self):
        # Written under a temporary name: the final names depend on how many
        # files there are in the end.
        path = self.directory / f".part{len(self.files):06d}"
        path.write_text("".join(self._chunks))
        self.files.append(path)
        self._chunks = []
        self._size = 0

    def close(self):
        if self._chunks:
            self._flush()
        newest = len(self.files) - 1
        for index, path in enumerate(self.files):
            suffix = "" if index == newest else f".{newest - index}"
            os.replace(path, self.directory / f"twistd.log{suffix}")
        return [
            self.directory / f"twistd.log{'' if i == 0 else f'.{i}'}"
            for i in range(len(self.files))
        ]


class Pool:
    """
    Live sessions of one kind: O(1) to add, remove and pick at random.
    """

    def __init__(self, rng):
        self.rng = rng
        self.items = []
        self.positions = {}

    def __len__(self):
        return len(self.items)

    def add(self, item):
        self.positions[item] = len(self.items)
        self.items.append(item)

    def remove(self, item):
        position = self.positions.pop(item)
        last = self.items.pop()
        if last is not item:
            self.items[position] = last
            self.positions[last] = position

    def choice(self):
        return self.items[self.rng.randrange(len(self.items))]


class Session:
    __slots__ = (
        "sid",
        "client",
        "transport",
        "topics",
        "stories",
        "alive",
        "troubled",
        "publisher",
    )

    def __init__(self, sid, client, transport, publisher):
        self.sid = sid
        self.client = client
        self.transport = transport
        self.topics = {}  # topic -> [mode, seq, queued (mid, published) or None]
        self.stories = set()  # mids sent or queued and not yet ended
        self.alive = True
        self.troubled = False
        self.publisher = publisher


class Broker:
    """
    One broker lifetime: its sessions, counters and events.
    """

    def __init__(self, generator, t):
        self.g = generator
        self.log = generator.log
        self.rng = generator.rng
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.sessions = {}
        self.subscribers = {}  # topic -> {sid: session}
        self.nextSid = itertools.count(1)
        self.nextMid = itertools.count(1)
        self.published = {}  # mid -> (topic, bytes, t)
        self.subscriberPool = Pool(self.rng)
        self.publisherPool = Pool(self.rng)
        self.log.entry(
            t,
            "twisted.scripts._twistd_unix.UnixAppLogger#info",
            "twistd 26.10.0 (/usr/bin/python3 3.11.7) starting up.",
        )
        self.log.entry(
            t,
            "twisted.scripts._twistd_unix.UnixAppLogger#info",
            "reactor class: twisted.internet.epollreactor.EPollReactor.",
        )
        self.log.entry(t, "-", "BrokerFactory starting on 1373")
        self.event(t + 0.0001, "listening", transport="tcp", address="0.0.0.0:1373")
        self.event(t + 0.0002, "listening", transport="udp", address="0.0.0.0:1234")

    def now(self, t):
        """
        C{t}, or the time of the last entry if that is later: a publish logs
        its sends a little after its own time, and what was due meanwhile
        happens after them, as in a real broker's log.
        """
        return max(t, self.log.lastTime)

    def event(self, t, name, level="info", **fields):
        t = self.now(t)
        text = " ".join(f"{key}={value}" for key, value in fields.items())
        self.log.entry(t, f"dallal#{level}", f"event={name} {text} t={t:.6f}")

    # Sessions

    def connect(self, t, publisher):
        sid = next(self.nextSid)
        transport = "udp" if self.rng.random() < 0.1 else "tcp"
        client = f"10.0.{self.rng.randrange(256)}.{self.rng.randrange(1, 255)}:{self.rng.randrange(1024, 65535)}"
        session = Session(sid, client, transport, publisher)
        self.sessions[sid] = session
        self.counters["connections"] += 1
        self.counters["connections_total"] += 1
        self.event(t, "connect", session=sid, client=client, transport=transport)
        if publisher:
            self.publisherPool.add(session)
        else:
            self.subscriberPool.add(session)
            for topic in self.g.pickTopics(self.rng.randint(1, 3)):
                self.subscribe(t, session, topic)
        return session

    def populate(self, t, subscribers, publishers):
        """
        Connect sessions until there are this many of each kind.
        """
        while len(self.subscriberPool) < subscribers:
            t += 0.001
            self.connect(t, publisher=False)
        while len(self.publisherPool) < publishers:
            t += 0.001
            self.connect(t, publisher=True)
        return t

    def subscribe(self, t, session, topic):
        if topic in session.topics:
            return
        mode = self.rng.choices(MODES, MODE_WEIGHTS)[0]
        session.topics[topic] = [mode, 0, None]
        self.subscribers.setdefault(topic, {})[session.sid] = session
        self.counters["subscriptions"] += 1
        self.event(
            t, "subscribe", session=session.sid, client=session.client, topic=topic, mode=mode
        )

    def disconnect(self, t, session, reason):
        if not session.alive:
            return
        session.alive = False
        (self.publisherPool if session.publisher else self.subscriberPool).remove(session)
        for mid in sorted(session.stories):
            self.drop(t, mid, session, "disconnected")
        for topic in session.topics:
            del self.subscribers[topic][session.sid]
        self.counters["subscriptions"] -= len(session.topics)
        self.counters["connections"] -= 1
        del self.sessions[session.sid]
        self.event(
            t,
            "disconnect",
            session=session.sid,
            client=session.client,
            transport=session.transport,
            reason=reason,
            subscriptions=len(session.topics),
        )

    # Messages

    def publish(self, t, publisher, topic, size):
        mid = next(self.nextMid)
        receivers = list(self.subscribers.get(topic, {}).values())
        counters = self.counters
        counters["published"] += 1
        counters["matched"] += len(receivers)
        counters["bytes_in"] += size
        self.published[mid] = (topic, size, t)
        self.event(
            t,
            "publish",
            mid=mid,
            topic=topic,
            bytes=size,
            session=publisher.sid,
            client=publisher.client,
            transport=publisher.transport,
            subscribers=len(receivers),
            origin=BROKER_NAME,
            hops=0,
        )
        for receiver in receivers:
            t += 0.00002
            subscription = receiver.topics[topic]
            mode = subscription[0]
            if mode == "latest" and (subscription[2] is not None or self.rng.random() < 0.05):
                # A slow subscriber: the message waits, replacing the one waiting.
                queued = subscription[2]
                if queued is not None:
                    receiver.stories.discard(queued)
                    counters["replaced"] += 1
                    self.event(t, "replace", mid=queued, topic=topic, session=receiver.sid, by=mid)
                subscription[2] = mid
                receiver.stories.add(mid)
                self.g.schedule(
                    t + self.rng.expovariate(20.0), self.sendQueued, receiver, topic, mid
                )
                continue
            if mode != "fire" and self.rng.random() < 0.002:
                counters["dropped"] += 1
                counters["dropped_queue_full"] += 1
                self.event(
                    t,
                    "drop",
                    "warn",
                    mid=mid,
                    topic=topic,
                    session=receiver.sid,
                    reason="queue_full",
                )
                continue
            self.send(t, receiver, topic, mid)

    def send(self, t, receiver, topic, mid, attempt=1):
        subscription = receiver.topics[topic]
        if attempt == 1:
            subscription[1] += 1
        mode = subscription[0]
        counters = self.counters
        counters["delivered" if attempt == 1 else "redelivered"] += 1
        counters["bytes_out"] += self.published[mid][1]
        self.event(
            t,
            "deliver",
            mid=mid,
            topic=topic,
            session=receiver.sid,
            client=receiver.client,
            mode=mode,
            seq=subscription[1],
            attempt=attempt,
        )
        if mode == "fire":
            counters["fired"] += 1
            return
        receiver.stories.add(mid)
        if self.rng.random() < 0.03:
            if attempt < 3:
                self.g.schedule(t + 5.0, self.redeliver, receiver, topic, mid, attempt + 1)
            else:
                self.g.schedule(t + 5.0, self.dropUnacked, receiver, mid)
        else:
            latency = self.rng.lognormvariate(math.log(0.004), 0.8)
            self.g.schedule(t + latency, self.ack, receiver, topic, mid)

    def sendQueued(self, t, receiver, topic, mid):
        subscription = receiver.topics.get(topic) if receiver.alive else None
        if subscription is None or subscription[2] != mid:
            return  # replaced meanwhile, or the session has gone
        subscription[2] = None
        self.send(t, receiver, topic, mid)

    def redeliver(self, t, receiver, topic, mid, attempt):
        if receiver.alive and mid in receiver.stories:
            self.send(t, receiver, topic, mid, attempt)

    def ack(self, t, receiver, topic, mid):
        if not receiver.alive or mid not in receiver.stories:
            return
        t = self.now(t)
        receiver.stories.discard(mid)
        self.counters["acked"] += 1
        self.event(
            t,
            "ack",
            mid=mid,
            topic=topic,
            session=receiver.sid,
            latency=f"{t - self.published[mid][2]:.6f}",
        )

    def dropUnacked(self, t, receiver, mid):
        if receiver.alive and mid in receiver.stories:
            self.drop(t, mid, receiver, "redelivery_limit")

    def drop(self, t, mid, session, reason):
        session.stories.discard(mid)
        self.counters["dropped"] += 1
        self.counters[f"dropped_{reason}"] += 1
        self.event(
            t,
            "drop",
            "warn",
            mid=mid,
            topic=self.published[mid][0],
            session=session.sid,
            reason=reason,
        )

    # Health

    def missPings(self, t, session, missed, recovers):
        if not session.alive:
            return
        if missed >= MAX_MISSED:
            self.counters["clients_dropped"] += 1
            self.event(
                t,
                "client_dropped",
                "warn",
                session=session.sid,
                client=session.client,
                missed=missed,
            )
            reason = "expired" if session.transport == "udp" else "missed_pings"
            self.disconnect(t + 0.0001, session, reason)
            return
        self.counters["pings_missed"] += 1
        self.event(
            t, "ping_missed", "warn", session=session.sid, client=session.client, missed=missed
        )
        if recovers and missed == 1:
            session.troubled = False
            return
        self.g.schedule(t + PING_INTERVAL, self.missPings, session, missed + 1, recovers)

    def refuse(self, t, session):
        code, fatal = self.rng.choice(ERROR_CODES)
        self.counters["errors"] += 1
        self.event(
            t,
            "protocol_error",
            "warn",
            session=session.sid,
            client=session.client,
            code=code,
            fatal=fatal,
        )
        if fatal:
            self.disconnect(t + 0.0001, session, "protocol_error")

    def stop(self, t):
        self.log.entry(t, "twisted.internet.base#info", "Received SIGTERM, shutting down.")
        for session in list(self.sessions.values()):
            t += 0.0001
            self.disconnect(t, session, "shutdown")
        self.counters["inflight"] = 0
        self.event(t + 0.001, "stats", **self.counters)
        self.log.entry(t + 0.002, "-", "(TCP Port 1373 Closed)")
        self.log.entry(t + 0.002, "twisted.internet.base#info", "Main loop terminated.")
        self.log.entry(
            t + 0.003, "twisted.scripts._twistd_unix.UnixAppLogger#info", "Server Shut Down."
        )


class Generator:
    """
    Drives brokers through time until the log has the lines asked for.
    """

    def __init__(self, directory, lines, seed, rate, restarts, rotateBytes=ROTATE_BYTES):
        self.rng = random.Random(seed)
        self.log = RotatingLog(directory, rotateBytes)
        self.target = lines
        self.rate = rate
        self.restarts = restarts
        topicNames = [
            f"sensors/site{site}/{kind}"
            for site in range(40)
            for kind in ("temperature", "humidity", "power")
        ]
        topicNames += [f"news/{section}" for section in ("world", "sport", "tech", "markets")]
        topicNames += [f"chat/room{room}" for room in range(60)]
        self.rng.shuffle(topicNames)
        self.topics = topicNames
        # Publishers favour a few topics (Zipf); subscribers less so.
        self.topicWeights = list(
            itertools.accumulate(1 / (rank + 1) for rank in range(len(topicNames)))
        )
        self.subscriptionWeights = list(
            itertools.accumulate(1 / math.sqrt(rank + 1) for rank in range(len(topicNames)))
        )
        self.queue = []
        self.order = itertools.count()

    def pickTopics(self, count):
        return set(self.rng.choices(self.topics, cum_weights=self.subscriptionWeights, k=count))

    def schedule(self, t, action, *args):
        heapq.heappush(self.queue, (t, next(self.order), action, args))

    def runDue(self, until):
        while self.queue and self.queue[0][0] <= until:
            t, _, action, args = heapq.heappop(self.queue)
            action(t, *args)

    def rateAt(self, t):
        # A slow swell over the hour, so the traffic chart has a shape.
        return self.rate * (1 + 0.5 * math.sin((t - START) / 3600 * 2 * math.pi))

    def run(self):
        rng = self.rng
        t = START
        stops = [self.target * (index + 1) // (self.restarts + 1) for index in range(self.restarts)]
        broker = Broker(self, t)
        t = broker.populate(t + 1, SUBSCRIBERS, PUBLISHERS)
        while self.log.lines < self.target:
            t += rng.expovariate(self.rateAt(t))
            self.runDue(t)
            roll = rng.random()
            if roll < 0.004:
                # Churn: a subscriber leaves (another will take its place).
                leaving = broker.subscriberPool.choice()
                broker.disconnect(t, leaving, "expired" if leaving.transport == "udp" else "closed")
            elif roll < 0.006:
                # A one-shot publisher, like `dallal publish`.
                oneShot = broker.connect(t, publisher=True)
                broker.publish(t + 0.001, oneShot, *self.message())
                broker.disconnect(t + 0.002, oneShot, "closed")
            elif roll < 0.0065:
                troubled = broker.subscriberPool.choice()
                if not troubled.troubled:
                    troubled.troubled = True
                    self.schedule(
                        t + PING_INTERVAL, broker.missPings, troubled, 1, rng.random() < 0.7
                    )
            elif roll < 0.0068:
                broker.refuse(t, broker.publisherPool.choice())
            elif roll < 0.00685:
                self.log.entry(t, "dallal#critical", "Unhandled Error\n" + TRACEBACK.rstrip("\n"))
            elif roll < 0.0069:
                self.log.entry(t, "twisted.internet.tcp.Port#info", "(TCP Port 1373 Closed)")
            else:
                broker.publish(t, broker.publisherPool.choice(), *self.message())
            t = broker.populate(t, SUBSCRIBERS, PUBLISHERS)
            if stops and self.log.lines >= stops[0]:
                stops.pop(0)
                self.runDue(t + 0.5)
                broker.stop(t + 1)
                self.queue.clear()
                t += 5
                broker = Broker(self, t)
                t = broker.populate(t + 1, SUBSCRIBERS, PUBLISHERS)
        self.runDue(t + 30)
        broker.stop(t + 31)
        self.queue.clear()
        return self.log.close()

    def message(self):
        topic = self.rng.choices(self.topics, cum_weights=self.topicWeights)[0]
        size = int(self.rng.lognormvariate(math.log(200), 1.0)) + 1
        return topic, size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lines",
        type=int,
        default=1_000_000,
        help="about how many lines to write (default 1000000)",
    )
    parser.add_argument("--out", required=True, help="the folder for twistd.log*")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rate",
        type=float,
        default=300.0,
        help="mean publishes per second of log time (default 300)",
    )
    parser.add_argument(
        "--restarts", type=int, default=1, help="broker restarts along the log (default 1)"
    )
    parser.add_argument("--rotate-bytes", type=int, default=ROTATE_BYTES)
    args = parser.parse_args(argv)
    started = time.monotonic()
    generator = Generator(
        args.out, args.lines, args.seed, args.rate, args.restarts, args.rotate_bytes
    )
    files = generator.run()
    elapsed = time.monotonic() - started
    print(f"{generator.log.lines} lines in {len(files)} files under {args.out} ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
