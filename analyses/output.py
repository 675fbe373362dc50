"""Writing analysis outputs: every figure with the CSV behind it, never half-written."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from probe.atomic import atomic_write  # noqa: E402


def save_figure(fig: plt.Figure, table: pd.DataFrame, out: Path, name: str) -> Path:
    """Save ``fig`` as ``out/name.png`` with ``table`` as ``out/name.csv`` beside it; close the figure."""
    atomic_write(Path(out) / f"{name}.csv", lambda tmp: table.to_csv(tmp, index=False))
    png = atomic_write(Path(out) / f"{name}.png", lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight"))
    plt.close(fig)
    return png
