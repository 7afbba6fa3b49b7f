"""
What the benchmarks share about the brokers they measure: a broker process
on free loopback ports and what /proc says about it (L{ServerProcess}), a
C{twistd -n dallal} one (L{Broker}; bench/compare.py starts its peers the
same way), and a raw control connection that asks it for its counters.
"""

import glob
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

BROKER_START_TIMEOUT = 15.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class BenchError(Exception):
    pass


class RequestRefused(BenchError):
    """
    The broker answered a request with C{ERR}.
    """


def twistdExecutable():
    """
    The twistd of this Python, so the broker runs the code being measured.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "twistd")
    if os.path.exists(beside):
        return beside
    found = shutil.which("twistd")
    if found is None:
        raise BenchError("no twistd found: pip install -e . installs Twisted")
    return found


def raiseDescriptorLimit():
    """
    Raise this process's RLIMIT_NOFILE soft limit to its hard limit (an
    unprivileged process can go no further; raising the hard limit needs
    CAP_SYS_RESOURCE).

    @return: the new (soft, hard) pair.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def tryRaiseHardLimit(wanted):
    """
    Try to raise the hard descriptor limit to C{wanted} (works with
    CAP_SYS_RESOURCE only).  @return: the (soft, hard) pair in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted and wanted > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
        except (ValueError, OSError):
            pass
    return raiseDescriptorLimit()


class ServerProcess:
    """
    A broker process on free loopback ports, logging to a file in
    C{directory}, measured through /proc (CPU, memory, descriptors) and
    stopped by its PID.  Subclasses say how to start it (L{startCommand})
    and find where it listens (L{awaitPorts}).

    @cvar name: names its log and output files.
    """

    name = "server"

    def __init__(self, directory):
        self.logPath = os.path.join(directory, f"{self.name}.log")
        self.command = self.startCommand(directory)
        self._output = open(os.path.join(directory, f"{self.name}.out"), "wb")
        self.process = subprocess.Popen(
            self.command,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            preexec_fn=self.beforeExec,
        )
        self.pid = self.process.pid
        try:
            self.awaitPorts()
        except BenchError as error:
            self.stop()
            raise BenchError(f"{error}\n{self.lastWords()}") from None

    def startCommand(self, directory):
        raise NotImplementedError

    def awaitPorts(self):
        """
        Wait until the server listens, and set C{port} to where.

        @raise BenchError: it exited, or took longer than
            C{BROKER_START_TIMEOUT}.
        """
        raise NotImplementedError

    def beforeExec(self):
        """
        Run in the child process before the server's executable.
        """

    def checkAlive(self):
        """
        @raise BenchError: the server has exited.
        """
        if self.process.poll() is not None:
            raise BenchError(
                f"{self.name} exited with status {self.process.returncode}: "
                f"{shlex.join(self.command)}"
            )

    def reproduce(self):
        return shlex.join(self.command)

    # /proc

    def _stat(self):
        with open(f"/proc/{self.pid}/stat", "rb") as stat:
            # The command name, in parentheses, may hold spaces: count the
            # fields after its closing parenthesis (utime is field 14).
            return stat.read().rpartition(b")")[2].split()

    def cpuSplit(self):
        """
        (user, system) CPU seconds of all its threads, and of the children
        it has waited for: its own code and its system calls.
        """
        # utime, stime, cutime, cstime: fields 14 to 17 of the stat line.
        user, system, childrenUser, childrenSystem = map(int, self._stat()[11:15])
        return (user + childrenUser) / CLOCK_TICKS, (system + childrenSystem) / CLOCK_TICKS

    def cpuSeconds(self):
        return sum(self.cpuSplit())

    def _threadSchedstats(self, field):
        """
        The sum over its threads of a field of /proc/<pid>/task/<tid>/schedstat,
        in nanoseconds.
        """
        total = 0
        for thread in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{thread}/schedstat") as schedstat:
                    total += int(schedstat.read().split()[field])
            except FileNotFoundError:  # the thread ended meanwhile
                pass
        return total

    def preciseCpuSeconds(self):
        """
        L{cpuSeconds} to the nanosecond rather than the clock tick: the time
        its threads have run (the first field of each schedstat), plus the
        CPU time of the children it has waited for (in clock ticks; /proc
        has nothing finer).  The time of a thread that has ended is lost.
        """
        childrenUser, childrenSystem = map(int, self._stat()[13:15])
        return self._threadSchedstats(0) / 1e9 + (childrenUser + childrenSystem) / CLOCK_TICKS

    def secondsWaitingForCore(self):
        """
        How long its threads have been ready to run but waiting for a core
        (the second field of each /proc/<pid>/task/<tid>/schedstat, in
        nanoseconds): time the machine's other load took from it.
        """
        return self._threadSchedstats(1) / 1e9

    def status(self, field):
        """
        A field of /proc/<pid>/status in bytes (VmRSS, VmHWM, ...).
        """
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise BenchError(f"no {field} in /proc/<pid>/status")

    def residentMemory(self):
        return self.status("VmRSS")

    def peakMemory(self):
        return self.status("VmHWM")

    def descriptors(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def descriptorLimit(self):
        with open(f"/proc/{self.pid}/limits") as limits:
            for line in limits:
                if line.startswith("Max open files"):
                    return int(line.split()[3]), int(line.split()[4])
        raise BenchError("no 'Max open files' in /proc/<pid>/limits")

    def logCount(self, needle):
        """
        Occurrences of C{needle} in the log, rotated parts included (twistd
        rotates its log file every megabyte).
        """
        count = 0
        for path in glob.glob(glob.escape(self.logPath) + "*"):
            with open(path, "rb") as log:
                count += log.read().count(needle)
        return count

    def lastWords(self):
        """
        The end of its log and output, to explain a failure.
        """
        lines = []
        for path in (self.logPath, self._output.name):
            if os.path.exists(path):
                with open(path, "rb") as output:
                    lines += output.read().decode("utf-8", "replace").splitlines()[-10:]
        return "\n".join([f"{self.name}'s last lines:", *lines])

    def alive(self):
        return self.process.poll() is None

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.close()


class Broker(ServerProcess):
    """
    A C{twistd -n dallal} process, its retained messages in C{directory}.

    @param tcpDescription: the endpoint of C{--tcp}.
    @param udp: also serve UDP (on a free port, C{udpPort}) if true.
    @param mqtt: also serve MQTT (on a free loopback port, C{mqttPort}) if
        true.
    @param messageEvents: log an event per message (C{--message-events}).
    @param extra: more C{twistd dallal} options.
    @param nofile: the RLIMIT_NOFILE (soft and hard) the broker starts with.
    """

    name = "twistd"

    def __init__(
        self,
        directory,
        extra=(),
        udp=False,
        mqtt=False,
        nofile=None,
        tcpDescription="tcp:0:interface=127.0.0.1",
        messageEvents=False,
    ):
        self._tcpDescription = tcpDescription
        self._udp = udp
        self._mqtt = mqtt
        self._messageEvents = messageEvents
        self._extra = list(extra)
        self._nofile = nofile
        self.udpPort = None
        self.mqttPort = None
        ServerProcess.__init__(self, directory)

    def startCommand(self, directory):
        command = [
            twistdExecutable(),
            "-n",
            "--pidfile=",
            f"--logfile={self.logPath}",
            "dallal",
            "--tcp",
            self._tcpDescription,
            "--data-dir",
            os.path.join(directory, "data"),
            *self._extra,
        ]
        if self._udp:
            command += ["--udp", "0"]
        if self._mqtt:
            command += ["--mqtt", "tcp:0:interface=127.0.0.1"]
        if self._messageEvents:
            command.append("--message-events")
        return command

    def beforeExec(self):
        if self._nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self._nofile, self._nofile))

    def awaitPorts(self):
        """
        The ports from the broker's C{event=listening} lines, which go to
        the log file (twistd writes nothing else to stdout with --logfile).
        """
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        transports = ["tcp"] + ["udp"] * self._udp + ["mqtt"] * self._mqtt
        while time.monotonic() < deadline:
            self.checkAlive()
            try:
                with open(self.logPath, "rb") as log:
                    text = log.read()
            except FileNotFoundError:
                text = b""
            ports = {
                transport: re.search(
                    rb"event=listening transport=%s address=127\.0\.0\.1:(\d+)"
                    % transport.encode(),
                    text,
                )
                for transport in transports
            }
            if all(ports.values()):
                self.port = int(ports["tcp"].group(1))
                self.udpPort = int(ports["udp"].group(1)) if self._udp else None
                self.mqttPort = int(ports["mqtt"].group(1)) if self._mqtt else None
                return
            time.sleep(0.05)
        raise BenchError("the broker did not log event=listening in time")

    def counters(self, timeout=10.0):
        """
        The broker's counters, from a C{STATS} request on a connection of
        its own, or C{None} from a broker that refuses it (commits older
        than C{STATS}).
        """
        control = ControlConnection(self.port)
        try:
            return control.stats(timeout)
        except RequestRefused:
            return None
        finally:
            control.close()


class ControlConnection:
    """
    A blocking TCP connection to the broker for STATS and PUB requests (the
    frames C{dallal stats --json} and C{dallal publish} send), answering the
    broker's PINGs while it waits.
    """

    def __init__(self, port, host="127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""
        self._next = 0

    def _takeFrame(self):
        """
        The first complete frame of the buffer, taken off it: (control line,
        payload or None), or None if the buffer holds no complete frame.
        """
        buffer = self._buffer
        lineEnd = buffer.find(b"\n")
        if lineEnd < 0:
            return None
        line = buffer[:lineEnd].rstrip(b"\r")
        verb = line.split(b" ", 1)[0]
        if verb not in (b"STATS", b"MSG", b"LIST", b"TOPICS"):
            self._buffer = buffer[lineEnd + 1 :]
            return line, None
        end = lineEnd + 1 + int(line.split(b" ")[2])
        terminator = 2 if buffer[end : end + 1] == b"\r" else 1
        if len(buffer) < end + terminator:
            return None
        self._buffer = buffer[end + terminator :]
        return line, buffer[lineEnd + 1 : end]

    def _readFrame(self, deadline):
        """
        The next frame other than PING/PONG (PINGs are answered).
        """
        while True:
            frame = self._takeFrame()
            if frame is not None:
                if frame[0] == b"PING":
                    self.sock.sendall(b"PONG\r\n")
                elif frame[0] != b"PONG":
                    return frame
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError("the broker did not answer the control connection in time")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise BenchError("the broker closed the control connection")
            self._buffer += data

    def pollPings(self):
        """
        Answer any PING waiting, without blocking.
        """
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    raise BenchError("the broker closed the control connection")
                self._buffer += data
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            self.sock.setblocking(True)
        while self._buffer.startswith((b"PING", b"PONG")) and b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            if line.startswith(b"PING"):
                self.sock.sendall(b"PONG\r\n")

    def _request(self, data, timeout):
        self._next += 1
        requestId = b"c%d" % self._next
        self.sock.sendall(data % requestId)
        deadline = time.monotonic() + timeout
        while True:
            line, payload = self._readFrame(deadline)
            parts = line.split(b" ")
            if len(parts) > 1 and parts[1] == requestId:
                if parts[0] == b"ERR":
                    raise RequestRefused(f"the broker refused a request: {line!r}")
                return line, payload

    def stats(self, timeout=10.0):
        _, payload = self._request(b"STATS %s\r\n", timeout)
        return json.loads(payload)

    def publish(self, topic, payload, timeout=10.0):
        return self._request(b"PUB %%s %s %d\r\n%s\r\n" % (topic, len(payload), payload), timeout)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def meminfo(field):
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def sockstat():
    """
    /proc/net/sockstat's TCP line: {'inuse': n, ..., 'mem': pages}.
    """
    with open("/proc/net/sockstat") as stat:
        for line in stat:
            if line.startswith("TCP:"):
                words = line.split()[1:]
                return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
    return {}
