"""
The Spark report against a single-process plain-Python baseline.

    python bench/spark_report.py --size 1m      # 1 million lines
    python bench/spark_report.py --size 10m     # 10 million lines
    python bench/spark_report.py --logs DIR     # logs already generated
    python bench/spark_report.py --size 10m --repeat 3   # medians of 3 each
    JAVA_HOME=/usr/lib/jvm/temurin-25-jdk-amd64 python bench/spark_report.py ...
                                                # on another Java (it prints which)

It generates a busy broker's rotated log with bench/loggen.py (unless given
one), runs `dallal-report` on it as a user would (JVM start
included), then the baseline: one Python process reading the same files in
order and computing the same aggregations in dictionaries -- lines by kind,
traffic per window, topic and transport with distinct publishers and
subscribers, top topics and publishers, exact latency percentiles per topic
and transport, the loss account per topic, sessions, concurrent connections
and errors.  It writes nothing and keeps no per-message account (the
report writes one, 600,000 rows at 10 million lines, among its Parquet
tables), so it does less than the report.  It prints both times, lines per second, their
ratio, and whether the two agree on the summary's totals.  Each reads the
log from disk: the files are dropped from the page cache before each run.
"""

import argparse
import ctypes
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The dallal-report command of this interpreter's installation.
REPORT = Path(sys.executable).parent / "dallal-report"
LOGGEN = HERE / "loggen.py"
SIZES = {"1m": 1_000_000, "10m": 10_000_000}
WINDOW = 60
QUANTILES = (0.5, 0.95, 0.99)
TWISTD_LINE = re.compile(
    r"^(?:\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[+-]\d{4})?|-) \[([^\]]*)\] ?(.*)$"
)
COMPARED = (
    "publishes",
    "deliveries",
    "redeliveries",
    "retained",
    "matched",
    "acked",
    "fired",
    "replaced",
    "dropped",
    "inflight",
    "bytes_in",
    "bytes_out",
    "sessions",
    "peak_connections",
    "errors",
    "pings_missed",
    "clients_dropped",
    "unparsed_lines",
)


def logFiles(folder):
    """
    twistd's rotated files oldest first: twistd.log.N ... twistd.log.1,
    twistd.log.
    """

    def age(path):
        suffix = path.name.rpartition(".log")[2].lstrip(".")
        return -int(suffix) if suffix.isdigit() else 0

    return sorted((path for path in Path(folder).iterdir() if path.is_file()), key=age)


def evictFromPageCache(files):
    """
    Ask the kernel to drop the files' cached pages, so that the next reader
    reads them from disk, whoever read them last.  Without it the second
    contender found the log in memory as the first left it; and this
    machine's kernel reclaims idle file pages within a minute (DAMON), so
    how much the first found there varied from run to run.

    @return: whether it could (posix_fadvise is missing on some systems).
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        with open(path, "rb") as stream:
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def percentile(values, quantile):
    """
    The smallest value with at least C{quantile} of the values at or below
    it (what the report's latency buckets approximate, within 0.58%).
    """
    return values[max(0, math.ceil(quantile * len(values)) - 1)] if values else None


class Baseline:
    """
    The report's aggregations, streaming over the lines in log order.
    """

    def __init__(self, window=WINDOW):
        self.window = window
        self.kinds = Counter()
        self.run = 0
        self.lastWasListening = False
        self.sessions = {}  # (run, session) -> [client, transport, first, last, end reason]
        self.connected = Counter()  # run -> sessions connected now
        self.peak = 0
        self.sizes = {}  # (run, mid) -> bytes
        self.traffic = defaultdict(lambda: [0, 0, 0, 0, 0, set(), set()])
        self.topics = defaultdict(lambda: [0, 0, 0, 0, 0, set(), set()])
        self.publishers = defaultdict(lambda: [0, 0, set()])
        self.latencies = defaultdict(list)
        self.loss = defaultdict(Counter)
        self.errors = Counter()
        self.health = Counter()
        self.totals = Counter()

    def feed(self, line):
        if line.startswith("\t"):
            self.kinds["continuation"] += 1
            return
        match = TWISTD_LINE.match(line)
        if match is None:
            self.kinds["unparsed"] += 1
            return
        system, text = match.groups()
        if not (system.startswith("dallal#") and text.startswith("event=")):
            self.kinds["other"] += 1
            return
        self.kinds["event"] += 1
        fields = dict(field.split("=", 1) for field in text.split(" ") if "=" in field)
        self.event(fields["event"], fields)

    def event(self, name, fields):
        t = float(fields["t"])
        if name == "listening":
            if not self.lastWasListening:
                self.run += 1
            self.lastWasListening = True
            return
        self.lastWasListening = False
        run = self.run
        session = fields.get("session")
        key = (run, session)
        if session not in (None, "0"):
            state = self.sessions.get(key)
            if state is None:
                state = self.sessions[key] = [
                    fields.get("client"),
                    fields.get("transport"),
                    t,
                    t,
                    None,
                ]
                self.connected[run] += 1
                self.peak = max(self.peak, self.connected[run])
            state[3] = t
            if name == "disconnect":
                state[4] = fields["reason"]
                self.connected[run] -= 1
        window = int(t // self.window)
        if name in ("publish", "retained"):
            mid = (run, fields["mid"])
            size = int(fields["bytes"])
            self.sizes[mid] = size
            topic = fields["topic"]
            matched = int(fields["subscribers"]) if name == "publish" else 1
            self.loss[topic]["matched"] += matched
            self.totals["matched"] += matched
            if name == "retained":
                self.totals["retained"] += 1
                return
            transport = fields.get("transport") or self.sessions.get(key, [None, "unknown"])[1]
            actor = f"{run}/{session}"
            for measures in (self.traffic[window, topic, transport], self.topics[topic]):
                measures[0] += 1
                measures[3] += size
                measures[5].add(actor)
            publisher = self.publishers[run, session, fields.get("client")]
            publisher[0] += 1
            publisher[1] += size
            publisher[2].add(topic)
        elif name == "deliver":
            topic = fields["topic"]
            transport = self.sessions.get(key, [None, "unknown"])[1]
            first = fields.get("attempt", "1") == "1"
            size = self.sizes.get((run, fields["mid"]), 0)
            for measures in (self.traffic[window, topic, transport], self.topics[topic]):
                measures[1 if first else 2] += 1
                measures[4] += size
                measures[6].add(f"{run}/{session}")
            if first and fields.get("mode", "fire") == "fire":
                self.loss[topic]["fired"] += 1
        elif name == "ack":
            topic = fields["topic"]
            self.loss[topic]["acked"] += 1
            transport = self.sessions.get(key, [None, "unknown"])[1]
            self.latencies[topic, transport].append(float(fields["latency"]))
        elif name == "replace":
            self.loss[fields["topic"]]["replaced"] += 1
        elif name == "drop":
            self.loss[fields["topic"]]["dropped"] += 1
            self.loss[fields["topic"]][f"dropped_{fields['reason']}"] += 1
        elif name == "protocol_error":
            self.errors[fields["code"], run, session, fields.get("client")] += 1
            self.health[window, "errors"] += 1
        elif name in ("ping_missed", "client_dropped"):
            self.health[window, name] += 1
            self.totals[name] += 1

    def summary(self):
        def total(rows, index):
            return sum(row[index] for row in rows)

        loss = Counter()
        for counts in self.loss.values():
            loss.update(counts)
        resolved = sum(loss[name] for name in ("acked", "fired", "replaced", "dropped"))
        latencies = sorted(value for values in self.latencies.values() for value in values)
        perTopicLatency = {
            key: [percentile(sorted(values), q) for q in QUANTILES]
            for key, values in self.latencies.items()
        }
        topics = self.topics.values()
        return {
            "publishes": total(topics, 0),
            "deliveries": total(topics, 1),
            "redeliveries": total(topics, 2),
            "bytes_in": total(topics, 3),
            "bytes_out": total(topics, 4),
            "retained": self.totals["retained"],
            "matched": loss["matched"],
            "acked": loss["acked"],
            "fired": loss["fired"],
            "replaced": loss["replaced"],
            "dropped": loss["dropped"],
            "inflight": loss["matched"] - resolved,
            "sessions": len(self.sessions),
            "peak_connections": self.peak,
            "errors": sum(self.errors.values()),
            "pings_missed": self.totals["ping_missed"],
            "clients_dropped": self.totals["client_dropped"],
            "unparsed_lines": self.kinds["unparsed"],
            "latency": {f"p{round(q * 100)}": percentile(latencies, q) for q in QUANTILES},
            "traffic_rows": len(self.traffic),
            "latency_rows": len(perTopicLatency),
        }


def runBaseline(folder):
    baseline = Baseline()
    lines = 0
    for path in logFiles(folder):
        with open(path, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                baseline.feed(line.rstrip("\n"))
                lines += 1
    return lines, baseline.summary()


def runSpark(folder, out, master):
    """
    The report's summary.
    """
    command = [str(REPORT), str(folder), "--out", str(out), "--quiet"]
    if master:
        command += ["--master", master]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((Path(out) / "summary.json").read_text())


def javaVersion():
    """
    The first line of C{java -version} of the Java PySpark starts: that of
    C{JAVA_HOME} if set, else the first on C{PATH}.
    """
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else "java"
    try:
        said = subprocess.run([java, "-version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{java}: {e}"
    return said.stderr.splitlines()[0] if said.stderr else java


# prctl(2): adopt the orphans of this process's descendants.
PR_SET_CHILD_SUBREAPER = 36


def adoptOrphans():
    """
    Become the parent of the processes this one's children leave behind:
    PySpark does not wait for the JVM it starts, so without this the JVM is
    reaped by init and its CPU time is missing from this process's
    C{RUSAGE_CHILDREN}.

    @return: whether it could (Linux only).
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reapedCpuSeconds():
    """
    Wait for every child (the JVM adopted by L{adoptOrphans} included),
    then the CPU seconds, user and system, of every child reaped so far.
    """
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(function, *arguments):
    started = time.monotonic()
    result = function(*arguments)
    return result, time.monotonic() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="1m",
        help="lines to generate: 1m or 10m (default 1m)",
    )
    source.add_argument("--logs", help="a folder of logs to use instead")
    parser.add_argument(
        "--work",
        help="an existing folder to hold the run's temporary folder (generated "
        "logs and the report, removed afterwards; default: the system's)",
    )
    parser.add_argument("--master", help="the Spark master (default local[*])")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the report and the baseline N times, alternately, and "
        "print the medians (the time of one run on a shared machine varies "
        "by a fifth)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be 1 or more, got {args.repeat}")
    if args.work is not None and not Path(args.work).is_dir():
        parser.error(f"--work: {args.work} is not a folder")

    with tempfile.TemporaryDirectory(prefix="dallal-bench-", dir=args.work) as work:
        work = Path(work)
        folder = Path(args.logs) if args.logs else work / "logs"
        if not args.logs:
            _, seconds = timed(
                subprocess.run,
                [
                    sys.executable,
                    str(LOGGEN),
                    "--lines",
                    str(SIZES[args.size]),
                    "--out",
                    str(folder),
                ],
            )
            print(f"generated in {seconds:.1f} s")
        files = logFiles(folder)
        countsJvm = adoptOrphans()
        size = sum(path.stat().st_size for path in files)
        sparkTimes, baselineTimes = [], []
        for run in range(1, args.repeat + 1):
            if args.repeat > 1:
                print(f"run {run} of {args.repeat}")
            # The machine may be shared: say how busy it was.
            print("load average before: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
            evicted = evictFromPageCache(files)
            if run == 1:
                print(f"java: {javaVersion()}")
                print(
                    "each contender reads the log from disk (dropped from the page cache before it)"
                    if evicted
                    else "the log may be in the page cache (posix_fadvise is missing here)"
                )
            cpuBefore = reapedCpuSeconds()
            sparkSummary, sparkSeconds = timed(runSpark, folder, work / "report", args.master)
            sparkCpu = reapedCpuSeconds() - cpuBefore
            sparkTimes.append(sparkSeconds)
            lines = sparkSummary["lines"]["lines"]
            print(f"{lines:,} lines, {len(files)} files, {size / 1e6:.0f} MB")
            print(
                f"spark report:    {sparkSeconds:8.1f} s  {lines / sparkSeconds:12,.0f} lines/s "
                "(JVM start included)"
            )
            if countsJvm:
                print(f"spark report CPU: {sparkCpu:7.1f} s (its Python and its JVM, all threads)")
            if args.no_baseline:
                continue
            evictFromPageCache(files)
            (baselineLines, baseline), baselineSeconds = timed(runBaseline, folder)
            baselineTimes.append(baselineSeconds)
            print(
                f"python baseline: {baselineSeconds:8.1f} s  "
                f"{baselineLines / baselineSeconds:12,.0f} lines/s"
            )
            print(f"ratio (baseline time / spark time): {baselineSeconds / sparkSeconds:.2f}")
            print("load average after: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        if args.repeat > 1:
            spark = statistics.median(sparkTimes)
            print(
                f"median of {args.repeat}: spark report {spark:.1f} s "
                f"({', '.join(f'{t:.1f}' for t in sparkTimes)})"
            )
            if baselineTimes:
                python = statistics.median(baselineTimes)
                ratios = [b / s for s, b in zip(sparkTimes, baselineTimes)]
                print(
                    f"median of {args.repeat}: python baseline {python:.1f} s "
                    f"({', '.join(f'{t:.1f}' for t in baselineTimes)})"
                )
                print(
                    f"median ratio (baseline time / spark time): "
                    f"{statistics.median(ratios):.2f} "
                    f"({', '.join(f'{r:.2f}' for r in ratios)})"
                )
        if args.no_baseline:
            return 0
        disagreements = [
            (key, sparkSummary[key], baseline[key])
            for key in COMPARED
            if sparkSummary[key] != baseline[key]
        ]
        for key, spark, python in disagreements:
            print(f"  disagree on {key}: spark {spark}, baseline {python}")
        print("totals agree" if not disagreements else "totals DISAGREE")
        print(
            "latency p50/p95/p99 spark (approximate): "
            + " / ".join(f"{sparkSummary['latency'][f'p{q}']:.6f}" for q in (50, 95, 99))
        )
        print(
            "latency p50/p95/p99 baseline (exact):    "
            + " / ".join(f"{baseline['latency'][f'p{q}']:.6f}" for q in (50, 95, 99))
        )
        print(
            f"counter mismatches (stats events vs log): {len(sparkSummary['counter_mismatches'])}"
        )
        return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
