"""User-facing errors: the CLI prints each as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """Bad input from the user (file, flag, model name): one clear line, exit code 2."""

    exit_code = 2


class Interrupted(UserError):
    """Ctrl-C, caught where the command knows what finished and where its partial output went: that,
    in one line, and exit code 130 (128 + SIGINT, as a shell reports it)."""

    exit_code = 130


def short_error(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), else its type's name."""
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
