"""
The C{dallal-passwd} command: add a user to a broker's password file, change
a user's password, or delete a user (as C{mosquitto_passwd} does for
Mosquitto).

    dallal-passwd FILE USER        add USER, or change its password
    dallal-passwd -D FILE USER     delete USER

The password is read from C{DALLAL_PASSWORD} when it is set (for scripts),
otherwise asked for twice on the terminal, without echo.  The file is
created if missing, and always written whole to a new file that replaces
the old one, readable by its owner only.
"""

import argparse
import sys

from dallal.cli.askpass import PASSWORD_VARIABLE, NoTerminal, askPassword, passwordFromEnvironment
from dallal.names import checkUserName
from dallal.security.passwords import PasswordFile, PasswordFileError, PasswordHash

PROGRAM = "dallal-passwd"


class PasswdError(Exception):
    """
    Why the command failed, for standard error.
    """


def buildParser():
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Add a user to a Dallal broker's password file (twistd dallal "
        "--passwords FILE), or change its password; the file is created if "
        f"missing.  The password comes from {PASSWORD_VARIABLE} if set, otherwise "
        "it is asked for twice on the terminal, without echo.  The broker reads "
        "the file when it starts.",
    )
    parser.add_argument("-D", "--delete", action="store_true", help="delete the user instead")
    parser.add_argument("file", metavar="FILE", help="the password file")
    parser.add_argument("user", metavar="USER", help="the user name")
    return parser


def newPassword():
    """
    The new password, as bytes: from the environment, or typed twice.

    @raise PasswdError: there is no terminal, the two differ, or it is
        empty.
    """
    password = passwordFromEnvironment()
    if password is None:
        try:
            password = askPassword("password: ")
            again = askPassword("password again: ")
        except NoTerminal as error:
            raise PasswdError(str(error)) from error
        if password != again:
            raise PasswdError("the two passwords differ; nothing changed")
    if not password:
        raise PasswdError("an empty password is refused; nothing changed")
    return password


def run(args):
    """
    @return: the line to print on success.
    @raise PasswdError: with the reason.
    """
    try:
        checkUserName(args.user)
        passwords = PasswordFile.load(args.file, missingIsEmpty=not args.delete)
    except (ValueError, PasswordFileError) as error:
        raise PasswdError(str(error)) from error
    if args.delete:
        try:
            passwords.delete(args.user)
        except KeyError:
            raise PasswdError(f"{args.file} has no user {args.user}; nothing changed") from None
        done = f"deleted {args.user} from {args.file}"
    else:
        isNew = passwords.set(args.user, PasswordHash.make(newPassword()))
        if isNew:
            done = f"added {args.user} to {args.file}"
        else:
            done = f"changed the password of {args.user} in {args.file}"
    try:
        passwords.save()
    except OSError as error:
        raise PasswdError(f"cannot write {args.file}: {error.strerror}; nothing changed") from error
    return done


def main(argv=None):
    args = buildParser().parse_args(argv)
    try:
        print(run(args), flush=True)
    except PasswdError as error:
        print(f"{PROGRAM}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from error
    except (EOFError, KeyboardInterrupt):
        # Ctrl-D or Ctrl-C at the prompt.
        print(file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
