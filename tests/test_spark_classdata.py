"""
The archive of the driver JVM's classes (spark/dallal_analytics/classdata.py):
where it is kept, when it is written or mapped, and that a second report
really loads Spark's classes from the archive the first one wrote.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest

pytest_plugins = ["conftest_spark"]

OPTIONS = ["-XX:+UseParallelGC", "-Xmx4g"]


@pytest.fixture
def classdata():
    from dallal_analytics import classdata

    return classdata


@pytest.fixture
def javaHome(tmp_path):
    """
    A Java installation as far as the archive cares: its release file and
    its base archive.
    """
    home = tmp_path / "jdk"
    (home / "lib" / "server").mkdir(parents=True)
    (home / "lib" / "server" / "classes.jsa").write_bytes(b"base")
    (home / "release").write_text('JAVA_VERSION="17.0.15"\n')
    return home


def environment(tmp_path, javaHome, **more):
    return {"JAVA_HOME": str(javaHome), "DALLAL_REPORT_CACHE": str(tmp_path / "cache"), **more}


def test_the_first_report_writes_the_archive_and_the_next_map_it(tmp_path, javaHome, classdata):
    environ = environment(tmp_path, javaHome)
    first = classdata.ClassDataArchive.find(OPTIONS, environ)
    assert first.creating
    assert first.unfinished.parent == tmp_path / "cache"
    assert first.javaOptions() == [f"-XX:ArchiveClassesAtExit={first.unfinished}", classdata.QUIET]
    first.finish(FakeJvm(first))
    assert first.path.name == f"{first.name}-7.jsa"

    second = classdata.ClassDataArchive.find(OPTIONS, environ)
    assert second.path == first.path
    assert not second.creating
    assert second.javaOptions() == [f"-XX:SharedArchiveFile={first.path}", classdata.QUIET]


def test_a_truncated_archive_is_written_again(tmp_path, javaHome, classdata):
    """
    Mapping an archive cut short can crash the JVM: one whose size is not
    the one in its name is removed, and this report writes it again.
    """
    environ = environment(tmp_path, javaHome)
    archive = classdata.ClassDataArchive.find(OPTIONS, environ)
    archive.finish(FakeJvm(archive))
    archive.path.write_bytes(b"class")
    again = classdata.ClassDataArchive.find(OPTIONS, environ)
    assert again.creating
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_archive_fits_one_java_and_one_set_of_options(tmp_path, javaHome, classdata):
    environ = environment(tmp_path, javaHome)
    name = classdata.ClassDataArchive.find(OPTIONS, environ).name
    assert classdata.ClassDataArchive.find(OPTIONS, environ).name == name
    bigger = ["-XX:+UseParallelGC", "-Xmx40g"]
    assert classdata.ClassDataArchive.find(bigger, environ).name != name
    assert (
        classdata.ClassDataArchive.find(
            OPTIONS, dict(environ, SPARK_CONF_DIR=str(tmp_path / "conf"))
        ).name
        != name
    )
    (javaHome / "release").write_text('JAVA_VERSION="17.0.16"\n')
    assert classdata.ClassDataArchive.find(OPTIONS, environ).name != name


def test_no_archive_where_there_can_be_none(tmp_path, javaHome, classdata):
    # No Java at all.
    assert (
        classdata.ClassDataArchive.find(
            OPTIONS, {"PATH": str(tmp_path / "empty"), "DALLAL_REPORT_CACHE": str(tmp_path)}
        )
        is None
    )
    # A cache folder that cannot be made (a file is in the way), or whose
    # path Spark's launcher would split.
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert (
        classdata.ClassDataArchive.find(
            OPTIONS, environment(tmp_path, javaHome, DALLAL_REPORT_CACHE=str(blocker / "cache"))
        )
        is None
    )
    assert (
        classdata.ClassDataArchive.find(
            OPTIONS, environment(tmp_path, javaHome, DALLAL_REPORT_CACHE=str(tmp_path / "a b"))
        )
        is None
    )
    # A Java without the base archive that a dynamic one extends.
    (javaHome / "lib" / "server" / "classes.jsa").unlink()
    assert classdata.ClassDataArchive.find(OPTIONS, environment(tmp_path, javaHome)) is None
    assert not (tmp_path / "cache").exists()


def test_the_java_on_the_path_when_java_home_is_unset(tmp_path, javaHome, classdata):
    (javaHome / "bin").mkdir()
    java = javaHome / "bin" / "java"
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    link = tmp_path / "bin"
    link.mkdir()
    (link / "java").symlink_to(java)
    assert classdata.javaHome({"PATH": str(link)}) == javaHome.resolve()
    assert classdata.javaHome({"PATH": str(link), "JAVA_HOME": str(tmp_path)}) == tmp_path
    assert classdata.javaHome({"PATH": str(tmp_path / "empty")}) is None


def test_the_cache_folder(tmp_path, classdata):
    assert classdata.cacheFolder({"DALLAL_REPORT_CACHE": "/x/y"}) == Path("/x/y")
    assert classdata.cacheFolder({"XDG_CACHE_HOME": "/c"}) == Path("/c/dallal-report")
    assert classdata.cacheFolder({}) == classdata.Path.home() / ".cache" / "dallal-report"


class FakeJvm:
    """
    The driver's process as PySpark holds it: it exits when its standard
    input closes, having written the archive if C{writes}.
    """

    def __init__(self, archive, status=0, writes=True, hangs=False):
        self.archive = archive
        self.status = status
        self.writes = writes
        self.hangs = hangs
        self.stdin = open(os.devnull, "w")
        self.killed = False

    def wait(self, timeout=None):
        if self.hangs and not self.killed:
            raise subprocess.TimeoutExpired("java", timeout)
        assert self.stdin.closed or self.killed
        if self.writes:
            self.archive.unfinished.write_bytes(b"classes")
        return self.status

    def kill(self):
        self.killed = True


def test_an_archive_is_put_in_place_only_whole(tmp_path, javaHome, classdata):
    environ = environment(tmp_path, javaHome)
    archive = classdata.ClassDataArchive.find(OPTIONS, environ)
    assert archive.finish(FakeJvm(archive, status=1)) is None
    assert archive.finish(FakeJvm(archive, hangs=True), timeout=0) is None
    assert archive.finish(FakeJvm(archive, writes=False)) is None
    assert archive.path is None
    assert list(archive.folder.iterdir()) == []

    assert archive.finish(FakeJvm(archive)) >= 0
    assert archive.path.read_bytes() == b"classes"
    assert list(archive.folder.iterdir()) == [archive.path]
    # A report that maps the archive has nothing to finish.
    mapping = classdata.ClassDataArchive.find(OPTIONS, environ)
    assert mapping.finish(FakeJvm(mapping)) is None
    assert archive.path.read_bytes() == b"classes"


def test_a_report_cut_short_writes_no_archive(tmp_path, javaHome, classdata):
    archive = classdata.ClassDataArchive.find(OPTIONS, environment(tmp_path, javaHome))
    jvm = FakeJvm(archive)
    archive.unfinished.write_bytes(b"half")
    archive.abandon(jvm)
    assert jvm.killed
    assert list(archive.folder.iterdir()) == []


def test_only_the_most_recently_used_archives_are_kept(tmp_path, javaHome, classdata):
    cache = tmp_path / "cache"
    cache.mkdir()
    now = time.time()
    for age in range(5):
        old = cache / f"driver-{age}-3.jsa"
        old.write_bytes(b"old")
        os.utime(old, (now - 100 * (age + 1), now - 100 * (age + 1)))
    abandoned = cache / "driver-x.jsa.1.tmp"
    writing = cache / "driver-y.jsa.2.tmp"
    for path, age in ((abandoned, 2 * classdata.ABANDONED_SECONDS), (writing, 0)):
        path.write_bytes(b"")
        os.utime(path, (now - age, now - age))
    # Not the report's: left alone, however old.
    foreign = [cache / "classes.jsa", cache / "notes.jsa.1.tmp"]
    for path in foreign:
        path.write_bytes(b"")
        os.utime(path, (0, 0))
    archive = classdata.ClassDataArchive.find(OPTIONS, environment(tmp_path, javaHome))
    archive.finish(FakeJvm(archive))
    assert sorted(path.name for path in cache.iterdir()) == sorted(
        [
            archive.path.name,
            "driver-0-3.jsa",
            "driver-1-3.jsa",
            writing.name,
            *(path.name for path in foreign),
        ]
    )


@pytest.fixture
def archiveOptions(monkeypatch, tmp_path):
    """
    Runs C{report.main} with these arguments up to the start of Spark, an
    archive C{driver} in C{tmp_path} to be had: the JVM options of the
    archive it gave the session.
    """
    import report

    class Started(Exception):
        pass

    given = []

    def buildSession(**options):
        given.append(options["driverJavaOptions"])
        raise Started

    monkeypatch.setattr(report, "startReadingAhead", lambda paths: None)
    monkeypatch.setattr(report, "buildSession", buildSession)
    monkeypatch.setattr(
        report.ClassDataArchive,
        "find",
        classmethod(lambda cls, options: cls(tmp_path, "driver")),
    )
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)

    def run(*arguments):
        with pytest.raises(Started):
            report.main(["logs", "--out", "report", *arguments])
        return given.pop()

    return run


def test_the_report_uses_an_archive_embedded_on_a_local_master_only(
    archiveOptions, monkeypatch, tmp_path, classdata
):
    import report

    # As in a process of its own: the tests' session may be running.
    monkeypatch.setattr(report, "jvmRunning", lambda: False)
    unfinished = tmp_path / f"driver.jsa.{os.getpid()}.tmp"
    writing = [f"-XX:ArchiveClassesAtExit={unfinished}", classdata.QUIET]
    assert archiveOptions() == writing
    assert archiveOptions("--master", "local[2]") == writing
    assert archiveOptions("--master", "spark://head:7077") == ()
    assert archiveOptions("--no-jvm-cache") == ()


@pytest.mark.e2e
def test_no_archive_for_a_jvm_already_running(spark, archiveOptions):
    """
    Called where a session already runs (an embedder's), the report joins
    its JVM: options would not apply to it, and ending it to write an
    archive would end the embedder's session.
    """
    assert archiveOptions() == ()


@pytest.mark.e2e
def test_a_second_report_loads_sparks_classes_from_the_archive(
    reportCommand, handWrittenLogs, handWrittenSummary, tmp_path, classdata
):
    """
    The real thing: the first report writes the archive as its JVM exits,
    and says so; the second one's JVM loads Spark's classes from it.  Both
    print the same, and nothing from the JVM.
    """
    cache = tmp_path / "cache"
    environ = dict(os.environ, DALLAL_REPORT_CACHE=str(cache))

    def report(out, **more):
        return subprocess.run(
            [*reportCommand, str(handWrittenLogs), "--out", str(tmp_path / out)],
            env=dict(environ, **more),
            capture_output=True,
            text=True,
            timeout=300,
        )

    def totals(out):
        return (
            f"{handWrittenSummary['publishes']} publishes, "
            f"{handWrittenSummary['deliveries']} deliveries, "
            f"{handWrittenSummary['sessions']} sessions, "
            f"{handWrittenSummary['unparsed_lines']} unparsed lines\n"
            f"report: {tmp_path / out / 'report.html'}\n"
            f"summary: {tmp_path / out / 'summary.json'}\n"
        )

    first = report("first")
    assert first.returncode == 0, first.stderr
    assert first.stdout == totals("first")
    assert all(line.startswith("dallal-report: ") for line in first.stderr.splitlines())
    assert "the JVM's classes archived for the next reports" in first.stderr.splitlines()[-1]
    [archive] = cache.iterdir()
    assert archive.name.endswith(".jsa")

    # The java launcher reads JDK_JAVA_OPTIONS (and says so on standard
    # error): each JVM logs where its classes came from, into a file of its
    # own (%p: its process id).
    loads = tmp_path / "loads"
    loads.mkdir()
    second = report("second", JDK_JAVA_OPTIONS=f"-Xlog:class+load=info:file={loads}/%p.txt")
    assert second.returncode == 0, second.stderr
    assert second.stdout == totals("second")
    assert "archived" not in second.stderr
    assert "cds" not in second.stdout + second.stderr
    fromArchive = [
        line
        for path in loads.iterdir()
        for line in path.read_text().splitlines()
        if "org.apache.spark.SparkContext " in line
    ]
    assert fromArchive and all("shared objects file (top)" in line for line in fromArchive)
    assert list(cache.iterdir()) == [archive]
