"""What every result object shares: settings, a tidy table, saving and loading (atomically).

A result (``Detection``, ``RetrievalScores``, ``LongPPLResult`` ...) carries the ``settings`` that
produced it, turns into a tidy ``to_frame()``, and round-trips through ``save(path)`` /
``load(path)``, as inseq's attribution outputs do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from probe.atomic import atomic_write
from probe.errors import InvalidValueError, LongprobeError, NotFoundError


@runtime_checkable
class Result(Protocol):
    """The protocol of longprobe's result objects."""

    settings: dict[str, Any]

    def to_frame(self) -> pd.DataFrame:
        """The result as a table."""
        ...

    def save(self, path: str | Path) -> None:
        """Write the result and its settings to ``path``, atomically."""
        ...

    @classmethod
    def load(cls, path: str | Path) -> Result:
        """The result :meth:`save` wrote."""
        ...


def write_json(path: str | Path, record: Any) -> Path:
    """``record`` as JSON at ``path``, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record)))


@contextmanager
def reading(path: str | Path, what: str):
    """Turn a malformed field met while building a ``what`` from the file at ``path`` (a number where a
    list belongs, a missing inner key) into an error that names the file and what was expected."""
    try:
        yield
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as error:
        if isinstance(error, LongprobeError):
            raise
        raise InvalidValueError(
            f"{path} is not a valid {what} file: a field is malformed ({type(error).__name__}: {error}); "
            f"expected a file written by {what}.save()"
        ) from None


def read_json(path: str | Path, what: str, keys: Sequence[str] = ()) -> Any:
    """The JSON record at ``path``, checked to be a ``what`` file: a JSON object holding ``keys``.

    A file that is not JSON, or lacks the keys, raises a :class:`ValueError` that says what was
    expected instead of a raw decoding or key error.
    """
    expected = f"expected a file written by {what}.save()"
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        raise NotFoundError(f"no {what} file at {path!r}: {expected}")
    try:
        record = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidValueError(
            f"{path} is not a {what} file: it is not JSON ({error}); {expected}"
        ) from None
    if not isinstance(record, dict):
        raise InvalidValueError(
            f"{path} is not a {what} file: it holds a JSON {type(record).__name__}; {expected}"
        )
    missing = sorted(set(keys) - set(record))
    if missing:
        has = sorted(record)[:8]
        raise InvalidValueError(f"{path} is not a {what} file: it lacks {missing} (has {has}); {expected}")
    return record
