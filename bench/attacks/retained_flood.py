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


def flood(extra, topics, size):
    """
    Publish C{topics} retained messages of C{size} bytes on new topics.

    @return: (accepted, the first refusal's line or None, store file size).
    """
    with lib.scratch() as directory, lib.dallal(directory, extra) as broker:
        connection = lib.Connection(broker.port, timeout=60)
        payload = b"r" * size
        accepted, refusal = 0, None
        for start in range(0, topics, 500):
            end = min(topics, start + 500)
            connection.send(
                b"".join(
                    b"PUB r%d flood/%d %d retain=1\r\n%s\r\n" % (k, k, size, payload)
                    for k in range(start, end)
                )
            )
            for k in range(start, end):
                answer = connection.answer(b"r%d" % k, timeout=60)
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
    if "--max-retained" in known:
        accepted, refusal, _ = flood(["--max-retained", "1000"], 1500, 10)
        ok = accepted <= 1000 and refusal is not None
        passed = passed and ok
        parts.append(f"--max-retained 1000: {accepted}/1500 accepted, refusal {refusal!r}")
    else:
        passed = False
        parts.append("no --max-retained")
    if "--max-retained-bytes" in known:
        accepted, refusal, _ = flood(["--max-retained-bytes", "262144"], 500, 1024)
        ok = accepted <= 256 and refusal is not None
        passed = passed and ok
        parts.append(f"--max-retained-bytes 262144: {accepted}/500 of 1 KiB accepted, refusal {refusal!r}")
    else:
        passed = False
        parts.append("no --max-retained-bytes")
    return passed, "; ".join(parts)


def main():
    lib.arguments(__doc__).parse_args()
    try:
        passed, figure = attack()
    except lib.BenchError as error:
        lib.broken(NAME, error)
    lib.verdict(NAME, passed, figure)


if __name__ == "__main__":
    main()
