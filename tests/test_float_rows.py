"""Float weights held by rows (:mod:`lit_ppl.parallel.float_rows`) on 2 real gloo processes: a backward pass
through layers held by rows gives the input gradients of the whole model, and autograd keeps a reference to each
gathered weight (gathered again for the backward pass) rather than the weight itself."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.nodes import free_port

from lit_ppl.parallel import float_rows
from lit_ppl.parallel.float_rows import FloatRows


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _input_grad(lm, ids: torch.Tensor) -> torch.Tensor:
    """The gradient of the summed log-probabilities at the input embeddings' output."""
    embeds = lm.get_input_embeddings()(ids).detach().requires_grad_(True)
    lm(inputs_embeds=embeds).logits.log_softmax(-1).sum().backward()
    return embeds.grad


def _worker(rank: int, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        ids = torch.randint(0, 64, (1, 9 + 4 * rank), generator=torch.Generator().manual_seed(rank))
        whole = _input_grad(_llama(), ids)
        lm = _llama()
        for p in lm.parameters():
            p.requires_grad_(False)
        names = [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
        FloatRows(lm, names, init_device_mesh("cpu", (2,)))
        saved = []
        original = float_rows._Saved.__init__

        def counted(self, *args):
            saved.append(args[0])
            original(self, *args)

        float_rows._Saved.__init__ = counted
        with FloatRows.regathered():
            by_rows = _input_grad(lm, ids)
        held = [type(lm.get_submodule(n).weight).__name__ for n in names]
        out[rank] = (whole, by_rows, len(names), len({id(m) for m in saved}), set(held), float_rows._GATHERED)
    finally:
        dist.destroy_process_group()


def test_a_backward_pass_through_rows_regathers_each_weight():
    """Each rank's sequence has its own length (9 and 13 tokens): the graph is the same, so the ranks' gathers in
    the backward pass pair up (a mismatch would time out)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(free_port(), out), nprocs=2)
        for rank in range(2):
            whole, by_rows, layers, saved_layers, held, left = out[rank]
            torch.testing.assert_close(by_rows, whole, rtol=1e-6, atol=1e-7)
            assert layers == 14 and saved_layers == layers  # every layer saved as a reference, none as a tensor
            assert held == {"DTensor"} and not left  # after the pass: rows again, no gathered weight kept
