"""
login-flood: password checks cannot be used to lock users out.

A broker with --passwords (and --ping-interval 1, so that a client dropped
for missed pings is dropped within seconds rather than 40 s). From
127.0.0.1 the attacker opens 200 connections, then (on a fresh broker) 700,
and sends on each, in one burst, a HELLO with a wrong password. Right after
the burst three real users, from 127.0.0.3 to 127.0.0.5 (other hosts),
log in with the right password while answering the broker's PINGs.

PASS if in both rounds every real login completes in under 3 s, none is
dropped, and the broker's resident memory peaks less than 32 MiB above
its peak during four password checks at once (scrypt takes 16 MiB each,
and the broker runs four at a time).
"""

import socket
import threading
import time

import attacklib as lib

NAME = "login-flood"
ROUNDS = (200, 700)
REAL_USERS = ("127.0.0.3", "127.0.0.4", "127.0.0.5")
LOGIN_LIMIT = 3.0
GROWTH_LIMIT = 32 * lib.MiB
REAL_TIMEOUT = 40.0


def wrongHello(number):
    return b"HELLO w%d flood%d %s\r\n" % (
        number,
        number,
        lib.credentialOptions("alice", "wrong-%d" % number).encode(),
    )


def realLogin(port, source, outcome):
    """
    Log in as alice from C{source}, answering PINGs meanwhile; put in
    C{outcome} the seconds it took, or why it failed.
    """
    start = time.monotonic()
    try:
        connection = lib.Connection(port, source=source, timeout=REAL_TIMEOUT)
        connection.send(
            b"HELLO h real %s\r\n" % lib.credentialOptions("alice", "alice-pw").encode()
        )
        answer = connection.waitFor(
            lambda line: line.split()[1:2] == [b"h"] or line.startswith(b"ERR"), REAL_TIMEOUT
        )
    except lib.Closed:
        outcome[source] = f"dropped after {time.monotonic() - start:.1f} s"
        return
    except OSError as error:
        outcome[source] = f"failed: {error}"
        return
    if answer is None:
        outcome[source] = f"no answer in {REAL_TIMEOUT:g} s"
    elif answer[0].startswith(b"HELLO"):
        outcome[source] = time.monotonic() - start
    else:
        outcome[source] = f"refused after {time.monotonic() - start:.1f} s: {answer[0][:60]!r}"
    connection.close()


class MemoryWatch(threading.Thread):
    """
    The broker's largest resident memory while it runs.
    """

    def __init__(self, broker):
        threading.Thread.__init__(self, daemon=True)
        self.broker = broker
        self.peak = 0
        self.running = True

    def run(self):
        while self.running and self.broker.alive():
            try:
                self.peak = max(self.peak, self.broker.residentMemory())
            except (OSError, lib.BenchError):
                break
            time.sleep(0.05)


def floodRound(size):
    with lib.scratch() as directory:
        passwords = lib.writePasswords(directory, {"alice": "alice-pw"})
        with lib.dallal(directory, ["--passwords", passwords, "--ping-interval", "1"]) as broker:
            # Four checks at once first: the memory they take is not the flood's.
            warm = [lib.Connection(broker.port) for _ in range(4)]
            for number, connection in enumerate(warm):
                connection.send(wrongHello(number))
            for connection in warm:
                connection.waitFor(lambda line: line.startswith(b"ERR"), 20)
                connection.close()
            # The flood's cost is what it adds to their peak.
            baseline = broker.peakMemory()
            watch = MemoryWatch(broker)
            watch.start()
            flood = []
            for _ in range(size):
                sock = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
                flood.append(sock)
            burst = time.monotonic()
            for number, sock in enumerate(flood):
                sock.send(wrongHello(number))
            burst = time.monotonic() - burst
            outcome = {}
            threads = [
                threading.Thread(target=realLogin, args=(broker.port, source, outcome))
                for source in REAL_USERS
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(REAL_TIMEOUT + 5)
            watch.running = False
            watch.join()
            for sock in flood:
                sock.close()
            return outcome, watch.peak - baseline, burst


def attack():
    passed = True
    parts = []
    for size in ROUNDS:
        outcome, growth, burst = floodRound(size)
        times = [value for value in outcome.values() if isinstance(value, float)]
        failures = [value for value in outcome.values() if not isinstance(value, float)]
        slowest = max(times) if times else float("nan")
        ok = (
            not failures
            and len(times) == len(REAL_USERS)
            and slowest < LOGIN_LIMIT
            and growth < GROWTH_LIMIT
        )
        passed = passed and ok
        described = f"real logins {', '.join(f'{t:.1f} s' for t in sorted(times)) or 'none'}"
        if failures:
            described += f", {'; '.join(failures)}"
        parts.append(
            f"{size} wrong HELLOs in {burst * 1000:.0f} ms: {described}, RSS +{lib.mib(growth)}"
        )
    figure = (
        " | ".join(parts)
        + f" (limits: each real login < {LOGIN_LIMIT:g} s, none dropped, RSS growth < {lib.mib(GROWTH_LIMIT)})"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack(), note="--ping-interval 1")
