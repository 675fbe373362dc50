"""Does the training objective teach a model to use the right context? CE vs LongCE vs CDT vs LOGO.

Each objective fine-tunes its own fresh copy of the model, once per seed (``--seeds``: a seed
seeds torch and shuffles the training samples, so all objectives of a seed see the same samples in
the same order; AdamW with the same settings, gradient-norm clipping) on synthetic 1-hop stories
(``multihop-1``: one supporting fact hidden among 1-2 interference facts, essay text and emoji).
Every loss is on the teacher-forced answer only, averaged over the ``--batch`` samples of a step:

- ``ce``: mean cross-entropy of the answer tokens (:func:`probe.target_loss`);
- ``longce``: LongCE (Fang et al. 2025, eqs. 6–7) on the answer tokens,
  :func:`probe.training.objectives.longce_target_loss`: each answer token weighted by min(exp(LSD), γ) of
  the model's own long-short difference. The short context is the last K tokens, K = length / 4
  by default. With K at least the sample's length no answer token has a short context, every
  weight is 1 and LongCE *is* CE; with K = length / 4 the short context holds the question and
  the chat template but rarely the supporting fact, so LSD measures how much the answer needs the
  long context. Adam (and clipping) normalize the overall scale of the gradient, so the weights act
  only *relative to the other samples of the same step*: with one-token answers and one sample per
  step, LongCE would again train exactly like CE — hence ``--batch`` > 1;
- ``cdt``: CDT (Context Denoising Training, eqs. 1–3), :func:`probe.training.objectives.cdt_loss`, online each
  step: the
  context tokens whose embedding-gradient norm is below the context mean are moved by −lr·β·∇E
  (β = 5; lr = the training learning rate, as the paper prints it, unless ``--cdt-lr``), then
  CE on the denoised embeddings. ``objectives_training.csv`` records how far that moves the
  embeddings (``relative_shift`` = ‖E' − E‖ / ‖E‖ over the moved tokens) and the share of context
  tokens flagged critical. At fine-tuning learning rates the move is negligible (SmolLM2, lr 2e-5:
  ~1e-5 of the embedding norm) and CDT trains like CE; ``--cdt-lr`` tries larger steps.
- ``logo``: LOGO (Tang et al. 2024, eqs. 2–3), :func:`probe.training.objectives.logo_loss` on
  :func:`probe.training.objectives.sequence_logprob`: the preferred response y_w is the gold answer, the M
  dispreferred responses y_l are the answers of the sample's interference facts
  (:func:`interference_answers`: "Fred went to the garden." → garden, "Fred took the apple." →
  apple; M = 1 or 2 here, the paper's M = 2 came from generations on irrelevant chunks), each
  tokenized as the answer is. β, γ (``--logo-beta``, ``--logo-gamma``) default to the paper's
  Llama-3-8B setting 10, 3 (SmolLM2 is a Llama), λ (``--logo-sft``) to 0.1. An interference fact
  may name the gold answer itself (training sample 0: "Sandra travelled to the kitchen." beside
  "John journeyed to the kitchen."): that y_l equals y_w, its reward difference is exactly 0 and
  only dilutes the margin — with it alone the sample trains by the SFT term only.
  ``objectives_training.csv`` records the dispreferred answers and the reward margin
  r(y_w) − 1/M Σ r(y_l), r(y) = β/|y| log π(y|x) (the paper's Fig. 6b).

Before (the base model) and after each fine-tuning, on held-out samples (other seeds): greedy
accuracy, the answer's teacher-forced NLL, and the attention mass from the rows predicting the
answer onto the supporting-fact tokens (and, as a control, onto the interference-fact tokens):
summed over those tokens, mean over heads, rows and all layers (one forward pass with the NLL,
:func:`probe.probes.noise_restraint.answer_attention`).

Writes ``objectives.png`` + ``objectives.csv`` (one row per held-out sample and model, with the
settings, the torch seed — empty for the base model — and the job's wall time) and
``objectives_training.csv`` (every training sample's loss, per objective and torch seed).

    python -m analyses.objectives --quick     # 256 tokens, 12 steps × 2 samples, 8 held-out samples
                                              # (CE/LongCE/CDT: 19 min here, sharing 2 cores with 3
                                              # other jobs; LOGO adds a run)
    python -m analyses.objectives             # 512 tokens, 32 steps × 4 samples, 24 held-out samples
    python -m analyses.objectives --length 256 --train-samples 64 --steps 32 --batch 2 \
        --eval-samples 32 --seeds 0 1 2       # the committed run: 55 min, 1 thread, shared
    python -m analyses.objectives --claims    # the claims' budget: SmolLM2 at 256 tokens, 200 steps
                                              # × 4 new samples, 64 held-out samples, seeds 0 1 2
    python -m analyses.objectives --objectives ce logo --seeds 0 1 --resume   # goes on after a kill
    accelerate launch --multi_gpu --num_processes 8 -m analyses.objectives --claims   # 8 GPUs

A sweep (:mod:`analyses.sweep`): one job evaluates the base model, one job per (objective, torch
seed) fine-tunes and evaluates; they run unchanged under ``accelerate launch``, split across the
processes. Each finished job is kept as a part (``OUT/.objectives_parts``), all of them in one file
once the outputs are written (:func:`analyses.sweep.finish`); ``--resume`` runs only the jobs no part holds.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

import probe
from probe import answer, tasks
from probe.checks import check_layers, model_context
from probe.probes.noise_restraint import answer_attention, category_mass
from probe.training.objectives import cdt_loss, logo_loss, longce_target_loss, sequence_logprob

from .arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from .output import atomic_write, save_figure
from .sweep import Tables, finish, sweep

NAME = "objectives"
TASK = "multihop-1"
OBJECTIVES = {"ce": "CE", "longce": "LongCE", "cdt": "CDT", "logo": "LOGO"}
EVAL_SEED_OFFSET = 10_000  # held-out samples use seeds 10000 + i; training samples seeds 0 … n − 1
METRICS = {
    "correct": "greedy accuracy",
    "attention_supporting": "attention mass on supporting facts",
    "answer_nll": "answer NLL (nats / token)",
}
FACT_ANSWER = re.compile(r"\bthe (\w+)\.$")  # a story fact's last noun: "Fred went to the garden." → garden


def interference_answers(sample: tasks.Sample) -> list[str]:
    """The answers of ``sample``'s interference facts, each once, in text order: what each fact
    names last — the place a character went to, or the object taken or dropped
    (:mod:`probe.tasks.story`). These are LOGO's dispreferred responses; one may equal the gold answer.

    Raises ``ValueError`` for a sample without interference facts and for a fact that names no
    answer (not a story fact: another task's distractor).
    """
    facts = sample.span_text("interference")
    where = f"the {sample.task} sample of seed {sample.seed}"
    if not facts:
        raise ValueError(f"{where} has no interference facts (their answers are LOGO's dispreferred ones)")
    found = [FACT_ANSWER.search(fact) for fact in facts]
    unanswered = [fact for fact, match in zip(facts, found, strict=True) if match is None]
    if unanswered:
        raise ValueError(
            f"the interference facts {unanswered} of {where} name no answer (a story fact ends in "
            "'the <place or object>.'); LOGO needs an answer per interference fact"
        )
    return list(dict.fromkeys(match.group(1) for match in found))


def response_ids(sample: tasks.Sample, tokenizer, text: str) -> torch.Tensor:
    """LongTensor[tokens]: ``text`` as a response to ``sample``'s prompt, tokenized as the gold answer
    is (after the same separator, e.g. " garden"); for ``sample.answer`` these are the sample's
    answer tokens with every tokenizer whose words start a new token after a space."""
    (spoken,) = sample.span_text("answer")  # the answer separator + the answer
    separator = spoken[: len(spoken) - len(sample.answer)]
    return torch.tensor(tokenizer(separator + text, add_special_tokens=False).input_ids)


def objective_loss(name: str, model, tokenizer, sample: tasks.Sample, args: argparse.Namespace):
    """(loss with gradients, diagnostics dict) of objective ``name`` on one training sample."""
    ids, targets = sample.input_ids[None], sample.target_positions
    if name == "ce":
        return probe.target_loss(model, ids, targets), {}
    if name == "longce":
        return longce_target_loss(model, ids, targets, K=args.longce_k, gamma=args.gamma), {}
    if name == "logo":
        return logo_sample_loss(model, tokenizer, sample, args)
    result = cdt_loss(model, ids, targets, lr=args.cdt_lr, beta=args.beta, context=sample.prompt_length)
    embeds = model.get_input_embeddings()(ids)[0].detach()
    moved = result.shift.norm(dim=-1) > 0
    return result.loss, {
        "critical_share": result.critical[: sample.prompt_length].float().mean().item(),
        "relative_shift": (result.shift[moved].norm() / embeds[moved].norm()).item() if moved.any() else 0.0,
    }


def logo_sample_loss(model, tokenizer, sample: tasks.Sample, args: argparse.Namespace):
    """(LOGO loss, diagnostics) of one sample: y_w = the gold answer, y_l = :func:`interference_answers`.

    1 + M passes over prompt + response (:func:`probe.training.objectives.sequence_logprob`), then
    :func:`probe.training.objectives.logo_loss` with batch 1. Diagnostics: the dispreferred answers
    (space-separated) and the reward margin r(y_w) − 1/M Σ_j r(y_l^(j)), r(y) = β/|y| log π(y|x).
    """
    others, prompt = interference_answers(sample), sample.prompt_ids
    chosen, chosen_length = sequence_logprob(model, prompt, sample.input_ids[sample.target_positions])
    pairs = [sequence_logprob(model, prompt, response_ids(sample, tokenizer, other)) for other in others]
    rejected = torch.stack([logp for logp, _ in pairs])[None]  # [1, M]
    lengths = [[length for _, length in pairs]]
    loss = logo_loss(
        chosen[None], [chosen_length], rejected, lengths, args.logo_beta, args.logo_gamma, args.logo_sft
    )
    rewards = [args.logo_beta * logp.item() / length for logp, length in [(chosen, chosen_length), *pairs]]
    return loss, {"dispreferred": " ".join(others), "reward_margin": rewards[0] - np.mean(rewards[1:])}


def finetune(base, name: str, seed: int, tokenizer, samples: list[tasks.Sample], args: argparse.Namespace):
    """A copy of ``base`` fine-tuned with objective ``name`` (eval mode), and the training log rows
    (one per training sample of each step).

    ``seed`` seeds torch (dropout, where a model has any: SmolLM2 and Gemma 3 have none) and
    shuffles the order of ``samples``, which the steps then cycle through ``--batch`` at a time:
    runs with the same seed see the same samples in the same order, whatever the objective.
    """
    torch.manual_seed(seed)
    order = np.random.default_rng(seed).permutation(len(samples))
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log = []
    for step in tqdm(range(args.steps), desc=f"{NAME}: {name}, seed {seed}", leave=False):
        optimizer.zero_grad()
        for i in range(args.batch):
            sample = samples[order[(step * args.batch + i) % len(samples)]]
            loss, diagnostics = objective_loss(name, model, tokenizer, sample, args)
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
    """One panel per metric: the base model and each fine-tuned model, mean over held-out samples
    and torch seeds (95% CI); with several seeds, one dot per seed's mean."""
    labels = list(results.model_label.unique())
    seeds = results.torch_seed.dropna().unique()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(len(METRICS) * (1.2 + 0.6 * len(labels)), 3.6))
    for ax, (metric, title) in zip(axes, METRICS.items(), strict=True):
        sns.barplot(results, x="model_label", y=metric, hue="model_label", order=labels, hue_order=labels,
                    errorbar=("ci", 95), seed=0, ax=ax)  # fmt: skip
        if len(seeds) > 1:
            per_seed = results.groupby(["model_label", "torch_seed"])[metric].mean().reset_index()
            sns.stripplot(per_seed, x="model_label", y=metric, order=labels, color="black", size=4, ax=ax)
        ax.set(title=title, xlabel="", ylabel="")
        ax.tick_params(axis="x", rotation=30)
    first = results.iloc[0]
    fig.suptitle(
        f"{first.model}, {TASK} at {first.length} tokens: {first.steps} AdamW steps × {first.batch} samples "
        f"(lr {first.lr:g}) per objective and seed\nmean over {results.seed.nunique()} held-out samples × "
        f"{max(len(seeds), 1)} seed(s), 95% CI" + ("; dots: each seed's mean" if len(seeds) > 1 else ""),
    )
    fig.tight_layout()
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local HF folder")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--length", type=int, default=512, help="prompt length in tokens")
    parser.add_argument("--train-samples", type=int, default=32, help="training samples (seeds 0 … n − 1)")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="samples per step (cycling, shuffled per seed)")
    parser.add_argument("--eval-samples", type=int, default=24, help="held-out samples (seeds 10000 + i)")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument(
        "--longce-k", type=int, default=None, help="LongCE short context K (default: length/4)"
    )
    parser.add_argument("--gamma", type=float, default=5.0, help="LongCE weight cap γ (eq. 7)")
    parser.add_argument("--beta", type=float, default=5.0, help="CDT denoising level β (eq. 2)")
    parser.add_argument("--cdt-lr", type=float, default=None, help="CDT's lr in eq. 2 (default: --lr)")
    parser.add_argument("--logo-beta", type=float, default=10.0, help="LOGO reward scale β (eq. 2)")
    parser.add_argument("--logo-gamma", type=float, default=3.0, help="LOGO target reward margin γ (eq. 2)")
    parser.add_argument("--logo-sft", type=float, default=0.1, help="LOGO SFT weight λ (eq. 3)")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="torch seeds: a fine-tuning per objective and seed"
    )
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--quick", action="store_true", help="256 tokens, 8 + 8 samples, 12 steps of 2")
    parser.add_argument(
        "--claims",
        action="store_true",
        help="the claims' budget: smollm2-135m, 256 tokens, all objectives, 200 steps of 4 new samples "
        "(800 training samples), 64 held-out samples, seeds 0 1 2",
    )
    parser.add_argument("--resume", action="store_true", help="keep the jobs a killed run finished")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.train_samples, args.steps, args.batch, args.eval_samples = 256, 8, 12, 2, 8
    if args.claims:
        args.model, args.objectives, args.seeds = "smollm2-135m", list(OBJECTIVES), [0, 1, 2]
        args.length, args.train_samples, args.steps, args.batch, args.eval_samples = 256, 800, 200, 4, 64
    if min(args.train_samples, args.steps, args.batch, args.eval_samples) < 1:
        parser.error("--train-samples, --steps, --batch and --eval-samples must be at least 1")
    if args.train_samples > EVAL_SEED_OFFSET:
        parser.error(f"--train-samples must be at most {EVAL_SEED_OFFSET} (held-out seeds start there)")
    if len(set(args.seeds)) < len(args.seeds) or len(set(args.objectives)) < len(args.objectives):
        parser.error("--seeds and --objectives must not repeat")
    if args.length < 64:
        parser.error("--length must be at least 64 tokens")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    args.longce_k = args.longce_k or args.length // 4
    args.cdt_lr = args.cdt_lr or args.lr
    return args


def settings(args: argparse.Namespace) -> dict:
    """The settings every output row carries."""
    names = ["length", "train_samples", "steps", "batch", "lr", "clip", "longce_k", "gamma", "beta", "cdt_lr",
             "logo_beta", "logo_gamma", "logo_sft"]  # fmt: skip
    return dict(model=Path(args.model).name, task=TASK, **{name: getattr(args, name) for name in names})


def run_job(
    base,
    tokenizer,
    train: list[tasks.Sample],
    held_out: list[tasks.Sample],
    args: argparse.Namespace,
    job: tuple,
) -> Tables:
    """One sweep job: ``("none",)`` evaluates the base model, ``(objective, torch seed)`` fine-tunes a
    fresh copy of it (:func:`finetune`) and evaluates that.

    Tables: ``results`` (one row per held-out sample, :func:`evaluate`) and, for a fine-tuning,
    ``training`` (its log), each row with the :func:`settings`, the seed (``torch_seed``; ``None``
    for the base model) and the job's wall time.
    """
    started = time.perf_counter()
    objective, *seed = job
    model, log, torch_seed = base, [], None
    if objective != "none":
        (torch_seed,) = seed
        model, log = finetune(base, objective, torch_seed, tokenizer, train, args)
    label = OBJECTIVES.get(objective, "base model")
    rows = [dict(objective=objective, model_label=label, **r) for r in evaluate(model, tokenizer, held_out)]
    common = dict(settings(args), torch_seed=torch_seed, wall_s=round(time.perf_counter() - started, 1))
    tables = {"results": pd.DataFrame(rows).assign(**common)}
    return tables | ({"training": pd.DataFrame(log).assign(**common)} if log else {})


def compare(
    base, tokenizer, args: argparse.Namespace, parts: Path
) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(results, training log) of the base model and every (objective, torch seed) of ``args``,
    jobs split across accelerate's processes (:func:`analyses.sweep.sweep`, parts in ``parts``);
    ``None`` on the processes other than the main one.

    ``results``: one row per held-out sample and model, the base model first, then each seed's
    objectives; ``torch_seed`` is a nullable integer (empty for the base model).
    """
    train = [tasks.make(TASK, tokenizer, args.length, seed=i) for i in range(args.train_samples)]
    held_out = [
        tasks.make(TASK, tokenizer, args.length, seed=EVAL_SEED_OFFSET + i) for i in range(args.eval_samples)
    ]
    jobs = [("none",)] + [(name, seed) for seed in args.seeds for name in args.objectives]
    run = functools.partial(run_job, base, tokenizer, train, held_out, args)
    found = sweep(jobs, run, parts, args.resume, desc=NAME, settings=resume_settings(args))
    if found is None:
        return None
    return found["results"].astype({"torch_seed": "Int64"}), found["training"]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run the comparison and write its outputs; returns the results table (empty on the processes
    of an ``accelerate launch`` other than the main one)."""
    args = parse_args(argv)
    base, tokenizer = load(args)
    context = model_context(base)
    if args.length + 16 > context:  # the answer and a few percent of slack in the prompt length
        raise SystemExit(
            f"--length {args.length} (+ the answer) exceeds {args.model}'s context of {context} tokens"
        )
    parts = args.out / f".{NAME}_parts"
    found = compare(base, tokenizer, args, parts)
    if found is None:  # not the main process of an accelerate launch: it writes the outputs
        return pd.DataFrame()
    results, training = found
    atomic_write(args.out / f"{NAME}_training.csv", lambda tmp: training.to_csv(tmp, index=False))
    save_figure(plot(results), results, args.out, NAME)
    finish(parts)  # every output is written: a --resume now runs nothing
    summary = results.groupby("model_label", sort=False)[[*METRICS, "attention_interference"]].mean()
    wall = results.drop_duplicates(["objective", "torch_seed"]).wall_s.sum()
    print(f"{summary.round(4).to_string()}\n\nwall time of the jobs {wall:.0f} s")
    return results


if __name__ == "__main__":
    main()
