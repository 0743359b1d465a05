"""Figures: one way to write them."""
from __future__ import annotations

import os


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay a figure out, write it to out_dir/name (110 dpi), close it; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
