"""
The SparkSession the report runs on, embedded (C{dallal-report}) or under
C{spark-submit}.

The site's Spark configuration is the user's: C{spark-defaults.conf} (in
C{SPARK_CONF_DIR}), C{--conf} options and JVM options are never replaced.
The JVM is started first, as Spark itself starts it (reading all of
those), and only then are the few settings the job needs added, each only
if the user did not set it (L{JOB_SETTINGS}).
"""

import os
import sys
from pathlib import Path

# What the job needs, set only where the user has not set it:
# - times are shown and bucketed into dates in UTC, as the broker logs them;
# - str_to_map fails the whole job on a repeated key under the default
#   EXCEPTION policy: one odd line must not do that;
# - the report caches a few small aggregations (per session, per actor)
#   that several queries read: adaptive execution may then merge their
#   partitions as it does any shuffle's (without, each read ran one task
#   per shuffle partition: 200 by default, for a few hundred rows).
JOB_SETTINGS = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
    "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
}
DEFAULT_MASTER = "local[*]"


def launchedBySparkSubmit():
    """
    spark-submit starts the JVM first and tells Python where its gateway is.
    """
    return "PYSPARK_GATEWAY_PORT" in os.environ


def isLocalMaster(master):
    """
    Whether every executor runs on this machine (C{local}, C{local[4]},
    C{local-cluster[...]}).
    """
    return master is not None and master.startswith("local")


def buildSession(
    master=None, appName="dallal-report", shufflePartitions=None, driverMemory=None, tmpDir=None
):
    """
    Start (or join) the SparkSession the report runs on.

    @param master: the master URL; C{None} keeps the one configured
        (spark-submit's, C{spark-defaults.conf}'s), else C{local[*]}.
    @param shufflePartitions: C{spark.sql.shuffle.partitions}, if given.
    @param driverMemory: e.g. C{"4g"}, if given; only effective when this
        call starts the JVM (not under spark-submit, which sized it).
    @param tmpDir: where Spark keeps its scratch files and warehouse, instead
        of the system's temporary folder and the working directory.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

    from pyspark import SparkConf
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    # What the user asked for on the command line, given to the JVM as it
    # starts (as --conf would be).
    launch = SparkConf(loadDefaults=False)
    if not launchedBySparkSubmit():
        # PySpark starts its JVM as a shell, which turns Spark's progress
        # bars on: they would write over the report's own progress lines.
        launch.set("spark.ui.showConsoleProgress", "false")
    if master is not None:
        launch.set("spark.master", master)
    if driverMemory is not None:
        launch.set("spark.driver.memory", driverMemory)
    if isLocalMaster(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Starts the JVM through spark-submit, which reads the site's settings
    # (a JVM that fails to start says why, as it writes it: nothing here
    # reads its output); then SparkConf() holds them all.
    SparkContext._ensure_initialized(conf=launch)
    conf = SparkConf()
    conf.setAll(launch.getAll())
    conf.setIfMissing("spark.master", DEFAULT_MASTER)
    conf.setIfMissing("spark.app.name", appName)
    for key, value in JOB_SETTINGS.items():
        conf.setIfMissing(key, value)
    if shufflePartitions is not None:
        conf.set("spark.sql.shuffle.partitions", str(shufflePartitions))
    if tmpDir is not None:
        conf.set("spark.local.dir", str(tmpDir))
        conf.set("spark.sql.warehouse.dir", str(Path(tmpDir) / "warehouse"))
    session = SparkSession.builder.config(conf=conf).getOrCreate()
    if not conf.contains("spark.log.level"):
        # Spark's default console logging reports every stage's warnings
        # over the report's own lines; a site that chose a level keeps it.
        session.sparkContext.setLogLevel("ERROR")
    return session
