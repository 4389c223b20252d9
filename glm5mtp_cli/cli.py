"""The Typer app: one entry point, commands registered lazily. No model logic here.

`glm5mtp --help` and `--version` must not pay for torch (a few seconds): each command is registered
as a thin stand-in that only knows its name and one-line help; running it (or its `--help`) imports
the command's module, builds that one command with Typer and hands it the remaining arguments.
Command modules keep torch and the engine out of their module level too, so `glm5mtp CMD --help`
stays fast as well.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import signal
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from glm5mtp_cli import __version__
from glm5mtp_cli.errors import Interrupted, UserError

# name -> ("module:function", one-line help shown by `glm5mtp --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("glm5mtp_cli.commands.generate:generate_cmd",
                 "Speculative generation: the MTP head drafts, the target verifies; output equals the target's."),
    "info": ("glm5mtp_cli.commands.info:info_cmd",
             "Parameters, bytes per component and cache bytes per token, from the config alone."),
    "init-random": ("glm5mtp_cli.commands.init_random:init_random_cmd",
                    "Write a random-weight checkpoint in the Hub layout (real dimensions, no download)."),
    "leak-check": ("glm5mtp_cli.commands.leak_check:leakcheck_cmd",
                   "Run sequences to every end (length, EOS, cancel, error); check every cache pool for leaks."),
    "profile": ("glm5mtp_cli.commands.profile:profile_cmd",
                "Per-sequence memory by component and latency per phase, ceiling vs budget allocation."),
    "train": ("glm5mtp_cli.commands.train:train_cmd",
              "Train a GLM-5-architecture model jointly with its MTP layer (how glm5-nano was made)."),
    "acceptance": ("glm5mtp_cli.commands.acceptance:acceptance_cmd",
                   "Acceptance length and per-position acceptance over a prompt set, per gamma and temperature."),
    "bench": ("glm5mtp_cli.commands.bench:bench_cmd",
              "Tokens/s and TPOT of gamma 0..4 beside transformers; one draft step against its memory floor."),
    "quantize": ("glm5mtp_cli.commands.quantize:quantize_cmd",
                 "Write an FP8 (e4m3, 128x128 block scales) copy of a checkpoint, or an FP8 one's fp32 twin."),
    "draft-vocab": ("glm5mtp_cli.commands.draft_vocab:draft_vocab_cmd",
                    "Count token frequencies on a corpus for `generate --draft-vocab K`."),
    "plan": ("glm5mtp_cli.commands.plan:plan_cmd",
             "Predict what the MTP drafter buys on given GPUs and batch sizes; settings for vLLM, SGLang, TRT-LLM."),
}

app = typer.Typer(
    name="glm5mtp",
    help="Speculative generation with the GLM-5 multi-token-prediction (MTP) draft head.\n\n"
         "Start with: glm5mtp generate --prompt 'class Point:' (glm5-nano, a 16 M-parameter demo model trained on "
         "Python sources, on the CPU). "
         "Each command has --help with examples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)
_OWN_PROCESS = False  # main() runs this process's own command line: the process ends when it returns


def _version(value: bool) -> None:
    if value:
        print(f"glm5mtp {__version__}")
        raise typer.Exit()


def _help(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help())
        raise typer.Exit()


# Our own --help: Typer's (0.29) shows a "<bool>" placeholder beside it, and a flag's metavar="" is the
# only public way to drop that; every command and the root take this one instead (add_help_option=False)
HelpOpt = Annotated[bool, typer.Option("--help", metavar="", callback=_help, is_eager=True, expose_value=False,
                                       help="Show this message and exit.")]


@app.callback(add_help_option=False)
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", metavar="", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
    _show_help: HelpOpt = False,
) -> None:
    """Speculative generation with the GLM-5 multi-token-prediction (MTP) draft head."""


def guarded(fn):
    """The command as Typer builds it: a UserError it raises becomes one red line and exit code 2 (also
    under CliRunner), and its signature gains HelpOpt."""

    @functools.wraps(fn)
    def run(*args, _show_help=None, **kwargs):  # Typer passes every parameter it knows, HelpOpt's too
        try:
            return fn(*args, **kwargs)
        except Interrupted as e:
            err_console.print(f"[yellow]interrupted:[/yellow] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except UserError as e:
            err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            # the commands that write files or stream say more (Interrupted); the others print at the end
            err_console.print("[yellow]interrupted:[/yellow] nothing was written", highlight=False)
            raise typer.Exit(Interrupted.exit_code) from None

    sig = inspect.signature(fn, eval_str=True)
    helps = inspect.Parameter("_show_help", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=HelpOpt)
    run.__signature__ = sig.replace(parameters=[*sig.parameters.values(), helps])
    return run


def load_command(name: str):
    """The command's own function (imported now), e.g. for launch.spawn or tests."""
    module, fn = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module), fn)


def command_app(name: str) -> typer.Typer:
    """A Typer app holding just this command, built from the function's signature and docstring."""
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    sub.command(name, add_help_option=False)(guarded(load_command(name)))
    return sub


def _register(name: str, short: str) -> None:
    @app.command(name, help=short, add_help_option=False,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def stand_in(ctx: typer.Context) -> None:
        # the real command parses everything after its name, --help included (SystemExit carries its code)
        command_app(name)(args=list(ctx.args), prog_name=f"glm5mtp {name}")


for _name, (_target, _short) in COMMANDS.items():
    _register(_name, _short)


def output_complete() -> None:
    """A command's output is whole: from here to the process's exit (the model freed, then the
    interpreter's teardown, about a second with torch loaded) Ctrl-C is ignored, so it cannot turn a
    complete run into exit 130. Only where main() runs the process's own command line: an in-process
    caller (CliRunner, step_phases) keeps its Ctrl-C."""
    if _OWN_PROCESS:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors become one red line and exit code 2."""
    global _OWN_PROCESS
    _OWN_PROCESS = argv is None
    try:
        app(args=argv, standalone_mode=True, prog_name="glm5mtp")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except UserError as e:
        err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:  # before a command started (while imports ran)
        err_console.print("[yellow]interrupted:[/yellow] nothing was written")
        return Interrupted.exit_code
    return 0


if __name__ == "__main__":
    # the package's module, not this __main__ copy of it: commands reach its state (output_complete)
    from glm5mtp_cli.cli import main as package_main

    sys.exit(package_main())
