"""The sample format shared by all text tasks, and the rendering that records exact token spans.

A task describes its prompt as a :class:`Prompt` (instruction, question, answer) plus the context
body as a list of :class:`Unit` s (noise sentences, facts, needles, emoji ...). :func:`render`
joins them into one string, records the character range of every unit that has a category while
it concatenates, applies the chat template when the tokenizer has one (the offsets shift by the
template's own prefix, found by rendering the template around a sentinel), tokenizes once with
``return_offsets_mapping=True`` and maps each character range to tokens by the span rule of
:mod:`probe.tasks.spans` (a token belongs to the span in which it starts; no text is refused).

The gold answer is always appended after the prompt (teacher forcing): ``input_ids`` is prompt +
answer and ``spans["answer"]`` points at the answer tokens; ``prompt_ids`` / ``prompt_text`` are the
prompt alone, for generation.

A :class:`Sample` knows itself: its token ``offsets`` (kept from that one tokenization), the
``target_positions`` of its answer, one category per token (``categories``) and its ablation units
(``sources``). Detectors, metrics, retrieval and denoising read them here; nothing re-tokenizes,
except :meth:`Sample.without`, the text-level ablation, which drops sources from the text and
tokenizes the result once, with the same exact span mapping.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe import views
from probe.checks import check_tokenizer, tokenizer_fingerprint
from probe.errors import InvalidTypeError, InvalidValueError
from probe.tasks import rewrite
from probe.tasks.answers import answer_match
from probe.tasks.spans import chat_wrapper, source_ranges, tokenize_with_spans, uses_chat

CATEGORIES = ("supporting", "interference", "noise", "low_frequency", "context", "question", "answer")
#: The categories of the context body: each of their spans is one :class:`Source`. ``context``: a
#: unit of a researcher's own text (:meth:`Sample.from_text`).
CONTEXT_CATEGORIES = ("supporting", "interference", "noise", "low_frequency", "context")


@dataclass(frozen=True)
class Unit:
    """One piece of the context body: its text and span category (``None``: untracked text)."""

    text: str
    category: str | None = None


@dataclass(frozen=True)
class Prompt:
    """The fixed parts of a task's prompt.

    The user message is ``instruction \\n\\n context_open + body + context_close + question_open +
    question`` (no instruction: no blank line either). The reply starts with ``answer_prefix``
    (prefilled in the assistant turn for chat models, after ``answer_open`` for completion models),
    then ``answer_separator + answer``. A plain continuation of a text (:mod:`probe.tasks.key_token`)
    leaves instruction, the openings and the answer prefix empty. ``answer_pattern`` is a
    regex matching every candidate answer of the task; ``Sample.score`` takes its first match
    (``scoring="pattern"``) or compares the whole answer after SQuAD's normalization
    (``"exact_match"``: real questions, :func:`probe.tasks.answers.answer_match`).
    """

    instruction: str
    question: str
    answer: str
    answer_prefix: str
    answer_pattern: str
    context_open: str = ""
    context_close: str = ""
    separator: str = " "  # between body units
    answer_separator: str = " "
    question_open: str = "\n\nQuestion: "
    answer_open: str = "\nAnswer: "  # completion prompts only: a chat template has its own
    scoring: str = "pattern"  # how Sample.score checks an answer: "pattern" or "exact_match"


@dataclass(frozen=True)
class Source:
    """One ablation unit of a sample: the ``index``-th span of ``category`` (a fact, needle, line,
    emoji, essay sentence), tokens ``start:end`` of ``input_ids`` (end exclusive)."""

    category: str
    index: int
    start: int
    end: int


@dataclass
class Sample:
    """One task instance for one tokenizer.

    ``input_ids``: LongTensor [seq] = prompt tokens + gold answer tokens (teacher forcing).
    ``spans``: category -> list of (start, end) token indices into ``input_ids`` (end exclusive), one
    entry per fact / needle / line / emoji / noise sentence, in text order. ``char_spans``: the same
    ranges in characters of ``text``. ``offsets``: int64 array [seq, 2], the character range
    (start, end) of each token in ``text``, as the tokenizer's offset mapping gave it when the sample
    was rendered ((0, 0) for an added special token such as ``<bos>``). ``prompt_length``: number
    of prompt tokens (the answer starts there). ``length``, ``seed``, ``depth`` and ``options`` are
    the settings that built it. ``removed``: the sources of the full sample that :meth:`without`
    dropped from this one's text, as ``(category, index)`` in the full sample's numbering, sorted;
    empty for a sample as rendered. ``tokenizer``: the fingerprint of the tokenizer that made it
    (:func:`probe.checks.tokenizer_fingerprint`; ``None`` for a sample built by hand), which probes
    check against the model and tokenizer they are given. ``cuts``: character positions where the text
    was tokenized in separate pieces so that every span owns a token (:func:`_tokenize`); empty when
    ``input_ids`` is the tokenization of ``text`` in one piece. ``scoring``: how :meth:`score` checks a
    generated answer (the task's ``answer_pattern``, or ``"exact_match"`` for real questions).
    """

    task: str
    length: int
    seed: int
    depth: Any
    options: dict[str, Any]
    text: str
    input_ids: torch.Tensor
    answer: str
    answer_pattern: str
    prompt_length: int
    spans: dict[str, list[tuple[int, int]]]
    char_spans: dict[str, list[tuple[int, int]]] = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    removed: tuple[tuple[str, int], ...] = ()
    tokenizer: dict[str, Any] | None = field(default=None, repr=False)
    cuts: tuple[int, ...] = ()
    scoring: str = "pattern"

    @property
    def target_positions(self) -> torch.Tensor:
        """LongTensor [answer_len]: positions of the teacher-forced answer tokens (row t − 1 predicts t)."""
        (start, end), *_ = self.spans["answer"]
        return torch.arange(start, end)

    @property
    def categories(self) -> np.ndarray:
        """One category per token, object array [seq]; ``"other"`` where no span covers it (template,
        instruction, separators)."""
        labels = np.full(len(self.input_ids), "other", dtype=object)
        for category, spans in self.spans.items():
            for start, end in spans:
                labels[start:end] = category
        return labels

    @property
    def sources(self) -> list[Source]:
        """The ablation units, in text order: one :class:`Source` per span of each category of
        :data:`CONTEXT_CATEGORIES`; never the question, the answer or uncategorised text."""
        units = [
            Source(category, index, start, end)
            for category in CONTEXT_CATEGORIES
            for index, (start, end) in enumerate(self.spans.get(category, []))
        ]
        return sorted(units, key=lambda source: source.start)

    @property
    def prompt_ids(self) -> torch.Tensor:
        """LongTensor [prompt_length]: the prompt alone, ending right before the answer (for generation)."""
        return self.input_ids[: self.prompt_length]

    @property
    def prompt_text(self) -> str:
        """The prompt alone as text (special tokens written out as in the template)."""
        return self.text[: self.char_spans["answer"][0][0]]

    def show(self):
        """The token view (:func:`probe.views.token_view`) in a notebook: spans outlined by category."""
        from IPython.display import HTML

        return HTML(self._repr_html_())

    def _repr_html_(self) -> str:
        return views.token_view(self, None, f"{self.task} sample")

    def save_html(self, path: str | Path) -> Path:
        """The token view as a self-contained HTML page, written atomically."""
        return views.save_html(path, self._repr_html_(), f"longprobe: {self.task} sample")

    def span_text(self, category: str) -> list[str]:
        """The recorded text of each span of ``category`` (what each token span stands for)."""
        return [self.text[start:end] for start, end in self.char_spans[category]]

    def without(self, sources: Sequence[Source], tokenizer: PreTrainedTokenizerBase) -> Sample:
        """The same sample with the text of ``sources`` removed, tokenized once more (text-level ablation).

        Each removed source takes with it the separator that joined it to the next source (to the
        previous one for the last of the body), so the remaining sources are joined exactly as
        :func:`render` joins a body without them: no doubled separators, and the context's opening
        and closing text stay. ``tokenizer`` must be the one that rendered the sample; the text is
        tokenized once, the chat template (if any) is already part of it, and every remaining span,
        ``offsets``, ``input_ids`` and ``prompt_length`` are recomputed by the span rule of
        :func:`render`. The removed sources' categories lose those entries (indices of later entries
        shift down); ``removed`` records what went, in the full sample's numbering, so ``without``
        composes. ``length``, ``seed``, ``depth`` and ``options`` stay the settings that built the full
        sample.

        ``sources``: any of :attr:`sources`, in any order (repeats count once); an empty selection
        returns a sample equal to this one. Raises ``ValueError`` for the question or the answer
        (never removed), for a source that is not one of this sample's, for a body whose sources are
        not all joined by one separator (untracked text between them), and when the re-tokenized
        question or answer tokens differ from this sample's (a different tokenizer).
        """
        return rewrite.without(self, sources, tokenizer)

    @classmethod
    def from_text(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        context: str,
        query: str,
        response: str | None = None,
        sources: str | Sequence[str] | Sequence[tuple[int, int]] = "sentences",
        chat: bool | None = None,
    ) -> Sample:
        """A researcher's own document and question as a sample, with exact token spans.

        ``context`` becomes the prompt's context, verbatim, cut into sources: ``"sentences"`` (after
        ., !, ? or … and the closing quotes or brackets that follow, before whitespace; no download,
        no model), ``"paragraphs"`` (at blank lines), a list of strings (each found in ``context``,
        in order, after the previous one) or a list of ``(start, end)`` character ranges of
        ``context``. Each source is one ``"context"`` span; the text between sources (whitespace)
        is kept but belongs to none. ``query`` is the question; ``response`` the answer whose tokens
        are explained, teacher-forced (``None``: a prompt-only sample whose answer is empty, for
        generating one, as :func:`probe.attribute` does). ``chat``: use the tokenizer's chat
        template (default: when it has one). One tokenization, the same exact span mapping as the
        tasks: every detector, metric, view and faithfulness measure works on the result.
        """
        check_tokenizer(tokenizer)
        for name, value in (("context", context), ("query", query)):
            if not isinstance(value, str) or not value.strip():
                raise InvalidValueError(f"{name} must be non-empty text, got {value!r}")
        if response is not None and (not isinstance(response, str) or not response.strip()):
            raise InvalidValueError(
                f"response must be non-empty text or None (generate one), got {response!r}"
            )
        ranges = source_ranges(context, sources)
        body, position = [], 0
        for start, end in ranges:
            body += [Unit(context[position:start]), Unit(context[start:end], "context")]
            position = end
        body.append(Unit(context[position:]))
        body = [unit for unit in body if unit.text]
        with_chat = uses_chat(tokenizer, chat)
        answer = "" if response is None else response.strip()
        prompt = Prompt(
            instruction="Answer the question using the context.",
            question=query.strip(),
            answer=answer,
            answer_prefix="",
            answer_pattern=re.escape(answer) if answer else r"\S+",
            context_open="Context:\n",
            separator="",
            answer_separator="" if with_chat else " ",
        )
        mode = sources if isinstance(sources, str) else "given"
        settings = {"task": "text", "length": len(context), "seed": 0, "depth": None,
                    "options": {"sources": mode, "chat": with_chat}}  # fmt: skip
        return render(tokenizer, prompt, body, settings, chat=with_chat)

    def score(self, generated_text: str) -> float:
        """1.0 if the first candidate answer in ``generated_text`` is the gold answer, else 0.0.

        Candidates are the matches of the task's ``answer_pattern`` (any number, any UUID, any place
        of the story vocabulary ...), case-insensitive, so hedging with several candidates counts
        as the first one named.
        """
        if self.scoring == "exact_match":
            return answer_match(generated_text, self.answer)["exact_match"]
        found = re.search(self.answer_pattern, generated_text, flags=re.IGNORECASE)
        return float(found is not None and found.group(0).lower() == self.answer.lower())

    def answer_match(self, generated_text: str) -> dict[str, float]:
        """Exact match and token F1 of ``generated_text`` against the gold answer, after SQuAD's
        normalization (:func:`probe.tasks.answers.answer_match`), for any task."""
        return answer_match(generated_text, self.answer)

    def with_answer(self, answer: str, tokenizer: PreTrainedTokenizerBase) -> Sample:
        """The same prompt with ``answer`` teacher-forced in place of the gold answer (e.g. the model's own
        greedy answer, to explain what the model said); ``answer`` becomes the sample's ``answer``, the
        answer pattern and scoring stay the task's. The text is tokenized once more with the same span
        rule; ``tokenizer`` must be the one that rendered the sample, and the prompt's tokens must come
        out the same (they do unless the answer merges with the prompt's last characters)."""
        return rewrite.with_answer(self, answer, tokenizer)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists, not tensors or arrays) for JSON / pandas; :meth:`from_dict` reads it."""
        record = asdict(self) | {
            "input_ids": self.input_ids.tolist(),
            "offsets": self.offsets.tolist(),
            "removed": [list(entry) for entry in self.removed],
        }
        for key in ("spans", "char_spans"):
            record[key] = {cat: [list(s) for s in spans] for cat, spans in record[key].items()}
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Sample:
        """The sample :meth:`to_dict` wrote (also after a JSON round trip)."""
        depth = record["depth"]
        fields = record | {
            "depth": tuple(depth) if isinstance(depth, list) else depth,
            "input_ids": torch.tensor(record["input_ids"], dtype=torch.long),
            "offsets": np.asarray(record["offsets"], dtype=np.int64).reshape(-1, 2),
            "removed": tuple(tuple(entry) for entry in record.get("removed", ())),
            "cuts": tuple(record.get("cuts", ())),
        }
        for key in ("spans", "char_spans"):
            fields[key] = {cat: [tuple(s) for s in spans] for cat, spans in record[key].items()}
        return cls(**fields)


def check_sample(sample) -> None:
    """``sample``: a :class:`Sample` (``probe.tasks.make``, ``probe.Sample.from_text``)."""
    if not isinstance(sample, Sample):
        raise InvalidTypeError(
            f"sample must be a probe.Sample, got {type(sample).__name__}: build one with "
            "probe.tasks.make(...) or probe.Sample.from_text(tokenizer, context, query, response)"
        )


class _TextBuilder:
    """Concatenates strings and records the character range of each categorized piece."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.position = 0
        self.char_spans: dict[str, list[tuple[int, int]]] = {cat: [] for cat in CATEGORIES}

    def add(self, text: str, category: str | None = None) -> None:
        if category is not None:
            self.char_spans[category].append((self.position, self.position + len(text)))
        self.parts.append(text)
        self.position += len(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def render(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    body: list[Unit],
    settings: dict[str, Any],
    chat: bool | None = None,
) -> Sample:
    """Build the sample text from ``prompt`` and ``body``, tokenize it and map every span to tokens.

    ``settings`` holds ``task, length, seed, depth, options`` and is stored on the sample.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise InvalidTypeError(
            f"{type(tokenizer).__name__} is a slow tokenizer without offset mapping; exact spans need a "
            "fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    with_chat = uses_chat(tokenizer, chat)
    prefix, suffix = chat_wrapper(tokenizer) if with_chat else ("", prompt.answer_open)
    built = _TextBuilder()
    built.add(prefix + (prompt.instruction + "\n\n" if prompt.instruction else "") + prompt.context_open)
    for i, unit in enumerate(body):
        built.add(prompt.separator if i else "")
        built.add(unit.text, unit.category)
    built.add(prompt.context_close + prompt.question_open)
    built.add(prompt.question, "question")
    if prompt.answer:
        built.add(suffix + prompt.answer_prefix)
        built.add(prompt.answer_separator + prompt.answer, "answer")
    else:  # a prompt for generation ends before the space a completion's first token carries
        built.add((suffix + prompt.answer_prefix).rstrip(" "))
    text = built.text

    input_ids, offsets, spans, cuts = tokenize_with_spans(tokenizer, text, built.char_spans, not with_chat)
    if not prompt.answer:  # a prompt without its answer yet: the answer starts after the last token
        n = len(input_ids)
        spans["answer"], built.char_spans["answer"] = [(n, n)], [(len(text), len(text))]
    return Sample(
        **settings,
        text=text,
        input_ids=input_ids,
        answer=prompt.answer,
        answer_pattern=prompt.answer_pattern,
        prompt_length=spans["answer"][0][0],
        spans=spans,
        char_spans=built.char_spans,
        offsets=offsets,
        tokenizer=tokenizer_fingerprint(tokenizer),
        cuts=cuts,
        scoring=prompt.scoring,
    )
