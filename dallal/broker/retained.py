"""
Retained messages: the last retained message of each topic, kept across
restarts.

The broker keeps one retained message per topic and gives it to every new
subscription whose filter matches the topic; a retained publish with an empty
payload clears the topic.  L{RetainedStore} answers from memory, so looking
up is a dictionary or tree lookup, and writes every change through to an
SQLite file in the broker's data directory.

SQLite is used from one dedicated worker thread, never from the reactor's:
a commit waits for the disk, and the broker goes on serving other clients
meanwhile.  Writes are applied in the order they were made; those made while
the thread is busy are committed together in one transaction when it is
free, so a burst of retained publishes costs a few disk syncs, not one each.
"""

import os
import sqlite3
from threading import Thread
from typing import NamedTuple

from twisted.internet.defer import Deferred, fail
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from dallal.topictree import TopicMap

FILE_NAME = "retained.sqlite3"

# Stored in the file's PRAGMA user_version.  Bump it when the schema
# changes; a file with any other version is refused rather than misread.
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE retained (
    topic TEXT PRIMARY KEY NOT NULL,
    payload BLOB NOT NULL
)
"""
STORE = """
INSERT INTO retained (topic, payload) VALUES (?, ?)
ON CONFLICT (topic) DO UPDATE SET payload = excluded.payload
"""
CLEAR = "DELETE FROM retained WHERE topic = ?"


class StoreError(Exception):
    """
    The retained message store cannot be opened or cannot store a message;
    the message says which file and why.

    @ivar code: one word for the log: SQLite's name for the error
        (C{SQLITE_FULL} when the disk is full, C{SQLITE_READONLY}, ...),
        C{closed} for a write after L{RetainedStore.close}.
    """

    def __init__(self, message, code="unknown"):
        Exception.__init__(self, message)
        self.code = code


def _errorCode(error):
    """
    The one-word name of an exception from the worker thread: SQLite's
    name for its own errors, the exception's type for anything else.
    """
    return getattr(error, "sqlite_errorname", None) or type(error).__name__


class RetainedStats(NamedTuple):
    """
    How much the store holds: C{count} topics, C{bytes} bytes of payload.
    """

    count: int
    bytes: int


class _Unsettled:
    """
    A topic with writes on their way to the disk.

    @ivar writes: how many.
    @ivar durable: its payload as committed (C{None}: no retained message),
        which the memory goes back to if the last of those writes fails.
    """

    __slots__ = ("writes", "durable")

    def __init__(self, durable):
        self.writes = 0
        self.durable = durable


class _DaemonThreadPool(ThreadPool):
    """
    A thread pool whose thread does not keep the process alive.

    The broker closes the store when it stops; a program that forgets to
    (or dies first) must still be able to exit.  Nothing acked is lost if
    the thread dies with it: an unfinished SQLite transaction rolls back,
    and a write is only acked once committed.
    """

    def threadFactory(self, **kwargs):
        return Thread(daemon=True, **kwargs)


class RetainedStore:
    """
    The retained messages of a broker, in memory and in an SQLite file.

    Open it with L{RetainedStore.open}; call L{close} when the broker stops.

    @ivar path: the SQLite file.
    """

    _log = Logger()

    def __init__(self, path, connection, messages, reactor):
        """
        Use L{RetainedStore.open}.
        """
        self.path = path
        self._connection = connection
        self._reactor = reactor
        self._messages = TopicMap()
        self._bytes = 0
        self._changed = None
        for topic, payload in messages:
            self._remember(topic, payload)
        self._unsettled = {}
        self._queue = []
        self._writing = False
        self._closed = None
        self._pool = _DaemonThreadPool(1, 1, name="dallal-retained")
        self._pool.start()

    @classmethod
    def open(cls, dataDir, reactor):
        """
        Open (creating if needed) the store in C{dataDir} and load every
        retained message.

        The store keeps its file locked while open, so that a second broker
        started on the same data directory is refused here.

        @raise StoreError: if the directory cannot be created or written
            to, or the file cannot be opened, locked or read, is empty, is
            not a database, is corrupt, or has another schema version.
        """
        try:
            os.makedirs(dataDir, exist_ok=True)
        except OSError as error:
            raise StoreError(
                f"cannot create the data directory {dataDir}: {error.strerror}"
            ) from error
        if not os.access(dataDir, os.W_OK | os.X_OK):
            # SQLite would only say "unable to open database file".
            raise StoreError(
                f"the data directory {dataDir} is not writable: the store and "
                "its write-ahead log are created there"
            )
        path = os.path.join(dataDir, FILE_NAME)
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            # SQLite would take it for a new database and start with no
            # retained messages: an emptied file is a store that was lost.
            raise StoreError(
                f"{path} is empty, not a Dallal retained message store: remove it "
                "to start with no retained messages"
            )
        try:
            # Used from the reactor's thread until open returns, then only
            # from the store's worker thread, never from two at once.
            connection = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, timeout=0
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open {path}: {error}") from error
        try:
            messages = _prepare(connection, path)
        except BaseException:
            connection.close()
            raise
        return cls(path, connection, messages, reactor)

    # Reading, from memory.

    def get(self, topic):
        """
        @return: the retained payload of C{topic}, or C{None}.
        """
        return self._messages.get(topic)

    def match(self, topicFilter, limit=None):
        """
        @param limit: see L{TopicMap.match}.
        @return: a C{list} of the (topic, payload) pairs whose topic the
            valid C{topicFilter} matches.
        """
        return self._messages.match(topicFilter, limit)

    @property
    def writing(self):
        """
        Whether some retained message is not yet written to disk (or
        refused): a C{set} whose Deferred has not fired.
        """
        return bool(self._unsettled)

    @property
    def stats(self):
        """
        @return: a L{RetainedStats}.
        """
        return RetainedStats(len(self._messages), self._bytes)

    def topics(self):
        """
        @return: an iterator over the topics that hold a retained message.
        """
        return iter(self._messages)

    def watch(self, changed):
        """
        Call C{changed(topic, held)} whenever a topic comes to hold a
        retained message (C{held} true) or stops holding one, including when
        a write that failed takes it back to what is on disk.
        """
        self._changed = changed

    # Writing.

    def set(self, topic, payload):
        """
        Make C{payload} the retained message of C{topic}; an empty payload
        clears it.  Lookups see the change at once.

        @return: a L{Deferred} that fires with C{None} once the change is
            committed to disk, or fails with L{StoreError}, in which case
            lookups go back to what is on disk (unless a later write to the
            topic is on its way).
        """
        if self._closed is not None:
            return fail(StoreError(f"{self.path} is closed", "closed"))
        unsettled = self._unsettled.get(topic)
        if unsettled is None:
            unsettled = self._unsettled[topic] = _Unsettled(self.get(topic))
        unsettled.writes += 1
        self._remember(topic, payload)
        written = Deferred()
        self._queue.append((topic, payload, written))
        self._writeQueue()
        return written

    def close(self):
        """
        Finish the writes already made, close the file and stop the worker
        thread.  Later writes fail with L{StoreError}; lookups still work.

        @return: a L{Deferred} that fires with C{None} when the thread has
            stopped.
        """
        if self._closed is None:
            self._closed = Deferred()
            self._closeIfIdle()
        # Every caller gets its own Deferred for the one closing.
        closed = Deferred()
        self._closed.addCallback(lambda _: closed.callback(None))
        return closed

    def _remember(self, topic, payload):
        """
        Set the in-memory retained message of C{topic}.
        """
        previous = self._messages.get(topic)
        if previous is not None:
            self._bytes -= len(previous)
        if payload:
            self._messages[topic] = payload
            self._bytes += len(payload)
        elif previous is not None:
            del self._messages[topic]
        held = bool(payload)
        if self._changed is not None and held != (previous is not None):
            self._changed(topic, held)

    def _writeQueue(self):
        """
        Hand every queued write to the worker thread as one batch, unless it
        is busy with the previous batch.
        """
        if self._writing or not self._queue:
            return
        batch, self._queue = self._queue, []
        self._writing = True
        writing = deferToThreadPool(
            self._reactor,
            self._pool,
            self._writeBatch,
            [(topic, payload) for topic, payload, _ in batch],
        )
        writing.addBoth(self._batchWritten, batch)

    def _writeBatch(self, writes):
        """
        On the worker thread: apply C{writes} in order in one transaction,
        each in its own savepoint so that a write that fails does not take
        the others with it.

        @return: for each write, C{None} if it is committed, otherwise the
            L{sqlite3.Error} that stopped it.
        """
        connection = self._connection
        reasons = []
        try:
            connection.execute("BEGIN IMMEDIATE")
            for topic, payload in writes:
                connection.execute("SAVEPOINT write")
                try:
                    if payload:
                        connection.execute(STORE, (topic, payload))
                    else:
                        connection.execute(CLEAR, (topic,))
                except sqlite3.Error as error:
                    connection.execute("ROLLBACK TO write")
                    reasons.append(error)
                else:
                    reasons.append(None)
                connection.execute("RELEASE write")
            connection.execute("COMMIT")
        except sqlite3.Error as error:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            return [error] * len(writes)
        return reasons

    def _batchWritten(self, reasons, batch):
        """
        Back on the reactor's thread: settle and fire each write of C{batch},
        then send the writes queued meanwhile.
        """
        if isinstance(reasons, Failure):
            # _writeBatch itself failed: every write of the batch did.
            reasons = [reasons.value] * len(batch)
        for (topic, payload, written), reason in zip(batch, reasons):
            unsettled = self._unsettled[topic]
            unsettled.writes -= 1
            if reason is None:
                unsettled.durable = payload or None
            if unsettled.writes == 0:
                del self._unsettled[topic]
                if reason is not None:
                    self._remember(topic, unsettled.durable)
            if reason is None:
                written.callback(None)
            else:
                written.errback(
                    StoreError(
                        f"retained message of {topic!r} not stored in {self.path}: {reason}",
                        _errorCode(reason),
                    )
                )
        self._writing = False
        self._writeQueue()
        self._closeIfIdle()

    def _closeIfIdle(self):
        """
        Once closing and every write is settled, close the file on the
        worker thread and then stop the thread.

        It gets past its test once only: when closing starts with no write
        on its way, or when the last batch is written, as no write can be
        queued once closing.
        """
        if self._closed is None or self._writing or self._queue:
            return
        closing = deferToThreadPool(self._reactor, self._pool, self._connection.close)
        # Every write is committed by now, so a failure to close loses
        # nothing: say so in the log and stop all the same.
        closing.addErrback(
            lambda failure: self._log.failure("closing {path} failed", failure, path=self.path)
        )
        closing.addCallback(lambda _: self._pool.stop())
        closing.chainDeferred(self._closed)


def _prepare(connection, path):
    """
    Lock the file, create the schema in a new file or check the schema
    version of an existing one, and read every retained message.

    @return: a list of (topic, payload) pairs.
    @raise StoreError: if any of that fails.
    """
    try:
        # Keep the lock from the first write to close: nobody else uses the
        # file while the broker runs.
        connection.execute("PRAGMA locking_mode = EXCLUSIVE")
        connection.execute("PRAGMA journal_mode = WAL")
        # A commit is on disk when it returns: a PubAck promises that.
        connection.execute("PRAGMA synchronous = FULL")
        connection.execute("BEGIN IMMEDIATE")
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            _createSchema(connection, path)
        elif version != SCHEMA_VERSION:
            raise StoreError(
                f"{path} has schema version {version}; this version of Dallal "
                f"reads version {SCHEMA_VERSION} only"
            )
        problems = [row[0] for row in connection.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise StoreError(f"{path} is corrupt: {'; '.join(problems[:3])}")
        messages = connection.execute("SELECT topic, payload FROM retained").fetchall()
        connection.execute("COMMIT")
    except sqlite3.Error as error:
        reason = str(error)
        if error.sqlite_errorname == "SQLITE_BUSY":
            reason += " (is another broker using this data directory?)"
        raise StoreError(f"cannot open {path}: {reason}") from error
    return messages


def _createSchema(connection, path):
    """
    Create the schema in an empty file.

    @raise StoreError: if the file holds something else.
    """
    if connection.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        raise StoreError(
            f"{path} is an SQLite database but not a Dallal retained message "
            "store (it has tables and no schema version)"
        )
    connection.execute(SCHEMA)
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
