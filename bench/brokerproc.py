"""
Helpers shared by bench/connections.py and bench/flow_control.py: a
C{twistd -n dallal} process on free loopback ports, what /proc says about
it, and a raw control connection that asks it for its counters.
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


class Broker:
    """
    A C{twistd -n dallal} process listening on free loopback ports, logging
    to a file in C{directory}.

    @param tcpDescription: the endpoint of C{--tcp}.
    @param udp: also serve UDP (on a free port) if true.
    @param extra: more C{twistd dallal} options.
    @param nofile: the RLIMIT_NOFILE (soft and hard) the broker starts with.
    """

    def __init__(self, directory, extra=(), udp=False, nofile=None,
                 tcpDescription="tcp:0:interface=127.0.0.1"):
        self.logPath = os.path.join(directory, "twistd.log")
        self.command = [
            twistdExecutable(), "-n", "--pidfile=", f"--logfile={self.logPath}",
            "dallal", "--tcp", tcpDescription,
            "--data-dir", os.path.join(directory, "data"),
            *extra,
        ]
        if udp:
            self.command += ["--udp", "0"]
        self._output = open(os.path.join(directory, "twistd.out"), "wb")

        def limits():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.process = subprocess.Popen(
            self.command, stdout=self._output, stderr=subprocess.STDOUT,
            preexec_fn=limits,
        )
        self.pid = self.process.pid
        try:
            self.port, self.udpPort = self._waitForPorts(udp)
        except BenchError as error:
            self.stop()
            raise BenchError(f"{error}\n{self.lastWords()}") from None

    def reproduce(self):
        return shlex.join(self.command)

    def _waitForPorts(self, udp):
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        tcpLine = re.compile(rb"event=listening transport=tcp address=127\.0\.0\.1:(\d+)")
        udpLine = re.compile(rb"event=listening transport=udp address=127\.0\.0\.1:(\d+)")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(
                    f"the broker exited with status {self.process.returncode}: "
                    f"{shlex.join(self.command)}"
                )
            try:
                with open(self.logPath, "rb") as log:
                    text = log.read()
            except FileNotFoundError:
                text = b""
            tcp = tcpLine.search(text)
            found = udpLine.search(text) if udp else None
            if tcp and (found or not udp):
                return int(tcp.group(1)), (int(found.group(1)) if found else None)
            time.sleep(0.05)
        raise BenchError("the broker did not log event=listening in time")

    # /proc

    def cpuSplit(self):
        """
        (user, system) CPU seconds: the broker's Python and its system calls.
        """
        with open(f"/proc/{self.pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS

    def cpuSeconds(self):
        with open(f"/proc/{self.pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def secondsWaitingForCore(self):
        """
        Time the broker was ready to run but waited for a core (the second
        field of /proc/<pid>/schedstat, nanoseconds).
        """
        with open(f"/proc/{self.pid}/schedstat") as schedstat:
            return int(schedstat.read().split()[1]) / 1e9

    def status(self, field):
        """
        A field of /proc/<pid>/status in bytes (VmRSS, VmHWM, ...).
        """
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise BenchError(f"no {field} in /proc/<pid>/status")

    def rss(self):
        return self.status("VmRSS")

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
        lines = []
        for path in (self.logPath, self._output.name):
            if os.path.exists(path):
                with open(path, "rb") as output:
                    lines += output.read().decode("utf-8", "replace").splitlines()[-10:]
        return "\n".join(["the broker's last lines:", *lines])

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
            self._buffer = buffer[lineEnd + 1:]
            return line, None
        end = lineEnd + 1 + int(line.split(b" ")[2])
        terminator = 2 if buffer[end:end + 1] == b"\r" else 1
        if len(buffer) < end + terminator:
            return None
        self._buffer = buffer[end + terminator:]
        return line, buffer[lineEnd + 1:end]

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
            except socket.timeout:
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
                    raise BenchError(f"the broker refused a request: {line!r}")
                return line, payload

    def stats(self, timeout=10.0):
        _, payload = self._request(b"STATS %s\r\n", timeout)
        return json.loads(payload)

    def publish(self, topic, payload, timeout=10.0):
        return self._request(
            b"PUB %%s %s %d\r\n%s\r\n" % (topic, len(payload), payload), timeout
        )

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
