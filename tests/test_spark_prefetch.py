"""
Reading the logs ahead while the JVM starts (spark/dallal_analytics/prefetch.py).
"""

import os

import pytest

pytest_plugins = ["conftest_spark"]


@pytest.fixture
def prefetch():
    from dallal_analytics import prefetch

    return prefetch


@pytest.fixture
def asked(monkeypatch):
    """
    The files the kernel is asked to read ahead, by name, in order.
    """
    names = []

    def fadvise(fd, offset, length, advice):
        assert (offset, length, advice) == (0, 0, os.POSIX_FADV_WILLNEED)
        names.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "posix_fadvise", fadvise, raising=False)
    return names


def logs(folder, sizes):
    folder.mkdir()
    for name, size in sizes.items():
        (folder / name).write_bytes(b"x" * size)
    return folder


def test_files_globs_and_directories(prefetch, tmp_path, asked):
    """
    Every local file the report will read is asked for once it is named:
    as a file, through a glob, or in a directory (not its subdirectories
    or hidden files, which Spark does not read either).
    """
    first = logs(tmp_path / "a", {"twistd.log": 10, "twistd.log.1": 10})
    second = logs(tmp_path / "b", {"twistd.log": 10, "twistd.log.1": 10, "twistd.log.2": 10})
    (second / "nested").mkdir()
    (second / ".twistd.log.swp").write_bytes(b"x")
    (second / "_SUCCESS").write_bytes(b"x")
    (second / "nested" / "twistd.log").write_bytes(b"x")
    assert (
        prefetch.readAhead(
            [
                str(first / "twistd.log.1"),
                f"file://{first}/twistd.log",
                str(second / "*.1"),
                str(second),
            ]
        )
        == 6
    )
    assert asked == [
        "twistd.log.1",
        "twistd.log",
        "twistd.log.1",
        "twistd.log",
        "twistd.log.1",
        "twistd.log.2",
    ]


def test_what_is_not_a_local_file_is_left_to_spark(prefetch, tmp_path, asked):
    """
    Missing paths, globs that match nothing and other file systems are
    skipped without an error: Spark reports what it cannot read.
    """
    assert (
        prefetch.readAhead(
            [
                str(tmp_path / "missing.log"),
                str(tmp_path / "*.log"),
                "hdfs://namenode/logs",
                "s3a://bucket/logs/twistd.log",
            ]
        )
        == 0
    )
    assert asked == []


def test_no_more_than_the_budget(prefetch, tmp_path, asked, monkeypatch):
    """
    Files are asked for in order until their sizes would pass the budget,
    by default half the free memory, so that a log larger than memory does
    not push itself out of it.
    """
    folder = logs(tmp_path / "logs", {"1": 400, "2": 400, "3": 400})
    assert prefetch.readAhead([str(folder)], budget=1000) == 2
    assert asked == ["1", "2"]
    monkeypatch.setattr(prefetch, "_freeMemory", lambda: 1000)
    assert prefetch.readAhead([str(folder)]) == 1


def test_the_report_reads_ahead_on_this_machine_only(monkeypatch):
    """
    Embedded on a local master, the report reads its logs ahead as it
    starts Spark; on a cluster the executors read them elsewhere.
    """
    import report

    class Started(Exception):
        pass

    def buildSession(**options):
        raise Started

    readAhead = []
    monkeypatch.setattr(report, "startReadingAhead", readAhead.append)
    monkeypatch.setattr(report, "buildSession", buildSession)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    for master in ([], ["--master", "local[2]"], ["--master", "spark://head:7077"]):
        with pytest.raises(Started):
            report.main(["logs/twistd.log*", "--out", "report", *master])
    assert readAhead == [["logs/twistd.log*"], ["logs/twistd.log*"]]
