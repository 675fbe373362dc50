"""Does the training objective teach a model to use the right context? CE vs LongCE vs CDT.

Each objective fine-tunes its own fresh copy of the model (same torch seed, same training
samples in the same order, AdamW with the same settings, gradient-norm clipping) on synthetic
1-hop stories (``multihop-1``: one supporting fact hidden among an interference fact, essay text
and emoji). Every loss is on the teacher-forced answer tokens only, averaged over the ``--batch``
samples of a step:

- ``ce``: mean cross-entropy of the answer tokens (:func:`probe.target_loss`);
- ``longce``: LongCE (seed 000, eqs. 6–7) on the answer tokens,
  :func:`probe.objectives.longce_target_loss`: each answer token weighted by min(exp(LSD), γ) of
  the model's own long-short difference. The short context is the last K tokens, K = length / 4
  by default. With K at least the sample's length no answer token has a short context, every
  weight is 1 and LongCE *is* CE; with K = length / 4 the short context holds the question and
  the chat template but rarely the supporting fact, so LSD measures how much the answer needs the
  long context. Adam (and clipping) normalize the overall scale of the gradient, so the weights act
  only *relative to the other samples of the same step*: with one-token answers and one sample per
  step, LongCE would again train exactly like CE — hence ``--batch`` > 1;
- ``cdt``: CDT (seed 002, eqs. 1–3), :func:`probe.objectives.cdt_loss`, online each step: the
  context tokens whose embedding-gradient norm is below the context mean are moved by −lr·β·∇E
  (β = 5; lr = the training learning rate, as the paper prints it, unless ``--cdt-lr``), then
  CE on the denoised embeddings. ``objectives_training.csv`` records how far that moves the
  embeddings (``relative_shift`` = ‖E' − E‖ / ‖E‖ over the moved tokens) and the share of context
  tokens flagged critical. At fine-tuning learning rates the move is negligible (SmolLM2, lr 2e-5:
  ~1e-5 of the embedding norm) and CDT trains like CE; ``--cdt-lr`` tries larger steps.

Before (the base model) and after each fine-tuning, on held-out samples (other seeds): greedy
accuracy, the answer's teacher-forced NLL, and the attention mass from the rows predicting the
answer onto the supporting-fact tokens (and, as a control, onto the interference-fact tokens):
summed over those tokens, mean over heads, rows and all layers (one forward pass with the NLL,
:func:`probe.denoise.answer_attention`).

Writes ``objectives.png`` + ``objectives.csv`` (one row per held-out sample and model, with the
settings and the wall time) and ``objectives_training.csv`` (every training sample's loss).

    python -m analyses.objectives --quick     # 256 tokens, 12 steps × 2 samples, 8 held-out samples
                                              # (19 min here, sharing 2 cores with 3 other jobs)
    python -m analyses.objectives             # 512 tokens, 32 steps × 4 samples, 24 held-out samples
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

import probe
from analyses.output import atomic_write, save_figure
from probe import tasks
from probe.capture import check_layers
from probe.denoise import answer_attention, category_mass
from probe.generation import answer
from probe.objectives import cdt_loss, longce_target_loss

NAME = "objectives"
TASK = "multihop-1"
OBJECTIVES = {"ce": "CE", "longce": "LongCE", "cdt": "CDT"}
EVAL_SEED_OFFSET = 10_000  # held-out samples use seeds 10000 + i; training samples seeds 0 … n − 1
METRICS = {
    "correct": "greedy accuracy",
    "attention_supporting": "attention mass on supporting facts",
    "answer_nll": "answer NLL (nats / token)",
}


def objective_loss(name: str, model, sample: tasks.Sample, args: argparse.Namespace):
    """(loss with gradients, diagnostics dict) of objective ``name`` on one training sample."""
    ids, targets = sample.input_ids[None], sample.target_positions
    if name == "ce":
        return probe.target_loss(model, ids, targets), {}
    if name == "longce":
        return longce_target_loss(model, ids, targets, K=args.longce_k, gamma=args.gamma), {}
    result = cdt_loss(model, ids, targets, lr=args.cdt_lr, beta=args.beta, context=sample.prompt_length)
    embeds = model.get_input_embeddings()(ids)[0].detach()
    moved = result.shift.norm(dim=-1) > 0
    return result.loss, {
        "critical_share": result.critical[: sample.prompt_length].float().mean().item(),
        "relative_shift": (result.shift[moved].norm() / embeds[moved].norm()).item() if moved.any() else 0.0,
    }


def finetune(base, name: str, samples: list[tasks.Sample], args: argparse.Namespace):
    """A fine-tuned copy of ``base`` (eval mode) and the training log rows."""
    torch.manual_seed(args.seed)
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log = []
    for step in tqdm(range(args.steps), desc=f"{NAME}: {name}", leave=False):
        optimizer.zero_grad()
        for i in range(args.batch):
            sample = samples[(step * args.batch + i) % len(samples)]
            loss, diagnostics = objective_loss(name, model, sample, args)
            (loss / args.batch).backward()
            log.append(
                {"objective": name, "step": step, "seed": sample.seed, "loss": loss.item(), **diagnostics}
            )
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
    return model.eval(), log


def evaluate(model, tokenizer, samples: list[tasks.Sample]) -> list[dict]:
    """Per held-out sample: greedy correctness, answer NLL, attention mass on supporting / interference."""
    rows = []
    for sample in samples:
        generated = answer(model, tokenizer, sample)
        layers = check_layers(model, None)
        pattern, nll = answer_attention(model, sample.input_ids, sample.target_positions, layers)
        mass = category_mass(pattern, sample.categories).mean()  # per category, mean over layers
        rows.append(
            {
                "seed": sample.seed,
                "generated": generated.strip(),
                "correct": sample.score(generated),
                "answer_nll": nll,
                **{f"attention_{c}": mass[c] for c in ("supporting", "interference")},
            }
        )
    return rows


def plot(results: pd.DataFrame) -> plt.Figure:
    """One panel per metric: the base model and each fine-tuned model, mean over held-out samples."""
    data = results.melt(id_vars=["model_label"], value_vars=list(METRICS), var_name="metric")
    data["metric"] = data.metric.map(METRICS)
    grid = sns.catplot(
        data=data,
        x="model_label",
        y="value",
        col="metric",
        col_order=list(METRICS.values()),
        hue="model_label",
        kind="bar",
        sharey=False,
        height=3.4,
        aspect=0.9,
        errorbar=("ci", 95),
    )
    grid.set_titles("{col_name}")
    grid.set_axis_labels("", "")
    first = results.iloc[0]
    grid.figure.suptitle(
        f"{first.model}, {TASK} at {first.length} tokens: {first.steps} AdamW steps × {first.batch} samples "
        f"(lr {first.lr:g}) per objective; mean over {results.seed.nunique()} held-out samples, 95% CI",
        y=1.04,
    )
    return grid.figure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local HF folder")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--length", type=int, default=512, help="prompt length in tokens")
    parser.add_argument("--train-samples", type=int, default=32, help="training samples (seeds 0 … n − 1)")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="samples per step (cycling through them)")
    parser.add_argument("--eval-samples", type=int, default=24, help="held-out samples (seeds 10000 + i)")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument(
        "--longce-k", type=int, default=None, help="LongCE short context K (default: length/4)"
    )
    parser.add_argument("--gamma", type=float, default=5.0, help="LongCE weight cap γ (eq. 7)")
    parser.add_argument("--beta", type=float, default=5.0, help="CDT denoising level β (eq. 2)")
    parser.add_argument("--cdt-lr", type=float, default=None, help="CDT's lr in eq. 2 (default: --lr)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of every fine-tuning run")
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--quick", action="store_true", help="256 tokens, 8 + 8 samples, 12 steps of 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.train_samples, args.steps, args.batch, args.eval_samples = 256, 8, 12, 2, 8
    if min(args.train_samples, args.steps, args.batch, args.eval_samples) < 1:
        parser.error("--train-samples, --steps, --batch and --eval-samples must be at least 1")
    if args.length < 64:
        parser.error("--length must be at least 64 tokens")
    args.longce_k = args.longce_k or args.length // 4
    args.cdt_lr = args.cdt_lr or args.lr
    return args


def run(base, tokenizer, args: argparse.Namespace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(results, training log) of the whole comparison for parsed ``args``, settings in every row.

    ``results``: one row per held-out sample and model (the base model, then each objective's).
    """
    started = time.perf_counter()
    train = [tasks.make(TASK, tokenizer, args.length, seed=i) for i in range(args.train_samples)]
    held_out = [
        tasks.make(TASK, tokenizer, args.length, seed=EVAL_SEED_OFFSET + i) for i in range(args.eval_samples)
    ]
    rows = [
        dict(objective="none", model_label="base model", **r) for r in evaluate(base, tokenizer, held_out)
    ]
    log = []
    for name in args.objectives:
        model, steps = finetune(base, name, train, args)
        rows += [
            dict(objective=name, model_label=OBJECTIVES[name], **r)
            for r in evaluate(model, tokenizer, held_out)
        ]
        log += steps
        del model
    settings = dict(
        model=Path(args.model).name,
        task=TASK,
        length=args.length,
        train_samples=args.train_samples,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        clip=args.clip,
        longce_k=args.longce_k,
        gamma=args.gamma,
        beta=args.beta,
        cdt_lr=args.cdt_lr,
        torch_seed=args.seed,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return pd.DataFrame(rows).assign(**settings), pd.DataFrame(log).assign(**settings)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    base, tokenizer = probe.load_model(args.model)
    context = base.config.get_text_config().max_position_embeddings
    if args.length + 16 > context:  # the answer and a few percent of slack in the prompt length
        raise SystemExit(
            f"--length {args.length} (+ the answer) exceeds {args.model}'s context of {context} tokens"
        )
    results, training = run(base, tokenizer, args)
    atomic_write(args.out / f"{NAME}_training.csv", lambda tmp: training.to_csv(tmp, index=False))
    save_figure(plot(results), results, args.out, NAME)
    summary = results.groupby("model_label", sort=False)[[*METRICS, "attention_interference"]].mean()
    print(f"{summary.round(4).to_string()}\n\nwall time {results.wall_s.iloc[0]} s")
    return results


if __name__ == "__main__":
    main()
