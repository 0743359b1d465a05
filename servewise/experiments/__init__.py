"""Reproductions of the source papers' experiments."""
from __future__ import annotations

import os

from servewise.metrics import save_json
from servewise.metrics.plots import can_plot


def under_regime(options: dict, regime: str) -> dict:
    """Engine options with request-level batching (Magnus's and UELLM's) run as static batches under the
    papers' regime ("static"); continuous batching and the "paged" regime unchanged."""
    if regime == "static" and options.get("batching", "continuous") != "continuous":
        return {**options, "static_batches": True}
    return options


def publish(res: dict, text: str, out_dir: str, name: str, plot) -> None:
    """Print an experiment's report and keep it under out_dir: name.txt (the report), name.json (res) and
    the figures plot(res, out_dir) draws (it returns their paths), when matplotlib is installed."""
    os.makedirs(out_dir, exist_ok=True)
    print(text)
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(text + "\n")
    path = os.path.join(out_dir, f"{name}.json")
    save_json(res, path)
    print(f"saved {path}")
    for p in plot(res, out_dir) if can_plot() else []:
        print(f"figure: {p}")
