"""What a run of hours had finished when it was killed: masked passes and detections, kept on disk as
each finishes, so that the run goes on mid-sample instead of starting the sample over.

Within ``with Journal(stem):`` (this thread only), :func:`probe.faithfulness.answer_scores` and
:func:`probe.detectors.detect_many` read what the journal holds for the same sample and settings
instead of computing it again, and add what they compute:

- ``{stem}.passes.jsonl``: one JSON line a masked pass (its key, mask, log-probability and whether the
  answer stayed greedy), flushed to disk as each batch of passes finishes; a line cut short by a kill is
  skipped. The values read back are the ones written, bit for bit. A detector some of whose passes an
  earlier process ran has no measured cost: the registry leaves its ``seconds`` None (:attr:`resumed`).
- ``{stem}.detections/``: one :meth:`probe.detectors.Detection.save` file a detection, written
  atomically as each detector finishes.

A journal holds no model: keep it where the run's settings pin the model and dtype, as
:func:`analyses.sweep.sweep`'s parts folder does (``analyses.detector_compare`` keeps one per batch of
samples there).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch


class Journal:
    """The passes and detections a run finished, at ``{stem}.passes.jsonl`` and ``{stem}.detections/``
    (module docstring). Use as a context manager."""

    def __init__(self, stem: Path | str):
        stem = Path(stem)
        self.passes_file = stem.with_name(f"{stem.name}.passes.jsonl")
        self.detections_folder = stem.with_name(f"{stem.name}.detections")
        self._passes: dict[tuple[str, str], tuple[float, bool]] = {}
        #: masked passes read back that an earlier process ran (not those this one wrote and reads again)
        self.resumed = 0
        text = self.passes_file.read_text() if self.passes_file.exists() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run, cut short
                continue
            self._passes[entry["key"], entry["removed"]] = (entry["logprob"], entry["correct"])
        self._from_disk = set(self._passes)
        if text and not text.endswith("\n"):  # end the cut line, so the next pass starts a line of its own
            with self.passes_file.open("a") as file:
                file.write("\n")

    def clear(self) -> None:
        """Forget everything the journal holds, on disk too (a run that starts over)."""
        self.passes_file.unlink(missing_ok=True)
        shutil.rmtree(self.detections_folder, ignore_errors=True)
        self._passes.clear()
        self._from_disk.clear()

    def __enter__(self) -> Journal:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def read_passes(self, key: str, removed: torch.Tensor) -> dict[int, tuple[float, bool]]:
        """Row index → (log-probability, correct) of each mask of ``removed`` BoolTensor[masks, sources]
        held under ``key`` (what the pass depends on besides its mask and the model)."""
        bits = [(key, mask_bits(mask)) for mask in removed]
        held = {index: self._passes[entry] for index, entry in enumerate(bits) if entry in self._passes}
        self.resumed += sum(bits[index] in self._from_disk for index in held)
        return held

    def write_passes(
        self, key: str, removed: torch.Tensor, logprob: torch.Tensor, correct: torch.Tensor
    ) -> None:
        """Append the passes of ``removed`` BoolTensor[masks, sources] and their ``logprob`` Tensor[masks]
        and ``correct`` BoolTensor[masks] under ``key``, flushed to disk."""
        lines = []
        for mask, value, right in zip(removed, logprob.tolist(), correct.tolist(), strict=True):
            self._passes[key, mask_bits(mask)] = (value, right)
            lines.append(
                json.dumps({"key": key, "removed": mask_bits(mask), "logprob": value, "correct": right})
            )
        self.passes_file.parent.mkdir(parents=True, exist_ok=True)
        with self.passes_file.open("a") as file:
            file.write("".join(line + "\n" for line in lines))
            file.flush()
            os.fsync(file.fileno())

    def detection_file(self, key: str) -> Path:
        """Where the detection of ``key`` (its sample, detector and options) is kept."""
        return self.detections_folder / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


_ACTIVE: contextvars.ContextVar[Journal | None] = contextvars.ContextVar("journal", default=None)


def active() -> Journal | None:
    """The journal of the innermost ``with Journal(...)`` in this thread, or None."""
    return _ACTIVE.get()


def mask_bits(mask: torch.Tensor) -> str:
    """A mask as a string of ``0``/``1``, one per source (the form saved passes take)."""
    return "".join("1" if bit else "0" for bit in mask.tolist())
