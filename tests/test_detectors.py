"""Detectors and metrics: shapes, agreement with the eager references, flag rules, planted signals."""

import ast
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import eager_forward, embedding_grad_reference, information_flow_reference
from transformers import AutoTokenizer

import probe
from probe import detectors, journal, metrics
from probe.detectors import registry
from probe.tasks import Sample

ATOL = 1e-5
NEEDLE = 7  # the token id the planted model attends to


def hand_sample(seq=48, needle=(12, 15), question=(36, 40), answer=(44, 46)) -> Sample:
    """A sample built by hand: random ids, NEEDLE tokens in the supporting span."""
    ids = torch.randint(10, 128, (seq,), generator=torch.Generator().manual_seed(0))
    ids[needle[0] : needle[1]] = NEEDLE
    spans = {"supporting": [needle], "interference": [], "noise": [(0, needle[0]), (needle[1], question[0])]}
    spans |= {"low_frequency": [], "question": [question], "answer": [answer]}
    return Sample(
        task="hand", length=seq, seed=0, depth=None, options={}, text="", input_ids=ids, answer="",
        answer_pattern="", prompt_length=answer[0], spans=spans, char_spans={},
        offsets=np.zeros((seq, 2), dtype=np.int64),
    )  # fmt: skip


def planted_model():
    """One-layer Llama whose every query attends (almost) only to NEEDLE tokens.

    Every embedding carries a constant in hidden dim 0, which q_proj turns into one query; only
    NEEDLE's embedding has hidden dim 1, which k_proj turns into a matching key. Query and key
    live in the slowest RoPE pair (rope_theta 1e9), so position barely rotates them.
    """
    model = probe.tiny_model(
        "llama", num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e9}
    )
    head_dim = model.config.head_dim
    slow = [head_dim // 2 - 1, head_dim - 1]  # the two halves of the slowest-rotating RoPE pair
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, :2] = 0.0
        embed[:, 0] = 3.0
        embed[NEEDLE, 1] = 3.0
        attention = model.model.layers[0].self_attn
        attention.q_proj.weight.zero_()
        attention.k_proj.weight.zero_()
        for head in range(model.config.num_attention_heads):
            attention.q_proj.weight[[head * head_dim + d for d in slow], 0] = 10.0
        for head in range(model.config.num_key_value_heads):
            attention.k_proj.weight[[head * head_dim + d for d in slow], 1] = 10.0
    return model


def test_registry_lists_every_detector_and_refuses_unknown_names(story):
    model, sample = story
    assert set(detectors.names()) >= {
        "attention", "fr", "embedding_grad", "information_flow", "integrated_gradients",
        "lsd", "random", "lexical_overlap", "recency",
    }  # fmt: skip
    with pytest.raises(ValueError, match="registered detectors"):
        probe.detect("nope", model, None, sample)


def test_detectors_register_in_a_fixed_order():
    """``names()`` is the registration order (the CLI's choices, the notebooks' tables): the package
    imports its modules in that order."""
    assert detectors.names() == [
        "attention", "fr", "embedding_grad", "information_flow", "grad_times_input", "key_removal_grad",
        "key_removal_banzhaf", "at2", "attn_lrp", "integrated_gradients", "lsd", "random", "recency",
        "lexical_overlap", "leave_one_out", "context_cite", "leave_few_out",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name", ["attention", "fr", "embedding_grad", "information_flow", "lsd", "random", "recency"]
)
def test_detector_output_shape_and_settings(story, tokenizer, name):
    model, sample = story
    detection = probe.detect(name, model, tokenizer, sample)
    assert detection.scores.shape == detection.flagged.shape == (len(sample.input_ids),)
    assert detection.flagged.dtype == torch.bool
    assert not detection.flagged[sample.prompt_length :].any()  # only context tokens are flagged
    assert detection.name == name and isinstance(detection.settings, dict)


def test_a_bfloat16_model_gives_float32_detections_that_save_and_show(story, tokenizer, tmp_path):
    """A half-precision model's detections are data like any other: float32 scores (numpy, pandas and
    the views read them), their views written, their frames built, alone and from the shared pass."""
    model, sample = story
    half = copy.deepcopy(model).to(torch.bfloat16)
    names = ["attention", "information_flow", "embedding_grad", "key_removal_grad", "leave_one_out"]
    options = {"leave_one_out": {"top_m": 2}}
    found = list(detectors.detect_many(names, half, tokenizer, sample, options).values())
    found.append(probe.detect("attention", half, tokenizer, sample))
    for detection in found:
        assert detection.scores.dtype == torch.float32, detection.name
        tensors = [value for value in detection.details.values() if torch.is_tensor(value)]
        assert all(value.dtype != torch.bfloat16 for value in tensors), detection.name
        detection.save_html(tmp_path / "view.html")
        assert (tmp_path / "view.html").stat().st_size > 0
        assert len(detection.to_frame()) == len(sample.input_ids)


def test_top_k_detectors_flag_exactly_k_context_tokens(story, tokenizer):
    model, sample = story
    for name in ("attention", "fr", "information_flow", "random", "recency"):
        detection = probe.detect(name, model, tokenizer, sample, top_k=11)
        assert detection.flagged.sum() == 11
        threshold = detection.scores[detection.flagged].min()
        assert (
            detection.scores[: sample.prompt_length][~detection.flagged[: sample.prompt_length]] <= threshold
        ).all()


def test_attention_detector_matches_eager(story, tokenizer):
    model, sample = story
    targets = sample.target_positions
    attentions, _ = eager_forward(model, sample.input_ids[None])
    expected = torch.stack([a[0][:, targets - 1].sum(0).mean(0) for a in attentions]).mean(0)
    got = probe.detect("attention", model, tokenizer, sample).scores
    assert (got - expected).abs().max() <= ATOL


def test_fr_counts_top_k_membership_per_head(story, tokenizer):
    model, sample = story
    detection = probe.detect("fr", model, tokenizer, sample, top_k=5)
    targets = sample.target_positions
    attentions, _ = eager_forward(model, sample.input_ids[None])
    context = sample.prompt_length
    for layer, attention in enumerate(attentions):
        for head in range(attention.shape[1]):
            rows = attention[0, head, targets - 1, :context]
            counts = torch.zeros(len(sample.input_ids))
            for row in rows:  # brute force: each generation step's top-5 set
                counts[row.topk(5).indices] += 1
            assert torch.allclose(detection.details["per_head"][layer, head], counts / len(rows))


def test_gradient_detectors_match_retain_grad(story, tokenizer):
    model, sample = story
    ids, targets = sample.input_ids[None], sample.target_positions
    flow = probe.detect("information_flow", model, tokenizer, sample)
    assert (flow.details["per_layer"] - information_flow_reference(model, ids, targets)).abs().max() <= ATOL
    grad = probe.detect("embedding_grad", model, tokenizer, sample, p=1)
    # relative too: a token's L1 gradient norm reaches ~30, where float32's summation order alone moves
    # the last digits (1.5e-5 on an Intel Xeon, 5.6e-7 relative)
    expected = embedding_grad_reference(model, ids, targets, p=1)
    torch.testing.assert_close(grad.scores, expected, rtol=1e-6, atol=ATOL)
    context = grad.scores[: sample.prompt_length]
    assert torch.equal(grad.flagged[: sample.prompt_length], context >= context.mean())  # CDT §4.1 rule


def test_integrated_gradients_is_complete_and_reports_its_delta():
    model, sample = probe.tiny_model("llama"), hand_sample()
    tokenizer = AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))
    baseline = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    coarse = probe.detect("integrated_gradients", model, tokenizer, sample, n_steps=2, internal_batch_size=2)
    fine = probe.detect("integrated_gradients", model, tokenizer, sample, n_steps=32, internal_batch_size=32)
    assert fine.details["convergence_delta"] < 1e-4 < coarse.details["convergence_delta"]
    targets = sample.target_positions
    with torch.no_grad():  # completeness: Σ attributions = f(x) − f(baseline), f = −loss
        pads = model.get_input_embeddings()(torch.full_like(sample.input_ids, baseline))[None]
        f_input = -probe.target_loss(model, sample.input_ids[None], targets)
        f_baseline = -probe.target_loss(model, sample.input_ids[None], targets, inputs_embeds=pads)
    assert fine.details["signed"].sum() == pytest.approx(float(f_input - f_baseline), abs=1e-4)
    assert torch.equal(fine.scores, fine.details["signed"].abs())


@pytest.mark.parametrize("name", ["attention", "fr", "information_flow", "embedding_grad"])
def test_planted_needle_is_found(name):
    model, sample = planted_model(), hand_sample()
    detection = probe.detect(name, model, None, sample, **({} if name == "embedding_grad" else {"top_k": 3}))
    record = metrics.plausibility(detection, sample, top_k=3)
    assert record["auroc"] > 0.95
    assert record["fact_hit_rate"] == 1.0
    if name != "embedding_grad":
        assert record["precision_supporting"] == 1.0


def test_lexical_overlap_flags_words_shared_with_the_question(story, tokenizer):
    _, sample = story
    detection = probe.detect("lexical_overlap", None, tokenizer, sample)
    (q_start, q_end), *_ = sample.char_spans["question"]
    flagged_words = {tokenizer.decode(t).strip().lower() for t in sample.input_ids[detection.flagged]}
    question = sample.text[q_start:q_end].lower()
    assert flagged_words and all(word in question for word in flagged_words)


def test_metrics_against_a_hand_count():
    sample = hand_sample()
    flagged = torch.zeros(48, dtype=torch.bool)
    flagged[[12, 13, 20, 21]] = True  # two needle tokens, two noise tokens
    scores = torch.zeros(48)
    scores[12:15] = 1.0
    record = metrics.plausibility(detectors.Detection(scores, flagged, {}), sample, top_k=3)
    assert record["precision_supporting"] == 0.5 and record["recall_supporting"] == pytest.approx(2 / 3)
    assert record["share_flagged_supporting"] == 0.5 and record["share_flagged_noise"] == 0.5
    assert record["auroc"] == 1.0 and record["fact_hit_rate"] == 1.0
    assert record["share_top_k_supporting"] == 1.0
    empty = metrics.plausibility(
        detectors.Detection(torch.zeros(48), torch.zeros(48, dtype=torch.bool), {}), sample
    )
    assert empty["precision_supporting"] == 0.0 and empty["auroc"] == 0.5


def test_detection_round_trips_through_json(story, tokenizer, tmp_path):
    model, sample = story
    detection = probe.detect("information_flow", model, tokenizer, sample)
    detection.save(tmp_path / "d.json")
    loaded = detectors.Detection.load(tmp_path / "d.json")
    assert loaded.name == "information_flow" and not list(tmp_path.glob(".*tmp*"))  # written atomically
    assert torch.allclose(loaded.scores, detection.scores) and torch.equal(loaded.flagged, detection.flagged)
    assert loaded.settings == detection.settings and loaded.seconds == detection.seconds > 0
    assert torch.allclose(loaded.details["per_layer"], detection.details["per_layer"])
    frame = detection.to_frame(tokenizer, sample)
    assert list(frame.columns[:3]) == ["position", "score", "flagged"] and len(frame) == len(sample.input_ids)
    assert not math.isnan(frame.score.sum())
    assert list(frame.category) == list(sample.categories) and (frame.detector == "information_flow").all()


def test_detections_carry_their_cost(story, tokenizer, monkeypatch):
    """``seconds``: the detector's own wall time; the detections read off one shared pass share its
    time over the samples; a pruned leave-one-out given ``key_removal_grad``'s ranking does not pay
    for it again."""
    model, sample = story
    clock = iter(range(0, 1000, 10))  # every reading of the clock 10 s after the last
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    alone = probe.detect("key_removal_grad", model, tokenizer, sample)
    assert alone.seconds == 10
    names = ["attention", "information_flow", "key_removal_grad", "leave_one_out"]
    found = detectors.detect_many(names, model, tokenizer, [sample, sample], {"leave_one_out": {"top_m": 2}})
    for one in found:  # key_removal_grad's key bias rides in the shared pass: 10 s over 2 samples
        shared = [one[name].seconds for name in ("attention", "information_flow", "key_removal_grad")]
        assert shared == [5, 5, 5]
        assert one["leave_one_out"].seconds == 10
        assert one["leave_one_out"].details["passes"] == 3  # the full context and the top 2


def test_detection_load_reads_files_written_with_the_name_first(tmp_path):
    """Files saved before the registry set names hold the same record: they load unchanged."""
    path = tmp_path / "old.json"
    path.write_text(
        '{"name": "fr", "settings": {"top_k": 2}, "scores": [0.5, 1.0], "flagged": [false, true], '
        '"details": {"per_head": [[[0.5, 1.0]]], "delta": 0.1}}'
    )
    loaded = detectors.Detection.load(path)
    assert loaded.name == "fr" and loaded.settings == {"top_k": 2} and loaded.details["delta"] == 0.1
    assert torch.equal(loaded.flagged, torch.tensor([False, True]))
    assert loaded.details["per_head"].shape == (1, 1, 2)


def test_the_registry_names_each_detection(sandbox):
    """A detector never writes its name: register(name) stamps it on the result, also on a direct call."""
    sample = hand_sample()

    @detectors.register("hand_made")
    def hand_made(model, tokenizer, sample, scale: float = 1.0):
        """Scores every token by its position."""
        scores = scale * torch.arange(len(sample.input_ids), dtype=torch.float32)
        return detectors.Detection(scores=scores, flagged=scores > 40, settings={"scale": scale})

    assert "hand_made" in detectors.names() and detectors.options("hand_made") == ["scale"]
    assert hand_made.__doc__ == "Scores every token by its position."
    detection = probe.detect("hand_made", None, None, sample, scale=2.0)
    assert detection.name == "hand_made" and detection.settings == {"scale": 2.0}
    assert hand_made(None, None, sample).name == "hand_made"
    with pytest.raises(ValueError, match="already registered"):
        detectors.register("hand_made")(hand_made)
    with pytest.raises(TypeError, match=r"\(model, tokenizer, sample, \*\*options\)"):
        detectors.register("backwards")(lambda sample, model, tokenizer: None)


def test_detectors_never_write_their_own_name():
    """Every ``Detection(...)`` in probe/detectors/ names its fields and leaves ``name`` to the registry."""
    files = sorted(Path(detectors.__file__).parent.glob("*.py"))
    assert len(files) > 1  # the package's modules, not only its __init__
    calls = [
        node
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Detection"
    ]
    assert len(calls) >= 10  # the walk found the constructions (additive detectors share one helper's)
    for call in calls:
        assert not call.args and "name" not in {keyword.arg for keyword in call.keywords}


def test_no_library_module_imports_the_package_itself_or_the_analyses():
    """``import probe`` (or a name of ``probe/__init__``) inside ``probe/`` is a cycle: ``probe/__init__``
    imports the modules. Submodules (``from probe import capture``) are fine."""
    package = Path(probe.__file__).parent
    submodules = {path.stem for path in package.glob("*.py")}
    submodules |= {path.parent.name for path in package.glob("*/__init__.py")}
    for path in package.rglob("*.py"):
        if path == package / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
                if node.module == "probe":
                    assert {alias.name for alias in node.names} <= submodules, f"{path}: from probe import"
                    continue
            else:
                continue
            for module in modules:
                assert module != "probe" and not module.startswith("analyses"), f"{path}: imports {module}"


def test_lsd_detector_flags_by_the_key_token_rule(story, tokenizer):
    model, sample = story
    detection = probe.detect("lsd", model, tokenizer, sample, K=64, d=32, alpha=0.0, beta=-20.0)
    lsd, lcl = detection.scores, detection.details["lcl"]
    assert (lsd[:64] == 0).all()  # no short-context score for the first K tokens
    expected = (lsd > 0.0) & (lcl > -20.0)
    expected[sample.prompt_length :] = False
    assert expected.any() and torch.equal(detection.flagged, expected)
    windows = len(range(65, len(sample.input_ids), 32))  # blocks start at K + 1, every d tokens
    assert detection.details["passes"] == 1 + windows


def test_options_lists_what_a_detector_accepts():
    assert detectors.options("embedding_grad") == ["p", "checkpoint", "target"]
    assert "top_k" in detectors.options("attention") and "top_k" not in detectors.options("lsd")


def test_option_default_is_the_signatures_default():
    assert detectors.option_default("leave_one_out", "rank_by") == "key_removal_grad"
    assert detectors.option_default("embedding_grad", "p") == 2.0
    with pytest.raises(TypeError, match="takes no option 'p'"):
        detectors.option_default("lsd", "p")


def test_grad_times_input_is_the_derivative_of_the_answer_logprob_along_each_embeddings_scale():
    """e_i · ∂ log P/∂e_i = d log P(c · e_i)/dc at c = 1 (Euler), by central finite differences, with
    its sign: what gradient × input measures is a token's embedding made louder, not removed."""
    model, sample = probe.tiny_model("llama"), hand_sample()
    found = probe.detect("grad_times_input", model, None, sample)
    ids, targets = sample.input_ids[None], sample.target_positions
    embeds = model.get_input_embeddings()(ids).detach()

    def logprob(position: int, scale: float) -> float:
        scaled = embeds.clone()
        scaled[0, position] *= scale
        with torch.no_grad():
            loss = probe.target_loss(model, ids, targets, inputs_embeds=scaled)
        return float(-len(targets) * loss)

    eps = 1e-3
    for position in range(0, sample.prompt_length, 3):
        derivative = (logprob(position, 1 + eps) - logprob(position, 1 - eps)) / (2 * eps)
        assert float(found.scores[position]) == pytest.approx(derivative, abs=2e-3)


JOURNALED = ["attention", "key_removal_grad", "lexical_overlap", "leave_one_out", "recency"]


def test_a_killed_run_of_detectors_reads_back_those_it_finished(story, tmp_path, passes, monkeypatch):
    """Killed in ``leave_one_out`` (the fourth detector), a journaled :func:`detect_many` has written the
    three before it; run again it reads them (no shared pass), runs the rest, and every detection equals
    an unjournaled run's (one read back keeps the cost it had when it ran; ``leave_one_out``, two of whose
    passes the killed run ran, has no measured cost; passes this process ran and reads again leave it
    measured). Other options are not read."""
    model, sample = story
    options = {"leave_one_out": {"top_m": 3}}
    plain = detectors.detect_many(JOURNALED, model, None, sample, options)
    shared_passes = []
    run_pass = registry.run_pass
    monkeypatch.setattr(registry, "run_pass", lambda *args: shared_passes.append(1) or run_pass(*args))
    passes.kill_after(2)
    with pytest.raises(KeyboardInterrupt), journal.Journal(tmp_path / "job"):
        detectors.detect_many(JOURNALED, model, None, sample, options)
    assert len(list((tmp_path / "job.detections").iterdir())) == 3
    passes.kill_after(None)
    with journal.Journal(tmp_path / "job"):
        again = detectors.detect_many(JOURNALED, model, None, sample, options)
    assert len(shared_passes) == 1  # the killed run's only
    assert passes.calls == 4 - 2  # leave_one_out runs 4 passes (full, top 3): the 2 journaled are read
    for name in JOURNALED:
        first, second = plain[name], again[name]
        assert torch.equal(first.scores, second.scores) and torch.equal(first.flagged, second.flagged)
        assert first.settings == second.settings and second.sample is sample
        for key, value in first.details.items():
            assert (
                torch.equal(value, second.details[key])
                if torch.is_tensor(value)
                else value == second.details[key]
            )
    saved = json.loads(next((tmp_path / "job.detections").iterdir()).read_text())
    assert saved["seconds"] in [again[name].seconds for name in JOURNALED]  # the cost it had when it ran
    assert plain["leave_one_out"].seconds > 0 and again["leave_one_out"].seconds is None
    with journal.Journal(tmp_path / "job"):
        other = detectors.detect_many(["attention"], model, None, sample, {"attention": {"top_k": 3}})
    assert len(shared_passes) == 2 and other["attention"].settings["top_k"] == 3
    with journal.Journal(tmp_path / "fresh") as fresh:  # passes this process ran, read again: measured
        detectors.detect("leave_one_out", model, None, sample, top_m=3)
        twice = detectors.detect("leave_one_out", model, None, sample, top_m=3)
    assert passes.calls == 2 + 4 and fresh.resumed == 0 and twice.seconds > 0
