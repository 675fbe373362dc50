"""The exchange between longprobe and a public attribution package run in an environment of its own.

A peer never runs inside longprobe (several pin other transformers versions). longprobe writes each
sample as one JSON line (:func:`export`): its ``key``, the ``text`` the model reads (chat template
included), the ``prompt`` (the text before the answer), the ``answer`` (the rest of ``text``: the
teacher-forced continuation, its leading space included), the character range of every source in
``text`` (``sources``: ``[[start, end], ...]``, in order), the ``model`` folder, and the token ids the
model reads (``input_ids``, special tokens such as a BOS included; ``prompt_tokens`` of them are the
prompt's), so a peer that takes ids needs no tokenizer guesswork. A peer's runner writes one JSON line
per sample back: the ``key``, ``scores`` (one number per source, in order), the ``seconds`` it spent
(CPU seconds of its process, ``time.process_time``) and the ``cpu`` they were measured on, or the
``error`` that stopped it on that sample (a failure is a result: :func:`failures` reads them).
:func:`read_scores` checks the scores; :func:`judge` judges every method with the same exact ablation
as longprobe's own detectors (:func:`probe.faithfulness.evaluate`, with the additive ceiling).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
import torch

from probe import faithfulness
from probe.atomic import atomic_write
from probe.errors import InvalidValueError
from probe.tasks import Sample

from . import peer_io


def sample_key(sample: Sample) -> str:
    """The name a sample travels under: task, length and seed."""
    return f"{sample.task}-{sample.length}-{sample.seed}"


def key_fields(key: str) -> tuple[str, int | None, int]:
    """The task, length (None: a real question's own length) and seed of a :func:`sample_key` (a task's
    name may hold "-")."""
    task, length, seed = key.rsplit("-", 2)
    return task, None if length == "None" else int(length), int(seed)


def export(samples: Sequence[Sample], model_folder: str | Path, path: str | Path) -> Path:
    """Write ``samples`` for a peer (module docstring), one JSON line each, atomically."""
    lines = [
        json.dumps(
            {
                "key": sample_key(sample),
                "text": sample.text,
                "prompt": sample.prompt_text,
                "answer": sample.text[len(sample.prompt_text) :],
                "sources": [list(sample.char_spans[s.category][s.index]) for s in sample.sources],
                "model": str(model_folder),
                "input_ids": sample.input_ids.tolist(),
                "prompt_tokens": sample.prompt_length,
            }
        )
        for sample in samples
    ]
    return atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def failures(path: str | Path) -> dict[str, str]:
    """The samples a peer could not score: sample key -> its error."""
    records = (json.loads(line) for line in Path(path).read_text().splitlines())
    return {record["key"]: record["error"] for record in records if "error" in record}


def read_scores(
    path: str | Path, samples: Sequence[Sample], cpu: str | None = None
) -> dict[str, tuple[torch.Tensor, float]]:
    """A peer's scores: sample key -> (Tensor[sources], seconds), checked against ``samples``; every
    sample must be scored or have failed (:func:`failures`). The seconds of a line measured on another
    CPU than ``cpu`` (default: this machine's, :func:`peer_io.cpu`), or on one it does not name, read
    as NaN: they cannot be set against a forward pass timed here."""
    cpu = cpu or peer_io.cpu()
    wanted = {sample_key(sample): len(sample.sources) for sample in samples}
    found, failed = {}, failures(path)
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        record = json.loads(line)
        key, scores = record.get("key"), record.get("scores")
        if key not in wanted:
            raise InvalidValueError(f"{path}:{number}: sample {key!r} was not exported")
        if key in failed:
            continue
        if not isinstance(scores, list) or len(scores) != wanted[key]:
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise InvalidValueError(
                f"{path}:{number}: {key} needs {wanted[key]} scores, one a source: got {got}"
            )
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in scores):
            raise InvalidValueError(f"{path}:{number}: {key} has scores that are not finite numbers")
        seconds = float(record.get("seconds", math.nan)) if record.get("cpu") == cpu else math.nan
        found[key] = (torch.tensor(scores, dtype=torch.float32), seconds)
    missing = sorted(set(wanted) - set(found) - set(failed))
    if missing:
        raise InvalidValueError(f"{path}: no scores for {missing}")
    return found


def judge(
    model,
    samples: Sequence[Sample],
    methods: Mapping[str, Mapping[str, tuple[torch.Tensor, float]]],
    judgement: faithfulness.Judgement = faithfulness.Judgement(ceiling_masks=256),
    known: Sequence[faithfulness.Ablations] = (),
) -> pd.DataFrame:
    """Every method's faithfulness on every sample, one row per (sample, method), with the additive
    ceiling (``judgement.ceiling_masks``) and each method's ``seconds``: ``methods`` maps a method's name
    to :func:`read_scores` (a method that failed on a sample has no row for it). ``judgement`` and
    ``known`` (passes already run) as :func:`probe.faithfulness.evaluate` takes them."""
    rows = []
    for sample in samples:
        key = sample_key(sample)
        scores = {name: found[key][0] for name, found in methods.items() if key in found}
        frame = faithfulness.evaluate(model, sample, scores, judgement, known=known)
        seconds = {name: found[key][1] for name, found in methods.items() if key in found}
        rows.append(frame.assign(sample=key, seconds=frame.scorer.map(seconds)))
    return pd.concat(rows, ignore_index=True)


def judge_part(
    part: str | Path,
    model,
    sample: Sample,
    methods: Mapping[str, Mapping[str, tuple[torch.Tensor, float]]],
    unit: Callable[[], float],
    judgement: faithfulness.Judgement = faithfulness.Judgement(ceiling_masks=256),
    known: Sequence[faithfulness.Ablations] = (),
) -> pd.DataFrame | None:
    """One sample's judged part (a CSV, one row a method, as :func:`judge` gives): every method of
    ``methods`` that scored ``sample`` and the part lacks is judged and added, and the part rewritten
    whole (atomically); ``None`` while no method has scored it. A method scored after its sample was
    judged is judged alone, against the part's own additive ceiling (``lds_share``). The cost unit,
    ``forward_seconds`` (the CPU seconds of one forward pass, ``unit()``), is timed in each call that
    judges something, on the machine whose seconds :func:`read_scores` kept (``forwards`` =
    ``seconds`` over it), so a part judged on two machines holds two units. ``judgement`` and ``known``
    as :func:`judge` takes them."""
    part = Path(part)
    judged = pd.read_csv(part) if part.exists() else None
    done = set() if judged is None else set(judged.scorer)
    key = sample_key(sample)
    new = {name: found for name, found in methods.items() if key in found and name not in done}
    if not new:
        return judged
    if judged is not None:  # the part's own ceiling stands
        judgement = dataclasses.replace(judgement, ceiling_masks=0)
    frame = judge(model, [sample], new, judgement, known)
    frame["forward_seconds"] = unit()
    frame["forwards"] = frame.seconds / frame.forward_seconds
    if judged is not None:
        if "lds_share" in judged:
            frame["lds_share"] = frame.lds / judged.lds[judged.scorer == "additive_ceiling"].iloc[0]
        frame = pd.concat([judged, frame], ignore_index=True)
    atomic_write(part, lambda tmp: frame.to_csv(tmp, index=False))
    return frame
