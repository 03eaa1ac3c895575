import torch
from torch import nn

from lit_ppl.models import ModelSpec, parameters_on_meta


def test_build_empty_has_meta_parameters_and_real_buffers(stories):
    spec = ModelSpec(path=str(stories))
    empty, full = spec.build_empty(torch.float32), spec.build(torch.float32)
    assert all(p.device.type == "meta" for p in empty.parameters())
    buffers = dict(full.named_buffers())
    for name, buffer in empty.named_buffers():  # rotary frequencies: computed, not loaded
        assert buffer.device.type == "cpu"
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0)
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # still tied
    weights = spec.read_weights(torch.float32)
    assert set(full.state_dict()) - set(weights) <= {"lm_head.weight"}


def test_parameters_on_meta_is_undone():
    with parameters_on_meta():
        inside = nn.Linear(3, 4)
    outside = nn.Linear(3, 4)
    assert inside.weight.device.type == "meta" and outside.weight.device.type == "cpu"
