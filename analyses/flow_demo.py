"""Where attention goes vs where information flows, layer by layer, on pass-key retrieval.

For each sample the model first answers greedily (scored against the gold key); then, with the
gold answer teacher-forced, we read from the rows that predict the answer tokens

- attention: A summed over heads, averaged over those rows (``probe.attention_rows``);
- information flow: Σ_rows |Σ_h A ⊙ ∂L/∂A| (``probe.information_flow``, CDT eq. 1),

and report per layer the share of each measure that lands on each token category (needle =
``supporting``, essay ``noise``, ``question``, the rest of the prompt as ``other``), split by
whether the model answered correctly — the layout of CDT Fig. 3.

    python -m analyses.flow_demo                   # SmolLM2-135M, 6 pass-key samples near 1K tokens
    python -m analyses.flow_demo --model gemma3-270m --length 2048
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

import probe
from analyses.output import save_figure
from probe import tasks

CATEGORY_ORDER = ("supporting", "question", "noise", "other")


def token_categories(sample: tasks.Sample) -> np.ndarray:
    """One category name per token of ``sample`` (``other`` where no span covers it)."""
    labels = np.full(len(sample.input_ids), "other", dtype=object)
    for category, spans in sample.spans.items():
        for start, end in spans:
            labels[start:end] = category
    return labels


def category_shares(scores: torch.Tensor, labels: np.ndarray, context: int) -> pd.DataFrame:
    """Share of each row of ``scores`` [layers, seq] on each category of the first ``context`` tokens."""
    frame = pd.DataFrame(scores[:, :context].T.numpy())
    frame["category"] = labels[:context]
    totals = frame.groupby("category").sum()
    shares = (totals / totals.sum()).reindex(CATEGORY_ORDER, fill_value=0.0)
    return shares.rename_axis("category").reset_index().melt("category", var_name="layer", value_name="share")


def analyse_sample(model, tokenizer, sample: tasks.Sample, max_new_tokens: int) -> pd.DataFrame:
    """Per-layer category shares of attention and information flow for one sample."""
    with torch.no_grad():
        generated = model.generate(
            sample.prompt_ids[None],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    answer = tokenizer.decode(generated[0, sample.prompt_length :], skip_special_tokens=True)
    (start, end), *_ = sample.spans["answer"]
    targets = torch.arange(start, end)
    attention = probe.attention_rows(model, sample.input_ids, targets - 1).sum(dim=1).mean(dim=1)
    flow = probe.information_flow(model, sample.input_ids, targets)
    labels = token_categories(sample)
    frames = [
        category_shares(scores, labels, sample.prompt_length).assign(measure=measure)
        for measure, scores in (("attention", attention), ("information flow", flow))
    ]
    return pd.concat(frames).assign(generated=answer.strip(), correct=bool(sample.score(answer)))


def plot(table: pd.DataFrame):
    grid = sns.relplot(
        data=table.assign(answer=table.correct.map({True: "correct", False: "wrong"})),
        x="layer",
        y="share",
        hue="category",
        hue_order=list(CATEGORY_ORDER),
        style="answer",
        col="measure",
        kind="line",
        errorbar=None,
        height=3.6,
        aspect=1.3,
    )
    grid.set_axis_labels("layer", "share of the measure on the category")
    grid.set_titles("{col_name}")
    grid.figure.suptitle("Attention vs information flow from the answer rows (pass-key retrieval)", y=1.03)
    return grid.figure


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local HF folder")
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model, tokenizer = probe.load_model(args.model)
    depths = np.linspace(0.1, 0.6, args.samples)  # needles well before the question
    frames = []
    for index, depth in enumerate(tqdm(depths, desc="samples")):
        sample = tasks.make("passkey", tokenizer, args.length, seed=args.seed + index, depth=float(depth))
        frames.append(analyse_sample(model, tokenizer, sample, args.max_new_tokens).assign(sample=index))
    table = pd.concat(frames, ignore_index=True).assign(model=args.model, length=args.length)
    save_figure(plot(table), table, args.out, "flow_demo")
    summary = table[table.category == "supporting"].groupby(["measure", "correct"]).share.mean()
    print(
        f"accuracy {table.drop_duplicates('sample').correct.mean():.2f}; mean share on the needle:\n{summary}"
    )
    return table


if __name__ == "__main__":
    main()
