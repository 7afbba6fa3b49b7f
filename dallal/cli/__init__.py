"""The command line: the C{dallal} command, its interactive shell and chat, and C{dallal-passwd}."""
