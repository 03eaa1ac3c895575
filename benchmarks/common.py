"""Helpers shared by the benchmark scripts: data paths, a config-built Llama, lit-ppl runs and the raw loop.

Every benchmark measures its ratio side by side in one run, so the machine's load (other processes on the
same cores) affects both sides alike; each side is run ``--repeats`` times and the best time is kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
STORIES = SHARED / "stories260K"
WIKITEXT = SHARED / "wikitext-2" / "valid.tokens.txt"
TINYSTORIES = SHARED / "tinystories_sample.txt"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(ROOT))

DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}

# A ~41M-parameter Llama (vocab 32k, tied embeddings): 16.4M embedding + 8 × 3.2M decoder blocks.
LLAMA_41M = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
}


def require_shared() -> None:
    """Exit with a clear message when the shared test data is absent."""
    if not STORIES.is_dir() or not WIKITEXT.is_file():
        sys.exit(f"the shared data is absent (expected {STORIES} and {WIKITEXT})")


def cut_text(src: Path, max_bytes: int | None, dst: Path) -> Path:
    """The first ``max_bytes`` of ``src`` (cut at a line end) written to ``dst``; ``None`` keeps it whole."""
    text = src.read_bytes()
    if max_bytes is not None and len(text) > max_bytes:
        text = text[: text.rfind(b"\n", 0, max_bytes) + 1]
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.is_file() or dst.read_bytes() != text:  # keep the file (and its tokenization cache) when unchanged
        dst.write_bytes(text)
    return dst


def make_llama(
    out: Path,
    tokenizer_from: Path = STORIES,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **shape: Any,
) -> Path:
    """Save a random-init ``LlamaForCausalLM`` built from a config (plus a real tokenizer) as a checkpoint.

    The tokenizer is stories260K's (ids < 512), so any vocabulary of at least 512 fits the text; the model's
    vocabulary only sets the output head's size, which is what the benchmarks are about.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = {**LLAMA_41M, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, **shape}
    if (out / "config.json").is_file() and json.loads((out / "lit_ppl_shape.json").read_text()) == cfg:
        return out
    torch.manual_seed(seed)
    with torch.device(device):  # a 1B model initialises in seconds on a GPU, in minutes on CPU
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    (out / "lit_ppl_shape.json").write_text(json.dumps(cfg))
    return out


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def compose(*overrides: str):
    """lit-ppl's Hydra config with ``overrides`` (as ``python -m lit_ppl.validate`` would compose it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return hydra_compose("validate", overrides=list(overrides))


@contextlib.contextmanager
def quiet():
    """Silence stdout (lit-ppl's results table) and Lightning's info logs; the progress bar stays (stderr)."""
    import logging

    level = logging.getLogger("lightning.pytorch").level
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.getLogger("lightning.pytorch").setLevel(level)


def lit_ppl(
    model: Path, text: Path, work: Path, *extra: str, trainer: str = "cpu", mode: str = "rolling"
) -> dict[str, Any]:
    """One in-process lit-ppl evaluation (``eval=mode``); returns its results (``seconds`` is the step loop)."""
    from lit_ppl.run import evaluate

    cfg = compose(
        f"model.path={model}",
        "data=text",
        f"data.path={text}",
        f"data.cache_dir={work / 'cache'}",
        f"output_dir={work / 'out'}",
        f"trainer={trainer}",
        f"eval={mode}",
        *extra,
    )
    with quiet():
        return evaluate(cfg)


def raw_batches(model: Path, text: Path, work: Path, seq_len: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """lit-ppl's own windows and batches (same windows, same order), prebuilt as plain tensors.

    Built before the raw loop's clock starts, so the baseline pays nothing for batching: a strict bar. Each is
    ``(input_ids, score_index, targets)`` as lit-ppl's collator makes them, so both sides score the same tokens.
    """
    from lit_ppl.data.datamodule import PerplexityDataModule
    from lit_ppl.data.sources import DataSpec
    from lit_ppl.model.spec import ModelSpec

    dm = PerplexityDataModule(
        DataSpec(path=str(text), cache_dir=str(work / "cache")),
        ModelSpec(path=str(model)).tokenizer(),
        "rolling",
        seq_len,
        batch_size=batch_size,
    )
    dm.setup()
    out = []
    for batch in dm.val_dataloader():
        out.append((batch["input_ids"], batch["score_index"], batch["targets"]))
    return out


def load_model(model: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval().requires_grad_(False)


def raw_step(lm: torch.nn.Module, batch, total: torch.Tensor, chunk_size: int = 1024, device: str = "cpu") -> int:
    """One step of the hand-written loop: decoder → scored positions → output head in chunks → float32
    cross-entropy, added to the float64 ``total`` in place (no host sync). Returns the tokens scored."""
    decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    input_ids, index, targets = (t.to(device, non_blocking=True) for t in batch)
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    scored = hidden.flatten(0, 1)[index]
    for a in range(0, len(targets), chunk_size):
        logits = head(scored[a : a + chunk_size]).float()
        total += F.cross_entropy(logits, targets[a : a + chunk_size], reduction="none").double().sum()
    return len(targets)


def raw_loop(lm: torch.nn.Module, batches, chunk_size: int = 1024, device: str = "cpu") -> tuple[int, float, float]:
    """The hand-written loop over ``batches``, under ``torch.inference_mode`` (:func:`raw_step` per batch).

    Same compute as lit-ppl's step (so the difference is the framework), no Lightning, no metric: the NLL
    sum accumulates in one float64 tensor, read once at the end. Returns ``(tokens, seconds, nll_sum)``.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            tokens += raw_step(lm, batch, total, chunk_size, device)
        nll_sum = float(total)  # the one host sync (on a GPU it waits for the queued work)
    return tokens, time.perf_counter() - t0, nll_sum


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of ``rows`` (the README pastes these)."""

    def fmt(v: Any) -> str:
        if not isinstance(v, float):
            return str(v)
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
