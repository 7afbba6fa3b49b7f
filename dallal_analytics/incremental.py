"""
Incremental runs (C{dallal-report --incremental}): the parsed lines are kept
as Parquet, partitioned by broker and date, under the report's folder, and
each run parses only what the logs gained since the last.

A log file is known by its device and inode, which twistd's rotation keeps
(C{twistd.log} renamed C{twistd.log.1} is the same file), with the bytes
already parsed: a known file that grew has its new bytes parsed; one that
did not is skipped; a new one, or one that shrank (truncated, or its inode
reused), is parsed whole.  The checkpoint is written once the new lines
are in the table.  Only files of the driver's file system can be followed.
"""

import glob
import json
import os
from pathlib import Path

from pyspark.sql import functions as F

from dallal_analytics import parse

EVENTS_TABLE = "parsed_lines"
CHECKPOINT = "checkpoint.json"
STAGING = "new-lines"


class IncrementalError(Exception):
    """
    The logs cannot be followed (not files of this machine).
    """


def logFiles(paths):
    """
    The files under C{paths} (files, globs or folders: every file in them,
    not hidden ones), sorted.
    """
    found = set()
    for path in paths:
        matches = glob.glob(path) if glob.has_magic(path) else [path]
        if not matches:
            raise IncrementalError(f"no such log file or folder: {path}")
        for match in matches:
            match = Path(match)
            if match.is_dir():
                found.update(
                    child
                    for child in match.iterdir()
                    if child.is_file() and not child.name.startswith(".")
                )
            elif match.is_file():
                found.add(match)
            else:
                raise IncrementalError(f"not a file of this machine: {match}")
    return sorted(found)


def _identity(status):
    return f"{status.st_dev}:{status.st_ino}"


def newParts(paths, checkpoint, staging):
    """
    What to parse of C{paths} given the C{checkpoint} (identity -> bytes
    parsed): files to read whole, and the new bytes of grown files, copied
    under C{staging}; and the checkpoint once they are parsed.  A file that
    ends in the middle of a line is parsed up to its last whole line.
    """
    staging.mkdir(parents=True, exist_ok=True)
    toRead, updated = [], dict(checkpoint)
    for number, path in enumerate(logFiles(paths)):
        status = path.stat()
        identity = _identity(status)
        parsed = checkpoint.get(identity, 0)
        if parsed > status.st_size:
            parsed = 0
        if parsed == status.st_size:
            continue
        with open(path, "rb") as stream:
            stream.seek(parsed)
            data = stream.read(status.st_size - parsed)
        whole = data[: data.rfind(b"\n") + 1]
        if not whole:
            continue
        part = staging / f"{number}-{path.name}"
        part.write_bytes(whole)
        toRead.append(str(part))
        updated[identity] = parsed + len(whole)
    return toRead, updated


def update(spark, paths, outDir):
    """
    Parse what is new in the logs at C{paths} into the table under
    C{outDir}, and move the checkpoint on.

    @return: the whole table, and how many lines were new.
    """
    outDir = Path(outDir)
    table = outDir / EVENTS_TABLE
    checkpointPath = outDir / CHECKPOINT
    checkpoint = json.loads(checkpointPath.read_text()) if checkpointPath.exists() else {}
    staging = outDir / STAGING
    for old in staging.glob("*"):
        old.unlink()
    toRead, updated = newParts(paths, checkpoint, staging)
    added = 0
    if toRead:
        lines = parse.parseLines(parse.readLines(spark, toRead)).select(
            "*", F.to_date(F.timestamp_seconds("t")).alias("date")
        )
        lines.write.mode("append").partitionBy(parse.BROKER, "date").parquet(str(table))
        added = sum(1 for part in toRead for _ in open(part, "rb"))
    # Written after the lines: a run cut short parses them again rather
    # than losing them (and could only duplicate what it appended).
    temporary = checkpointPath.with_suffix(".tmp")
    temporary.write_text(json.dumps(updated, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, checkpointPath)
    for part in staging.glob("*"):
        part.unlink()
    if not table.exists():
        raise IncrementalError("no log lines to report on")
    # The schema given: inferred from the folders' names, a broker named
    # 123 would be a number.
    schema = (
        parse.parseLines(spark.createDataFrame([], "value STRING"))
        .select("*", F.lit(None).cast("date").alias("date"))
        .schema
    )
    return spark.read.schema(schema).parquet(str(table)).drop("date"), added
