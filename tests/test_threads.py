"""Probes on one model from several threads: the results of sequential calls, and the model left
exactly as found (attention implementation, train / eval mode, every requires_grad)."""

import threading

import pytest
import torch

import probe

TARGETS = torch.tensor([18, 19])


@pytest.mark.parametrize("n_threads", [2, 4])
def test_concurrent_probes_equal_sequential_ones_and_restore_the_model(n_threads):
    model = probe.tiny_model("gemma3")
    model.train()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)  # a mixed state, restored exactly
    state = (model.config._attn_implementation, model.training, [p.requires_grad for p in model.parameters()])
    inputs = [
        torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(i)) for i in range(n_threads)
    ]
    model.eval()
    sequential = [probe.information_flow(model, ids, TARGETS) for ids in inputs]
    rows = [probe.attention_rows(model, ids, TARGETS - 1) for ids in inputs]
    model.train()
    results, errors = {}, []
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                results[i] = (
                    probe.information_flow(model, inputs[i], TARGETS),
                    probe.attention_rows(model, inputs[i], TARGETS - 1),
                )
        except Exception as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in range(n_threads):
        assert torch.allclose(results[i][0], sequential[i], atol=1e-6)
        assert torch.allclose(results[i][1], rows[i], atol=1e-6)
    assert (
        model.config._attn_implementation,
        model.training,
        [p.requires_grad for p in model.parameters()],
    ) == state
