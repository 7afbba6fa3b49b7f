"""
An archive of the driver JVM's classes, written by one report and mapped by
the next ones: HotSpot's dynamic class data sharing (CDS, JDK 13 and later).

Before its first task, the report's JVM loads, parses and verifies some ten
thousand classes from the jars of Spark, Scala and their libraries, and
plans its first queries with that code still new.  A JVM started with
C{-XX:ArchiveClassesAtExit=FILE} writes the classes it loaded into FILE as
it exits; one started with C{-XX:SharedArchiveFile=FILE} maps them from it,
already parsed and verified.  With the archive, a million lines were parsed
and counted 3.3 s sooner on Java 17 and 2.9 s sooner on Java 25 (the first
task starts about 4 s after the start instead of 7), and the report of ten
million lines took 1.4 to 3.3 s less in three alternated pairs
(docs/ANALYTICS.md).  Writing it costs the first report some 10 s more as
its JVM exits, and the archive takes about 190 MB.

An archive fits one Java, one set of JVM options and one class path (the
PySpark installation's jars and Spark's configuration folder): its name is
a digest of these, so that changing one makes a new archive rather than
reusing one that does not fit, and its size, so that one truncated since it
was written (which can crash the JVM that maps it) is written again.  The
JVM checks it again when it maps it and, should it not fit or be damaged,
runs without it; the options given here keep it silent about that, as about
what it leaves out when writing one (the classes Spark generates, those of
signed jars).
"""

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

# The archives are kept under this folder ($XDG_CACHE_HOME/dallal-report or
# ~/.cache/dallal-report unless it is set).
CACHE_VARIABLE = "DALLAL_REPORT_CACHE"
CACHE_FOLDER = "dallal-report"
# The archives' names: driver-<digest>-<size>.jsa.
PREFIX = "driver-"
SUFFIX = ".jsa"
# Archives of other Javas, options or installations, kept in case they are
# used again (each is about 190 MB): this many, the most recently used.
KEPT = 3
# An unfinished archive older than this was left by a report that was
# killed while its JVM wrote it.
ABANDONED_SECONDS = 3600
# HotSpot's messages about class data sharing (what it leaves out of an
# archive, an archive it cannot map): on standard output, among the
# report's own lines, unless turned off.
QUIET = "-Xlog:cds*=off"


def cacheFolder(environ=None):
    """
    Where the archives are kept: C{$DALLAL_REPORT_CACHE}, else
    C{$XDG_CACHE_HOME/dallal-report}, else C{~/.cache/dallal-report}.
    """
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_VARIABLE):
        return Path(environ[CACHE_VARIABLE])
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / CACHE_FOLDER


def javaHome(environ=None):
    """
    The Java that PySpark starts, as C{spark-class} finds it: that of
    C{JAVA_HOME} if set, else the first C{java} on C{PATH}; C{None} if
    there is none.
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAVA_HOME"):
        return Path(environ["JAVA_HOME"]).resolve()
    java = shutil.which("java", path=environ.get("PATH"))
    return Path(java).resolve().parent.parent if java else None


def _release(home):
    """
    The text of a Java installation's C{release} file (its version, vendor
    and build), or C{None}.
    """
    try:
        return (home / "release").read_text(errors="replace")
    except OSError:
        return None


def _canShare(home):
    """
    Whether this Java has the base archive of its own classes that a
    dynamic archive extends (some builds leave it out).
    """
    return any((home / "lib" / "server").glob(f"classes*{SUFFIX}"))


class ClassDataArchive:
    """
    The archive for the report's JVM: mapped if an earlier report wrote it,
    written as this one's JVM exits if not (see L{finish}).
    """

    def __init__(self, folder, name):
        """
        The archive C{name} in C{folder}, kept as C{<name>-<size>.jsa}: a
        JVM that maps a truncated archive can crash (SIGBUS, on Java 17),
        so one whose size is not the size it was written with is removed
        rather than mapped, and written again.
        """
        self.folder = Path(folder)
        self.name = name
        self.path = None
        for candidate in self.folder.glob(f"{name}-*{SUFFIX}"):
            size = candidate.name[len(name) + 1 : -len(SUFFIX)]
            try:
                whole = size.isdigit() and candidate.stat().st_size == int(size)
                if not whole:
                    candidate.unlink()
            except OSError:
                continue
            if whole:
                self.path = candidate
        self.creating = self.path is None
        self.unfinished = self.folder / f"{name}{SUFFIX}.{os.getpid()}.tmp"

    @classmethod
    def find(cls, javaOptions, environ=None):
        """
        The archive for a JVM started with C{javaOptions} (those that
        shape the heap or the class path included), or C{None} where there
        can be none: no Java with a base archive, a cache folder that
        cannot be written, or one whose path has blanks or quotes (Spark's
        launcher splits the options there).
        """
        environ = os.environ if environ is None else environ
        home = javaHome(environ)
        release = _release(home) if home else None
        if release is None or not _canShare(home):
            return None
        folder = cacheFolder(environ)
        if any(character.isspace() or character in "'\"" for character in str(folder)):
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        if not os.access(folder, os.W_OK | os.X_OK):
            return None
        import pyspark

        fits = "\0".join(
            [
                str(home),
                release,
                str(Path(pyspark.__file__).resolve().parent),
                pyspark.__version__,
                environ.get("SPARK_HOME", ""),
                environ.get("SPARK_CONF_DIR", ""),
                *javaOptions,
            ]
        )
        digest = hashlib.sha256(fits.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return cls(folder, f"{PREFIX}{digest}")

    def javaOptions(self):
        """
        The driver's JVM options that map the archive or write it.
        """
        if self.creating:
            return [f"-XX:ArchiveClassesAtExit={self.unfinished}", QUIET]
        try:
            # Marks it as used, for pruning.
            os.utime(self.path)
        except OSError:
            pass
        return [f"-XX:SharedArchiveFile={self.path}", QUIET]

    def finish(self, jvm, timeout=300):
        """
        Once the report is done with Spark: if this report writes the
        archive, end its JVM (C{jvm}, the process PySpark started) and
        wait while it writes it, then put it in place.  Return how many
        seconds that took, or C{None} if this report put no archive in
        place.

        An archive is put in place only whole: written under another name,
        renamed once the JVM exited normally, with its size in its name.
        """
        if not self.creating:
            return None
        started = time.monotonic()
        placed = False
        try:
            # PySpark's JVM exits when its standard input closes.
            if jvm.stdin is not None:
                jvm.stdin.close()
            try:
                status = jvm.wait(timeout)
            except subprocess.TimeoutExpired:
                jvm.kill()
                jvm.wait()
                status = None
            size = self.unfinished.stat().st_size if self.unfinished.is_file() else 0
            if status == 0 and size:
                self.path = self.folder / f"{self.name}-{size}{SUFFIX}"
                os.replace(self.unfinished, self.path)
                placed = True
        finally:
            self.unfinished.unlink(missing_ok=True)
            self._prune()
        return time.monotonic() - started if placed else None

    def abandon(self, jvm):
        """
        After a report that failed or was interrupted: if this report was
        to write the archive, end its JVM without letting it (an archive of
        a report cut short may lack the classes of its later stages).
        """
        if not self.creating:
            return
        try:
            jvm.kill()
            jvm.wait()
        finally:
            self.unfinished.unlink(missing_ok=True)

    def _prune(self):
        """
        Remove all but the L{KEPT} most recently used archives, and the
        unfinished ones abandoned long ago: the report's own files only
        (C{driver-*}), whatever else the folder holds.
        """

        def modified(paths):
            found = []
            for path in paths:
                try:
                    found.append((path, path.stat().st_mtime))
                except OSError:
                    # Removed meanwhile, by another report.
                    pass
            return found

        try:
            archives = modified(self.folder.glob(f"{PREFIX}*{SUFFIX}"))
            unfinished = modified(self.folder.glob(f"{PREFIX}*{SUFFIX}.*.tmp"))
        except OSError:
            return
        archives.sort(key=lambda entry: entry[1], reverse=True)
        abandoned = [
            path for path, changed in unfinished if time.time() - changed > ABANDONED_SECONDS
        ]
        for path in [path for path, _ in archives[KEPT:]] + abandoned:
            path.unlink(missing_ok=True)
