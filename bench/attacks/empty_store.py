"""
empty-store: a store that is not a Dallal store is refused at start.

The broker is started with, in its data directory, in place of its
retained store (retained.sqlite3): an empty file; a text file; an SQLite
database of another application (a table of its own, no Dallal schema).

PASS if the broker refuses to start in each case (it exits instead of
listening) and says why, naming the store; a broker that starts with no
retained messages has silently taken another file for an empty store.
"""

import os
import re
import sqlite3

import attacklib as lib

NAME = "empty-store"


def writeEmpty(path):
    open(path, "wb").close()


def writeText(path):
    with open(path, "w") as file:
        file.write("these are not the retained messages you are looking for\n")


def writeOtherDatabase(path):
    connection = sqlite3.connect(path)
    connection.execute("CREATE TABLE inventory (item TEXT, count INTEGER)")
    connection.execute("INSERT INTO inventory VALUES ('spoons', 12)")
    connection.commit()
    connection.close()


CASES = (
    ("an empty file", writeEmpty),
    ("a text file", writeText),
    ("another application's SQLite database", writeOtherDatabase),
)


def tryStart(write):
    """
    @return: (started, what the broker said last).
    """
    with lib.scratch() as directory:
        data = os.path.join(directory, "data")
        os.makedirs(data)
        write(os.path.join(data, "retained.sqlite3"))
        try:
            with lib.dallal(directory):
                return True, ""
        except lib.BenchError as error:
            return False, str(error)


def attack():
    parts, passed = [], True
    for what, write in CASES:
        started, said = tryStart(write)
        reason = next(
            (line.strip() for line in said.splitlines() if "retained" in line or "store" in line),
            "",
        )
        if started:
            passed = False
            parts.append(f"{what}: started (no refusal)")
        elif not reason:
            passed = False
            parts.append(f"{what}: refused without naming the store")
        else:
            shown = re.sub(r"/\S*/dallal-attack-[^/]+/", "", reason)
            parts.append(f"{what}: refused ({shown[:160]})")
    return passed, "; ".join(parts)


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
