"""User-facing errors: a mistake in the input ends the command with exit code 2 and one line, no traceback."""


class UserError(Exception):
    """Bad input from the user (unknown preset, missing file, impossible plan). The message says what, where and how
    to fix it; the CLI prints it as one line and exits with code 2."""
