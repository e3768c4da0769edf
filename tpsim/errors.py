"""The one error type users see: a one-line message that names the problem and the fix."""


class UsageError(Exception):
    """Bad input. The CLI prints `tpsim: error: <message>` and exits 2, without a traceback."""


class RankError(Exception):
    """A rank failed or stalled; the message names the rank and what it was doing."""
