"""
The command line: the C{dallal} command, its interactive shell and chat,
C{dallal-passwd}, and the C{dallal-report} launcher.
"""
