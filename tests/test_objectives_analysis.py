"""The objectives experiment end to end on a tiny model saved like a real one, LOGO's dispreferred
answers, seeds, --resume, and its refusals."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import closed
from transformers import AutoTokenizer

import probe
from analyses import objectives
from analyses.sweep import part_name
from probe import tasks

TINY = ["--length", "128", "--train-samples", "2", "--steps", "1", "--batch", "2", "--eval-samples", "1"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_folder):
    return AutoTokenizer.from_pretrained(tiny_model_folder)


def test_objectives_writes_figure_csv_and_training_log(tiny_model_folder, tokenizer, tmp_path):
    table = objectives.main(["--model", str(tiny_model_folder), *TINY, "--out", str(tmp_path)])
    assert (tmp_path / "objectives.png").stat().st_size > 0
    results = pd.read_csv(tmp_path / "objectives.csv")
    assert len(results) == len(table) == 5  # base model + 4 objectives, 1 held-out sample each
    assert list(results.objective) == ["none", "ce", "longce", "cdt", "logo"]
    assert results.torch_seed.isna().tolist() == [True, False, False, False, False]  # the base is not trained
    assert (results.torch_seed.dropna() == 0).all() and str(table.torch_seed.dtype) == "Int64"
    assert (results.seed == objectives.EVAL_SEED_OFFSET).all()
    assert results[["attention_supporting", "attention_interference"]].gt(0).all().all()
    assert results.attention_supporting.lt(1).all()
    assert (results[["length", "steps", "batch", "longce_k"]].iloc[0] == [128, 1, 2, 32]).all()
    assert (results.cdt_lr == results.lr).all()  # CDT's eq. 2 uses the training learning rate
    assert (results[["logo_beta", "logo_gamma", "logo_sft"]] == [10.0, 3.0, 0.1]).all().all()
    # every objective changed its own copy of the model, and the base model was left as it was
    base_nll = results.answer_nll.iloc[0]
    assert (results.answer_nll.iloc[1:] != base_nll).all()

    training = pd.read_csv(tmp_path / "objectives_training.csv")
    assert len(training) == 4 * 2  # 4 objectives × 1 step × 2 samples
    assert sorted(training.seed[training.objective == "ce"]) == [0, 1]
    cdt = training[training.objective == "cdt"]
    assert cdt.critical_share.between(0, 1, inclusive="neither").all()
    assert cdt.relative_shift.gt(0).all() and cdt.relative_shift.lt(1e-2).all()
    logo = training[training.objective == "logo"]
    assert logo.reward_margin.notna().all()
    for seed, dispreferred in zip(logo.seed, logo.dispreferred, strict=True):  # the samples' interference
        sample = tasks.make(objectives.TASK, tokenizer, 128, seed=seed)
        assert dispreferred.split() == objectives.interference_answers(sample)
    assert training[training.objective != "logo"].dispreferred.isna().all()
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written left behind
    assert [closed(parts) for parts in tmp_path.glob(".*parts")] == [True]


def test_logo_disprefers_the_answers_of_the_interference_facts(tokenizer):
    for seed in range(6):
        sample = tasks.make(objectives.TASK, tokenizer, 128, seed=seed)
        answers = objectives.interference_answers(sample)
        facts = [sample.text[start:end] for start, end in sample.char_spans["interference"]]
        assert facts and len(answers) == len(set(answers))
        # each fact's answer is the place or object it names last, and each answer is some fact's
        assert {fact.removesuffix(".").split()[-1] for fact in facts} == set(answers)
        assert all(any(fact.endswith(f" the {a}.") for fact in facts) for a in answers)
        # responses are tokenized as the gold answer is: the gold answer gives the sample's own tokens
        gold = objectives.response_ids(sample, tokenizer, sample.answer)
        assert torch.equal(gold, sample.input_ids[sample.target_positions])
        for a in answers:
            assert tokenizer.decode(objectives.response_ids(sample, tokenizer, a)) == f" {a}"


def test_logo_loss_of_a_sample_whose_interference_fact_names_the_gold_answer(tiny_model_folder, tokenizer):
    """Seed 0: 'Sandra travelled to the kitchen.' beside 'John journeyed to the kitchen.'. The
    dispreferred response is the preferred one, the margin is 0 and the loss is −log σ(−γ) + λ·NLL."""
    model, _ = probe.load_model(str(tiny_model_folder))
    sample = tasks.make(objectives.TASK, tokenizer, 128, seed=0)
    assert objectives.interference_answers(sample) == [sample.answer] == ["kitchen"]
    args = objectives.parse_args(["--model", str(tiny_model_folder)])
    loss, diagnostics = objectives.logo_sample_loss(model, tokenizer, sample, args)
    assert diagnostics == {"dispreferred": "kitchen", "reward_margin": 0.0}
    nll = probe.target_loss(model, sample.input_ids[None], sample.target_positions)
    expected = -F.logsigmoid(torch.tensor(-args.logo_gamma)) + args.logo_sft * nll
    torch.testing.assert_close(loss, expected)


def test_interference_answers_are_refused_without_story_facts(tokenizer):
    with pytest.raises(ValueError, match="has no interference facts"):
        objectives.interference_answers(tasks.make("passkey", tokenizer, 128, seed=0))
    with pytest.raises(ValueError, match="name no answer"):
        objectives.interference_answers(tasks.make("niah", tokenizer, 256, seed=0, distractors=2))


def test_seeds_shuffle_the_training_samples_and_each_row_records_its_seed(tiny_model_folder, tmp_path):
    argv = ["--model", str(tiny_model_folder), *TINY, "--train-samples", "4", "--objectives", "ce", "logo"]
    results = objectives.main([*argv, "--seeds", "0", "1", "--out", str(tmp_path)])
    assert list(zip(results.objective, results.torch_seed.astype(object), strict=True)) == [
        ("none", pd.NA), ("ce", 0), ("logo", 0), ("ce", 1), ("logo", 1),
    ]  # fmt: skip
    trained = results.dropna(subset="torch_seed").set_index(["objective", "torch_seed"]).answer_nll
    assert trained["ce", 0] != trained["ce", 1] and trained["logo", 0] != trained["logo", 1]
    training = pd.read_csv(tmp_path / "objectives_training.csv")
    order = training.groupby(["objective", "torch_seed"]).seed.agg(list)
    assert order["ce", 0] == order["logo", 0] != order["ce", 1] == order["logo", 1]  # a seed's order
    assert set(training.torch_seed) == {0, 1}


def test_resume_reruns_only_the_missing_jobs(tiny_model_folder, tmp_path, monkeypatch):
    """A run killed in its last job leaves the parts of the others; one more part is deleted; --resume
    runs exactly those two jobs and writes the CSVs of an uninterrupted run."""
    argv = ["--model", str(tiny_model_folder), *TINY, "--objectives", "ce", "logo", "--seeds", "0", "1"]
    objectives.main([*argv, "--out", str(tmp_path / "whole")])

    ran, run_job = [], objectives.run_job

    def killed_at_the_last_job(*arguments):
        job = arguments[-1]
        ran.append(job)
        if job == ("logo", 1) and len(ran) == 5:
            raise KeyboardInterrupt
        return run_job(*arguments)

    monkeypatch.setattr(objectives, "run_job", killed_at_the_last_job)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        objectives.main([*argv, "--out", str(out)])
    (out / ".objectives_parts" / f"{part_name(('ce', 0))}.pkl").unlink()
    objectives.main([*argv, "--out", str(out), "--resume"])
    assert ran[5:] == [("ce", 0), ("logo", 1)]
    for name in ("objectives.csv", "objectives_training.csv"):
        whole, resumed = (pd.read_csv(folder / name) for folder in (tmp_path / "whole", out))
        pd.testing.assert_frame_equal(resumed.drop(columns="wall_s"), whole.drop(columns="wall_s"))
    assert closed(out / ".objectives_parts")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "at least 1"),
        (["--objectives", "nope"], "invalid choice"),
        (["--seeds", "0", "0"], "must not repeat"),
        (["--train-samples", "10001"], "at most 10000"),
        (["--length", "32"], "at least 64"),
        (["--length", "4000"], "context"),
    ],
)
def test_bad_settings_are_refused(tiny_model_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        objectives.main(["--model", str(tiny_model_folder), "--out", str(tmp_path), *argv])
    assert message in str(exit_info.value) + capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_claims_is_the_issue_budget():
    args = objectives.parse_args(["--claims"])
    assert (args.model, args.length, args.seeds, args.objectives) == (
        "smollm2-135m", 256, [0, 1, 2], ["ce", "longce", "cdt", "logo"],
    )  # fmt: skip
    assert args.steps >= 200 and args.eval_samples >= 64 and args.steps * args.batch <= args.train_samples
