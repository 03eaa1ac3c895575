import torch
from torch import nn

from lit_ppl.model.checkpoint import key_problem
from lit_ppl.model.spec import ModelSpec, parameters_on_meta
from lit_ppl.parallel.sharding import unloaded


def test_build_empty_has_meta_parameters_and_real_buffers(stories):
    spec = ModelSpec(path=str(stories))
    empty, full = spec.build_empty(torch.float32), spec.build(torch.float32)
    assert all(p.device.type == "meta" for p in empty.parameters())
    buffers = dict(full.named_buffers())
    for name, buffer in empty.named_buffers():  # rotary frequencies: computed, not loaded
        assert buffer.device.type == "cpu"
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0)
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # still tied
    weights = spec.full_state_dict(torch.float32)
    assert set(weights) == set(empty.state_dict()) == set(full.state_dict())
    assert all(w.device.type == "cpu" for w in weights.values())


def test_key_problem_names_missing_then_unexpected_keys():
    assert key_problem("m", [], []) is None
    line = key_problem("m", [f"layer.{i}" for i in range(7)], ["extra"])
    assert line == (
        "model.path='m': the checkpoint lacks layer.0, layer.1, layer.2, layer.3, layer.4 and 2 more; "
        "give a complete checkpoint of this architecture"
    )
    assert "does not use: extra" in key_problem("m", [], ["extra"])
    assert "wrong shape: w" in key_problem("m", [], [], ["w"])


def test_unloaded_parameters_are_found():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert unloaded(model) == []
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    assert unloaded(model) == ["1.bias"]


def test_parameters_on_meta_is_undone():
    with parameters_on_meta():
        inside = nn.Linear(3, 4)
    outside = nn.Linear(3, 4)
    assert inside.weight.device.type == "meta" and outside.weight.device.type == "cpu"
