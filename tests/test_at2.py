"""AT2 head weights: the fit recovers planted weights, the detector equals its formula by hand, weights
refuse another architecture, round-trip through a file, and the learning analysis runs end to end."""

import numpy as np
import pytest
import torch

import probe
from analyses import learn_head_weights
from probe import faithfulness
from probe.probes import at2


def test_fit_recovers_planted_head_weights():
    generator = torch.Generator().manual_seed(0)
    planted = torch.randn(2, 3, 4, generator=generator)
    features, kept, logprob = [], [], []
    for i in range(12):
        f = torch.rand(20, 2, 3, 4, generator=generator)
        k = faithfulness.random_masks(20, 40, seed=i)
        features.append(f)
        kept.append(k)
        logprob.append(k.float() @ at2.source_scores(f, planted) + 5.0 * i)  # a per-sample intercept
    weights, alpha, table = at2.fit(features, kept, logprob, alphas=(1e-6, 1e-3, 1.0))
    assert torch.allclose(weights, planted, atol=1e-3)
    assert table.cv_lds.max() > 0.99 and alpha in (1e-6, 1e-3)


def test_at2_detector_is_its_formula_and_weights_check_the_model(tmp_path, tiny):
    sample_ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    config = tiny.config
    weights = at2.HeadWeights(
        torch.randn(
            2,
            config.num_hidden_layers,
            config.num_attention_heads,
            generator=torch.Generator().manual_seed(2),
        ),
        {"name": "tiny", "model": at2.fingerprint(tiny)},
    )
    path = weights.save(tmp_path / "w.json")
    loaded = at2.HeadWeights.load(path)
    assert torch.equal(loaded.weights, weights.weights) and loaded.settings == weights.settings
    sample = _sample(sample_ids)
    found = probe.detect("at2", tiny, None, sample, weights=path)
    attribution = probe.answer_attribution(tiny, sample.input_ids, sample.target_positions)
    pattern, grad = attribution.pattern, attribution.pattern_grad  # [layers, heads, rows, seq]
    by_hand = (weights.weights[0][..., None] * pattern.mean(2)).sum((0, 1)) + (
        weights.weights[1][..., None] * (pattern * grad).abs().sum(2)
    ).sum((0, 1))
    assert torch.allclose(found.scores, by_hand, atol=1e-6)
    shared = probe.detectors.detect_many(["attention", "at2"], tiny, None, sample, {"at2": {"weights": path}})
    assert torch.allclose(shared["at2"].scores, found.scores, atol=1e-6)
    other = probe.tiny_model("gemma3" if config.model_type == "llama" else "llama")
    with pytest.raises(ValueError, match="learned for"):
        probe.detect("at2", other, None, _sample(sample_ids), weights=path)
    if at2.HeadWeights.bundled(tiny) is None:
        with pytest.raises(ValueError, match="no bundled"):
            probe.detect("at2", tiny, None, sample)


def test_the_bundled_head_weights_are_found_for_the_model_they_were_learned_on():
    """Each file shipped in ``probe/data/head_weights`` is what ``at2`` finds, with no ``weights=``, for a
    model of its fingerprint (a tiny Llama of those shapes: no download)."""
    files = sorted(at2.BUNDLED.glob("*.json"))
    assert {path.stem for path in files} >= {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"}
    smollm2 = at2.HeadWeights.load(at2.BUNDLED / "smollm2-135m.json")
    shape = smollm2.settings["model"]
    model = probe.tiny_model(
        "llama", num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=3,
        hidden_size=shape["hidden_size"], intermediate_size=64, vocab_size=shape["vocab_size"],
    )  # fmt: skip
    assert at2.fingerprint(model) == shape
    assert torch.equal(at2.HeadWeights.for_model(model).weights, smollm2.weights)


def _sample(ids: torch.Tensor):
    """A hand-made Sample over random ids: four sources, a question and a two-token answer."""
    from probe.tasks.sample import Sample

    n = len(ids)
    spans = {"supporting": [(2, 8), (20, 26)], "noise": [(10, 18), (28, 34)], "question": [(34, 37)],
             "answer": [(n - 2, n)]}  # fmt: skip
    return Sample(
        task="hand", length=n, seed=0, depth=None, options={}, text="x" * n, input_ids=ids, answer="",
        answer_pattern="", prompt_length=n - 2, spans=spans, char_spans=dict(spans),
        offsets=np.array([(i, i + 1) for i in range(n)]),
    )  # fmt: skip


@pytest.mark.real
def test_learning_analysis_runs_end_to_end(tiny_model_folder, tmp_path):
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--train-samples", "2",
            "--heldout-samples", "1", "--heldout-task-samples", "1", "--heldout-length", "160",
            "--heldout-length-samples", "1", "--masks", "6", "--out", str(tmp_path),
            "--weights-out", str(tmp_path / "w.json")]  # fmt: skip
    summary = learn_head_weights.main(argv)
    assert set(summary.set) == {"seeds", "task", "length"}
    assert {"at2", "information_flow", "at2 − information_flow"} <= set(summary.detector)
    weights = at2.HeadWeights.load(tmp_path / "w.json")
    assert (
        weights.settings["train_samples"] == 4
        and (tmp_path / f"head_weights_{tiny_model_folder.name}.png").exists()
    )
