"""A zoo of tiny random-init Hugging Face causal LMs, one per architecture family people evaluate.

Each is built from its config at test time (no download), saved with ``save_pretrained`` next to the
stories260K tokenizer, and scored by a plain Hugging Face forward as the reference. The weights are drawn
with a large ``initializer_range`` so that the logits are far from uniform: a wrong head or an unloaded
tensor then moves the perplexity far from the reference instead of hiding near the vocabulary size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB = 512  # the stories260K tokenizer
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
COMMON = {
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}

# model_type -> config keyword arguments beyond COMMON (each family names its sizes its own way).
LLAMA_LIKE = {
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
CONFIGS: dict[str, dict] = {
    "llama": {**LLAMA_LIKE, "tie_word_embeddings": True},
    "gpt2": {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 256},
    "gpt_neox": {**LLAMA_LIKE, "num_key_value_heads": HEADS, "tie_word_embeddings": False},
    "opt": {
        "hidden_size": HIDDEN,
        "ffn_dim": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "word_embed_proj_dim": HIDDEN,
        "init_std": 0.1,
    },
    "bloom": {"hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": HEADS},
    "falcon": {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "new_decoder_architecture": True,
        "num_kv_heads": KV_HEADS,
    },
    "gpt_bigcode": {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 256, "multi_query": True},
    "qwen2": LLAMA_LIKE,
    "mistral": {**LLAMA_LIKE, "sliding_window": 16},
    "mixtral": {**LLAMA_LIKE, **MOE},
    "qwen2_moe": {
        **LLAMA_LIKE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "gemma": {**LLAMA_LIKE, "head_dim": 16},
    "gemma2": {**LLAMA_LIKE, "head_dim": 16, "final_logit_softcapping": 2.0, "sliding_window": 16},
    "granite": {**LLAMA_LIKE, "logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    "cohere": {**LLAMA_LIKE, "logit_scale": 0.5},
    "phi3": LLAMA_LIKE,
    "olmo2": LLAMA_LIKE,
    "falcon_h1": {
        **LLAMA_LIKE,
        "head_dim": 16,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "lm_head_multiplier": 0.25,
    },
    "minicpm3": {
        **LLAMA_LIKE,
        "num_key_value_heads": HEADS,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "dim_model_base": 16,  # logits_scaling = hidden_size / dim_model_base = 4
    },
    # One key/value head (Gemma 3 270m/1B's shape) and multi-query attention: tensor parallelism replicates the KV
    # head on every rank of the group (tp exceeds the KV heads).
    "gemma3_text": {**LLAMA_LIKE, "head_dim": 16, "num_key_value_heads": 1, "sliding_window": 16},
    "llama_mqa": {**LLAMA_LIKE, "num_key_value_heads": 1},
}
ARCHITECTURES = tuple(CONFIGS)
MODEL_TYPES = {"llama_mqa": "llama"}  # variants of a family under their own name


def model_type(arch: str) -> str:
    return MODEL_TYPES.get(arch, arch)


def build(model_type: str, root: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random ``model_type`` causal LM (an entry of :data:`CONFIGS`) with the tokenizer of
    ``tokenizer_dir`` under ``root``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / model_type
    if (out / "config.json").is_file():
        return out
    config = AutoConfig.for_model(MODEL_TYPES.get(model_type, model_type), **COMMON, **CONFIGS[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def reference_nll(model_dir: Path, documents: list[str], seq_len: int) -> tuple[float, int]:
    """``(NLL sum, tokens)`` of ``documents``, each after a BOS in one window, by a plain HF forward in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # Eager experts: the grouped-matmul kernels of mixture-of-experts layers have no float64 version.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in documents:
            ids = torch.tensor([[tok.bos_token_id, *tok(doc, add_special_tokens=False)["input_ids"]]])
            assert ids.shape[1] - 1 <= seq_len, f"a document of {ids.shape[1] - 1} tokens needs several windows"
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total, count


def write_documents(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return path
