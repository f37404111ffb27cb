"""The trainer's start-up check that packed rows keep their samples apart."""

import pytest
import torch
import transformers

from llamarl_core.pipeline import learner


def _model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50))


def test_installed_transformers_keeps_packed_samples_apart():
    learner.check_packed_rows_attend_within_samples(_model())


def test_check_fails_when_packed_samples_attend_to_each_other(monkeypatch):
    """Given an explicit all-ones attention mask, transformers no longer detects
    packing from the position ids (as versions before 4.53.1 never did): the
    samples of a row attend to each other, and the check must say so."""
    def unmasked_logits(model, input_ids, position_ids):
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=torch.ones_like(input_ids),
                     use_cache=False).logits[:, :-1]

    monkeypatch.setattr(learner, "_logits", unmasked_logits)
    with pytest.raises(RuntimeError, match=r"lets packed samples attend to each other .* transformers>=4\.53\.1"):
        learner.check_packed_rows_attend_within_samples(_model())


def test_check_leaves_the_callers_random_stream_alone():
    """The trainer seeds, builds its model, then checks: what it draws next must
    not depend on the check."""
    torch.manual_seed(3)
    _model()
    expected = torch.rand(4)
    torch.manual_seed(3)
    learner.check_packed_rows_attend_within_samples(_model())
    assert torch.equal(torch.rand(4), expected)
