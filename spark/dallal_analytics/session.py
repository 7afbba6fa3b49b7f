"""
A quiet SparkSession for the report, embedded or under spark-submit.

Embedded (C{python spark/report.py}), this module starts the JVM itself: it
pins the Python executables, binds to 127.0.0.1 for local masters, points
log4j at the errors-only configuration beside this file, gives the JVM the
compiler directives beside it too, and filters the lines the JVM prints
before any logging exists (L{JVM_NOISE}).
Under C{spark-submit} the JVM already runs with the submitter's options, so
only settings that are still missing are added.
"""

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

LOG4J_CONFIGURATION = Path(__file__).with_name("log4j2.properties")
# Which code the optimizing compiler leaves alone (see JVM_OPTIONS).
COMPILER_DIRECTIVES = Path(__file__).with_name("compiler-directives.json")

# Lines a JVM writes before any logging exists, which no logging setting
# silences: Spark adds --add-modules=jdk.incubator.vector to every JVM it
# starts, and the JVM announces it; it opens sun.security.action to itself,
# a package that Java 25 no longer has; and the JVM counts the compiler
# directives it read (on standard output, sent to standard error with the
# rest of its own output: see compilerDirectiveOptions).
JVM_NOISE = re.compile(
    rb"WARNING: Using incubator modules:"
    rb"|WARNING: package sun\.security\.action not in java\.base"
    rb"|\d+ compiler directives added$"
)

# Classes whose first use costs a core about a second, initialized while the
# JVM starts (see _initializeAhead): Spark 4's table of the characters whose
# title case is several characters, which it builds by asking ICU about
# each of the 1,114,112 Unicode code points as the class is initialized (by
# a task, the first time one runs code that needs it).
CLASSES_TO_INITIALIZE_AHEAD = ("org.apache.spark.sql.catalyst.util.CollationAwareUTF8String",)

# Chosen when the report moved every event of every message once (now only
# with --deliveries): with 4, that stage took 40 s instead of 28 at ten
# million lines (one run each, on a shared machine).  Adaptive execution
# merges the partitions of the small shuffles, so more costs little.
LOCAL_SHUFFLE_PARTITIONS = 16

# twistd rotates its log at 1 MB, so a log is many small files, and Spark
# packs them into tasks counting each file as this many bytes more: its
# default, 4 MB, made ten million lines (1,639 files) 64 tasks of 25 files,
# for every scan of the cached log.  Opening a local file costs far less:
# with 256 KB they are 16 tasks, and the report at ten million lines took
# 96-98 s instead of 101-117 (runs alternated).  Remote storage (HDFS, S3)
# keeps Spark's default, where opening does cost.
LOCAL_FILE_OPEN_COST = 256 * 1024

# The JVM options of the driver and, where we start them, the executors:
# - HotSpot never compiles a method of more than 8,000 bytes of bytecode, and
#   the code Spark generates for parsing a log line (some twenty fields) is
#   larger: interpreted, it took twice as long;
# - the report is a batch job: the parallel collector's throughput beats G1's
#   short pauses (at ten million lines, 133 s against 160 s back to back);
# - HotSpot's optimizing compiler (C2) kept one of two cores busy for the
#   report's first minute, mostly compiling Spark's own planning code
#   (Janino, Catalyst, serialization), which runs some thousands of times per
#   query: ten times its usual thresholds leave that code to the quick
#   compiler (C1) and C2 to the per-row loops, which run millions of times
#   (C2 57 CPU-s -> 30, the report at ten million lines 151 s -> 124);
# - the parallel collector stops every thread for a full collection (of a
#   heap that holds the cached log: 0.36-0.57 s at ten million lines) when
#   compiled code or class metadata have grown by a threshold: Spark's
#   generated classes grow both, and room for them up front removes those
#   collections (at a million lines, pauses 0.84 s -> 0.55).
# The compiler directives (COMPILER_DIRECTIVES) keep C2 from the code that
# runs while Spark plans queries, generates and compiles code and ships
# tasks (Janino, Catalyst's rules, Java serialization): C1 compiles it, and
# C2 is left for the rest, the per-row code above all (at ten million
# lines, 2 to 6 CPU-seconds less, see compilerDirectiveOptions).
# docs/ANALYTICS.md has the measurements.
JVM_OPTIONS = (
    "-XX:-DontCompileHugeMethods",
    "-XX:+UseParallelGC",
    "-XX:Tier4InvocationThreshold=50000",
    "-XX:Tier4MinInvocationThreshold=6000",
    "-XX:Tier4CompileThreshold=150000",
    "-XX:Tier4BackEdgeThreshold=400000",
    "-XX:ReservedCodeCacheSize=512m",
    "-XX:MetaspaceSize=256m",
)

# Where every executor runs in the driver's JVM or beside it, the memory of
# aggregations, joins and sorts is taken outside the heap: on the heap, the
# collector copied those buffers whenever it ran during one (pauses of 0.3
# to 0.8 s after the parse; in all 4.5-5.5 s -> 3.4-4.0 at ten million
# lines).  The cached log stays on the heap, where reading it costs no copy.
LOCAL_OFF_HEAP_MEMORY = "1g"


def isLocalMaster(master):
    """
    Whether every executor runs on this machine (C{local}, C{local[4]},
    C{local-cluster[...]}).
    """
    return master is not None and master.startswith("local")


def launchedBySparkSubmit():
    """
    spark-submit starts the JVM first and tells Python where its gateway is.
    """
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _quotedOption(option):
    """
    A JVM option as Spark's launcher reads the options' text (split as a
    shell would): quoted, in case it holds a path with spaces.
    """
    return '"' + option.replace("\\", "\\\\").replace('"', '\\"') + '"'


def compilerDirectiveOptions():
    """
    The JVM options that apply L{COMPILER_DIRECTIVES}, for JVMs of this
    machine (a JVM does not start without the file); none if the file is
    not there (the package was shipped without it).

    At ten million lines the report took 2 to 6 CPU-seconds less in each
    of three pairs of alternated runs, on Java 17 and on Java 25
    (docs/ANALYTICS.md).  The option needs the diagnostic options
    unlocked; the JVM then writes a line on standard output, which it is
    told to write on standard error, where L{JVM_NOISE} filters it.
    """
    if not COMPILER_DIRECTIVES.is_file():
        return []
    return [
        "-XX:+UnlockDiagnosticVMOptions",
        "-XX:+DisplayVMOutputToStderr",
        _quotedOption(f"-XX:CompilerDirectivesFile={COMPILER_DIRECTIVES}"),
    ]


def _forwardStderr(stream, destination):
    for line in stream:
        if not JVM_NOISE.match(line):
            destination.write(line)
            destination.flush()


def _launchQuietGateway(conf):
    """
    Start the JVM with its standard error passed through a filter thread.
    """
    from pyspark.java_gateway import launch_gateway

    gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
    # The JVM writes to this pipe for as long as it lives; the thread ends
    # when it exits and closes it.
    threading.Thread(
        target=_forwardStderr,
        args=(gateway.proc.stderr, sys.stderr.buffer),
        name="jvm-stderr",
        daemon=True,
    ).start()
    return gateway


def tasksRunInDriver(master):
    """
    Whether the tasks run in the driver's JVM (C{local}, C{local[4]}), rather
    than in executor JVMs (C{local-cluster[...]}, a cluster's).
    """
    return master == "local" or master.startswith("local[")


def _initializeAhead(gateway):
    """
    Initialize L{CLASSES_TO_INITIALIZE_AHEAD} in the JVM of C{gateway}, from
    a thread of its own, while this one goes on starting Spark: the JVM
    starts on one core, mostly, and the other is idle then.  Otherwise a
    task initializes them while every core parses the log (about a second
    of one core on Java 17 and on Java 25).  A class that this Spark does
    not have is skipped.
    """
    from py4j.protocol import Py4JError

    def initialize():
        for name in CLASSES_TO_INITIALIZE_AHEAD:
            try:
                gateway.jvm.java.lang.Class.forName(name)
            except Py4JError:
                # Not in this version of Spark, or the JVM has already
                # stopped: there is nothing to do ahead.
                pass

    thread = threading.Thread(target=initialize, name="initialize-ahead", daemon=True)
    thread.start()
    return thread


def jvmRunning():
    """
    Whether this process already has a JVM to talk to (spark-submit's, or
    one an earlier session started): a new session joins it, and JVM
    options given now are not applied.
    """
    from pyspark.core.context import SparkContext

    return launchedBySparkSubmit() or SparkContext._gateway is not None


def driverProcess():
    """
    The driver's JVM, if this process started it (embedded); C{None} under
    spark-submit.
    """
    from pyspark.core.context import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def buildSession(
    master=None,
    appName="dallal-report",
    shufflePartitions=None,
    driverMemory=None,
    tmpDir=None,
    driverJavaOptions=(),
):
    """
    Start (or join) the SparkSession the report runs on.

    @param master: the master URL; C{None} keeps spark-submit's, or runs
        C{local[*]} when embedded.
    @param shufflePartitions: C{None} means a few for local masters and
        Spark's default elsewhere.
    @param driverMemory: e.g. C{"2g"}; only effective when embedded, since
        spark-submit has already sized its JVM.
    @param tmpDir: where Spark keeps its scratch files and warehouse, instead
        of the system's temporary folder and the working directory.
    @param driverJavaOptions: more options for the driver's JVM (those of
        a L{dallal_analytics.classdata.ClassDataArchive}); only effective
        when this call starts the JVM (see L{jvmRunning}).
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

    from pyspark import SparkConf
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    submitted = launchedBySparkSubmit()
    if submitted:
        # Connect to spark-submit's JVM first so that SparkConf() sees its
        # settings and ours only fill the gaps.
        SparkContext._ensure_initialized()
    conf = SparkConf()
    if master is not None:
        conf.set("spark.master", master)
    elif not submitted:
        conf.set("spark.master", "local[*]")
    effectiveMaster = conf.get("spark.master")
    local = isLocalMaster(effectiveMaster)
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    log4j = f"-Dlog4j2.configurationFile={LOG4J_CONFIGURATION.as_uri()}"
    javaOptions = [log4j, *JVM_OPTIONS, *compilerDirectiveOptions()]
    if tmpDir is not None:
        javaOptions.append(_quotedOption(f"-Djava.io.tmpdir={tmpDir}"))
        conf.set("spark.local.dir", str(tmpDir))
        conf.set("spark.sql.warehouse.dir", str(Path(tmpDir) / "warehouse"))
    defaults = {
        "spark.app.name": appName,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.extraJavaOptions": " ".join([*javaOptions, *driverJavaOptions]),
    }
    if local:
        # Executors of local-cluster masters are JVMs of this machine too;
        # remote ones would not find the file.
        defaults["spark.executor.extraJavaOptions"] = " ".join(javaOptions)
        defaults["spark.sql.shuffle.partitions"] = str(
            shufflePartitions or LOCAL_SHUFFLE_PARTITIONS
        )
        defaults["spark.sql.files.openCostInBytes"] = str(LOCAL_FILE_OPEN_COST)
        defaults["spark.memory.offHeap.enabled"] = "true"
        defaults["spark.memory.offHeap.size"] = LOCAL_OFF_HEAP_MEMORY
    else:
        defaults["spark.executor.extraJavaOptions"] = " ".join(JVM_OPTIONS)
        if shufflePartitions:
            defaults["spark.sql.shuffle.partitions"] = str(shufflePartitions)
    if driverMemory:
        defaults["spark.driver.memory"] = driverMemory
    for key, value in defaults.items():
        conf.setIfMissing(key, value)
    # str_to_map fails the whole job on a repeated key under the default
    # EXCEPTION policy; one odd line must not do that.
    conf.set("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
    # PySpark sends the JVM the Python call site of every Column it builds,
    # for error messages: building the parsing expressions took 9,100 calls
    # to the JVM instead of 2,700, and the first query was planned 2 s later
    # (at ten million lines, while no task runs).  The report's expressions
    # cast with try_cast and do not fail on a line, so its errors lose no
    # call site worth having.
    conf.setIfMissing("spark.python.sql.dataFrameDebugging.enabled", "false")
    # The report caches the parsed log once and reads it a few times:
    # compressed, the whole report took 15% longer at 10 million lines
    # (its columns are mostly numbers and short text: it shrank by a tenth).
    conf.setIfMissing("spark.sql.inMemoryColumnarStorage.compressed", "false")
    # The report also caches small aggregations (per session, per actor),
    # which several queries read.  By default Spark keeps a cached plan's
    # partitions as its shuffle made them (16 on a local master), so each
    # read ran 16 tasks of a few hundred rows; allowed to change them,
    # adaptive execution merges them into as few as their size needs (at ten
    # million lines, the report faster by 0.4, 2.1 and 2.0 s in three pairs
    # of alternated runs, every table and summary.json equal).
    conf.setIfMissing("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning", "true")

    if not jvmRunning():
        gateway = _launchQuietGateway(conf)
        # Executors of other JVMs would each initialize them anyway.
        if tasksRunInDriver(effectiveMaster):
            _initializeAhead(gateway)
        SparkContext(conf=conf, gateway=gateway)
    session = SparkSession.builder.config(conf=conf).getOrCreate()
    # Under spark-submit log4j was configured by the submitter: quiet what
    # follows at least.
    session.sparkContext.setLogLevel("ERROR")
    return session
