"""Renamed keyword arguments keep working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def renamed_arguments(**renames: str) -> Callable[[F], F]:
    """Decorator: accept each old keyword ``old=`` as its new name ``renames[old]``, warning once per call.

        @renamed_arguments(positions="target_positions")
        def long_logprobs(model, input_ids, target_positions=None): ...
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}() got both {old}= (deprecated) and {new}=")
                warnings.warn(
                    f"{fn.__qualname__}({old}=...) is deprecated and will be removed in the next release; "
                    f"use {new}=...",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
