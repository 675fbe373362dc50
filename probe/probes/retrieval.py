"""Retrieval heads: which attention heads copy the needle into the answer (Wu et al. 2024; LOGO App. B).

A head *retrieves* at a decoding step when the context token it attends most is a token of the
needle's answer and is the very token being generated (copy-paste). Over greedy decoding of a
needle-in-a-haystack trial, each such hit adds 1/|answer span|; a head's retrieval score is the
mean over trials whose answer was correct. Heads above 0.1 are retrieval heads; LOGO's retrieval
score of a model is the mean of the top 10 of them.

Decoding is efficient: the prompt is prefilled once with the fused attention (no pattern kept),
then each step feeds one token through the capture core, which recomputes only that query row,
Tensor[heads, 1, kv] per layer — O(layers·heads·seq) memory, as in Wu et al.'s decode-only trick.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from probe import views
from probe.attention.capture import trace
from probe.attention.shared_state import frozen_parameters
from probe.checks import cache_keyword, check_input_ids, check_tokenizer, hf_model, n_layers
from probe.errors import InvalidTypeError, InvalidValueError
from probe.results import read_json, reading, write_json
from probe.tasks import Sample, check_sample

THRESHOLD = 0.1  # Wu et al.: a head that copies at least 10% of the needle is a retrieval head
TOP = 10  # LOGO App. B: the model's retrieval score is the mean of its top-10 retrieval heads


def needle_answer_positions(sample: Sample) -> list[torch.Tensor]:
    """Token positions of each occurrence of the gold answer inside the supporting spans (the needles).

    One LongTensor per occurrence (a passkey needle states its key twice; LOGO's multi-value
    needles each hold the shared value). Found by exact character match of ``sample.answer``
    in the recorded needle text, mapped to tokens through ``sample.offsets``: a token counts if
    it overlaps the answer's characters.
    """
    offsets = torch.from_numpy(sample.offsets)
    occurrences = []
    for start, end in sample.char_spans["supporting"]:
        for match in re.finditer(re.escape(sample.answer), sample.text[start:end], flags=re.IGNORECASE):
            first, last = start + match.start(), start + match.end()
            tokens = torch.nonzero((offsets[:, 0] < last) & (offsets[:, 1] > first)).flatten()
            occurrences.append(tokens)
    if not occurrences:
        raise InvalidValueError(
            f"the gold answer {sample.answer!r} does not occur in the supporting spans of this "
            f"{sample.task!r} sample; retrieval scores need a needle that states its answer"
        )
    return occurrences


@dataclass
class RetrievalScores:
    """Per-trial retrieval scores of every (layer, query head), and the trials behind them.

    ``scores``: Tensor[trials, layers, heads], Wu et al.'s score of each trial (all trials, also
    wrong ones). ``trials``: one row per trial (task, length, depth, seed, answer, generated,
    correct). ``argmax``: per trial, LongTensor[steps, layers, heads], the position each head
    attended most at each decoding step (empty when loaded from Wu et al.'s layout).
    ``settings``: what produced them. :meth:`save` / :meth:`load` round-trip all four;
    :meth:`to_json` is Wu et al.'s published layout.
    """

    scores: torch.Tensor
    trials: pd.DataFrame
    settings: dict[str, Any]
    argmax: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def counted(self) -> torch.Tensor:
        """bool Tensor[trials]: the trials that count (correct answer, unless the gate was off)."""
        if not self.settings.get("require_correct", True):
            return torch.ones(len(self.scores), dtype=torch.bool)
        return torch.as_tensor(self.trials["correct"].to_numpy() > 0)

    def mean(self) -> torch.Tensor:
        """Tensor[layers, heads]: mean score over the counted trials (zeros if none counted)."""
        counted = self.scores[self.counted]
        return counted.mean(dim=0) if len(counted) else torch.zeros(self.scores.shape[1:])

    def _repr_html_(self) -> str:
        counted = int(self.counted.sum())
        title = f"retrieval scores: mean over {counted} counted of {len(self.scores)} trials"
        return views.heatmap(self.mean().numpy(), title)

    def show(self):
        """The [layers, heads] heatmap of :meth:`mean` in a notebook."""
        from IPython.display import HTML

        return HTML(self._repr_html_())

    def save_html(self, path: str | Path) -> Path:
        """The heatmap as a self-contained HTML page, written atomically."""
        return views.save_html(path, self._repr_html_(), "longprobe: retrieval scores")

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head): layer, head, score = :meth:`mean` (over the counted trials),
        best first. Per-trial scores are ``scores[trial, layer, head]``."""
        mean = self.mean()
        layers, heads = torch.meshgrid(*(torch.arange(n) for n in mean.shape), indexing="ij")
        frame = pd.DataFrame({"layer": layers.flatten(), "head": heads.flatten(), "score": mean.flatten()})
        return frame.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)

    def top(self, k: int = TOP) -> pd.DataFrame:
        """The ``k`` highest-scoring heads."""
        return self.to_frame().head(k)

    def retrieval_heads(self, threshold: float = THRESHOLD) -> list[tuple[int, int]]:
        """(layer, head) pairs scoring above ``threshold``, best first."""
        frame = self.to_frame()
        return list(frame.loc[frame.score > threshold, ["layer", "head"]].itertuples(index=False, name=None))

    def logo_score(self, threshold: float = THRESHOLD, k: int = TOP) -> float:
        """LOGO's retrieval score (003, App. B): mean of the top-``k`` heads above ``threshold`` (or 0)."""
        frame = self.to_frame()
        above = frame.score[frame.score > threshold].head(k)
        return float(above.mean()) if len(above) else 0.0

    def to_json(self) -> dict[str, list[float]]:
        """Wu et al.'s file layout: ``{"layer-head": [score of each counted trial]}``."""
        counted = self.scores[self.counted]
        return {
            f"{layer}-{head}": counted[:, layer, head].tolist()
            for layer in range(self.scores.shape[1])
            for head in range(self.scores.shape[2])
        }

    @classmethod
    def concat(cls, results: list[RetrievalScores]) -> RetrievalScores:
        """The trials of ``results`` in order, as one result: scores Tensor[Σ trials, layers, heads].

        Trials are scored independently, so :func:`retrieval_scores` on samples split into parts
        and concatenated equals one call on all of them (how a sweep spreads the trials over
        processes). The results must share their settings and [layers, heads] shape.
        """
        if not results:
            raise InvalidValueError("concat needs at least one RetrievalScores")
        first = results[0]
        for other in results[1:]:
            if other.settings != first.settings or other.scores.shape[1:] != first.scores.shape[1:]:
                raise InvalidValueError(
                    f"cannot concatenate results with settings {first.settings} and {other.settings}, "
                    f"[layers, heads] {list(first.scores.shape[1:])} and {list(other.scores.shape[1:])}"
                )
        return cls(
            torch.cat([r.scores for r in results]),
            pd.concat([r.trials for r in results], ignore_index=True),
            dict(first.settings),
            [argmax for r in results for argmax in r.argmax],
        )

    def save(self, path: str | Path) -> None:
        """Write scores, trials, settings and argmax as JSON, atomically; :meth:`load` reads them back.

        For a file comparable with the published ``head_score/*.json``, write :meth:`to_json`.
        """
        record = {
            "scores": self.scores.tolist(),
            "trials": self.trials.to_dict(orient="tight"),
            "settings": self.settings,
            "argmax": [argmax.tolist() for argmax in self.argmax],
        }
        write_json(path, record)

    @classmethod
    def load(cls, path: str | Path) -> RetrievalScores:
        """Read a file :meth:`save` wrote, or one in Wu et al.'s layout (:meth:`to_json`, ours or a
        published one: no trials, no argmax, every listed trial counts)."""
        record = read_json(path, "RetrievalScores")
        with reading(path, "RetrievalScores"):
            if "scores" in record:
                return cls(
                    torch.tensor(record["scores"]),
                    pd.DataFrame.from_dict(dict(record["trials"]), orient="tight"),
                    record["settings"],
                    [torch.tensor(argmax, dtype=torch.long) for argmax in record["argmax"]],
                )
            if not record or not all(re.fullmatch(r"\d+-\d+", key) for key in record):
                raise InvalidValueError(
                    f"{path} is not a RetrievalScores file: expected 'scores', 'trials' and 'settings' "
                    "(RetrievalScores.save()) or Wu et al.'s layout, 'layer-head' keys such as '12-3', "
                    f"got keys {sorted(record)[:8]}"
                )
            keys = [tuple(map(int, key.split("-"))) for key in record]
            layers, heads = max(k[0] for k in keys) + 1, max(k[1] for k in keys) + 1
            trials = {len(values) for values in record.values()}
            if len(trials) != 1:
                raise InvalidValueError(f"{path}: heads list different numbers of trials {sorted(trials)}")
            scores = torch.zeros(trials.pop(), layers, heads)
            for (layer, head), values in zip(keys, record.values(), strict=True):
                scores[:, layer, head] = torch.tensor(values)
            settings = {"source": str(path), "require_correct": False}
            return cls(scores, pd.DataFrame(index=range(len(scores))), settings)


@torch.no_grad()
def decode_with_argmax(
    model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding that records where every head looks.

    Returns (generated LongTensor[steps], argmax LongTensor[steps, layers, heads]): at step s the
    query is the position whose logits produce token s (the last prompt token for s = 0), and
    ``argmax[s, l, h]`` is the absolute position it attends most in layer l, head h. The prompt
    minus its last token is prefilled once with the fused attention; each step then runs one
    token through :func:`probe.attention.capture.trace` capturing that single row. Under a sliding-window
    cache a layer sees only the last keys; positions are mapped back to the whole sequence.
    """
    inner = hf_model(model)
    ids = check_input_ids(model, prompt_ids)
    if ids.shape[1] < 2:
        raise InvalidValueError("the prompt needs at least 2 tokens (one to prefill, one to decode from)")
    with frozen_parameters(inner):
        keyword = cache_keyword(inner)
        cache = inner(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1)[keyword]
        token, length = ids[:, -1:], ids.shape[1]
        generated, argmax = [], []
        for _ in range(max_new_tokens):
            with trace(model, rows=[0]) as captured:
                out = inner(input_ids=token, use_cache=True, **{keyword: cache})
            cache, token = out[keyword], out.logits[:, -1].argmax(-1, keepdim=True)
            patterns = [captured["pattern", layer][0, :, 0] for layer in range(n_layers(inner))]  # [H, kv]
            argmax.append(torch.stack([length - p.shape[-1] + p.argmax(-1) for p in patterns]))
            generated.append(int(token))
            length += 1
            if eos_token_id is not None and int(token) == eos_token_id:
                break
    return torch.tensor(generated), torch.stack(argmax).cpu()  # bookkeeping on the CPU


def copy_hits(
    sequence: torch.Tensor, generated: torch.Tensor, argmax: torch.Tensor, needles: list[torch.Tensor]
) -> torch.Tensor:
    """Wu et al.'s score of one trial: Tensor[layers, heads].

    ``sequence``: prompt + generated tokens; ``argmax`` [steps, layers, heads]; ``needles``: the
    answer occurrences. A hit at step s: the attended position lies in a needle answer span and
    holds the token generated at s; each hit adds 1/|span| (the first occurrence's length).
    """
    in_needle = torch.isin(argmax, torch.cat(needles))
    copied = sequence[argmax] == generated[: len(argmax), None, None]
    return (in_needle & copied).sum(dim=0) / len(needles[0])


def retrieval_scores(
    model,
    tokenizer,
    samples: list[Sample],
    max_new_tokens: int | None = None,
    require_correct: bool = True,
    progress: bool = False,
) -> RetrievalScores:
    """Retrieval score of every (layer, query head) over needle ``samples`` (Wu et al. 2024, eq. 5 of LOGO).

    Each sample is decoded greedily from ``sample.prompt_ids`` for ``max_new_tokens`` steps
    (default: the gold answer's token count + 4) or until EOS, and graded with ``sample.score``.
    With ``require_correct`` (Wu et al.'s gate) only correctly answered trials count in
    :meth:`RetrievalScores.mean` and the JSON; per-trial scores of all trials are kept.
    """
    check_tokenizer(tokenizer)
    if not isinstance(samples, (list, tuple)) or not samples:
        raise InvalidTypeError(f"samples must be a non-empty list of probe.Sample, got {samples!r:.60}")
    for sample in samples:
        check_sample(sample)
    if not samples:
        raise InvalidValueError("retrieval_scores needs at least one needle sample")
    scores, argmaxes, rows = [], [], []
    for sample in tqdm(samples, desc="retrieval trials", disable=not progress):
        needles = needle_answer_positions(sample)
        steps = len(sample.target_positions) + 4 if max_new_tokens is None else max_new_tokens
        generated, argmax = decode_with_argmax(model, sample.prompt_ids, steps, tokenizer.eos_token_id)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        scores.append(copy_hits(torch.cat([sample.prompt_ids, generated]), generated, argmax, needles))
        argmaxes.append(argmax)
        rows.append(
            dict(
                task=sample.task,
                length=sample.length,
                depth=sample.depth,
                seed=sample.seed,
                prompt_tokens=sample.prompt_length,
                answer=sample.answer,
                generated=text.strip(),
                correct=sample.score(text),
            )
        )
    settings = {"max_new_tokens": max_new_tokens, "require_correct": require_correct, "threshold": THRESHOLD}
    return RetrievalScores(torch.stack(scores), pd.DataFrame(rows), settings, argmaxes)
