"""The key-token task: a real essay token picked by LSD on the model, explained from earlier sentences."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from reference import token_starts, tokens_starting_in
from transformers import AutoTokenizer

import probe
from probe import tasks
from probe.models import converted_folder
from probe.tasks.noise import sentences

TOKENIZERS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
ANY = {"alpha": -math.inf, "beta": -math.inf}  # every scored token is a candidate (a random model)


@functools.cache
def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(converted_folder(name))


@functools.cache
def tiny_for(name: str):
    return probe.tiny_model("llama", vocab_size=len(tokenizer(name)), max_position_embeddings=4608)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("length", [512, 4096])
def test_key_token_builds_for_every_bundled_tokenizer(name, length):
    model, tok = tiny_for(name), tokenizer(name)
    sample = tasks.make("key-token", tok, length, seed=1, model=model, **ANY)
    t = int(sample.target_positions[-1])
    assert abs(sample.prompt_length - length) <= 0.05 * length + 1 and sample.cuts == ()
    assert sample.input_ids.tolist() == tok(sample.text).input_ids  # tokenized as the model reads it
    assert sample.prompt_length == t and tok.decode(sample.input_ids[t]).strip() == sample.answer
    assert sample.text.endswith(sample.answer) and sample.span_text("question")[0] in " ".join(sentences())
    sources = sample.sources
    assert len(sources) > 5 and {s.category for s in sources} == {"context"}
    assert sources[-1].end <= sample.spans["question"][0][0]
    starts = token_starts(sample.text, sample.offsets)
    for source in sources:
        chars = sample.char_spans["context"][source.index]
        assert tokens_starting_in(starts, chars) == list(range(source.start, source.end))
    with torch.no_grad():  # LCL as recorded: log P(x_t | x_<t) of the model, by a plain forward
        logits = model(sample.input_ids[None], logits_to_keep=torch.tensor([t - 1])).logits[0, 0]
    lcl = float(logits.log_softmax(-1)[sample.input_ids[t]])
    assert sample.options["lcl"] == pytest.approx(lcl, abs=1e-4)
    assert sample.options["K"] == length // 8 and sample.options["lsd"] == sample.options["lsd"]  # not NaN


@pytest.mark.parametrize("name", TOKENIZERS)
def test_key_token_at_the_models_full_context_stays_within_it(name):
    """At ``length`` = the context, the window of candidates (±5 %) stops at the context: the key token
    is at most its last position, and LSD never reads past it."""
    tok = tokenizer(name)
    model = probe.tiny_model("llama", vocab_size=len(tok), max_position_embeddings=512)
    positions = [
        int(tasks.make("key-token", tok, 512, seed, model=model, **ANY).target_positions[-1])
        for seed in range(4)
    ]
    assert all(0.95 * 512 <= t < 512 for t in positions)
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        tasks.make("key-token", tok, 513, model=model, **ANY)


def test_key_token_refuses_what_it_cannot_do():
    model, tok = tiny_for("smollm2-135m"), tokenizer("smollm2-135m")
    with pytest.raises(ValueError, match="model=model"):
        tasks.make("key-token", tok, 512, seed=0)
    with pytest.raises(ValueError, match="chat template"):
        tasks.make("key-token", tok, 512, seed=0, model=model, chat=True)
    with pytest.raises(ValueError, match="no depth"):
        tasks.make("key-token", tok, 512, seed=0, depth=0.5, model=model)
    with pytest.raises(ValueError, match="no key token"):
        tasks.make("key-token", tok, 512, seed=0, model=model, alpha=1e9)


@pytest.mark.real
def test_a_real_key_token_depends_on_far_context(smollm2):
    """SmolLM2 at 1K: the token's LSD and LCL pass eq. 4, and removing every source (the far context)
    lowers its log-probability."""
    model, tok = smollm2
    sample = tasks.make("key-token", tok, 1024, seed=0, model=model)
    assert sample.options["lsd"] > 2 and sample.options["lcl"] > -2
    removed = torch.ones(1, len(sample.sources), dtype=torch.bool)
    kept, gone = probe.faithfulness.answer_scores(model, sample, torch.cat([~removed, removed])).logprob
    assert float(kept) == pytest.approx(sample.options["lcl"], abs=1e-3) and gone < kept - 1
