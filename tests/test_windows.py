"""Every mode scores every document token exactly once, within seq_len inputs, without crossing documents."""

import numpy as np
import pytest

from lit_ppl.data.datamodule import WindowCollator
from lit_ppl.data.store import Corpus
from lit_ppl.data.windows import build_windows

L = 8
EDGE_LENGTHS = [1, L - 1, L, L + 1, 5 * L]


def _corpus(lengths):
    """Token ids that encode (document, position) so every target can be traced back."""
    ids = [[1000 * (d + 1) + i for i in range(n)] for d, n in enumerate(lengths)]
    return Corpus.from_lists(ids, [1] * len(ids), list(lengths), 0)


def _scored(mode, lengths, stride=None):
    corpus = _corpus(lengths)
    w = build_windows(mode, corpus.doc_lengths, L, stride, corpus.doc_words, corpus.doc_bytes)
    collate = WindowCollator(corpus, w)
    scored, contexts = [], []
    for i in range(len(w)):
        batch = collate([i])
        inputs = batch["input_ids"][0].numpy()
        targets = batch["targets"].numpy()
        pos = batch["score_index"].numpy()
        assert len(inputs) <= L and (pos < len(inputs)).all()
        scored.extend(targets.tolist())
        contexts.extend(pos.tolist())
    return corpus, w, scored, contexts


@pytest.mark.parametrize("mode,stride", [("rolling", None), ("sliding", 3), ("sliding", L - 1), ("block", None)])
@pytest.mark.parametrize("lengths", [[n] for n in EDGE_LENGTHS] + [EDGE_LENGTHS])
def test_every_token_scored_exactly_once(mode, stride, lengths):
    _, w, scored, _ = _scored(mode, lengths, stride)
    expected = [1000 * (d + 1) + i for d, n in enumerate(lengths) for i in range(n)]
    assert sorted(scored) == expected
    assert (w.lengths <= L).all() and (w.lengths >= 1).all()
    assert w.documents.sum() == len(lengths) and w.bytes.sum() == sum(lengths)


@pytest.mark.parametrize("mode,stride", [("rolling", None), ("sliding", 3)])
def test_documents_never_bleed(mode, stride):
    lengths = [3, 17, 9]
    corpus = _corpus(lengths)
    w = build_windows(mode, corpus.doc_lengths, L, stride)
    offsets = np.concatenate([[0], np.cumsum(np.array(lengths) + 1)])
    for a, b in zip(w.start, w.end, strict=True):
        doc = np.searchsorted(offsets, a, side="right") - 1
        assert b <= offsets[doc + 1] - 1, "a window reads past its document"


def _lm_eval_rolling(tokens, prefix, max_seq_len):
    """lm-evaluation-harness get_rolling_token_windows(context_len=1) + make_disjoint_window, re-derived."""
    out, pred_len, predicted = [], max_seq_len, 0
    first = min(max_seq_len, len(tokens))
    out.append(([prefix, *tokens[: first - 1]], tokens[:first]))
    predicted += first
    while predicted < len(tokens):
        wlen = min(len(tokens) - predicted, pred_len)
        end = predicted + wlen
        out.append((tokens[end - max_seq_len - 1 : end - 1], tokens[end - wlen : end]))
        predicted += wlen
    # make_disjoint_window: the model input is context + continuation[:-1]
    return [(ctx[: len(ctx) - (len(cont) - 1)] + cont[:-1], cont) for ctx, cont in out]


@pytest.mark.parametrize("n", [1, 5, L, L + 1, 3 * L + 2])
def test_rolling_reads_exactly_what_lm_eval_reads(n):
    corpus = _corpus([n])
    w = build_windows("rolling", corpus.doc_lengths, L)
    collate = WindowCollator(corpus, w)
    ref = _lm_eval_rolling(corpus.tokens[1:].tolist(), 0, L)
    assert len(ref) == len(w)
    for i, (inputs, cont) in enumerate(ref):
        batch = collate([i])
        assert batch["input_ids"][0].tolist() == inputs
        assert batch["targets"].tolist() == cont


def test_sliding_context_is_hf_strided_window():
    corpus = _corpus([20])
    w = build_windows("sliding", corpus.doc_lengths, L, 4)
    # HF: windows begin at 0, 4, 8, 12 (end_loc 8, 12, 16, 20, 21); inputs are [begin, end_loc - 1).
    assert w.start.tolist() == [0, 4, 8, 12, 16]
    assert w.end.tolist() == [7, 11, 15, 19, 20]
    assert w.score_from.tolist() == [1, 8, 12, 16, 20]


def test_block_shares_windows_across_documents_but_never_scores_a_separator():
    corpus = _corpus([2, 2])  # stream: BOS a a | BOS b b — the second BOS and b are targets of block 0
    w = build_windows("block", corpus.doc_lengths, 4)
    batch = WindowCollator(corpus, w)(list(range(len(w))))
    assert 0 not in batch["targets"].tolist()
    assert w.documents.tolist() == [2, 0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "nope"}, "eval.mode"),
        ({"seq_len": 0}, "eval.seq_len"),
        ({"mode": "sliding", "stride": 0}, "eval.stride"),
        ({"mode": "sliding", "stride": L}, "eval.stride"),
        ({"doc_lengths": [3, 0]}, "no tokens"),
    ],
)
def test_bad_window_arguments(kwargs, match):
    args = {"mode": "rolling", "doc_lengths": [5], "seq_len": L, "stride": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_windows(args["mode"], np.array(args["doc_lengths"]), args["seq_len"], args["stride"])
