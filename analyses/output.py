"""Writing analysis outputs: every figure with the CSV behind it, never half-written."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def atomic_write(path: Path, write) -> Path:
    """Call ``write(tmp_path)``, then rename the temporary file onto ``path`` (same folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_figure(fig: plt.Figure, table: pd.DataFrame, out: Path, name: str) -> Path:
    """Save ``fig`` as ``out/name.png`` with ``table`` as ``out/name.csv`` beside it; close the figure."""
    atomic_write(Path(out) / f"{name}.csv", lambda tmp: table.to_csv(tmp, index=False))
    png = atomic_write(Path(out) / f"{name}.png", lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight"))
    plt.close(fig)
    return png
