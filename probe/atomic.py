"""Writing a file so that it is never left half-written: the one way longprobe writes its outputs.

Standard library only, on purpose: the peers' runners (``analyses/peers/peer_io.py``) load this file by its
path inside the peers' own environments, where longprobe is not installed, and write their journals with
the same :func:`atomic_write`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp_path)``, then rename the temporary file onto ``path`` (same folder).

    The temporary name is unique to this call (process id and a random suffix), so concurrent
    writers of one path never collide: each rename is whole, and the last complete write wins.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}-{secrets.token_hex(4)}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
