"""
How many simultaneous clients one broker holds: idle TCP subscribers,
ramped up until something runs out, pinged by the broker's sweep, then
served one message each.

It starts a fresh broker (`twistd -n dallal`, a short --ping-interval so
that the ping sweep runs often during the measurement, RLIMIT_NOFILE raised
to the hard limit), then --workers processes open subscriber connections
with non-blocking sockets and epoll, each bound before connecting to a
source address of its own among 127.0.0.2, 127.0.0.3, ... (at most
--per-address connections each), so that one address's ephemeral ports
are not what runs out.  Each connection sends `SUB <id> <topic>` and counts
as held once its SUBACK arrives; every connection answers PING with PONG
and acks its messages.  The ramp stops at --connections, or when
--stop-after connections in a row fail (the reason is what they failed
with), or when the machine's available memory falls under --min-available.

Then, with every connection idle, it measures the broker's CPU over
--idle-intervals ping intervals (the sweep: a PING written to every
connection not heard from in the last interval, a PONG read from each: an
idle connection is pinged every other interval), checks that no connection missed a
ping or was dropped, publishes one message on the topic and times how long
it takes to reach every subscriber.

    python3 bench/connections.py                   # up to the broker's descriptor limit
    python3 bench/connections.py --connections 2000 --idle-intervals 3

bench/README.md describes the output; docs/CONNECTIONS.md has the figures.
"""

import argparse
import errno
import json
import multiprocessing
import os
import platform
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from brokerproc import (  # noqa: E402
    BenchError,
    Broker,
    ControlConnection,
    meminfo,
    raiseDescriptorLimit,
    sockstat,
    tryRaiseHardLimit,
)

from dallal.limits import RESERVED_DESCRIPTORS  # noqa: E402

TOPIC = b"conn"
PAYLOAD = b"hello"
RECEIVE_SIZE = 4096


# The load generator: one process holding many subscriber connections.


class Conn:
    __slots__ = (
        "sock",
        "state",
        "buffer",
        "payloadNext",
        "started",
        "pings",
        "received",
        "address",
    )

    def __init__(self, sock, address, now):
        self.sock = sock
        self.address = address
        self.state = "connecting"
        self.buffer = b""
        self.payloadNext = False
        self.started = now
        self.pings = 0
        self.received = None


def classify(error):
    code = error.errno if isinstance(error, OSError) else error
    if code in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return "ports"
    if code in (errno.EMFILE, errno.ENFILE):
        return "client_fds"
    if code == errno.ECONNREFUSED:
        return "refused"
    if code in (errno.ECONNRESET, errno.EPIPE):
        return "reset"
    if code == errno.ETIMEDOUT:
        return "timeout"
    return "other"


class Worker:
    """
    Holds subscriber connections from its source addresses, answering the
    broker; driven by commands from the parent over a pipe.
    """

    def __init__(
        self, number, port, addresses, perAddress, inflight, subackTimeout, stopAfter, pipe
    ):
        self.number = number
        self.port = port
        self.addresses = list(addresses)
        self.perAddress = perAddress
        self.inflight = inflight
        self.subackTimeout = subackTimeout
        self.stopAfter = stopAfter
        self.pipe = pipe
        self.selector = selectors.EpollSelector()
        self.conns = {}
        self.addressIndex = 0
        self.onAddress = 0
        self.target = 0
        self.opened = 0
        self.pending = 0
        self.held = 0
        self.failures = Counter()
        self.inARow = 0
        self.stopReason = None
        self.closedAfterHeld = 0
        self.pingsTotal = 0
        self.messages = 0
        self.messageTimes = []
        self.ramping = False
        self.portsExhausted = []
        self.lastTimeoutScan = 0.0

    # Opening connections

    def _nextAddress(self):
        if self.onAddress >= self.perAddress:
            self.addressIndex += 1
            self.onAddress = 0
        if self.addressIndex >= len(self.addresses):
            return None
        return self.addresses[self.addressIndex]

    def _fail(self, kind):
        self.failures[kind] += 1
        self.inARow += 1
        if self.inARow >= self.stopAfter and self.stopReason is None:
            self.stopReason = kind
            self.ramping = False

    def _open(self, now):
        address = self._nextAddress()
        if address is None:
            self.stopReason = "addresses"
            self.ramping = False
            return
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as error:
            self._fail(classify(error))
            if classify(error) == "client_fds":
                self.stopReason = "client_fds"
                self.ramping = False
            return
        self.opened += 1
        try:
            sock.setblocking(False)
            sock.bind((address, 0))
            self.onAddress += 1
            code = sock.connect_ex(("127.0.0.1", self.port))
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, os.strerror(code))
        except OSError as error:
            sock.close()
            kind = classify(error)
            self._fail(kind)
            if kind == "ports":
                # This address has no port left: go on with the next one.
                self.portsExhausted.append((address, self.onAddress))
                self.onAddress = self.perAddress
            return
        conn = Conn(sock, address, now)
        self.conns[sock.fileno()] = conn
        self.pending += 1
        self.selector.register(sock, selectors.EVENT_WRITE, conn)

    def _lost(self, conn, kind):
        fd = conn.sock.fileno()
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(fd, None)
        conn.sock.close()
        if conn.state == "held":
            self.held -= 1
            self.closedAfterHeld += 1
        else:
            self.pending -= 1
            self._fail(kind)
        conn.state = "closed"

    # Reading

    def _connected(self, conn):
        code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._lost(conn, classify(code))
            return
        conn.state = "subscribing"
        try:
            conn.sock.send(b"SUB s %s\r\n" % TOPIC)
        except OSError as error:
            self._lost(conn, classify(error))
            return
        self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _readable(self, conn, now):
        try:
            data = conn.sock.recv(RECEIVE_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._lost(conn, classify(error))
            return
        if not data:
            self._lost(conn, "closed")
            return
        buffer = conn.buffer + data if conn.buffer else data
        replies = []
        position = 0
        while True:
            lineEnd = buffer.find(b"\n", position)
            if lineEnd < 0:
                break
            line = buffer[position:lineEnd]
            position = lineEnd + 1
            if conn.payloadNext:
                conn.payloadNext = False
                continue
            if line.startswith(b"PING"):
                conn.pings += 1
                self.pingsTotal += 1
                replies.append(b"PONG\r\n")
            elif line.startswith(b"SUBACK"):
                if conn.state == "subscribing":
                    conn.state = "held"
                    self.pending -= 1
                    self.held += 1
                    self.inARow = 0
            elif line.startswith(b"MSG "):
                conn.payloadNext = True
                if conn.received is None:
                    conn.received = now
                    self.messages += 1
                    self.messageTimes.append(now)
                for option in line.rstrip(b"\r").split(b" ")[3:]:
                    if option.startswith(b"id="):
                        replies.append(b"ACK %s\r\n" % option[3:])
        conn.buffer = buffer[position:]
        if replies:
            try:
                conn.sock.send(b"".join(replies))
            except OSError as error:
                self._lost(conn, classify(error))

    # The loop

    def status(self):
        return {
            "worker": self.number,
            "opened": self.opened,
            "held": self.held,
            "pending": self.pending,
            "failures": dict(self.failures),
            "stop_reason": self.stopReason,
            "ports_exhausted": self.portsExhausted,
            "ramping": self.ramping,
            "closed_after_held": self.closedAfterHeld,
            "pings": self.pingsTotal,
            "messages": self.messages,
            "cpu": sum(os.times()[:2]),
            "ports_used": {address: 0 for address in self.addresses}
            | dict(Counter(c.address for c in self.conns.values())),
        }

    def _command(self, message):
        kind = message[0]
        if kind == "ramp":
            self.target = message[1]
            self.ramping = True
            self.inARow = 0
        elif kind == "stop_ramp":
            self.ramping = False
        elif kind == "status":
            self.pipe.send(self.status())
        elif kind == "message_times":
            self.pipe.send(self.messageTimes)
        elif kind == "quit":
            return False
        return True

    def run(self):
        raiseDescriptorLimit()
        self.selector.register(self.pipe.fileno(), selectors.EVENT_READ, None)
        while True:
            now = time.monotonic()
            if self.ramping:
                while (
                    self.ramping
                    and self.pending < self.inflight
                    and self.held + self.pending < self.target
                ):
                    self._open(now)
                if self.held >= self.target:
                    self.ramping = False
                    self.stopReason = self.stopReason or "target"
            for key, _events in self.selector.select(0.05):
                conn = key.data
                if conn is None:
                    if not self._command(self.pipe.recv()):
                        return
                    continue
                if conn.state == "closed":
                    continue
                if conn.state == "connecting":
                    self._connected(conn)
                else:
                    self._readable(conn, time.monotonic())
            if self.pending and now - self.lastTimeoutScan >= 1.0:
                self.lastTimeoutScan = now
                limit = now - self.subackTimeout
                for conn in [
                    c for c in self.conns.values() if c.state != "held" and c.started < limit
                ]:
                    self._lost(conn, "timeout" if conn.state == "connecting" else "no_suback")


def runWorker(*arguments):
    try:
        Worker(*arguments).run()
    except KeyboardInterrupt:
        pass


# The parent: the broker, the ramp, the measurements.


def log(message):
    print(message, flush=True)


class Run:
    def __init__(self, options):
        self.options = options
        self.series = []

    def tell(self, kind, *rest):
        for pipe in self.pipes:
            pipe.send((kind, *rest))

    def ask(self, kind, *rest):
        for pipe in self.pipes:
            pipe.send((kind, *rest))
        answers = []
        for pipe in self.pipes:
            if not pipe.poll(30):
                raise BenchError("a worker did not answer")
            answers.append(pipe.recv())
        return answers

    def statuses(self):
        statuses = self.ask("status")
        total = {
            "held": sum(s["held"] for s in statuses),
            "pending": sum(s["pending"] for s in statuses),
            "opened": sum(s["opened"] for s in statuses),
            "pings": sum(s["pings"] for s in statuses),
            "messages": sum(s["messages"] for s in statuses),
            "closed_after_held": sum(s["closed_after_held"] for s in statuses),
            "cpu": sum(s["cpu"] for s in statuses),
            "ramping": any(s["ramping"] for s in statuses),
            "failures": sum((Counter(s["failures"]) for s in statuses), Counter()),
            "stop_reasons": [s["stop_reason"] for s in statuses],
            "ports_used": {},
        }
        for s in statuses:
            total["ports_used"].update(s["ports_used"])
        return total

    def sample(self, started, status):
        self.series.append(
            {
                "t": round(time.monotonic() - started, 3),
                "held": status["held"],
                "rss": self.broker.residentMemory(),
                "cpu": self.broker.cpuSeconds(),
                "fds": self.broker.descriptors(),
            }
        )

    def main(self):
        options = self.options
        soft, hard = tryRaiseHardLimit(options.nofile)
        nofile = options.nofile or hard
        if nofile > hard:
            log(
                f"cannot raise the descriptor limit to {nofile}: the hard limit is "
                f"{hard} (raising it needs CAP_SYS_RESOURCE); using {hard}"
            )
            nofile = hard
        target = options.connections or nofile + options.beyond
        shares = [
            target // options.workers + (1 if i < target % options.workers else 0)
            for i in range(options.workers)
        ]
        # Each worker has source addresses of its own, enough for its share
        # at --per-address connections each, and one more in case some
        # ports are taken.
        workerAddresses, nextHost = [], 2
        for share in shares:
            count = -(-share // options.per_address) + 1
            workerAddresses.append([f"127.0.0.{nextHost + i}" for i in range(count)])
            nextHost += count
        addresses = [a for mine in workerAddresses for a in mine]
        directory = tempfile.mkdtemp(prefix="dallal-connections-")
        log(describeSetup())
        log(
            f"descriptor limit: this process {soft}/{hard}, the broker {nofile}/{nofile}; "
            f"ephemeral ports {portRange()}; target {target:,} connections from "
            f"{len(addresses)} source address(es), at most {options.per_address:,} each, "
            f"{options.workers} worker process(es)"
        )
        endpoint = "tcp:0:interface=127.0.0.1"
        if options.backlog:
            endpoint += f":backlog={options.backlog}"
        self.broker = Broker(
            directory,
            nofile=nofile,
            tcpDescription=endpoint,
            # The broker's connection limits at its descriptor limit (it fits
            # --max-connections under it, 32 descriptors short), so that the
            # ramp measures the descriptors, not the defaults.
            extra=[
                "--ping-interval",
                f"{options.ping_interval:g}",
                "--max-connections",
                str(nofile),
                "--max-connections-per-ip",
                str(nofile),
            ],
        )
        broker = self.broker
        log(f"broker: pid {broker.pid}, port {broker.port}: {broker.reproduce()}")
        context = multiprocessing.get_context("fork")
        self.pipes, processes = [], []
        try:
            for number in range(options.workers):
                mine, theirs = context.Pipe()
                process = context.Process(
                    target=runWorker,
                    args=(
                        number,
                        broker.port,
                        workerAddresses[number],
                        options.per_address,
                        options.inflight,
                        options.suback_timeout,
                        options.stop_after,
                        theirs,
                    ),
                    daemon=True,
                )
                process.start()
                theirs.close()
                self.pipes.append(mine)
                processes.append(process)
            time.sleep(0.5)
            control = ControlConnection(broker.port)
            baselineRss = broker.residentMemory()
            baselineSock = sockstat()
            control.stats()
            overflowsBefore = listenOverflows()
            report = {
                "target": target,
                "nofile": nofile,
                "ping_interval": options.ping_interval,
                "baseline_rss": baselineRss,
                "baseline_fds": broker.descriptors(),
            }
            log(
                f"baseline: broker RSS {baselineRss / 2**20:.1f} MiB, "
                f"{report['baseline_fds']} descriptors open"
            )

            # The ramp.
            started = time.monotonic()
            for pipe, share in zip(self.pipes, shares):
                pipe.send(("ramp", share))
            memoryStop = False
            lastLog = 0
            deadline = started + options.ramp_timeout
            while True:
                time.sleep(0.5)
                control.pollPings()
                status = self.statuses()
                self.sample(started, status)
                now = time.monotonic()
                if now - lastLog >= 5:
                    lastLog = now
                    last = self.series[-1]
                    log(
                        f"  {last['t']:6.1f} s  held {status['held']:6,}  pending "
                        f"{status['pending']:4}  failed {sum(status['failures'].values()):5,}  "
                        f"broker RSS {last['rss'] / 2**20:6.1f} MiB  fds {last['fds']:6,}"
                    )
                available = meminfo("MemAvailable")
                if available is not None and available < options.min_available * 2**20:
                    memoryStop = True
                    self.tell("stop_ramp")
                if not status["ramping"] and not status["pending"]:
                    break
                if now > deadline and status["ramping"]:
                    self.tell("stop_ramp")
                    log("  the ramp took longer than --ramp-timeout: stopped")
            rampSeconds = time.monotonic() - started
            status = self.statuses()
            held = status["held"]
            report.update(
                {
                    "held": held,
                    "ramp_seconds": round(rampSeconds, 1),
                    "failures": dict(status["failures"]),
                    "stop_reasons": status["stop_reasons"],
                    "memory_stop": memoryStop,
                    "ports_used": status["ports_used"],
                }
            )
            fds = broker.descriptors()
            limitSoft, _ = broker.descriptorLimit()
            emfile = broker.logCount(b"EMFILE")
            statsRamp = control.stats()
            overflows = listenOverflows() - overflowsBefore
            report.update(
                {
                    "broker_fds": fds,
                    "broker_fd_limit": limitSoft,
                    "broker_emfile_log_lines": emfile,
                    "listen_overflows_during_ramp": overflows,
                    "pings_missed_during_ramp": statsRamp["pings_missed"],
                }
            )
            report["stopped_because"] = stopCause(
                held,
                target,
                fds,
                limitSoft,
                emfile,
                status,
                memoryStop,
                statsRamp["refused_connections"],
            )
            log(
                f"ramp: {held:,} connections held after {rampSeconds:.1f} s "
                f"({held / rampSeconds:,.0f}/s); failures {dict(status['failures'])}; "
                f"worker stop reasons {status['stop_reasons']}"
            )
            backlog = options.backlog or "the broker's default, 1024"
            log("stopped because: " + report["stopped_because"])
            log(
                f"broker: {fds:,} descriptors open of its limit {limitSoft:,}; "
                f"'EMFILE' in its log {emfile:,} times; the machine's listen queue "
                f"overflowed {overflows:,} times (TcpExt ListenOverflows, the broker's "
                f"backlog is {backlog}); pings missed "
                f"during the ramp {statsRamp['pings_missed']:,}"
            )

            # Memory, once everything has settled.
            time.sleep(1.0)
            control.pollPings()
            rss = broker.residentMemory()
            sock = sockstat()
            stats = control.stats()
            perConnection = (rss - baselineRss) / max(held, 1)
            slope = fitSlope([(p["held"], p["rss"]) for p in self.series if p["held"]])
            kernelPages = sock.get("mem", 0) - baselineSock.get("mem", 0)
            report.update(
                {
                    "rss": rss,
                    "rss_per_connection": round(perConnection),
                    "rss_slope_per_connection": round(slope) if slope else None,
                    "kernel_tcp_mem_pages_delta": kernelPages,
                    "broker_connections": stats["connections"],
                    "vmhwm": broker.peakMemory(),
                }
            )
            log(
                f"memory: broker RSS {rss / 2**20:.1f} MiB, "
                f"{(rss - baselineRss) / 2**20:.1f} MiB over its baseline: "
                f"{perConnection:,.0f} bytes ({perConnection / 1024:.2f} KiB) per connection; "
                f"slope of RSS against connections during the ramp "
                f"{(slope or 0):,.0f} bytes; "
                f"kernel TCP buffers (both ends) {kernelPages * 4096 / 2**20:+.1f} MiB; "
                f"the broker counts {stats['connections']:,} connections"
            )

            # The idle sweep, over a window that starts between two sweeps,
            # so that it holds exactly --idle-intervals of them.
            interval = options.ping_interval
            alignSweep(broker, interval, control)
            before = self.statuses()
            statsBefore = control.stats()
            cpuBefore, workerCpuBefore = broker.cpuSeconds(), before["cpu"]
            waitBefore = broker.secondsWaitingForCore()
            splitBefore = broker.cpuSplit()
            profiler = None
            if options.profile:
                profiler = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(broker.pid),
                        "--function",
                        "-r",
                        "200",
                        "-f",
                        "raw",
                        "-o",
                        options.profile,
                        "--duration",
                        str(int(options.idle_intervals * options.ping_interval)),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            t0 = time.monotonic()
            sweepSamples = []
            while time.monotonic() - t0 < options.idle_intervals * interval:
                time.sleep(0.1)
                sweepSamples.append((time.monotonic() - t0, broker.cpuSeconds()))
                if len(sweepSamples) % 10 == 0:
                    control.pollPings()
            window = time.monotonic() - t0
            cpu = broker.cpuSeconds() - cpuBefore
            waited = broker.secondsWaitingForCore() - waitBefore
            splitAfter = broker.cpuSplit()
            userCpu = splitAfter[0] - splitBefore[0]
            systemCpu = splitAfter[1] - splitBefore[1]
            if profiler is not None:
                profiler.wait(30)
            after = self.statuses()
            statsAfter = control.stats()
            sweeps = window / interval
            pings = after["pings"] - before["pings"]
            perSweep = cpu / sweeps
            share = cpu / window
            perConnectionUs = perSweep / max(held, 1) * 1e6
            at10 = perConnectionUs * 1e-6 * held / 10.0
            report.update(
                {
                    "idle_window": round(window, 2),
                    "idle_cpu": round(cpu, 3),
                    "idle_cpu_share": round(share, 4),
                    "cpu_per_sweep": round(perSweep, 4),
                    "idle_waiting_for_core": round(waited, 3),
                    "idle_cpu_user": round(userCpu, 3),
                    "idle_cpu_system": round(systemCpu, 3),
                    "cpu_per_connection_per_interval_us": round(perConnectionUs, 2),
                    "cpu_share_at_10s": round(at10, 4),
                    # An idle connection's PONG spares it the next sweep's PING.
                    "pings_received": pings,
                    "pings_expected": round(held * sweeps / 2),
                    "pings_missed": statsAfter["pings_missed"] - statsBefore["pings_missed"],
                    "pings_missed_total": statsAfter["pings_missed"],
                    "clients_dropped_total": statsAfter["clients_dropped"],
                    "closed_after_held": after["closed_after_held"],
                    "worker_cpu_idle": round(after["cpu"] - workerCpuBefore, 3),
                    "sweep_bursts": sweepBursts(sweepSamples),
                }
            )
            log(
                f"idle sweep: {window:.1f} s = {sweeps:.1f} ping intervals of {interval:g} s; "
                f"broker CPU {cpu:.2f} s = {share:.1%} of a core; "
                f"{perSweep * 1000:.0f} ms per sweep; {perConnectionUs:.1f} us per connection "
                f"and interval; so one sweep of {held:,} connections every 10 s (the default "
                f"interval) takes {at10:.1%} of a core; "
                f"the broker waited {waited:.2f} s for a core (the machine's other load); "
                f"user {userCpu:.2f} s (Python), system {systemCpu:.2f} s (system calls)"
            )
            log(
                f"  pings received by the subscribers {pings:,} (expected ~{held * sweeps / 2:,.0f}: "
                "an idle connection is pinged every other interval); "
                f"pings missed in the window {report['pings_missed']:,} "
                f"(since start {statsAfter['pings_missed']:,}); clients dropped "
                f"{statsAfter['clients_dropped']:,}; connections lost after being held "
                f"{after['closed_after_held']:,}; subscriber processes' CPU "
                f"{report['worker_cpu_idle']:.2f} s"
            )

            # One publish to everyone.
            heldNow = after["held"]
            publishCpuBefore = broker.cpuSeconds()
            t0 = time.monotonic()
            control.publish(TOPIC, PAYLOAD, timeout=options.deliver_timeout)
            pubAck = time.monotonic() - t0
            deadline = t0 + options.deliver_timeout
            while time.monotonic() < deadline:
                status = self.statuses()
                if status["messages"] >= heldNow:
                    break
                time.sleep(0.05)
            publishCpu = broker.cpuSeconds() - publishCpuBefore
            times = sorted(t for ts in self.ask("message_times") for t in ts)
            latencies = [t - t0 for t in times]
            report.update(
                {
                    "publish_subscribers": heldNow,
                    "publish_received": len(latencies),
                    "puback_seconds": round(pubAck, 4),
                    "publish_cpu": round(publishCpu, 3),
                    "first_seconds": round(latencies[0], 4) if latencies else None,
                    "median_seconds": round(latencies[len(latencies) // 2], 4)
                    if latencies
                    else None,
                    "last_seconds": round(latencies[-1], 4) if latencies else None,
                }
            )
            if latencies:
                log(
                    f"publish: {len(latencies):,} of {heldNow:,} subscribers received it within "
                    f"{options.deliver_timeout:g} s; PUBACK after {pubAck * 1000:.0f} ms; "
                    f"first after {latencies[0] * 1000:.0f} ms, median "
                    f"{report['median_seconds'] * 1000:.0f} ms, last "
                    f"{latencies[-1] * 1000:.0f} ms; the broker's CPU meanwhile "
                    f"{publishCpu:.2f} s ({publishCpu / heldNow * 1e6:.0f} us per subscriber)"
                )
            else:
                log(f"publish: no subscriber received it within {options.deliver_timeout:g} s")
            report["stats_end"] = control.stats()
            report["verdict"] = verdict(report, options)
            for line in report["verdict"]:
                log(line)
            if options.json:
                with open(options.json, "w") as output:
                    json.dump({"report": report, "series": self.series}, output, indent=1)
                log(f"wrote {options.json}")
            if options.plot:
                plot(self.series, report, options.plot)
                log(f"wrote {options.plot}")
            control.close()
        finally:
            for pipe in self.pipes:
                try:
                    pipe.send(("quit",))
                except OSError:
                    pass
            for process in processes:
                process.join(20)
                if process.is_alive():
                    process.kill()
                    process.join()
            broker.stop()
            if options.keep:
                log(f"the broker's log: {broker.logPath}")
            else:
                shutil.rmtree(directory, ignore_errors=True)
        log("reproduce: " + reproduceCommand(options))


def alignSweep(broker, interval, control, sample=0.05):
    """
    Wait until just after one of the broker's sweeps (a burst of CPU that
    ends), plus a quarter interval: a window of whole intervals started then
    holds whole sweeps.  Gives up after three intervals.
    """
    deadline = time.monotonic() + 3 * interval
    previous = broker.cpuSeconds()
    busy = quiet = 0
    while time.monotonic() < deadline:
        time.sleep(sample)
        now = broker.cpuSeconds()
        used, previous = now - previous, now
        if used > sample * 0.3:
            busy += 1
            quiet = 0
        elif busy:
            quiet += 1
            if quiet >= 3:
                break
    control.pollPings()
    time.sleep(interval / 4)


def stopCause(held, target, fds, limit, emfile, status, memoryStop, refused):
    """
    Why the ramp stopped, from what the workers saw and what the broker's
    /proc, log and counters say.

    @param refused: connections the broker refused for its --max-connections.
    """
    failures = status["failures"]
    reasons = [r for r in status["stop_reasons"] if r]
    if held >= target:
        return "the target was reached"
    if memoryStop:
        return "the machine's available memory fell under --min-available"
    if refused:
        return (
            f"the broker's --max-connections, its descriptor limit ({limit:,}) less the "
            f"{RESERVED_DESCRIPTORS} it keeps for its other files: it answered {refused:,} connections past it "
            f"ERR TOO_MANY_CLIENTS and closed them; the clients saw {dict(failures)}"
        )
    if fds >= limit - 1:
        return (
            f"the broker's descriptor limit (RLIMIT_NOFILE {limit:,}): it has {fds:,} open "
            f"and logged EMFILE {emfile:,} times; the connections past the limit completed "
            f"their handshake in the kernel, then the broker accepted and at once closed "
            f"them (Twisted's EMFILE recovery) or left them in its listen queue: the "
            f"clients saw {dict(failures)}"
        )
    if "ports" in reasons or "addresses" in reasons:
        return "the source addresses' ephemeral ports ran out"
    if "client_fds" in reasons:
        return "the subscriber processes ran out of descriptors"
    return f"the workers stopped after failures in a row: {reasons}, {dict(failures)}"


def listenOverflows():
    """
    The machine's TcpExt ListenOverflows: connections whose handshake
    completed while a listening socket's accept queue was full (system-wide:
    other programs' count too).
    """
    with open("/proc/net/netstat") as netstat:
        lines = [line.split() for line in netstat if line.startswith("TcpExt:")]
    if len(lines) < 2:
        return 0
    return int(dict(zip(lines[0], lines[1])).get("ListenOverflows", 0))


def fitSlope(points):
    """
    Least-squares slope of y against x.
    """
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if not sxx:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def sweepBursts(samples):
    """
    The broker's CPU in bursts: runs of 0.1 s samples in which it used CPU,
    as (start, CPU seconds, duration) -- one per sweep when idle.
    """
    bursts = []
    previousTime, previousCpu = 0.0, samples[0][1] if samples else 0.0
    current = None
    for moment, cpu in samples:
        used = cpu - previousCpu
        if used > 0.015:
            if current is None:
                current = [round(previousTime, 1), 0.0, 0.0]
                bursts.append(current)
            current[1] = round(current[1] + used, 3)
            current[2] = round(moment - current[0], 1)
        else:
            current = None
        previousTime, previousCpu = moment, cpu
    return bursts


def verdict(report, options):
    limit = report["broker_fd_limit"]
    held = report["held"]
    kib = report["rss_per_connection"] / 1024
    lines = ["targets:"]
    # The baseline counts the broker's own descriptors (log, listening
    # socket, epoll, Twisted's EMFILE reserve, ...) and the control
    # connection: the rest is what subscribers can have, within the
    # connections the broker accepts at that limit (its --max-connections
    # fitted under it, the control connection among them).
    accepted = limit - RESERVED_DESCRIPTORS - 1
    spare = min(limit - report["baseline_fds"], accepted)
    if report["target"] > spare:
        allHeld = held >= spare
        what = f"the broker's limit of {limit:,} descriptors leaves {spare:,} for subscribers"
    else:
        allHeld = held >= report["target"]
        what = f"the target was {report['target']:,} (below the limit: not a limit test)"
    lines.append(
        f"  connections: {held:,} held; {what} (the broker's own {report['baseline_fds']} "
        f"include the control connection): {'met' if allHeld else 'GAP'}"
    )
    served = (
        report["publish_received"] == report["publish_subscribers"]
        and report["pings_missed"] == 0
        and report["closed_after_held"] == 0
    )
    lines.append(
        f"  pinged and served: {report['pings_missed']} pings missed in the idle window, "
        f"{report['closed_after_held']} held connections lost, "
        f"{report['publish_received']:,}/{report['publish_subscribers']:,} received the "
        f"message: {'met' if served else 'GAP'}"
    )
    lines.append(
        f"  memory: {kib:.2f} KiB of broker RSS per idle connection (target <= 6 KiB): "
        f"{'met' if kib <= 6 else 'GAP'}"
    )
    at10 = report["cpu_share_at_10s"]
    lines.append(
        f"  ping sweep: {report['idle_cpu_share']:.1%} of a core at --ping-interval "
        f"{options.ping_interval:g}, {at10:.1%} scaled to the default 10 s "
        f"(target < 5%): {'met' if at10 < 0.05 else 'GAP'}"
    )
    return lines


def plot(series, report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, left = plt.subplots(figsize=(6.4, 3.4), dpi=90)
    held = [p["held"] for p in series]
    left.plot(held, [p["rss"] / 2**20 for p in series], color="tab:blue")
    left.set_xlabel("subscriber connections held")
    left.set_ylabel("broker RSS (MiB)", color="tab:blue")
    right = left.twinx()
    right.plot(held, [p["fds"] for p in series], color="tab:gray", linestyle=":")
    right.set_ylabel("broker descriptors", color="tab:gray")
    left.set_title(
        f"{report['held']:,} connections: {report['rss_per_connection'] / 1024:.2f} KiB RSS each",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path)


def portRange():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = map(int, ports.read().split())
        return f"{low}-{high} ({high - low + 1:,} per source address and destination)"
    except OSError:
        return "unknown"


def describeSetup():
    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "unknown"
    total = meminfo("MemTotal") or 0
    return (
        f"machine: {os.cpu_count()} cores, {total / 2**30:.1f} GiB, load average {load}; "
        f"Python {platform.python_version()}"
    )


def reproduceCommand(options):
    arguments = [sys.executable, "bench/connections.py"]
    for name, value in sorted(vars(options).items()):
        if value in (None, False):
            continue
        flag = "--" + name.replace("_", "-")
        arguments += [flag] if value is True else [flag, str(value)]
    return shlex.join(arguments)


def parseArguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--connections",
        type=int,
        default=None,
        help="connections to open (default: the broker's descriptor limit "
        "plus --beyond, to find where it stops)",
    )
    parser.add_argument(
        "--beyond", type=int, default=300, help="how many past the limit to try by default (300)"
    )
    parser.add_argument(
        "--nofile",
        type=int,
        default=None,
        help="RLIMIT_NOFILE for the broker (default: the hard limit)",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="the broker's listen backlog (default: the broker's, 1024)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the broker's temporary directory (its log)"
    )
    parser.add_argument(
        "--profile",
        help="sample the broker with py-spy during the idle sweep (raw stacks to this file)",
    )
    parser.add_argument(
        "--ping-interval", type=float, default=2.0, help="the broker's --ping-interval (2 s)"
    )
    parser.add_argument("--workers", type=int, default=2, help="subscriber processes (2)")
    parser.add_argument(
        "--per-address", type=int, default=5000, help="connections per source address (5000)"
    )
    parser.add_argument(
        "--inflight", type=int, default=32, help="connections each worker has opening at once (32)"
    )
    parser.add_argument(
        "--suback-timeout",
        type=float,
        default=5.0,
        help="seconds a connection may take to be subscribed (5)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=50,
        help="a worker stops ramping after this many failures in a row (50)",
    )
    parser.add_argument(
        "--min-available",
        type=int,
        default=2048,
        help="stop the ramp when the machine's MemAvailable falls under this many MiB (2048)",
    )
    parser.add_argument(
        "--ramp-timeout", type=float, default=180.0, help="seconds the ramp may take (180)"
    )
    parser.add_argument(
        "--idle-intervals",
        type=int,
        default=6,
        help="ping intervals over which the idle CPU is measured; even, so that "
        "every idle connection is pinged as often (6)",
    )
    parser.add_argument(
        "--deliver-timeout",
        type=float,
        default=30.0,
        help="seconds for the message to reach everyone (30)",
    )
    parser.add_argument(
        "--probe-ports",
        action="store_true",
        help="instead: bind sockets to 127.0.0.2 port 0 until its ephemeral "
        "ports run out, and say how many there were",
    )
    parser.add_argument("--json", help="also write the report and the ramp's samples here")
    parser.add_argument("--plot", help="also draw broker RSS against connections to this PNG")
    return parser.parse_args(argv)


def bindUntilFull(address, limit, pipe):
    """
    Bind TCP sockets to (address, 0) until the kernel has no ephemeral port
    left for the address or this process reaches C{limit}; report how many
    and what stopped it, then hold them until told to let go.
    """
    raiseDescriptorLimit()
    sockets, error = [], "limit"
    try:
        while len(sockets) < limit:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((address, 0))
            except OSError as failure:
                sock.close()
                error = f"{errno.errorcode.get(failure.errno, failure.errno)}: {failure.strerror}"
                break
            sockets.append(sock)
    except OSError as failure:
        error = f"{errno.errorcode.get(failure.errno, failure.errno)} (this process's descriptors)"
    pipe.send((len(sockets), error))
    pipe.recv()
    for sock in sockets:
        sock.close()


def probePorts(options):
    """
    How many sockets one source address can bind before connecting: its
    ephemeral ports.  Two processes share the work, since one process may
    hold fewer descriptors than there are ports.
    """
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    address = "127.0.0.2"
    context = multiprocessing.get_context("fork")
    _, hard = raiseDescriptorLimit()
    perProcess = hard - 50
    processes, pipes, results = [], [], []
    started = time.monotonic()
    try:
        for _ in range(-(-(high - low + 2) // perProcess)):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=bindUntilFull, args=(address, perProcess, theirs), daemon=True
            )
            process.start()
            pipes.append(mine)
            processes.append(process)
            # One after the other: the first takes what it can, the next the rest.
            if not mine.poll(120):
                raise BenchError("a binding process did not answer")
            results.append(mine.recv())
            if results[-1][1] != "limit":
                break
    finally:
        for pipe in pipes:
            pipe.send("done")
        for process in processes:
            process.join(20)
    total = sum(count for count, _ in results)
    log(
        f"ports: {total:,} sockets bound to {address} port 0 in {len(results)} process(es) "
        f"({time.monotonic() - started:.1f} s) before {results[-1][1]}; "
        f"ip_local_port_range {low}-{high} holds {high - low + 1:,} ports"
    )


def main(argv=None):
    options = parseArguments(argv)
    if options.probe_ports:
        try:
            probePorts(options)
        except BenchError as error:
            print(f"connections.py: {error}", file=sys.stderr)
            return 1
        return 0
    try:
        Run(options).main()
    except BenchError as error:
        print(f"connections.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
