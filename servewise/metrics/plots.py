"""Figures: one way to write them."""
from __future__ import annotations

import importlib.util
import os


def can_plot() -> bool:
    """Whether matplotlib (the `plot` extra) is installed; if it is not, print one line saying the figures
    are skipped, so that a run without it still writes its report and JSON."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print('figures skipped: matplotlib is not installed (pip install "servewise[plot]")')
    return False


def series_style(i: int) -> dict:
    """Line keywords for the i-th of many series: tab20 colours and three markers, so that no two of up
    to 20 look alike (matplotlib's default cycle repeats after 10)."""
    import matplotlib.pyplot as plt

    return {"marker": "os^"[i % 3], "markersize": 4, "color": plt.cm.tab20(i % 20)}


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay a figure out, write it to out_dir/name (110 dpi), close it; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
