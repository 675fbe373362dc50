"""What every peer runner shares, standard library only (it runs inside the peer's environment).

    .venv-peers/NAME/bin/python -m analyses.peers.NAME.run EXPORTED.jsonl SCORES.jsonl [--method M]
        [--threads N]

from the repository root, so that ``analyses.peers`` imports without an install (its package files import
nothing: ``probe`` is not installed there).

A runner reads the samples longprobe exported (``exchange.export``), scores every source of each, and
writes one line a sample: ``{"key", "scores": [one number a source], "seconds"}``. A sample the peer
cannot score gets ``{"key", "error": "..."}`` instead, so the table can say why. ``seconds`` are CPU
seconds of the runner's process (``time.process_time``, every thread of it), not wall-clock time: a run
that is stopped and resumed, shares the machine with another job or is paused still measures what the method
itself costs, so methods scored at different times compare. Each line also names the ``cpu`` it was
measured on (:func:`cpu`): CPU seconds compare only on one kind of CPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


def _longprobe_module(name: str):
    """The standard-library-only module ``probe/NAME.py`` of longprobe, loaded from its file: ``probe``
    itself (torch, transformers of longprobe's versions) is not installed in a peer's environment."""
    path = Path(__file__).resolve().parents[2] / "probe" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"longprobe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


atomic_write = _longprobe_module("atomic").atomic_write  # :func:`probe.atomic.atomic_write`


def arguments(methods: list[str] | None = None, argv: list[str] | None = None) -> argparse.Namespace:
    """The runner's command line (``argv``, default ``sys.argv``): input, output, ``--method`` (when the
    peer has several), ``--threads``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("exported", type=Path)
    parser.add_argument("out", type=Path)
    if methods:
        parser.add_argument("--method", choices=methods, default=methods[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-answer-tokens", type=int, default=None,
        help="leave out (as a failure that says why) every sample whose answer is longer: for a method whose "
        "cost grows with each answer token",
    )  # fmt: skip
    parsed = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(parsed.threads))
    return parsed


def samples(path: Path) -> Iterator[dict]:
    """The exported samples: dicts with key, text, prompt, answer, sources ([[start, end], ...]), model."""
    for line in path.read_text().splitlines():
        yield json.loads(line)


def model_folders(path: Path) -> set[str]:
    """The model folders the exported samples name: a runner loads them before any clock starts."""
    return {sample["model"] for sample in samples(path)}


def journaled(path: Path) -> list[dict]:
    """The records of a JSON-lines journal (none if it does not exist yet), rewritten without a last line
    cut off by a kill, so that appending goes on after the last whole record. The rewrite is one rename
    of a whole new file: a kill during it leaves the old journal, never a shortened one."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the last line, cut off by a kill
    atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(record) + "\n" for record in records)))
    return records


class StepJournal:
    """The finished steps of the sample being scored (e.g. one answer token each), one JSON line a step in
    ``OUT.steps.partial``: a run killed inside a long sample resumes at its next step, and the sample's
    ``seconds`` still count the CPU seconds of the steps run before the kill (:meth:`replayed_seconds`).
    Give it to :func:`run`, which removes the file once every sample has its line."""

    def __init__(self, out: Path):
        self.path = out.with_name(out.name + ".steps.partial")
        self.done = {(record["key"], record["step"]): record for record in journaled(self.path)}
        self.replayed: dict[str, float] = {}

    def step(self, key: str, step: int, compute: Callable[[], list[float]]) -> list[float]:
        """Step ``step`` of sample ``key``: read back if a run before this one finished it, else computed
        by ``compute`` and journaled with its CPU seconds."""
        if (key, step) in self.done:
            record = self.done[key, step]
            self.replayed[key] = self.replayed.get(key, 0.0) + record["seconds"]
            return record["values"]
        start = time.process_time()
        values = [float(x) for x in compute()]
        record = {"key": key, "step": step, "values": values, "seconds": time.process_time() - start}
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
        self.done[key, step] = record
        return values

    def replayed_seconds(self, key: str) -> float:
        """CPU seconds that runs before this one spent on the steps of ``key`` read back here."""
        return self.replayed.get(key, 0.0)


def run(
    args: argparse.Namespace, score: Callable[[dict], list[float]], journal: StepJournal | None = None
) -> None:
    """Score every sample of ``args.exported`` with ``score`` and write the answers to ``args.out``
    (:func:`resumable`); a sample whose answer has more than ``args.max_answer_tokens`` tokens is not
    scored, its line says why. ``args``: :func:`arguments`. ``journal``: the :class:`StepJournal` that
    ``score`` keeps its steps in, whose earlier runs' seconds each sample's ``seconds`` include."""

    def answer(sample: dict) -> dict:
        length, limit = len(sample["input_ids"]) - sample["prompt_tokens"], args.max_answer_tokens
        if limit is not None and length > limit:
            reason = f"not run: {length} answer tokens, --max-answer-tokens {limit}"
            return {"key": sample["key"], "error": reason}
        start = time.process_time()
        try:
            scores = [float(x) for x in score(sample)]
            earlier = journal.replayed_seconds(sample["key"]) if journal else 0.0
            return {"key": sample["key"], "scores": scores, "seconds": time.process_time() - start + earlier}
        except Exception as error:  # a peer's failure is a result: recorded, not hidden
            return {"key": sample["key"], "error": f"{type(error).__name__}: {error}",
                    "trace": traceback.format_exc(limit=4)}  # fmt: skip

    jobs = ((sample["key"], functools.partial(answer, sample)) for sample in samples(args.exported))
    resumable(args.out, jobs)
    if journal:
        journal.path.unlink(missing_ok=True)


def cpu() -> str:
    """This machine's CPU, as ``/proc/cpuinfo`` names it (else :func:`platform.processor`)."""
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def resumable(out: Path, jobs: Iterable[tuple[str, Callable[[], dict]]]) -> None:
    """Write ``out``, one JSON line a job (``key``, a function that makes the line, to which the
    :func:`cpu` it ran on is added), resumably: each finished line is appended to ``out.partial`` at
    once, a restart skips the keys found there (a line cut off by a kill is dropped and its job runs
    again), and ``out`` appears by one rename once every job has its line."""
    partial = out.with_name(out.name + ".partial")
    done = journaled(partial)
    finished = {record["key"] for record in done}
    with partial.open("a") as file:
        for key, make in jobs:
            if key in finished:
                continue
            record = make() | {"cpu": cpu()}
            file.write(json.dumps(record) + "\n")
            file.flush()
            print(key, record.get("seconds", record.get("error")), flush=True)
    partial.replace(out)


def source_of_token(offsets: list[tuple[int, int]], text: str, sources: list[list[int]]) -> list[int | None]:
    """longprobe's span rule for a peer's own tokenization: a token belongs to the source holding its first
    non-whitespace character (a whitespace-only token: its first character); ``None`` outside every source
    and for a token with no characters (an added ``<bos>`` at (0, 0)). ``offsets`` are the tokenizer's
    character offsets of each token."""
    owner = []
    for start, end in offsets:
        first = next((i for i in range(start, end) if not text[i].isspace()), start)
        inside = (n for n, (a, b) in enumerate(sources) if a <= first < b)
        owner.append(next(inside, None) if end > start else None)
    return owner


def tokens(tokenizer, sample: dict) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """The exported ids (what longprobe's model reads), their character offsets in ``text`` from the
    peer's ``tokenizer`` (a Hugging Face fast tokenizer; with or without its special tokens, whichever
    gives the exported ids) and the answer's positions. Refuses a tokenizer that gives other ids."""
    ids = sample["input_ids"]
    for special in (False, True):
        encoded = tokenizer(sample["text"], add_special_tokens=special, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == ids:
            offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
            return ids, offsets, list(range(sample["prompt_tokens"], len(ids)))
    raise ValueError("the peer's tokenizer does not give the exported input_ids for this text")


def written_out(tokenizer, sample: dict) -> dict:
    """``sample`` for a peer that tokenizes text without special tokens and relies on a chat template to
    write them (AT2, ContextCite, FlashTrace): the tokens longprobe adds in front of a text without chat
    template (Gemma 3's ``<bos>``) are written out at the start of ``text`` and ``prompt``, the sources
    shifted to match; nothing changes for a text that carries its chat template. Refuses a tokenizer
    whose ids for the result are not the exported ``input_ids``."""
    ids = sample["input_ids"]
    added = len(ids) - len(tokenizer(sample["text"], add_special_tokens=False)["input_ids"])
    prefix = tokenizer.decode(ids[:added]) if added > 0 else ""
    shifted = sample | {
        "text": prefix + sample["text"],
        "prompt": prefix + sample["prompt"],
        "sources": [[start + len(prefix), end + len(prefix)] for start, end in sample["sources"]],
    }
    if tokenizer(shifted["text"], add_special_tokens=False)["input_ids"] != ids:
        raise ValueError(
            f"the peer's tokenizer does not give the exported input_ids for this text (special tokens "
            f"written out: {prefix!r})"
        )
    return shifted


def source_cuts(text: str, sources: list[list[int]]) -> list[tuple[int, int]]:
    """What removing each source cuts out of ``text`` when removal cuts text (ContextCite's ablation):
    its characters and the whitespace just before it, back to the previous source's end; the text
    between sources that is no source stays."""
    cuts, previous = [], 0
    for start, end in sources:
        first = start
        while first > previous and text[first - 1].isspace():
            first -= 1
        cuts.append((first, end))
        previous = end
    return cuts


def cut_out(text: str, sources: list[list[int]], kept: Iterable[bool]) -> str:
    """``text`` with every source not ``kept`` cut out (:func:`source_cuts`)."""
    pieces, cursor = [], 0
    for (start, end), keep in zip(source_cuts(text, sources), kept, strict=True):
        if not keep:
            pieces.append(text[cursor:start])
            cursor = end
    return "".join(pieces) + text[cursor:]


def sum_by_source(values: list[float], offsets: list[tuple[int, int]], sample: dict) -> list[float]:
    """Each source's score: the sum of its tokens' ``values`` (:func:`source_of_token`)."""
    scores = [0.0] * len(sample["sources"])
    for value, owner in zip(values, source_of_token(offsets, sample["text"], sample["sources"]), strict=True):
        if owner is not None:
            scores[owner] += value
    return scores
