"""
retained-flood: the retained store has limits.

One client publishes retained messages on ever new topics. On a broker
with --max-retained and --max-retained-bytes (options the fix adds: the
attack looks for them in `twistd dallal --help`), two brokers: one with
--max-retained 1000 gets 1500 retained topics of 10 bytes, one with
--max-retained-bytes 262144 gets 500 of 1 KiB. Without them, one broker
with its defaults gets 5000 of 1 KiB.

PASS if each broker refuses the retained messages over its limit with an
ERR and keeps no more than it allows; a broker without the options fails.
"""

import glob
import os

import attacklib as lib

NAME = "retained-flood"
# (option, its value, topics published, payload bytes, how many fit)
LIMITS = (
    ("--max-retained", 1000, 1500, 10, 1000),
    ("--max-retained-bytes", 262144, 500, 1024, 256),
)


def flood(extra, topics, size):
    """
    Publish C{topics} retained messages of C{size} bytes on new topics.

    @return: (accepted, the first refusal's line or None, store file size).
    """
    with lib.scratch() as directory, lib.dallal(directory, extra) as broker:
        connection = lib.Connection(broker.port, timeout=60)
        payload = b"r" * size
        accepted, refusal = 0, None
        for k in range(topics):
            try:
                answer = connection.request(
                    b"PUB r%d flood/%d %d retain=1" % (k, k, size), b"r%d" % k, payload, 60
                )
            except lib.Closed:
                # Closed after its refusals (a run of errors may close a
                # connection): go on with another.
                connection = lib.Connection(broker.port, timeout=60)
                continue
            if answer is None:
                raise lib.BenchError(f"retained publish {k} not answered in 60 s")
            if answer[0].startswith(b"PUBACK"):
                accepted += 1
            elif refusal is None:
                refusal = answer[0].decode("utf-8", "replace")
        connection.close()
        # The store and its write-ahead log.
        storeSize = sum(
            os.path.getsize(path)
            for path in glob.glob(os.path.join(directory, "data", "retained.sqlite3*"))
        )
    return accepted, refusal, storeSize


def attack():
    known = lib.dallalOptions()
    if "--max-retained" not in known and "--max-retained-bytes" not in known:
        accepted, refusal, storeSize = flood([], 5000, 1024)
        return False, (
            f"no --max-retained nor --max-retained-bytes in this broker: {accepted}/5000 retained "
            f"1 KiB messages accepted on new topics, store {lib.mib(storeSize)}, "
            f"first refusal: {refusal or 'none'}"
        )
    parts, passed = [], True
    for option, value, topics, size, allowed in LIMITS:
        if option not in known:
            passed = False
            parts.append(f"no {option}")
            continue
        accepted, refusal, _ = flood([option, str(value)], topics, size)
        passed = passed and accepted <= allowed and refusal is not None
        parts.append(
            f"{option} {value}: {accepted}/{topics} of {size} bytes accepted, refusal {refusal!r}"
        )
    return passed, "; ".join(parts)


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
