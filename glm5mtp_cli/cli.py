"""The Typer app: parse flags, call one function per command, print. No model logic here."""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from glm5mtp_cli import __version__
from glm5mtp_cli.errors import UserError

app = typer.Typer(
    name="glm5mtp",
    help="Speculative generation with the GLM-5 multi-token-prediction (MTP) draft head.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        print(f"glm5mtp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Speculative generation with the GLM-5 multi-token-prediction (MTP) draft head."""


def guarded(fn):
    """Turn a UserError raised by a command into one red line and exit code 2 (also under CliRunner)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return run


def command(name: str, fn) -> None:
    app.command(name)(guarded(fn))


def _register() -> None:
    """Commands live one module each (cmd_*.py); registering them here keeps one entry point."""
    from glm5mtp_cli.commands import generate as cmd_generate
    from glm5mtp_cli.commands import info as cmd_info
    from glm5mtp_cli.commands import init_random as cmd_init
    from glm5mtp_cli.commands import leak_check as cmd_leakcheck
    from glm5mtp_cli.commands import profile as cmd_profile
    from glm5mtp_cli.commands import train as cmd_train
    from glm5mtp_cli.commands import acceptance as cmd_acceptance
    from glm5mtp_cli.commands import bench as cmd_bench
    from glm5mtp_cli.commands import draft_vocab as cmd_draftvocab

    command("generate", cmd_generate.generate_cmd)
    command("profile", cmd_profile.profile_cmd)
    command("leak-check", cmd_leakcheck.leakcheck_cmd)
    command("info", cmd_info.info_cmd)
    command("init-random", cmd_init.init_random_cmd)
    command("train", cmd_train.train_cmd)
    command("acceptance", cmd_acceptance.acceptance_cmd)
    command("bench", cmd_bench.bench_cmd)
    command("draft-vocab", cmd_draftvocab.draft_vocab_cmd)


_register()


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors become one red line and exit code 2."""
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except UserError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
