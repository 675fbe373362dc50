"""probe.probes.lsd against slow, obvious references: truncated forward passes, full logits, sums by hand."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_logprobs import SEQ, full_logprobs, random_ids, truncated_logprob
from transformers import AutoTokenizer

import probe
from probe.models import converted_folder
from probe.probes import logprobs, lsd
from probe.training.objectives import longce_loss, longce_weights


@pytest.fixture
def ids():
    return random_ids()


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
    with pytest.raises(ValueError, match="must be at least 1"):
        logprobs.short_context_blocks(50, K=8, d=0)


def test_key_tokens_are_strict_and_skip_unscored():
    values = torch.tensor([2.0, 2.1, float("nan"), 3.0, 2.5])
    lcl = torch.tensor([0.0, -2.0, 0.0, -1.9, float("nan")])
    assert lsd.key_token_mask(values, lcl).tolist() == [False, False, False, True, False]


def test_longce_weights_are_clipped_at_gamma():
    weights = longce_weights(torch.tensor([float("nan"), -1.0, 0.0, math.log(3.0), 10.0]), gamma=5.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, math.exp(-1.0), 1.0, 3.0, 5.0]))


def test_longce_loss_and_gradients(tiny, ids):
    K, d, gamma = 8, 16, 1.05
    tiny.train()
    loss = longce_loss(tiny, ids, K, d, gamma)
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
    reference = full_logprobs(model, torch.tensor(encoding.input_ids))
    nll = [
        -reference[t - 1, encoding.input_ids[t]].item()
        for t, (a, b) in enumerate(encoding.offset_mapping)
        if t > 0 and (chars := [c for c in range(a, b) if not ESSAY[c].isspace()]) and set(chars) <= key_chars
    ]
    assert result.n_key_tokens == len(nll) > 0
    assert result.longppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    offline = lsd.find_key_tokens(ESSAY, evaluator, gemma_tokenizer, **settings)
    assert probe.longppl(ESSAY, model, smol_tokenizer, key_tokens=offline) == result


class CharTokenizer:
    """A tokenizer over the tiny vocabulary: one character per token, with offsets."""

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
        out = {"input_ids": [ord(c) % 128 for c in text]}
        offsets = {"offset_mapping": [(i, i + 1) for i in range(len(text))]}
        return out | (offsets if return_offsets_mapping else {})

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]


def test_token_lsd_frame(tiny):
    text = "abcdefghij" * 5
    frame = probe.token_lsd(tiny, CharTokenizer(), text, K=16, d=8)
    assert list(frame.columns) == [
        "position", "token_id", "token", "char_start", "char_end",
        "long_logprob", "short_logprob", "lsd", "lcl", "greedy",
    ]  # fmt: skip
    assert "".join(frame.token) == text and frame.lsd.isna().sum() == 17 and frame.lcl.isna().sum() == 1
    np.testing.assert_allclose(frame.lsd, frame.long_logprob - frame.short_logprob)


def test_key_tokens_frame_and_round_trip(tiny, tmp_path):
    text = "abcdefghij" * 5
    keys = lsd.find_key_tokens(text, tiny, CharTokenizer(), K=16, d=8, alpha=0.0, beta=-100.0)
    assert keys.settings == dict(K=16, d=8, alpha=0.0, beta=-100.0, gamma=5.0, official=False, evaluator=None)
    frame = keys.to_frame()
    columns = ["position", "token_id", "char_start", "char_end", "lsd", "lcl", "key", "soft"]
    assert list(frame.columns) == columns
    assert len(frame) == len(text) and frame.key.sum() == keys.key.sum() > 0 and frame.attrs == keys.settings
    keys.save(tmp_path / "keys.json")
    loaded = lsd.KeyTokens.load(tmp_path / "keys.json")
    assert loaded.text == text and loaded.settings == keys.settings and loaded.spans == keys.spans
    np.testing.assert_array_equal(loaded.offsets, keys.offsets)
    for name in ("input_ids", "lsd", "lcl", "key", "soft"):
        torch.testing.assert_close(getattr(loaded, name), getattr(keys, name), equal_nan=True, rtol=0, atol=0)
    result = lsd.longppl(text, tiny, CharTokenizer(), key_tokens=loaded)
    assert result == lsd.longppl(text, tiny, CharTokenizer(), key_tokens=keys)
    assert result.settings == keys.settings | {"model": None}


def hand_result(nll, key, weights, **settings) -> lsd.LongPPLResult:
    arrays = np.array(nll), np.array(key, dtype=bool), np.array(weights)
    return lsd.LongPPLResult.from_tokens(*arrays, settings=settings)


# two documents' per-token values: nll (NaN: the first token, not predicted), key, I_soft (NaN: none)
NAN = float("nan")
DOC_A = dict(nll=[NAN, 1.0, 2.0, 3.0], key=[True, True, False, True], weights=[NAN, NAN, 2.0, 5.0])
DOC_B = dict(nll=[NAN, 0.5, 4.0], key=[False, False, True], weights=[NAN, 1.0, 0.5])


def test_longppl_result_from_tokens_by_hand():
    a = hand_result(**DOC_A)
    assert (a.n_predicted, a.n_key_tokens, a.n_tokens) == (3, 2, 3)  # key at t = 0 dropped
    assert a.longppl == pytest.approx(math.exp((1.0 + 3.0) / 2))
    assert a.longppl_soft == pytest.approx(math.exp((2.0 * 2.0 + 5.0 * 3.0) / (2.0 + 5.0)))
    assert a.ppl == pytest.approx(math.exp((1.0 + 2.0 + 3.0) / 3))
    none = hand_result(nll=[NAN, 1.0], key=[False, False], weights=[NAN, NAN])
    assert math.isnan(none.longppl) and math.isnan(none.longppl_soft) and none.ppl == pytest.approx(math.e)


def test_pool_longppl_is_the_per_token_score_of_all_documents():
    pooled = lsd.pool_longppl([hand_result(**DOC_A, K=8), hand_result(**DOC_B, K=8)])
    # brute force: every token of both documents in one list
    nll, key, weights = ([*DOC_A[name][1:], *DOC_B[name][1:]] for name in ("nll", "key", "weights"))
    key_nll = [n for n, k in zip(nll, key, strict=True) if k]
    soft = [(w, n) for w, n in zip(weights, nll, strict=True) if not math.isnan(w)]
    assert pooled.longppl == pytest.approx(math.exp(sum(key_nll) / len(key_nll)))
    soft_nll = sum(w * n for w, n in soft) / sum(w for w, _ in soft)
    assert pooled.longppl_soft == pytest.approx(math.exp(soft_nll))
    assert pooled.ppl == pytest.approx(math.exp(sum(nll) / len(nll)))
    assert (pooled.n_key_tokens, pooled.n_tokens, pooled.key_spans) == (3, 5, [])
    assert pooled.settings == dict(K=8, documents=2)
    assert lsd.pool_longppl([pooled, hand_result(**DOC_A, K=8)]).settings["documents"] == 3
    single = lsd.pool_longppl([hand_result(**DOC_A)])
    assert (single.longppl, single.longppl_soft, single.ppl) == (
        hand_result(**DOC_A).longppl, hand_result(**DOC_A).longppl_soft, hand_result(**DOC_A).ppl,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"differ in \['K'\]"):
        lsd.pool_longppl([hand_result(**DOC_A, K=8), hand_result(**DOC_B, K=16)])
    with pytest.raises(ValueError, match="at least one"):
        lsd.pool_longppl([])


def test_longppl_result_frame_and_round_trip(tmp_path):
    result = hand_result(**DOC_A, K=8, evaluator="gemma3-270m")
    result = dataclasses.replace(result, key_spans=[(0, 3), (7, 9)])
    frame = result.to_frame()
    assert len(frame) == 1 and (frame.longppl[0], frame.ppl[0]) == (result.longppl, result.ppl)
    assert frame.n_key_spans[0] == 2 and frame.evaluator[0] == "gemma3-270m" and frame.K[0] == 8
    result.save(tmp_path / "result.json")
    assert lsd.LongPPLResult.load(tmp_path / "result.json") == result


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
        assert tiny.config._attn_implementation == probe.attention.IMPLEMENTATION
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
