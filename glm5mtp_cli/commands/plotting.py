"""--plot (profile, plan): matplotlib is imported only when a plot is asked for (--help stays light),
checked before any work starts, and every failure is one line."""

from __future__ import annotations

from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.output_file import check_output

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
    """Before any work: the file is writable, matplotlib is there and writes the name's format."""
    if path is not None:
        check_output(path, "--plot")
        pyplot()
        _check_format(path)


def _check_format(path: Path) -> None:
    """savefig takes the format from the name's extension (and appends '.png' to a name without one)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise UserError(f"--plot {path}: matplotlib writes {', '.join(sorted(formats))}; end the name with one "
                        "(e.g. .png)")


def save(fig, path: Path) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror}") from None
