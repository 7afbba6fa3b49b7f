"""
Tests for dallal.broker.retained: the retained message store, in memory and on
disk, and how it fails.
"""

import sqlite3
import threading

import pytest
import pytest_twisted
from twisted.internet import reactor

from dallal.broker.retained import (
    FILE_NAME,
    SCHEMA_VERSION,
    RetainedStats,
    RetainedStore,
    StoreError,
)

# Only turns a hang into a failure: the machine is small and shared.
TIMEOUT = 30


def within(deferred):
    return deferred.addTimeout(TIMEOUT, reactor)


def storeThreads():
    return [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("PoolThread-dallal-retained")
    ]


@pytest.fixture
def openStore():
    """
    Opens stores and, at the end of the test, closes those still open and
    checks that no worker thread is left.
    """
    opened = []

    def openStore(dataDir):
        store = RetainedStore.open(str(dataDir), reactor)
        opened.append(store)
        return store

    yield openStore
    for store in opened:
        pytest_twisted.blockon(within(store.close()))
    assert storeThreads() == []


def sql(dataDir, *statements):
    """
    Run SQL on the store's file directly, while no store has it open.
    """
    connection = sqlite3.connect(dataDir / FILE_NAME, isolation_level=None)
    try:
        for statement in statements:
            connection.execute(statement)
    finally:
        connection.close()


async def reopen(store, openStore, dataDir):
    await within(store.close())
    return openStore(dataDir)


@pytest_twisted.ensureDeferred
async def test_setGetClear(tmp_path, openStore):
    store = openStore(tmp_path / "data")
    assert store.get("a/b") is None
    written = store.set("a/b", b"hello")
    # Lookups see the change before it reaches the disk.
    assert store.get("a/b") == b"hello"
    assert not written.called
    assert await within(written) is None
    assert store.stats == RetainedStats(count=1, bytes=5)
    await within(store.set("a/b", b"bye"))
    assert store.get("a/b") == b"bye"
    assert store.stats == RetainedStats(count=1, bytes=3)
    cleared = store.set("a/b", b"")
    assert store.get("a/b") is None
    await within(cleared)
    assert store.stats == RetainedStats(count=0, bytes=0)
    # Clearing a topic without a retained message is not an error.
    await within(store.set("x", b""))


@pytest_twisted.ensureDeferred
async def test_match(tmp_path, openStore):
    store = openStore(tmp_path)
    for topic in ["home/kitchen/temp", "home/hall/temp", "home/kitchen", "office/temp"]:
        await within(store.set(topic, topic.encode()))
    assert sorted(store.match("home/+/temp")) == [
        ("home/hall/temp", b"home/hall/temp"),
        ("home/kitchen/temp", b"home/kitchen/temp"),
    ]
    assert sorted(topic for topic, _ in store.match("home/kitchen/#")) == [
        "home/kitchen",
        "home/kitchen/temp",
    ]
    assert store.match("office/temp") == [("office/temp", b"office/temp")]
    assert store.match("nowhere/#") == []


@pytest_twisted.ensureDeferred
async def test_watch(tmp_path, openStore):
    """
    The watcher hears when a topic comes to hold a message and when it stops,
    not when its message is only replaced.
    """
    store = openStore(tmp_path)
    await within(store.set("kept", b"1"))
    changes = []
    store.watch(lambda topic, held: changes.append((topic, held)))
    for topic, payload in [("a", b"1"), ("a", b"22"), ("kept", b""), ("a", b""), ("never", b"")]:
        await within(store.set(topic, payload))
    assert changes == [("a", True), ("kept", False), ("a", False)]
    assert list(store.topics()) == []


@pytest_twisted.ensureDeferred
async def test_persistsAcrossReopen(tmp_path, openStore):
    store = openStore(tmp_path)
    await within(store.set("kept", b"\x00binary\xff"))
    await within(store.set("replaced", b"old"))
    await within(store.set("replaced", b"new"))
    await within(store.set("cleared", b"gone"))
    await within(store.set("cleared", b""))
    store = await reopen(store, openStore, tmp_path)
    assert store.get("kept") == b"\x00binary\xff"
    assert store.get("replaced") == b"new"
    assert store.get("cleared") is None
    assert store.stats == RetainedStats(count=2, bytes=11)
    assert store.match("#") != []


@pytest_twisted.ensureDeferred
async def test_writesKeepTheirOrder(tmp_path, openStore):
    """
    Writes made in a burst are committed, and acknowledged, in the order
    they were made; the last one wins, in memory and on disk.
    """
    store = openStore(tmp_path)
    acknowledged = []
    writes = []
    for number in range(50):
        payload = b"" if number % 7 == 3 else str(number).encode()
        topic = f"t/{number % 3}"
        written = store.set(topic, payload)
        written.addCallback(lambda _, number=number: acknowledged.append(number))
        writes.append(written)
    for written in writes:
        await within(written)
    assert acknowledged == list(range(50))
    expected = {"t/0": b"48", "t/1": b"49", "t/2": b"47"}
    assert dict(store.match("t/+")) == expected
    store = await reopen(store, openStore, tmp_path)
    assert dict(store.match("t/+")) == expected


@pytest_twisted.ensureDeferred
async def test_closeFinishesPendingWrites(tmp_path, openStore):
    store = openStore(tmp_path)
    writes = [store.set(f"t/{number}", b"x") for number in range(10)]
    closing = store.close()
    for written in writes:
        assert await within(written) is None
    assert await within(closing) is None
    assert storeThreads() == []
    # A second close is harmless.
    assert await within(store.close()) is None
    store = openStore(tmp_path)
    assert store.stats.count == 10


@pytest_twisted.ensureDeferred
async def test_setAfterCloseFails(tmp_path, openStore):
    store = openStore(tmp_path)
    await within(store.set("a", b"1"))
    await within(store.close())
    with pytest.raises(StoreError, match="is closed"):
        await within(store.set("a", b"2"))
    assert store.get("a") == b"1"


def doom(dataDir, topic):
    """
    Make every write of C{topic} fail, as a full disk would.
    """
    sql(
        dataDir,
        f"CREATE TRIGGER doomInsert BEFORE INSERT ON retained WHEN NEW.topic = '{topic}'"
        " BEGIN SELECT RAISE(ABORT, 'simulated disk failure'); END",
        f"CREATE TRIGGER doomDelete BEFORE DELETE ON retained WHEN OLD.topic = '{topic}'"
        " BEGIN SELECT RAISE(ABORT, 'simulated disk failure'); END",
    )


@pytest_twisted.ensureDeferred
async def test_failingWriteFailsItsDeferred(tmp_path, openStore):
    """
    A write that cannot be stored fails its own Deferred with StoreError and
    the lookups go back to what is on disk; writes around it, even in the
    same transaction, are stored.
    """
    store = openStore(tmp_path)
    await within(store.set("doomed", b"old"))
    await within(store.close())
    doom(tmp_path, "doomed")
    store = openStore(tmp_path)
    # The first write goes alone; the next three are queued meanwhile and
    # go together.
    before = store.set("before", b"1")
    failing = store.set("doomed", b"new")
    clearing = store.set("doomed", b"")
    after = store.set("after", b"2")
    assert store.get("doomed") is None
    await within(before)
    with pytest.raises(StoreError) as failed:
        await within(failing)
    assert str(failed.value) == (
        f"retained message of 'doomed' not stored in {tmp_path / FILE_NAME}: simulated disk failure"
    )
    # The clear is still on its way, so lookups keep showing it.
    assert store.get("doomed") is None
    with pytest.raises(StoreError, match="simulated disk failure"):
        await within(clearing)
    assert store.get("doomed") == b"old"
    await within(after)
    assert store.stats == RetainedStats(count=3, bytes=5)
    store = await reopen(store, openStore, tmp_path)
    assert dict(store.match("#")) == {"before": b"1", "doomed": b"old", "after": b"2"}


@pytest_twisted.ensureDeferred
async def test_failedNewTopicIsForgotten(tmp_path, openStore):
    store = openStore(tmp_path)
    await within(store.close())
    doom(tmp_path, "doomed")
    store = openStore(tmp_path)
    with pytest.raises(StoreError):
        await within(store.set("doomed", b"new"))
    assert store.get("doomed") is None
    assert store.stats == RetainedStats(count=0, bytes=0)
    assert store.match("#") == []


# Stores that cannot be opened.


@pytest_twisted.ensureDeferred
async def test_schemaVersionMismatch(tmp_path, openStore):
    await within(openStore(tmp_path).close())
    sql(tmp_path, f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value) == (
        f"{tmp_path / FILE_NAME} has schema version {SCHEMA_VERSION + 1}; "
        f"this version of Dallal reads version {SCHEMA_VERSION} only"
    )


def test_foreignDatabase(tmp_path, openStore):
    sql(tmp_path, "CREATE TABLE notes (text)")
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value).startswith(
        f"{tmp_path / FILE_NAME} is an SQLite database but not a Dallal retained message store"
    )


def test_notADatabase(tmp_path, openStore):
    (tmp_path / FILE_NAME).write_bytes(b"these are not the bytes of a database\n" * 200)
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value) == f"cannot open {tmp_path / FILE_NAME}: file is not a database"


def test_emptyFile(tmp_path, openStore):
    """
    An empty file (which SQLite would take for a new database) is refused:
    starting with no retained messages would lose them silently.
    """
    (tmp_path / FILE_NAME).write_bytes(b"")
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value) == (
        f"{tmp_path / FILE_NAME} is empty, not a Dallal retained message store: "
        "remove it to start with no retained messages"
    )


@pytest_twisted.ensureDeferred
async def test_corruptPages(tmp_path, openStore):
    """
    A file with a valid header and garbage in its pages is refused at open,
    not found out on a later write.
    """
    store = openStore(tmp_path)
    for number in range(300):
        store.set(f"topic/{number}", b"payload %d" % number)
    await within(store.close())
    path = tmp_path / FILE_NAME
    contents = bytearray(path.read_bytes())
    # Keep the first page, which holds the header and the schema.
    assert len(contents) > 8192
    contents[4096:] = b"\xa5" * (len(contents) - 4096)
    path.write_bytes(bytes(contents))
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    message = str(failed.value)
    assert str(path) in message
    assert "malformed" in message or "corrupt" in message


@pytest.mark.parametrize("dataDir", ["afile/data", "afile"])
def test_dataDirectoryNotCreatable(tmp_path, openStore, dataDir):
    """
    A data directory that cannot be created (here because a regular file is
    in the way: chmod does not stop root) is refused with its path.
    """
    (tmp_path / "afile").write_text("in the way")
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path / dataDir)
    assert str(failed.value).startswith(f"cannot create the data directory {tmp_path / dataDir}: ")


def test_storeFileIsADirectory(tmp_path, openStore):
    (tmp_path / FILE_NAME).mkdir()
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value).startswith(f"cannot open {tmp_path / FILE_NAME}: ")


def test_secondStoreOnTheSameDirectory(tmp_path, openStore):
    openStore(tmp_path)
    with pytest.raises(StoreError) as failed:
        openStore(tmp_path)
    assert str(failed.value) == (
        f"cannot open {tmp_path / FILE_NAME}: database is locked "
        "(is another broker using this data directory?)"
    )
