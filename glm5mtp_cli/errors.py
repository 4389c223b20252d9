"""User-facing errors: the CLI prints each as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """Bad input from the user (file, flag, model name): one clear line, exit code 2."""

    exit_code = 2


def short_error(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), else its type's name."""
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
