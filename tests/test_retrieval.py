"""Retrieval heads and head ablation, checked against slow references and a hand-built copying head."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from reference import eager_forward
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import probe
from probe import tasks
from probe.probes.retrieval import RetrievalScores, copy_hits, decode_with_argmax, needle_answer_positions


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer (fast, with offsets)."""
    return AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def niah(tokenizer):
    return tasks.make("niah", tokenizer, 160, seed=0, depth=0.4)


def test_needle_answer_positions_decode_to_the_answer(tokenizer):
    sample = tasks.make("passkey", tokenizer, 200, seed=1)
    occurrences = needle_answer_positions(sample)
    assert len(occurrences) == 2  # the passkey needle states its key twice
    (start, end), *_ = sample.spans["supporting"]
    for positions in occurrences:
        assert start <= positions.min() and positions.max() < end
        assert tokenizer.decode(sample.input_ids[positions]).strip() == sample.answer


def test_needle_answer_positions_read_the_sample_offsets(tokenizer):
    sample = tasks.make("multivalue-niah", tokenizer, 200, seed=2, needles=3)
    occurrences = needle_answer_positions(sample)
    assert len(occurrences) == 3  # every city needle holds the shared activity
    for positions, (start, end) in zip(occurrences, sample.spans["supporting"], strict=True):
        assert start <= positions.min() and positions.max() < end
        assert tokenizer.decode(sample.input_ids[positions]).strip() == sample.answer


def test_needle_answer_positions_refuse_a_needle_without_its_answer(tokenizer):
    sample = tasks.make("niah", tokenizer, 200, seed=0)
    sample.answer = "31415926"  # a number that no needle states
    with pytest.raises(ValueError, match="does not occur in the supporting spans"):
        needle_answer_positions(sample)


def test_copy_hits_by_hand():
    sequence = torch.tensor([5, 7, 8, 9, 1, 7, 8])  # needle answer 7 8 at positions 1-2; generated 7 8 at 5-6
    generated = torch.tensor([7, 8])
    argmax = torch.tensor(
        [
            [[1, 0], [1, 2]],  # step 0 (generates 7): head (0,0) copies pos 1; (1,0) too; (1,1) looks at 8
            [[2, 2], [3, 1]],  # step 1 (generates 8): (0,0), (0,1) copy pos 2; (1,0) looks at 9; (1,1) at 7
        ]
    )
    hits = copy_hits(sequence, generated, argmax, [torch.tensor([1, 2])])
    torch.testing.assert_close(hits, torch.tensor([[1.0, 0.5], [0.5, 0.0]]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decoding_row_matches_eager_attention(arch, tokenizer, niah):
    """Every step's argmax and token equal a full eager forward (no cache) on the sequence so far."""
    model = probe.tiny_model(arch, vocab_size=len(tokenizer))
    generated, argmax = decode_with_argmax(model, niah.prompt_ids, 5)
    sequence = niah.prompt_ids[None]
    for step in range(5):
        attentions, _ = eager_forward(model, sequence)
        expected = torch.stack([a[0, :, -1].argmax(-1) for a in attentions])  # [layers, heads]
        torch.testing.assert_close(argmax[step], expected, rtol=0, atol=0)
        with torch.no_grad():
            token = model(input_ids=sequence).logits[0, -1].argmax()
        assert generated[step] == token
        sequence = torch.cat([sequence, token.view(1, 1)], dim=1)


def copying_model(vocab_size: int, offset: int, gain: float = 20.0) -> LlamaForCausalLM:
    """One layer, two heads. Head 0 always attends ``offset`` positions back and writes that token's
    embedding into the residual stream, so the model copies; head 1 attends uniformly, writes nothing.

    Head 0's query and key are constant (biases only); RoPE makes q_m·k_n = q0·R(n − m + offset) q0,
    a sum of cosines over all frequencies, maximal only at n = m − offset.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        head_dim=128,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    eye = torch.eye(128)
    with torch.no_grad():
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        query = torch.cat([torch.full((64,), 18.0), torch.zeros(64)])
        cos, sin = model.model.rotary_emb(query[None, None], torch.tensor([[offset]]))
        key, _ = apply_rotary_pos_emb(query[None, None, None], query[None, None, None], cos, sin)
        attention.q_proj.bias[:128] = query
        attention.k_proj.bias[:128] = key.flatten()
        attention.v_proj.weight[:128] = eye
        attention.o_proj.weight[:, :128] = gain * eye
    return model


def test_a_forced_copy_head_scores_one_and_the_others_zero(tokenizer, niah):
    (needle,) = needle_answer_positions(niah)
    offset = niah.prompt_length - 1 - int(needle[0])  # the last prompt token reads the first answer token
    model = copying_model(len(tokenizer), offset)
    result = probe.retrieval_scores(model, tokenizer, [niah, niah])
    assert result.trials.correct.tolist() == [1.0, 1.0]
    assert result.trials.generated[0].startswith(niah.answer)
    torch.testing.assert_close(result.mean(), torch.tensor([[1.0, 0.0]]))
    assert result.retrieval_heads() == [(0, 0)]
    assert result.logo_score() == 1.0


def test_wrong_answers_do_not_count(tokenizer, niah):
    model = copying_model(len(tokenizer), offset=3)  # copies the wrong tokens
    gated = probe.retrieval_scores(model, tokenizer, [niah])
    assert gated.trials.correct.tolist() == [0.0]
    assert gated.to_json() == {"0-0": [], "0-1": []}
    torch.testing.assert_close(gated.mean(), torch.zeros(1, 2))


def test_scores_json_round_trip_and_logo_score(tmp_path):
    scores = torch.tensor([[[0.9, 0.05, 0.3]], [[0.7, 0.0, 0.1]], [[0.2, 1.0, 1.0]]])  # [trials, 1, 3 heads]
    correct = pd.DataFrame({"correct": [1.0, 1.0, 0.0]})  # the third trial was answered wrongly
    result = RetrievalScores(scores, correct, {"require_correct": True})
    torch.testing.assert_close(result.mean(), torch.tensor([[0.8, 0.025, 0.2]]))
    expected = {"0-0": [0.9, 0.7], "0-1": [0.05, 0.0], "0-2": [0.3, 0.1]}
    assert {key: pytest.approx(values) for key, values in result.to_json().items()} == expected
    assert result.retrieval_heads() == [(0, 0), (0, 2)]
    assert result.logo_score() == pytest.approx(0.5)  # mean of 0.8 and 0.2; 0.025 is below 0.1
    assert result.logo_score(k=1) == pytest.approx(0.8)
    (tmp_path / "heads.json").write_text(json.dumps(result.to_json()))  # Wu et al.'s published layout
    loaded = RetrievalScores.load(tmp_path / "heads.json")
    torch.testing.assert_close(loaded.mean(), result.mean())
    assert loaded.settings["require_correct"] is False and not loaded.argmax


def test_save_and_load_round_trip_everything(tokenizer, niah, tmp_path):
    (needle,) = needle_answer_positions(niah)
    model = copying_model(len(tokenizer), niah.prompt_length - 1 - int(needle[0]))
    other = tasks.make("passkey", tokenizer, 200, seed=1, depth=0.1)
    result = probe.retrieval_scores(model, tokenizer, [niah, other])
    result.save(tmp_path / "scores.json")
    loaded = RetrievalScores.load(tmp_path / "scores.json")
    assert torch.equal(loaded.scores, result.scores) and loaded.settings == result.settings
    pd.testing.assert_frame_equal(loaded.trials, result.trials)
    assert torch.equal(loaded.counted, result.counted)
    assert len(loaded.argmax) == 2 and all(
        torch.equal(a, b) and a.dtype == torch.long for a, b in zip(loaded.argmax, result.argmax, strict=True)
    )
    pd.testing.assert_frame_equal(loaded.to_frame(), result.to_frame())
    assert loaded.to_json() == result.to_json() and not list(tmp_path.glob(".*tmp*"))


def test_concat_of_single_trials_equals_one_call_on_all(tokenizer, niah):
    (needle,) = needle_answer_positions(niah)
    model = copying_model(len(tokenizer), niah.prompt_length - 1 - int(needle[0]))
    samples = [niah, tasks.make("passkey", tokenizer, 200, seed=1, depth=0.1)]
    whole = probe.retrieval_scores(model, tokenizer, samples)
    joined = RetrievalScores.concat([probe.retrieval_scores(model, tokenizer, [s]) for s in samples])
    assert torch.equal(joined.scores, whole.scores) and joined.settings == whole.settings
    pd.testing.assert_frame_equal(joined.trials, whole.trials)
    assert all(torch.equal(a, b) for a, b in zip(joined.argmax, whole.argmax, strict=True))
    assert joined.to_json() == whole.to_json()
    other = RetrievalScores(whole.scores, whole.trials, {**whole.settings, "require_correct": False})
    with pytest.raises(ValueError, match="cannot concatenate"):
        RetrievalScores.concat([whole, other])


def test_to_frame_is_one_row_per_head_with_the_mean_best_first():
    scores = torch.tensor([[[0.1, 0.4], [0.0, 0.5]], [[0.3, 0.2], [0.1, 0.9]]])  # [trials, 2 layers, 2 heads]
    result = RetrievalScores(scores, pd.DataFrame({"correct": [1.0, 1.0]}), {"require_correct": True})
    frame = result.to_frame()
    assert list(frame.columns) == ["layer", "head", "score"]
    assert list(zip(frame["layer"], frame["head"], strict=True)) == [(1, 1), (0, 1), (0, 0), (1, 0)]
    np.testing.assert_allclose(frame.score, [0.7, 0.3, 0.2, 0.05], rtol=1e-6)


def o_proj_ablation_reference(model, input_ids, heads):
    """Logits with the given heads' slices of the output projection's input zeroed by hand."""
    handles = []
    for layer, head in heads:
        attention = model.model.layers[layer].self_attn

        def zero(module, args, head=head, dim=attention.head_dim):
            hidden = args[0].clone()
            hidden[..., head * dim : (head + 1) * dim] = 0
            return (hidden,)

        handles.append(attention.o_proj.register_forward_pre_hook(zero))
    try:
        with torch.no_grad():
            return model(input_ids=input_ids).logits
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_ablate_heads_matches_zeroing_the_output_projection_input(arch):
    model = probe.tiny_model(arch)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    heads = [(0, 1), (2, 0), (2, 1)]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with probe.ablate_heads(model, heads):
            ablated = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(ablated, o_proj_ablation_reference(model, ids, heads), rtol=0, atol=1e-5)
    assert (ablated - before).abs().max() > 1e-3  # the ablation changes the output
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.config._attn_implementation == "sdpa"


def test_ablate_heads_restores_the_model_after_an_exception():
    model = probe.tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"), probe.ablate_heads(model, [(0, 0)]):
        model(input_ids=torch.tensor([[1, 2, 3]]))
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        clean = model(input_ids=torch.tensor([[1, 2, 3]])).logits
        with probe.ablate_heads(model, []):
            same = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    torch.testing.assert_close(same, clean, rtol=0, atol=0)


def test_ablate_heads_in_generate_and_bad_heads():
    model = probe.tiny_model("llama")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad(), probe.ablate_heads(model, [(layer, h) for layer in range(3) for h in range(4)]):
        silent = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3)
    assert silent.shape == (1, 11)
    with pytest.raises(IndexError, match="head 4 out of range"), probe.ablate_heads(model, [(0, 4)]):
        pass
    with pytest.raises(IndexError, match="out of range"), probe.ablate_heads(model, [(3, 0)]):
        pass
