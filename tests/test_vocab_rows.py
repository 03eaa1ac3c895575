"""A vocabulary held by blocks of rows under FSDP (:mod:`lit_ppl.parallel.vocab_rows`): the same lookups and logits
as the whole table, and on 2 real gloo processes the same NLL as one process, with ranks that score different
numbers of chunks (every block's all-gather must still have both ranks: a mismatch would hang, here time out)."""

from __future__ import annotations

import datetime
import itertools
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.nodes import free_port

from lit_ppl.evaluation.reference import full_head
from lit_ppl.metrics.kl import token_stats
from lit_ppl.model.placement import Placement, place, place_head
from lit_ppl.model.scorer import check_scorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.vocab_rows import RowsEmbedding, RowsHead, hold_by_rows, row_targets

CHUNK = 5  # positions per head call: rank 0's 23 take 5 calls, rank 1's 9 take 2
LENGTHS = (23, 9)


def _llama(tied: bool, vocab: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_blocks_of_rows_give_the_tables_lookups_and_logits(tied):
    lm = _llama(tied)
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = lm(input_ids=ids).logits
        table = lm.get_input_embeddings().weight.clone()
        held = hold_by_rows(lm, 16 * 4 * 100)  # 100 rows a block: 6 blocks, the last of 12 rows
        after = lm(input_ids=ids).logits
    assert len(held) == (1 if tied else 2) and [len(t.blocks) for t in held] == [6] * len(held)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    assert isinstance(embed, RowsEmbedding) and isinstance(head, RowsHead) and (embed.rows is head.rows) == tied
    assert embed.weight.shape == (512, 16) and embed.weight.is_meta  # read for its shape, never for values
    assert torch.equal(torch.cat([b.weight for b in embed.rows.blocks]), table)
    assert torch.equal(embed(ids), torch.nn.functional.embedding(ids, table))
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    assert set(row_targets(lm)) == {"model.embed_tokens.weight", "lm_head.weight"}  # tied: both names, one table
    assert [start for start, _ in row_targets(lm)["model.embed_tokens.weight"]] == [0, 100, 200, 300, 400, 500]


def test_a_table_of_one_block_or_a_subclass_stays_whole():
    lm = _llama(True)
    assert hold_by_rows(lm, 512 * 16 * 4) == []  # the whole table fits in one block
    lm.model.embed_tokens.max_norm = 1.0  # renormalises rows as it looks them up: not a plain lookup
    assert hold_by_rows(lm, 16 * 4 * 100) == []
    assert type(lm.get_input_embeddings()) is torch.nn.Embedding


def _int8() -> object:
    from lit_ppl.config.quant import quant_config
    from lit_ppl.quant.quantizer import Quantizer

    return Quantizer(quant_config({"name": "int8"}))


def _worker(rank: int, models: list[str], port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        for model in models:
            out[rank, model] = _scores(rank, model)
    finally:
        dist.destroy_process_group()


def _scores(rank: int, model: str) -> tuple:
    """On this rank of 2 (fsdp): whether the float and the int8 model hold their vocabulary by rows, the NLL of this
    rank's ids, the model against itself as a live reference, its whole head as saved, and the int8 model's NLL."""

    def broadcast(obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    where = Placement(Layout(dp_replicate=1, dp_shard=2, tp=1), torch.device("cpu"), CHUNK, broadcast)
    scorer, _ = place(ModelSpec(path=model), where, torch.float32)
    check_scorer(scorer, torch.device("cpu"))
    embed, head = scorer.lm.get_input_embeddings(), scorer.lm.get_output_embeddings()
    held = isinstance(embed, RowsEmbedding) and isinstance(head, RowsHead)
    reference, _ = place(ModelSpec(path=model), where, torch.float32)  # a live reference: held by rows too
    ids = torch.randint(0, 512, (1, LENGTHS[rank] + 1), generator=torch.Generator().manual_seed(rank))
    index, targets = torch.arange(LENGTHS[rank]), ids[0, 1:]

    def compare(hidden: torch.Tensor, run: object, reference: object = reference, streamed: bool = False) -> dict:
        def stats(hidden_base: torch.Tensor, base: object) -> dict:
            blocks = (run.head_blocks, base.head_blocks) if streamed else None
            return token_stats(
                hidden, hidden_base, targets, run.head, base.head, CHUNK, lockstep=run.lockstep, blocks=blocks
            )

        return reference(ids[:, :-1], index, targets, then=stats)

    int8, _ = place(ModelSpec(path=model), where, torch.float32, _int8())  # its table stays float: by rows
    held = held and isinstance(int8.lm.get_output_embeddings(), RowsHead) and int8.lockstep is not None
    held = held and len(scorer.head_blocks) == len(int8.head_blocks) > 1  # the loss streams over the blocks
    table = full_head(scorer)["weight"]
    linear = torch.nn.Linear(16, 512, bias=False)
    linear.weight = torch.nn.Parameter(table.clone(), requires_grad=False)
    stored, group = place_head(linear, where, scorer.lm)  # a saved reference's head: held by rows too
    hidden = torch.randn(LENGTHS[rank], 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = stored(hidden)
    held = held and isinstance(stored, RowsHead) and group is not None and len(stored.rows.blocks) > 1
    held = held and torch.allclose(logits, torch.nn.functional.linear(hidden, table), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        nll = scorer(ids[:, :-1], index, targets)
        kl = scorer(ids[:, :-1], index, targets, then=compare)
        nll8 = int8(ids[:, :-1], index, targets)
        # Against the int8 model (its table stays float, held by rows), streamed over both tables' blocks.
        kl8 = scorer(ids[:, :-1], index, targets, then=partial(compare, reference=int8, streamed=True))
    return held, nll, scorer.lockstep is not None, kl, full_head(scorer)["weight"], nll8, kl8


def test_fsdp_holds_the_vocabulary_by_rows_and_scores_as_one_process(tmp_path: Path):
    models = {tied: tmp_path / ("tied" if tied else "untied") for tied in (True, False)}
    for tied, model in models.items():
        _llama(tied).save_pretrained(model)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=([str(m) for m in models.values()], free_port(), out), nprocs=2)
        for model, rank in itertools.product(models.values(), range(2)):
            _check_against_one_process(model, rank, out[rank, str(model)])


def _check_against_one_process(model: Path, rank: int, scores: tuple) -> None:
    single = Placement(None, torch.device("cpu"), CHUNK, lambda o: o)
    one, _ = place(ModelSpec(path=str(model)), single, torch.float32)
    table = one.lm.get_output_embeddings().weight
    one8, _ = place(ModelSpec(path=str(model)), single, torch.float32, _int8())
    held, nll, lockstep, kl, saved, nll8, kl8 = scores
    assert held and lockstep
    # The same model as its own reference: the same logits on both sides (float64 statistics).
    assert torch.equal(kl["nll"], kl["nll_base"]) and not kl["kld"].any() and len(kl["kld"]) == LENGTHS[rank]
    torch.testing.assert_close(kl["nll"].float(), nll, rtol=1e-5, atol=1e-5)
    assert torch.equal(saved, table)  # what save_reference writes: the whole head, gathered
    ids = torch.randint(0, 512, (1, LENGTHS[rank] + 1), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        expected = one(ids[:, :-1], torch.arange(LENGTHS[rank]), ids[0, 1:])
    torch.testing.assert_close(nll, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        expected8 = one8(ids[:, :-1], torch.arange(LENGTHS[rank]), ids[0, 1:])
    assert not torch.equal(expected8, expected)  # int8 moved the numbers: a quantized model was scored
    torch.testing.assert_close(nll8, expected8, rtol=1e-6, atol=1e-6)

    def whole(hidden: torch.Tensor, run: object) -> dict:  # one process, whole rows
        def stats(hidden_base: torch.Tensor, base: object) -> dict:
            return token_stats(hidden, hidden_base, ids[0, 1:], run.head, base.head, CHUNK)

        return one8(ids[:, :-1], torch.arange(LENGTHS[rank]), ids[0, 1:], then=stats)

    with torch.no_grad():
        expected_kl = one(ids[:, :-1], torch.arange(LENGTHS[rank]), ids[0, 1:], then=whole)
    assert expected_kl["kld"].min() > 0 and torch.equal(kl8["same_top"], expected_kl["same_top"])
    for key in ("nll", "nll_base", "kld", "kld_rev", "p_diff", "top_p"):
        torch.testing.assert_close(kl8[key], expected_kl[key], rtol=1e-4, atol=1e-7)
