"""Every mode scores every document token exactly once, within seq_len inputs, without crossing documents."""

import json
import math

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


@pytest.mark.parametrize("bos_first", [True, False])
@pytest.mark.parametrize("lengths", [[2 * L], [3, 17, 9], [5 * L + 3, 1, 2]])
def test_llamacpp_chunks_the_joined_stream(lengths, bos_first):
    corpus = _corpus(lengths)
    w = build_windows("llamacpp", corpus.doc_lengths, L, bos_first=bos_first)
    stream = ([0] if bos_first else []) + [1000 * (d + 1) + i for d, n in enumerate(lengths) for i in range(n)]
    chunks = [stream[i * L : (i + 1) * L] for i in range(len(stream) // L)]  # llama-perplexity's, tail dropped
    assert len(w) == len(chunks) and (w.lengths == L - 1).all()
    batch = WindowCollator(corpus, w)(list(range(len(w))))
    inputs = batch["input_ids"].numpy()
    for row, chunk in zip(inputs, chunks, strict=True):
        assert row.tolist() == ([0] if bos_first else chunk[:1]) + chunk[1 : L - 1]  # BOS in place of the first
    expected = [t for chunk in chunks for t in chunk[L // 2 + 1 :]]
    assert batch["targets"].tolist() == expected
    assert len(expected) == len(chunks) * (L - 1 - L // 2)
    starts = np.cumsum([0, *lengths[:-1]]) + bos_first
    assert w.documents.sum() == (starts < len(chunks) * L).sum() and w.words.sum() == 0


def test_llamacpp_needs_two_chunks_of_tokens():
    with pytest.raises(ValueError, match=r"eval.mode=llamacpp needs at least 2·n_ctx = 16 tokens.*has 15"):
        build_windows("llamacpp", np.array([7, 7]), L)


def test_llamacpp_equals_a_float64_reimplementation(compose, stories, docs_file):
    """Real model, real text: lit-ppl's llamacpp mode against llama-perplexity's loop written out in float64."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ppl.run import evaluate

    n_ctx = 96
    r = evaluate(compose(f"model.path={stories}", f"data.path={docs_file}", "eval=llamacpp", f"eval.seq_len={n_ctx}"))
    tok = AutoTokenizer.from_pretrained(stories)
    texts = [json.loads(line)["text"] for line in docs_file.read_text(encoding="utf-8").splitlines()]
    assert tok("a")["input_ids"][0] == tok.bos_token_id  # this vocabulary adds BOS: llama.cpp's add_bos
    stream = [tok.bos_token_id] + [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]
    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float64).eval()
    n_chunks, first, nll, nll2, count = len(stream) // n_ctx, n_ctx // 2, 0.0, 0.0, 0
    with torch.no_grad():
        for i in range(n_chunks):
            chunk = list(stream[i * n_ctx : (i + 1) * n_ctx])
            chunk[0] = tok.bos_token_id
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0], dim=-1)
            for j in range(first, n_ctx - 1):
                x = -float(logp[j, stream[i * n_ctx + j + 1]])
                nll, nll2, count = nll + x, nll2 + x * x, count + 1
    mean = nll / count
    ppl = math.exp(mean)
    assert r["tokens"] == count == n_chunks * (n_ctx - 1 - first)
    assert r["ppl"] == pytest.approx(ppl, rel=1e-6)
    assert r["ppl_stderr"] == pytest.approx(ppl * math.sqrt((nll2 / count - mean * mean) / (count - 1)), rel=1e-5)
    assert r["mode"] == "llamacpp" and r["word_ppl"] is None and r["bits_per_byte"] is None
