"""``results.json``'s keys: each one's type and meaning, the one table the documentation renders.

:func:`lit_ppl.report.results.build_results` writes the document; this table says what its keys are. The docs
site renders it (``docs/hooks.py``: the results.json reference) and ``tests/test_docs.py`` checks it against the
keys real runs write, both ways: a key written but not listed, or listed but never written, fails. A key below a
node is dotted (``compare.kld_mean``); ``[]`` is every element of a list (``compare.kld_by_top_p[].share``); ``*``
stands for the percentile (``compare.kld_p*``: ``kld_p99.9``, ``kld_p99``, ...). A node with no rows below it
(``config``, ``quant.modules``) is described by its own row.
"""

from __future__ import annotations

from typing import NamedTuple


class ResultKey(NamedTuple):
    """One key of ``results.json``: its dotted name, JSON type (``null`` where it can be absent) and meaning."""

    key: str
    type: str
    meaning: str


def _percentiles(stat: str, what: str) -> tuple[ResultKey, ...]:
    return (
        ResultKey(f"compare.{stat}_max", "float", f"largest {what} (exact)"),
        ResultKey(f"compare.{stat}_p*", "float", f"percentiles of {what} (within 0.1% of the exact ones)"),
        ResultKey(f"compare.{stat}_min", "float", f"smallest {what} (exact)"),
    )


RESULT_KEYS: tuple[ResultKey, ...] = (
    ResultKey("schema_version", "int", "version of these keys"),
    # The perplexity and its error.
    ResultKey("ppl", "float", "token perplexity, exp(nll_sum / tokens)"),
    ResultKey("nll_mean", "float", "mean NLL per scored token (nats)"),
    ResultKey("nll_stderr", "float", "standard error of nll_mean, llama.cpp's sqrt((E[nll²] − E[nll]²)/(N − 1))"),
    ResultKey("ppl_stderr", "float", "ppl × nll_stderr"),
    ResultKey("ppl_ci95", "list[float]", "[low, high]: ppl ± 1.96 × ppl_stderr"),
    ResultKey("word_ppl", "float | null", "exp(nll_sum / words), lm-eval's; null under eval=llamacpp"),
    ResultKey("byte_ppl", "float | null", "exp(nll_sum / bytes) over UTF-8 bytes; null under eval=llamacpp"),
    ResultKey("bits_per_byte", "float | null", "nll_sum / bytes / ln 2; null under eval=llamacpp"),
    ResultKey("nll_sum", "float", "summed NLL of every scored token (nats, float64)"),
    ResultKey("tokens", "int", "scored tokens"),
    ResultKey("words", "int", "whitespace-separated words of the documents (lm-eval's count)"),
    ResultKey("bytes", "int", "UTF-8 bytes of the documents"),
    ResultKey("documents", "int", "documents evaluated"),
    # How the text was cut and the ranks laid out.
    ResultKey("mode", "str", "eval.mode: rolling, sliding, block or llamacpp"),
    ResultKey("seq_len", "int", "most input tokens per window"),
    ResultKey("stride", "int | null", "eval.stride under eval=sliding, else null"),
    ResultKey("world_size", "int", "processes that ran the evaluation"),
    ResultKey("num_nodes", "int", "nodes"),
    ResultKey("strategy", "str", "strategy preset (auto, ddp, fsdp, hsdp, tp, fsdp_tp)"),
    ResultKey("parallel", "dict", "the resolved layout"),
    ResultKey("parallel.dp_replicate", "int", "data-parallel replicas"),
    ResultKey("parallel.dp_shard", "int", "data-parallel shards (FSDP)"),
    ResultKey("parallel.tp", "int", "tensor-parallel ranks"),
    ResultKey("parallel.kind", "str", "single, ddp, fsdp, hsdp, tp, fsdp_tp or hsdp_tp"),
    ResultKey("batch_size", "int", "windows per step (the resolved number under batch_size=auto)"),
    ResultKey("deterministic", "bool", "eval.deterministic: bit-identical at any world size"),
    ResultKey("balance", "dict", "how work was shared between ranks"),
    ResultKey("balance.mode", "str", "distributed.balance: tokens, weights or measured"),
    ResultKey("balance.rank_weights", "list[float] | null", "each rank's share weight (null: equal)"),
    ResultKey("balance.measured_tokens_per_s", "list[float] | null", "balance=measured: each rank's probe speed"),
    ResultKey("precision", "str", "Lightning precision"),
    ResultKey("chunk_size", "int", "scored positions per output-head chunk (resolved under eval.chunk_size=auto)"),
    ResultKey("model", "str", "model.path"),
    ResultKey("model_identity", "dict", "which weights, by the checkpoint files' stat (no read)"),
    ResultKey("model_identity.digest", "str", "digest of every file's name, size, mtime and ctime"),
    ResultKey("model_identity.names_digest", "str", "digest of the files' names and sizes only"),
    ResultKey("model_identity.files", "int", "checkpoint files"),
    ResultKey("model_identity.bytes", "int", "their bytes"),
    ResultKey("data", "dict", "what was evaluated"),
    ResultKey("data.source", "str", "the files or hub dataset read"),
    ResultKey("data.files", "int", "files read"),
    ResultKey("data.limit", "int | null", "data.limit"),
    ResultKey("data.documents", "int", "documents in the token store"),
    ResultKey("data.token_store", "str | null", "the token store's directory"),
    ResultKey("data.token_dtype", "str", "dtype of the stored token ids (uint16, uint32)"),
    # Time and memory.
    ResultKey("seconds", "float", "evaluation time"),
    ResultKey("tokens_per_s", "float | null", "tokens / seconds"),
    ResultKey("sync_seconds", "float", "time of the final cross-rank sync"),
    ResultKey("rank_tokens", "list[int]", "tokens each rank scored"),
    ResultKey("rank_steps", "list[int]", "steps each rank ran (padding steps included)"),
    ResultKey(
        "rank_peak_rss_mb",
        "list[float] | null",
        "each rank's peak host RSS up to the final sync, MB of 2^20 bytes: Linux's VmHWM (ru_maxrss carries over exec)",
    ),
    ResultKey(
        "rank_peak_device_mb", "list[float] | null", "each rank's torch.cuda.max_memory_allocated; null off CUDA"
    ),
    ResultKey("rank_weight_bytes", "list[int] | null", "weight bytes each rank holds (its shards, codes and scales)"),
    # Checks and breakdowns.
    ResultKey("scorer_check", "dict", "lit-ppl's scoring path against the model's own logits on one window"),
    ResultKey("scorer_check.tokens", "int", "positions checked"),
    ResultKey("scorer_check.max_abs_logprob_diff", "float", "largest log-probability gap"),
    ResultKey("scorer_check.tolerance", "float", "the gap allowed (1e-4 in float32, 0.1 in 16-bit)"),
    ResultKey(
        "nll_by_position",
        "dict | null",
        "NLL sums by position in the window (nll_by_position.png); null unless report.plots, report.html or "
        "report.per_document is set: the step loop does no work nobody asked for",
    ),
    ResultKey("nll_by_position.sum", "list[float]", "summed NLL per position"),
    ResultKey("nll_by_position.sum_sq", "list[float]", "summed squared NLL per position"),
    ResultKey("nll_by_position.count", "list[int]", "tokens scored per position"),
    ResultKey("config", "dict", "the resolved config (see the config reference)"),
    ResultKey("versions", "dict", "versions of lit-ppl, torch, lightning, torchmetrics, transformers, ..."),
    # Quantization applied by the run (a checkpoint's own quantization: the checkpoints guide).
    ResultKey("quant", "dict | null", "the quantization applied, or the checkpoint's own; null: none"),
    ResultKey("quant.name", "str", "quant.name (int8, int8dq, int4, policy, auto)"),
    ResultKey("quant.source", "str", "quant.source: local (every rank quantizes), rank0 (broadcast), or checkpoint"),
    ResultKey("quant.backend", "dict", "per scheme: the torchao config and tensor type used"),
    ResultKey("quant.weight_bytes_before", "int", "the model's weight bytes before quantization"),
    ResultKey("quant.weight_bytes_after", "int", "and after, as held in memory"),
    ResultKey(
        "quant.weight_bytes_packed",
        "int",
        "and after, as the schemes store them packed (int4 two a byte: CPU kernels hold it unpacked)",
    ),
    ResultKey("quant.quantized_modules", "int", "modules quantized"),
    ResultKey("quant.full_precision_bytes", "int", "weight bytes left in full precision"),
    ResultKey("quant.full_precision_fraction", "float", "their share of the weight bytes"),
    ResultKey("quant.skipped", "dict", "weights a rule asked for but could not be given, with the reason"),
    ResultKey("quant.adapted", "dict", "layers given a smaller int4 group: {requested, config}"),
    ResultKey("quant.converted", "dict", "projections converted to nn.Linear (GPT-2 Conv1D, FalconLinear)"),
    ResultKey("quant.modules", "dict", "per weight: the config applied or why none, its bytes before/after"),
    ResultKey("quant.consistency", "dict | null", "the ranks' hash check of the quantized tensors"),
    ResultKey("quant.digest", "str | null", "digest of the dequantized weights, the same at any layout"),
    ResultKey("quant.calibration", "dict | null", "awq/gptq/auto: the calibration text, tokens, windows, seconds"),
    ResultKey("quant.auto", "dict", "quant=auto: budget, predicted and measured cost, bytes, rounds, choice"),
    ResultKey("reference_quant", "dict | null", "compare=unquantized: the reference's quantization (as quant)"),
    # The per-token files and the saved reference.
    ResultKey("per_token", "dict", "report.per_token=true: the per-token files"),
    ResultKey("per_token.path", "str", "per_token.npy: float64 NLL per scored token, corpus order"),
    ResultKey("per_token.index", "str", "per_token_index.npy: (document id, position) per token"),
    ResultKey("saved_reference", "dict", "save_reference=DIR: the store written"),
    ResultKey("saved_reference.path", "str", "its directory"),
    ResultKey("saved_reference.tokens", "int", "rows stored"),
    ResultKey("saved_reference.bytes", "int", "its bytes"),
    ResultKey(
        "saved_reference.noise_floor",
        "dict | null",
        "the saving model's noise floor (as compare.noise_floor), kept for compare=saved; null: noise_floor=0",
    ),
    ResultKey("reference_store", "dict", "compare=saved: the store read"),
    ResultKey("reference_store.store", "str", "its directory"),
    ResultKey("reference_store.model", "str", "the model that wrote it"),
    ResultKey("reference_store.dtype", "str", "the stored hidden states' dtype"),
    ResultKey("reference_store.quant", "dict | null", "the saving run's quantization"),
    ResultKey("reference_store.head", "str", "the model's own (its head has the stored digest) or stored"),
    # A comparison (llama.cpp's --kl-divergence names; probabilities as fractions).
    ResultKey("compare", "dict", "compare=unquantized|saved: the candidate against the reference, token by token"),
    ResultKey("compare.tokens", "int", "tokens compared"),
    ResultKey("compare.ppl", "float", "the candidate's PPL"),
    ResultKey("compare.ppl_unc", "float", "its uncertainty"),
    ResultKey("compare.ppl_base", "float", "the reference's PPL"),
    ResultKey("compare.ppl_base_unc", "float", "its uncertainty"),
    ResultKey("compare.ln_ppl_correlation", "float", "correlation of the two models' ln PPL"),
    ResultKey("compare.ln_ppl_ratio", "float", "ln(PPL / PPL_base)"),
    ResultKey("compare.ln_ppl_ratio_unc", "float", "its covariance-aware uncertainty"),
    ResultKey("compare.ppl_ratio", "float", "PPL / PPL_base"),
    ResultKey("compare.ppl_ratio_unc", "float", "its uncertainty"),
    ResultKey("compare.ppl_diff", "float", "PPL − PPL_base"),
    ResultKey("compare.ppl_diff_unc", "float", "its uncertainty"),
    ResultKey("compare.kld_mean", "float", "mean KL(P‖Q): reference P, candidate Q (nats)"),
    ResultKey("compare.kld_mean_unc", "float", "its standard error"),
    *_percentiles("kld", "KL(P‖Q)"),
    ResultKey("compare.kld_rev_mean", "float", "mean reverse KL(Q‖P)"),
    ResultKey("compare.kld_rev_mean_unc", "float", "its standard error"),
    *_percentiles("kld_rev", "KL(Q‖P)"),
    ResultKey("compare.p_diff_mean", "float", "mean Δp: candidate minus reference probability of the target"),
    ResultKey("compare.p_diff_mean_unc", "float", "its standard error"),
    *_percentiles("p_diff", "Δp"),
    ResultKey("compare.p_diff_rms", "float", "RMS Δp"),
    ResultKey("compare.p_diff_rms_unc", "float", "its uncertainty"),
    ResultKey("compare.same_top", "float", "share of tokens whose top-1 token both models agree on"),
    ResultKey("compare.same_top_unc", "float", "its binomial error"),
    ResultKey(
        "compare.kld_by_top_p", "list[dict]", "buckets of the reference's top-1 probability (exllamav3's qbench)"
    ),
    ResultKey("compare.kld_by_top_p[].top_p", "list[float]", "[low, high) of the bucket (the last closed)"),
    ResultKey("compare.kld_by_top_p[].tokens", "int", "tokens in the bucket"),
    ResultKey("compare.kld_by_top_p[].share", "float", "their share of the tokens compared"),
    ResultKey("compare.kld_by_top_p[].kld_mean", "float | null", "mean KL(P‖Q) in the bucket; null if empty"),
    ResultKey("compare.kld_by_top_p[].kld_rev_mean", "float | null", "mean KL(Q‖P) in the bucket; null if empty"),
    ResultKey("compare.kld_by_top_p[].same_top", "float | null", "top-1 agreement in the bucket; null if empty"),
    ResultKey("compare.kld_histogram", "dict", "KL(P‖Q) counts per quarter decade"),
    ResultKey("compare.kld_histogram.edges", "list[float]", "bin edges"),
    ResultKey("compare.kld_histogram.counts", "list[int]", "tokens per bin"),
    ResultKey("compare.kld_histogram.below", "int", "values below the first bin (zeros, rounding-level)"),
    ResultKey("compare.kld_histogram.above", "int", "values past the last bin"),
    # The reference's noise floor (lit_ppl/evaluation/noise_floor.py).
    ResultKey(
        "compare.noise_floor",
        "dict | null",
        "the reference's own rounding: KL(float64 re-score ‖ reference as run) on compare.noise_floor windows spread "
        "over the corpus; null: compare.noise_floor=0",
    ),
    ResultKey(
        "compare.noise_floor.kld_mean",
        "float | null",
        "its mean KLD (nats); null: not measured (a quantized reference, a store without one, no memory for the copy)",
    ),
    ResultKey("compare.noise_floor.kld_mean_unc", "float", "its standard error"),
    ResultKey("compare.noise_floor.kld_rev_mean", "float", "its mean reverse KLD"),
    ResultKey("compare.noise_floor.kld_max", "float", "its largest KLD"),
    ResultKey("compare.noise_floor.same_top", "float", "top-1 agreement of the two scores"),
    ResultKey("compare.noise_floor.tokens", "int", "tokens re-scored"),
    ResultKey("compare.noise_floor.windows", "int", "windows re-scored (fewer than asked when the text has fewer)"),
    ResultKey("compare.noise_floor.precision", "str", "the precision the reference ran in (and its own dtype if set)"),
    ResultKey("compare.noise_floor.source", "str", "live: measured by this run; saved: by the run saving the store"),
    ResultKey("compare.noise_floor.note", "str", "why it was not measured (only then)"),
)
