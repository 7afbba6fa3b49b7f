"""
MQTT sessions across broker restarts: the sessions that outlive their
connections, written to an SQLite file in the broker's data directory when
the broker stops and read when it starts (L{dallal.server.mqttsession}).

What is written of a session: its client id, the user it logged in as, how
long it has left before it expires, its subscriptions with their options,
the incoming QoS 2 packet identifiers not yet released, and its QoS 1 and 2
messages, those sent and not acked (with their packet identifiers, sent
again with DUP when the client comes back) and those waiting.  A message is
kept as the MQTT 5 PUBLISH that carries its topic, payload, QoS, retain flag
and properties.  The will of a client that is away, waiting for its MQTT 5
Will Delay Interval or for the session to end, is kept with the time it had
left: after the restart it goes out when that time is over, or at once if
it went by while the broker was stopped (Mosquitto 2.0 publishes such wills
as it stops, however long their delay).  A session that expired while the
broker was stopped is read only if it had such a will, to publish it.

The file is written once, when the broker stops (as Mosquitto without
C{autosave_interval}), in one transaction on a worker thread, so a broker
that is killed comes back with the sessions of its previous clean stop.  It
is read when the broker starts, before it serves anyone.
"""

import json
import os
import sqlite3
import time

from twisted.internet.threads import deferToThread

from dallal.broker.retained import StoreError
from dallal.protocol.mqtt import MQTT_5, MQTTDecoder, Publish

FILE_NAME = "mqtt-sessions.sqlite3"

# Stored in the file's PRAGMA user_version; a file with another version is
# refused rather than misread.
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE sessions (
    client_id TEXT PRIMARY KEY NOT NULL,
    user TEXT,
    peer TEXT NOT NULL,
    -- Seconds it had left when written, NULL for never.
    expiry REAL,
    saved REAL NOT NULL,
    window INTEGER NOT NULL,
    next_packet_id INTEGER NOT NULL,
    unreleased TEXT NOT NULL
);
CREATE TABLE subscriptions (
    client_id TEXT NOT NULL,
    filter TEXT NOT NULL,
    qos INTEGER NOT NULL,
    no_local INTEGER NOT NULL,
    retain_as_published INTEGER NOT NULL,
    identifiers TEXT NOT NULL,
    PRIMARY KEY (client_id, filter)
);
CREATE TABLE messages (
    client_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    -- NULL for a message not sent yet.
    packet_id INTEGER,
    qos INTEGER,
    released INTEGER NOT NULL,
    subscription TEXT NOT NULL,
    published REAL NOT NULL,
    retained INTEGER NOT NULL,
    packet BLOB NOT NULL,
    PRIMARY KEY (client_id, position)
);
"""

# Made by the first write of a file whose schema lacks it: a Dallal that
# does not know it reads the rest.
WILLS_SCHEMA = """
CREATE TABLE IF NOT EXISTS wills (
    client_id TEXT PRIMARY KEY NOT NULL,
    -- Its Will Delay Interval.
    delay REAL NOT NULL,
    -- Seconds it had left when written, NULL for when the session ends.
    due REAL,
    packet BLOB NOT NULL
)
"""


class StoredMessage:
    """
    One message of a stored session.

    @ivar packetId: its packet identifier if it was sent, else C{None}.
    @ivar qos: the QoS it was sent at, if it was.
    @ivar released: for QoS 2, whether its PUBREC came.
    @ivar publish: the L{Publish} with its topic, payload, publish QoS,
        retain flag and properties (L{storedPublish}).
    """

    __slots__ = ("packetId", "qos", "released", "subscription", "published", "retained", "publish")

    def __init__(self, packetId, qos, released, subscription, published, retained, publish):
        self.packetId = packetId
        self.qos = qos
        self.released = released
        self.subscription = subscription
        self.published = published
        self.retained = retained
        self.publish = publish


class StoredSession:
    """
    A session as the store keeps it.

    @ivar expiry: the seconds it has left, or C{None} for ever.
    @ivar subscriptions: C{(filter, qos, noLocal, retainAsPublished,
        identifiers)} of each.
    @ivar messages: its L{StoredMessage}s, oldest first.
    @ivar will: the L{Publish} of the will of its client, away, or C{None}.
    @ivar willDelay: that will's Will Delay Interval, in seconds.
    @ivar willDue: the seconds the will has left before it goes out, or
        C{None} if it goes out when the session ends.
    """

    def __init__(
        self,
        clientId,
        user,
        peer,
        expiry,
        window,
        nextPacketId,
        unreleased,
        subscriptions=(),
        messages=(),
        will=None,
        willDelay=0,
        willDue=None,
    ):
        self.clientId = clientId
        self.user = user
        self.peer = peer
        self.expiry = expiry
        self.window = window
        self.nextPacketId = nextPacketId
        self.unreleased = unreleased
        self.subscriptions = list(subscriptions)
        self.messages = list(messages)
        self.will = will
        self.willDelay = willDelay
        self.willDue = willDue


def storedPublish(topic, payload, attributes):
    """
    The PUBLISH that keeps a message's topic, payload and
    L{dallal.server.mqttsession.PublishAttributes}.
    """
    return Publish(
        topic,
        payload,
        attributes.qos,
        attributes.retain,
        packetId=1 if attributes.qos else None,
        properties=attributes.properties,
    )


def _decodePublish(packet):
    (publish,) = MQTTDecoder(MQTT_5).feed(packet)
    return publish


class SessionStore:
    """
    The MQTT sessions file of a data directory.

    @ivar path: the SQLite file.
    """

    def __init__(self, path, runInThread=deferToThread, clock=time.time):
        self.path = path
        self._runInThread = runInThread
        self._clock = clock

    @classmethod
    def open(cls, dataDir, **kwargs):
        """
        The store of C{dataDir}, whose directory the retained store has
        checked (L{dallal.broker.retained.RetainedStore.open}).
        """
        return cls(os.path.join(dataDir, FILE_NAME), **kwargs)

    def load(self):
        """
        Read the stored sessions, without those whose expiry passed while
        the broker was stopped.

        @return: a list of L{StoredSession}.
        @raise StoreError: the file cannot be read, or is not a store of
            this version.
        """
        if not os.path.exists(self.path):
            return []
        try:
            connection = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as error:
            raise StoreError(f"cannot open {self.path}: {error}") from error
        try:
            return self._read(connection)
        except sqlite3.Error as error:
            raise StoreError(f"cannot read {self.path}: {error}", _errorName(error)) from error
        finally:
            connection.close()

    def _read(self, connection):
        (version,) = connection.execute("PRAGMA user_version").fetchone()
        if version == 0:
            # Never written to.
            return []
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, not {SCHEMA_VERSION}: "
                "it was written by another version of Dallal"
            )
        now = self._clock()
        sessions = {}
        # Those that expired while the broker was stopped: only their wills
        # are taken up.
        expired = {}
        elapsed = {}
        for row in connection.execute(
            "SELECT client_id, user, peer, expiry, saved, window, next_packet_id, unreleased "
            "FROM sessions"
        ):
            clientId, user, peer, expiry, saved, window, nextPacketId, unreleased = row
            elapsed[clientId] = now - saved
            if expiry is not None:
                expiry = max(0, expiry - elapsed[clientId])
            session = StoredSession(
                clientId, user, peer, expiry, window, nextPacketId, json.loads(unreleased)
            )
            (expired if expiry == 0 else sessions)[clientId] = session
        for clientId, *subscription in connection.execute(
            "SELECT client_id, filter, qos, no_local, retain_as_published, identifiers "
            "FROM subscriptions ORDER BY rowid"
        ):
            session = sessions.get(clientId)
            if session is not None:
                topicFilter, qos, noLocal, retainAsPublished, identifiers = subscription
                session.subscriptions.append(
                    (
                        topicFilter,
                        qos,
                        bool(noLocal),
                        bool(retainAsPublished),
                        json.loads(identifiers),
                    )
                )
        for clientId, *message in connection.execute(
            "SELECT client_id, packet_id, qos, released, subscription, published, retained, "
            "packet FROM messages ORDER BY client_id, position"
        ):
            session = sessions.get(clientId)
            if session is not None:
                packetId, qos, released, subscription, published, retained, packet = message
                session.messages.append(
                    StoredMessage(
                        packetId,
                        qos,
                        bool(released),
                        subscription,
                        published,
                        bool(retained),
                        _decodePublish(packet),
                    )
                )
        hasWills = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'wills'"
        ).fetchone()
        if hasWills:
            for clientId, delay, due, packet in connection.execute(
                "SELECT client_id, delay, due, packet FROM wills"
            ):
                session = sessions.get(clientId) or expired.get(clientId)
                if session is None:
                    continue
                sessions[clientId] = session
                session.will = _decodePublish(packet)
                session.willDelay = delay
                if due is not None:
                    session.willDue = max(0, due - elapsed[clientId])
        return list(sessions.values())

    def save(self, sessions):
        """
        Replace what the file holds with C{sessions}, in one transaction
        on a worker thread.

        @param sessions: a list of L{StoredSession}.
        @return: a Deferred that fires once they are committed, or fails
            with L{StoreError}.
        """
        return self._runInThread(self._write, sessions, self._clock())

    def _write(self, sessions, saved):
        try:
            connection = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as error:
            raise StoreError(f"cannot open {self.path}: {error}") from error
        try:
            connection.execute("BEGIN IMMEDIATE")
            (version,) = connection.execute("PRAGMA user_version").fetchone()
            if version == 0:
                # In the same transaction: a file is a store, or empty.
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        connection.execute(statement)
                connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            connection.execute(WILLS_SCHEMA)
            for table in ("sessions", "subscriptions", "messages", "wills"):
                connection.execute(f"DELETE FROM {table}")
            for session in sessions:
                _writeSession(connection, session, saved)
            connection.execute("COMMIT")
        except sqlite3.Error as error:
            raise StoreError(f"cannot write {self.path}: {error}", _errorName(error)) from error
        finally:
            connection.close()
        return len(sessions)


def _writeSession(connection, session, saved):
    clientId = session.clientId
    connection.execute(
        "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            clientId,
            session.user,
            session.peer,
            session.expiry,
            saved,
            session.window,
            session.nextPacketId,
            json.dumps(sorted(session.unreleased)),
        ),
    )
    connection.executemany(
        "INSERT INTO subscriptions VALUES (?, ?, ?, ?, ?, ?)",
        [
            (clientId, topicFilter, qos, noLocal, retainAsPublished, json.dumps(identifiers))
            for topicFilter, qos, noLocal, retainAsPublished, identifiers in session.subscriptions
        ],
    )
    connection.executemany(
        "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                clientId,
                position,
                message.packetId,
                message.qos,
                message.released,
                message.subscription,
                message.published,
                message.retained,
                message.publish.encode(MQTT_5),
            )
            for position, message in enumerate(session.messages)
        ],
    )
    if session.will is not None:
        connection.execute(
            "INSERT INTO wills VALUES (?, ?, ?, ?)",
            (clientId, session.willDelay, session.willDue, session.will.encode(MQTT_5)),
        )


def _errorName(error):
    return getattr(error, "sqlite_errorname", None) or type(error).__name__
