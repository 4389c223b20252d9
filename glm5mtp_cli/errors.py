"""User-facing errors: the CLI prints each as one line and exits non-zero, never a traceback."""


class UserError(Exception):
    """Bad input from the user (file, flag, model name): one clear line, exit code 2."""

    exit_code = 2
