"""--plot (profile, plan): matplotlib is imported only when a plot is asked for (--help stays light),
checked before any work starts, and every failure is one line."""

from __future__ import annotations

from pathlib import Path

from glm5mtp_cli.commands.generate import check_output
from glm5mtp_cli.errors import UserError

PLOT_HINT = "--plot needs matplotlib: pip install 'glm5mtp[plot]' (or pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or one line saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(PLOT_HINT) from None
    return plt


def check_plot(path: Path | None) -> None:
    """Before any work: the file's folder is writable and matplotlib is there."""
    if path is not None:
        check_output(path, "--plot")
        pyplot()


def save(fig, path: Path) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror}") from None
