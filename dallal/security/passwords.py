"""
The password file of C{twistd dallal --passwords FILE}: user names, salted
scrypt hashes, and the file that holds them.

One user per line, C{name:hash}; blank lines and lines starting with C{#}
are ignored.  A hash is::

    $scrypt$n=16384,r=8,p=1$<salt>$<digest>

the scrypt parameters it was made with, then a random 16-byte salt and the
32-byte scrypt digest of the password's bytes, both in base64 without
padding.  The parameters travel with each hash, so they can be raised later
without invalidating the hashes already written: a user's hash changes
when its password is set again.

C{n=16384, r=8, p=1} are the scrypt paper's parameters for interactive
logins: 16 MiB of memory and some tens of milliseconds of CPU per check.
The broker checks passwords off the reactor thread (L{dallal.security.auth}).

L{PasswordFile} reads and edits the file (C{dallal-passwd} writes it);
the broker only reads it.
"""

import base64
import binascii
import hashlib
import hmac
import os
import re
import tempfile
from dataclasses import dataclass

from dallal.names import checkUserName

SCHEME = "scrypt"
DEFAULT_N = 2**14
DEFAULT_R = 8
DEFAULT_P = 1
SALT_BYTES = 16
DIGEST_BYTES = 32

# Bounds on the parameters a file may ask for, so that a garbled or hostile
# file cannot make each login allocate gigabytes: n=2**20, r=16 is 2 GiB.
MAX_N = 2**20
MAX_R = 16
MAX_P = 16
MAX_MEMORY = 2**31

# Letters, digits and ._@- : safe in the control line, in log lines (no
# space or '='), in the password file (no ':') and in ACL topics (no '/',
# '+' or '#' for %u to smuggle in).

_HASH = re.compile(
    r"\$scrypt\$n=(?P<n>[0-9]{1,8}),r=(?P<r>[0-9]{1,3}),p=(?P<p>[0-9]{1,3})"
    r"\$(?P<salt>[A-Za-z0-9+/]+)\$(?P<digest>[A-Za-z0-9+/]+)"
)


def _b64encode(data):
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _b64decode(text):
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


@dataclass(frozen=True)
class PasswordHash:
    """
    A password's scrypt hash, with the parameters and salt it was made with.
    """

    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def make(cls, password, n=DEFAULT_N, r=DEFAULT_R, p=DEFAULT_P, salt=None):
        """
        Hash a password (bytes) with a new random salt.
        """
        salt = os.urandom(SALT_BYTES) if salt is None else salt
        return cls(n, r, p, salt, cls._scrypt(password, salt, n, r, p))

    @classmethod
    def parse(cls, text):
        """
        Read a hash as the password file holds it.

        @raise ValueError: with the reason.
        """
        if text.startswith(("$6$", "$7$")):
            raise ValueError(
                "a Mosquitto hash: Dallal reads its own $scrypt$ hashes only; set "
                "this user's password again with dallal-passwd"
            )
        match = _HASH.fullmatch(text)
        if match is None:
            raise ValueError(
                "the hash is not $scrypt$n=<N>,r=<R>,p=<P>$<salt>$<digest> (made by dallal-passwd)"
            )
        n, r, p = int(match["n"]), int(match["r"]), int(match["p"])
        if not (1 < n <= MAX_N and n & (n - 1) == 0):
            raise ValueError(f"scrypt n={n} is not a power of 2 from 2 to {MAX_N}")
        if not (1 <= r <= MAX_R and 1 <= p <= MAX_P):
            raise ValueError(f"scrypt r={r}, p={p} out of bounds (r 1-{MAX_R}, p 1-{MAX_P})")
        try:
            salt, digest = _b64decode(match["salt"]), _b64decode(match["digest"])
        except (binascii.Error, ValueError):
            raise ValueError("the salt or digest is not base64") from None
        if len(digest) < 16:
            raise ValueError("the digest is too short")
        return cls(n, r, p, salt, digest)

    def __str__(self):
        return (
            f"${SCHEME}$n={self.n},r={self.r},p={self.p}"
            f"${_b64encode(self.salt)}${_b64encode(self.digest)}"
        )

    def __repr__(self):
        # Never print the digest where a log might keep it.
        return f"PasswordHash(n={self.n}, r={self.r}, p={self.p})"

    def verify(self, password):
        """
        Whether C{password} (bytes) is the one hashed, in constant time for
        a given length of digest.  Costs one scrypt: call it off the
        reactor thread.
        """
        computed = self._scrypt(password, self.salt, self.n, self.r, self.p, len(self.digest))
        return hmac.compare_digest(computed, self.digest)

    def decoy(self):
        """
        A hash with the same parameters that no password matches: checking
        an unknown user against it costs what checking a known one does, so
        that timing does not tell which user names exist.
        """
        return PasswordHash(
            self.n, self.r, self.p, os.urandom(SALT_BYTES), os.urandom(len(self.digest))
        )

    @staticmethod
    def _scrypt(password, salt, n, r, p, length=DIGEST_BYTES):
        # scrypt needs 128 * r * n bytes for its main array, and a little
        # more; hashlib refuses anything over maxmem (32 MiB by default).
        memory = 128 * r * (n + p + 2) + 2**20
        return hashlib.scrypt(
            password, salt=salt, n=n, r=r, p=p, maxmem=min(memory, MAX_MEMORY), dklen=length
        )


class PasswordFileError(Exception):
    """
    The password file cannot be read, or a line of it is wrong: the message
    names the file (and line) and says why.
    """


class PasswordFile:
    """
    A password file's lines, in order: users with their hash, and the
    comments and blank lines between them, which editing keeps.

    @ivar path: where it is read from and written to.
    @ivar users: user name -> L{PasswordHash}.
    """

    def __init__(self, path):
        self.path = path
        self.users = {}
        # Each line: a user name (its hash is in self.users), or the text of
        # a comment or blank line.
        self._lines = []

    @classmethod
    def load(cls, path, missingIsEmpty=False):
        """
        Read a password file.

        @param missingIsEmpty: a file that does not exist is an empty one
            (for C{dallal-passwd}, which creates it).
        @raise PasswordFileError: the file cannot be read, or a line is
            wrong.
        """
        passwords = cls(path)
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except FileNotFoundError:
            if missingIsEmpty:
                return passwords
            raise PasswordFileError(f"cannot read the password file {path}: no such file") from None
        except OSError as error:
            raise PasswordFileError(
                f"cannot read the password file {path}: {error.strerror}"
            ) from error
        except UnicodeDecodeError:
            raise PasswordFileError(f"the password file {path} is not UTF-8 text") from None
        for number, line in enumerate(text.splitlines(), 1):
            try:
                passwords._read(line.strip())
            except ValueError as error:
                raise PasswordFileError(f"{path}:{number}: {error}") from error
        return passwords

    def _read(self, line):
        if not line or line.startswith("#"):
            self._lines.append(line)
            return
        name, colon, hashed = line.partition(":")
        if not colon:
            raise ValueError("expected <user>:<hash>")
        checkUserName(name)
        if name in self.users:
            raise ValueError(f"user {name} is listed twice")
        self.users[name] = PasswordHash.parse(hashed)
        self._lines.append(name)

    def set(self, name, hashed):
        """
        Add a user, or change its hash.

        @return: whether the user is new.
        """
        checkUserName(name)
        isNew = name not in self.users
        if isNew:
            self._lines.append(name)
        self.users[name] = hashed
        return isNew

    def delete(self, name):
        """
        @raise KeyError: there is no such user.
        """
        del self.users[name]
        self._lines.remove(name)

    def text(self):
        lines = [
            f"{line}:{self.users[line]}" if line in self.users else line for line in self._lines
        ]
        return "".join(line + "\n" for line in lines)

    def save(self):
        """
        Write the file atomically, readable by its owner only: a new file
        beside it, flushed to disk, then renamed over it, so that a broker
        reading it never sees half of it.

        @raise OSError: it could not be written (the old file is intact).
        """
        folder = os.path.dirname(os.path.abspath(self.path))
        descriptor, temporary = tempfile.mkstemp(
            dir=folder, prefix=".dallal-passwd-", suffix=".tmp"
        )
        try:
            # mkstemp makes the file 0600 already; say so for the reader.
            os.fchmod(descriptor, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(self.text())
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass
            raise
