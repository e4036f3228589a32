"""A problem the user can fix (a bad argument, a run that is not there, a file in the way): every
command raises `UsageError`, and `dflash-ops` prints it as one line on stderr with exit status 2,
never a traceback. A module of its own so that a command needs nothing of `console.cli.main`, which
imports the commands.
"""

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""
