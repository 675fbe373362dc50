"""probe.lsd against slow, obvious references: truncated forward passes, full logits, sets of characters."""

import math

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import probe
from probe import lsd
from probe.models import converted_folder

SEQ = 48


def full_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Textbook log-softmax over the model's full logits: Tensor[seq, vocab] for the rows of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)


def truncated_logprob(model, ids: torch.Tensor, start: int, t: int) -> float:
    """log P(x_t | x[start:t]) from a separate forward pass over the truncated context."""
    return full_logprobs(model, ids[start:t])[-1, ids[t]].item()


@pytest.fixture
def ids():
    return torch.randint(0, 128, (SEQ,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_head_matches_model_logits(arch, ids, monkeypatch):
    model = probe.tiny_model(arch, **({"final_logit_softcapping": 2.0} if arch == "gemma3" else {}))
    monkeypatch.setattr(lsd, "HEAD_CHUNK_ELEMENTS", 128 * 9)  # 9 rows per chunk: several chunks
    reference = full_logprobs(model, ids)[:-1]
    scores = lsd.long_logprobs(model, ids)
    torch.testing.assert_close(scores.target[1:], reference.gather(1, ids[1:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.top[1:], reference.max(-1).values, atol=1e-5, rtol=0)
    assert scores.target[0].isnan()
    some = lsd.long_logprobs(model, ids, positions=[5, 40])
    assert some.target.isnan().sum() == SEQ - 2
    torch.testing.assert_close(some.target[[5, 40]], scores.target[[5, 40]], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("K", "d", "official"), [(10, 7, False), (10, 7, True), (5, 64, True)])
def test_sliding_window_equals_truncated_forwards(tiny, ids, K, d, official):
    # batch_tokens forces several batches and a shorter last window in its own pass
    scores = lsd.short_logprobs(tiny, ids, K, d, official=official, batch_tokens=2 * (K + d))
    first = K if official else K + 1
    assert scores.target[:first].isnan().all() and not scores.target[first:].isnan().any()
    for t in range(first, SEQ):
        start = (t - first) // d * d + (first - K)  # eq. 8: the block's shared window start
        assert t - start >= K and t - start < K + d
        assert scores.target[t].item() == pytest.approx(truncated_logprob(tiny, ids, start, t), abs=1e-5)


def test_exact_mode_equals_per_token_truncation(tiny, ids):
    K = 12
    scores = lsd.short_logprobs(tiny, ids, K, d=1, batch_tokens=64)
    for t in range(K + 1, SEQ):
        assert scores.target[t].item() == pytest.approx(truncated_logprob(tiny, ids, t - K, t), abs=1e-5)


def test_positions_without_a_short_context_score_nan(tiny, ids):
    scores = lsd.short_logprobs(tiny, ids, K=12, d=4, positions=[3, 12])  # both t <= K
    assert scores.target.isnan().all() and scores.top.isnan().all()
    some = lsd.short_logprobs(tiny, ids, K=12, d=4, positions=[3, 20])
    assert some.target.isfinite().sum() >= 1 and some.target[3].isnan()


def test_official_first_block_sees_its_whole_prefix(tiny, ids):
    lsd_values, lcl = lsd.lsd_scores(tiny, ids, K=10, d=8, official=True)
    torch.testing.assert_close(lsd_values[10:18], torch.zeros(8), atol=1e-5, rtol=0)
    assert lsd_values[:10].isnan().all() and lcl[1:].isfinite().all()
    ours, _ = lsd.lsd_scores(tiny, ids, K=10, d=8)
    assert ours[:11].isnan().all() and (ours[11:18].abs() > 1e-4).all()


def test_no_token_with_a_short_context_is_a_clear_error(tiny, ids):
    with pytest.raises(ValueError, match="no token gets a short-context score"):
        lsd.lsd_scores(tiny, ids[:20], K=19)
    with pytest.raises(ValueError, match="longer than the model's context"):
        lsd.lsd_scores(tiny, torch.zeros(tiny.config.max_position_embeddings + 1, dtype=torch.long), K=8)
    with pytest.raises(ValueError, match="must be positive"):
        lsd.short_context_blocks(50, K=8, d=0)


def test_key_tokens_are_strict_and_skip_unscored():
    values = torch.tensor([2.0, 2.1, float("nan"), 3.0, 2.5])
    lcl = torch.tensor([0.0, -2.0, 0.0, -1.9, float("nan")])
    assert lsd.key_token_mask(values, lcl).tolist() == [False, False, False, True, False]


def test_longce_weights_are_clipped_at_gamma():
    weights = lsd.longce_weights(torch.tensor([float("nan"), -1.0, 0.0, math.log(3.0), 10.0]), gamma=5.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, math.exp(-1.0), 1.0, 3.0, 5.0]))


def test_longce_loss_and_gradients(tiny, ids):
    K, d, gamma = 8, 16, 1.05
    tiny.train()
    loss = lsd.longce_loss(tiny, ids, K, d, gamma)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in tiny.named_parameters()}
    assert all(g.isfinite().all() for g in grads.values()) and any(g.abs().sum() > 0 for g in grads.values())
    # reference: weights from brute-force truncated passes, CE from the full logits, weights constant
    tiny.zero_grad()
    long = torch.log_softmax(tiny(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
    short = torch.ones(SEQ - 1)
    for t in range(K + 1, SEQ):
        start = (t - K - 1) // d * d + 1
        short[t - 1] = math.exp(long[t - 1].item() - truncated_logprob(tiny, ids, start, t))
    weights = short.clamp(max=gamma)
    assert (weights <= gamma).all() and (weights == gamma).any() and (weights < 1).any()
    reference = -(weights * long).mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    for name, p in tiny.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- alignment by characters

TEXT = "The key is 12345 ok"
#       0123456789012345678
WORDS = np.array([[0, 3], [3, 7], [7, 10], [10, 16], [16, 19]])  # "The", " key", " is", " 12345", " ok"
TRIMMED = np.array([[0, 3], [4, 7], [8, 10], [11, 14], [14, 16], [17, 19]])  # no spaces; "123", "45"
CHARS = np.array([[i, i + 1] for i in range(len(TEXT))])


def keys(source_offsets, source_values, target_offsets, skip_spaces=True):
    values = lsd.transfer_to_tokens(
        TEXT, source_offsets, np.asarray(source_values, float), target_offsets, "all", skip_spaces
    )
    return [TEXT[a:b] for (a, b), v in zip(target_offsets, values, strict=True) if v == 1]


def test_finer_evaluated_tokens_each_become_key():
    assert keys(WORDS, [0, 0, 0, 1, 0], CHARS) == [" ", "1", "2", "3", "4", "5"]


def test_coarser_evaluated_token_is_key_only_if_wholly_covered():
    assert keys(TRIMMED, [0, 0, 0, 1, 0, 0], WORDS) == []  # " 12345" is only partly key ("123")
    assert keys(TRIMMED, [0, 0, 0, 1, 1, 0], WORDS) == [" 12345"]  # the uncovered space is ignored
    assert keys(TRIMMED, [0, 0, 0, 1, 1, 0], WORDS, skip_spaces=False) == []  # official: raw containment
    assert keys(WORDS, [0, 0, 0, 1, 0], TRIMMED) == ["123", "45"]
    assert keys(WORDS, [np.nan, 1, 1, 1, 1], WORDS) == [" key", " is", " 12345", " ok"]


def test_soft_weights_are_string_level_averages():
    weights = lsd.transfer_to_tokens(TEXT, TRIMMED, np.array([1, 1, 1, 3, 1, np.nan]), WORDS, "mean")
    np.testing.assert_allclose(weights, [1, 1, 1, (3 * 3 + 1 * 2) / 5, np.nan])


def test_character_runs_merge_touching_spans():
    assert lsd.character_runs(TRIMMED, [1, 0, 0, 1, 1, 0]) == [(0, 3), (11, 16)]


class NoOffsets:
    """A tokenizer without offset mapping (like tiktoken-based ones): raises when asked for offsets."""

    def __init__(self, tokenizer, lowercase=False):
        self.tokenizer, self.lowercase = tokenizer, lowercase

    def __call__(self, text, return_offsets_mapping=False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("no offsets")
        return self.tokenizer(text, **kwargs)

    def decode(self, ids, **kwargs):
        text = self.tokenizer.decode(ids, **kwargs)
        return text.lower() if self.lowercase else text


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_offsets_fallback_rebuilds_the_text(name):
    tokenizer = AutoTokenizer.from_pretrained(converted_folder(name))
    text = " ".join(probe.tasks.noise.sentences()[:40]) + " Ünïcödé ✓ 12345\n\n  end"
    ids, offsets = lsd.encode(tokenizer, text)
    fallback_ids, fallback = lsd.encode(NoOffsets(tokenizer), text)
    assert torch.equal(ids, fallback_ids)
    assert "".join(text[a:b] for a, b in fallback) == text
    differ = (offsets != fallback).any(axis=1)  # only where byte tokens split a character
    assert differ.sum() <= 3 and all(not text[a:b].isascii() for a, b in offsets[differ])
    with pytest.raises(ValueError, match="cannot be mapped to characters"):
        lsd.encode(NoOffsets(tokenizer, lowercase=True), text)


# --------------------------------------------------------------------------- LongPPL


@pytest.fixture(scope="module")
def smol_tokenizer():
    return AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))


ESSAY = "The pass key is 73915. Remember it. " * 3 + "What is the pass key? The pass key is 73915."


@pytest.mark.real
def test_longppl_with_itself_as_evaluator(smol_tokenizer):
    model = probe.tiny_model("llama", vocab_size=len(smol_tokenizer))
    result = probe.longppl(ESSAY, model, smol_tokenizer, K=8, d=4, alpha=0.0, beta=-100.0)
    ids = torch.tensor(smol_tokenizer(ESSAY).input_ids)
    lsd_values, lcl = lsd.lsd_scores(model, ids, K=8, d=4)
    key = (lsd_values > 0) & (lcl > -100)
    assert 0 < result.n_key_tokens == key.sum() and result.n_tokens == len(ids) - 1
    assert result.longppl == pytest.approx(math.exp(-lcl[key].mean().item()), rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(-lcl[1:].mean().item()), rel=1e-5)
    weights = lsd_values.exp().clamp(max=5.0)
    scored = ~weights.isnan()
    soft = math.exp(-(weights[scored] * lcl[scored]).sum().item() / weights[scored].sum().item())
    assert result.longppl_soft == pytest.approx(soft, rel=1e-5)


@pytest.mark.real
def test_longppl_across_tokenizers(smol_tokenizer):
    gemma_tokenizer = AutoTokenizer.from_pretrained(converted_folder("gemma3-270m"))
    evaluator = probe.tiny_model("llama", vocab_size=len(gemma_tokenizer), seed=1)
    model = probe.tiny_model("llama", vocab_size=len(smol_tokenizer), seed=2)
    settings = dict(K=8, d=4, alpha=0.0, beta=-100.0)
    result = probe.longppl(ESSAY, model, smol_tokenizer, evaluator, gemma_tokenizer, **settings)
    # naive reference: key characters as a set; a SmolLM2 token is key if its non-space characters are in it
    key_chars = {c for a, b in result.key_spans for c in range(a, b)}
    encoding = smol_tokenizer(ESSAY, return_offsets_mapping=True)
    logprobs = full_logprobs(model, torch.tensor(encoding.input_ids))
    nll = [
        -logprobs[t - 1, encoding.input_ids[t]].item()
        for t, (a, b) in enumerate(encoding.offset_mapping)
        if t > 0 and (chars := [c for c in range(a, b) if not ESSAY[c].isspace()]) and set(chars) <= key_chars
    ]
    assert result.n_key_tokens == len(nll) > 0
    assert result.longppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    offline = lsd.find_key_tokens(ESSAY, evaluator, gemma_tokenizer, **settings)
    assert probe.longppl(ESSAY, model, smol_tokenizer, key_tokens=offline) == result


def test_token_lsd_frame(tiny):
    class Tokenizer:  # a tokenizer over the tiny vocabulary: one character per token
        def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
            out = {"input_ids": [ord(c) % 128 for c in text]}
            return out | (
                {"offset_mapping": [(i, i + 1) for i in range(len(text))]} if return_offsets_mapping else {}
            )

        def convert_ids_to_tokens(self, ids):
            return [chr(i) for i in ids]

    text = "abcdefghij" * 5
    frame = probe.token_lsd(tiny, Tokenizer(), text, K=16, d=8)
    assert list(frame.columns) == [
        "position", "token_id", "token", "char_start", "char_end",
        "long_logprob", "short_logprob", "lsd", "lcl", "greedy",
    ]  # fmt: skip
    assert "".join(frame.token) == text and frame.lsd.isna().sum() == 17 and frame.lcl.isna().sum() == 1
    np.testing.assert_allclose(frame.lsd, frame.long_logprob - frame.short_logprob)


# --------------------------------------------------------------------------- attention windows


def test_attention_window_equals_truncation_in_one_layer(ids):
    model = probe.tiny_model("llama")
    model.model.layers = model.model.layers[:1]  # one layer: its reach is the window exactly
    model.config.num_hidden_layers = 1
    window = 9
    with probe.attention_window(model, window):
        windowed = full_logprobs(model, ids)
    for t in (3, 9, 30, SEQ - 1):
        reference = full_logprobs(model, ids[max(0, t - window + 1) : t + 1])[-1]
        torch.testing.assert_close(windowed[t], reference, atol=1e-5, rtol=0)


def test_attention_window_changes_attention_and_is_restored(tiny, ids):
    before = full_logprobs(tiny, ids)
    with probe.attention_window(tiny, 4):
        assert tiny.config._attn_implementation == probe.capture.IMPLEMENTATION
        windowed = full_logprobs(tiny, ids)
        generated = tiny.generate(ids[None, :20], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(windowed[:4], before[:4], atol=1e-5, rtol=0)  # the first 4 see no more
    assert (windowed[10:] - before[10:]).abs().max() > 1e-2
    assert tiny.config._attn_implementation == "sdpa"
    torch.testing.assert_close(full_logprobs(tiny, ids), before)
    with probe.attention_window(tiny, 4):  # generation under the window = greedy on windowed logits
        step = full_logprobs(tiny, generated[0, :20]).argmax(-1)[-1]
    assert generated[0, 20] == step
    with pytest.raises(RuntimeError), probe.attention_window(tiny, 4):
        raise RuntimeError
    assert tiny.config._attn_implementation == "sdpa"
    with probe.attention_window(tiny, SEQ):
        torch.testing.assert_close(full_logprobs(tiny, ids), before, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- a real model


@pytest.mark.real
def test_passkey_answer_digits_have_high_lsd(smollm2):
    model, tokenizer = smollm2
    sample = probe.tasks.make("passkey", tokenizer, 512, seed=0, depth=0.2)
    lsd_values, lcl = lsd.lsd_scores(model, sample.input_ids, K=128, d=128)
    (start, end), *_ = sample.spans["answer"]
    digits = [t for t in range(start, end) if tokenizer.decode(sample.input_ids[t]).strip().isdigit()]
    assert digits and (lsd_values[digits] > 1.0).all()
    assert lsd_values[digits].min() > lsd_values[: sample.spans["question"][0][0]].nan_to_num().quantile(0.95)
