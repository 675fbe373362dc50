"""Is ContextCite's gap on Gemma 3 its ablation? Every peer's scores judged against cut-out passes too.

`context-cite` 0.0.4 removes a source by cutting its text out of the prompt and tokenizing again (every
later token moves to an earlier position; analyses/peers/context_cite/NOTES.md); longprobe removes the
source's keys and keeps every position, and judges every method by that removal. Not its target
(`analyses/context_cite_target.py`). This runs each held-out sample's 32 LDS masks again as ContextCite
ablates (`peer_io.cut_out`, its runner's own cut, on the exported text; the answer teacher-forced) and
scores every method of the peers' run by LDS against both: the study's key-masked passes (read from its
saved passes) and these cut-out ones. If the package's gap from our `context_cite` is the ablation, it
closes or turns under cut-out judging.

    python -m analyses.context_cite_ablation figures/studies/detector_gemma3-270m-1024_faffad12 \\
        --peers bench/results/peers/gemma3-270m-1024 --csv bench/results/context_cite_ablation.csv

One forward pass a mask (32 a sample), one thread; tunes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import probe
from bench.harness import intervals, report_with_summary, saved_passes_parser, study_masks
from probe import faithfulness
from probe.target import target_of

from .peers import peer_io
from .peers.exchange import key_fields
from .study_files import saved_passes

PAIRS = [("peer:context_cite", "context_cite"), ("peer:context_cite", "leave_one_out"),
         ("context_cite", "key_removal_banzhaf"), ("leave_one_out", "key_removal_banzhaf")]  # fmt: skip


def method_scores(peers: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Method → sample key → Tensor[sources], from the peers' run's ``scores/*.jsonl``: ours by their
    names, each peer as ``peer:FILE`` (``peer:context_cite`` is `context-cite` 0.0.4)."""
    found = {}
    for path in sorted((peers / "scores").glob("*.jsonl")):
        name = (
            path.stem.removeprefix("longprobe_")
            if path.stem.startswith("longprobe_")
            else f"peer:{path.stem}"
        )
        lines = map(json.loads, path.read_text().splitlines())
        found[name] = {line["key"]: torch.tensor(line["scores"]) for line in lines if line.get("scores")}
    return found


def cut_out_logprobs(model, tokenizer, sample: dict, kept: torch.Tensor) -> torch.Tensor:
    """Tensor[masks]: the answer's log-probability with each mask's removed sources cut out of the prompt
    and the rest tokenized again (``kept`` BoolTensor[masks, sources])."""
    sample = peer_io.written_out(tokenizer, sample)  # Gemma 3's <bos> written out, as ContextCite reads it
    answer, n_answer = (
        sample["text"][len(sample["prompt"]) :],
        len(sample["input_ids"]) - sample["prompt_tokens"],
    )
    values = []
    for mask in kept.tolist():
        ids = tokenizer(peer_io.cut_out(sample["prompt"], sample["sources"], mask) + answer,
                        add_special_tokens=False)["input_ids"]  # fmt: skip
        if ids[-n_answer:] != sample["input_ids"][-n_answer:]:
            raise ValueError(f"{sample['key']}: cutting changed the answer's tokens")
        positions = torch.arange(len(ids) - n_answer, len(ids))
        with torch.no_grad():
            values.append(float(target_of(model, torch.tensor([ids]), positions)))
    return torch.tensor(values)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = saved_passes_parser(__doc__)
    parser.add_argument("--peers", type=Path, required=True, help="the peers' run on the study's samples")
    parser.add_argument("--model", default="gemma3-270m")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = probe.load_model(args.model)
    methods = method_scores(args.peers)
    saved = pd.concat(
        [saved_passes(study, args.model, dtype="") for study in args.studies], ignore_index=True
    )
    rows = []
    exported = list(peer_io.samples(args.peers / "samples.jsonl"))
    for sample in tqdm(exported, desc="samples"):
        task, _, seed = key_fields(sample["key"])
        passes = saved[(saved.task == task) & (saved.seed == seed)]
        known = faithfulness.Ablations.from_frame(passes)
        kept, _ = study_masks(len(sample["sources"]), args.masks, args.ceiling_masks, args.mask_seed)
        whole = torch.ones(1, len(sample["sources"]), dtype=torch.bool)  # nothing cut: the study's full pass
        gap = float(cut_out_logprobs(model, tokenizer, sample, whole)[0] - known.logprob_of(whole)[0])
        if abs(gap) > 1e-3:
            raise AssertionError(f"{sample['key']}: the uncut text's log P is {gap:+.2e} from the study's")
        judged = {
            "key-masked": known.logprob_of(kept),
            "cut out": cut_out_logprobs(model, tokenizer, sample, kept),
        }
        for name, by_sample in methods.items():
            if sample["key"] in by_sample:
                scores = by_sample[sample["key"]]
                for removal, actual in judged.items():
                    rows.append({"task": task, "seed": int(seed), "method": name, "removal": removal,
                                 "lds": faithfulness.lds(scores, kept, actual)})  # fmt: skip
    table = pd.DataFrame(rows)
    lds = table.pivot_table(index=["task", "seed", "removal"], columns="method", values="lds").reset_index()
    run = [(a, b) for a, b in PAIRS if a in lds and b in lds]  # a run without a method: none of its pairs
    pairs = lds.assign(**{f"{a} − {b}": lds[a] - lds[b] for a, b in run})
    summary = pd.concat(
        [intervals(table, ["removal", "method"], ["lds"]),
         intervals(pairs, ["removal"], [f"{a} − {b}" for a, b in run])]
    )  # fmt: skip
    return report_with_summary(table, summary, args.csv)


if __name__ == "__main__":
    main()
