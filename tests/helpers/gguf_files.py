"""GGUF files written in-test with the ``gguf`` package, as llama.cpp's ``convert_hf_to_gguf.py`` lays them out.

transformers reads GGUF but writes none, so the file is put together here from a tiny Llama built from a config
and the stories260K tokenizer: the metadata keys transformers' loader maps to a ``LlamaConfig``, the tokenizer
(tokens, types, merges, BOS/EOS ids, ``add_bos_token``) and every tensor under its GGUF name, the query and key
projections row-permuted as llama.cpp stores them. Beside it, the *same* quantized weights dequantized with
``gguf.quants.dequantize`` (llama.cpp's definitions in numpy) are saved as a plain Hugging Face checkpoint: the
reference a GGUF run must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

# Rows of 256: K-quants work on super-blocks of 256 values.
CONFIG = {
    "vocab_size": 512,  # the stories260K tokenizer
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
    "initializer_range": 0.05,
}


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a query/key projection (rotary pairs interleaved), the inverse of what
    transformers' GGUF loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A valid Q4_K encoding of ``w`` (rows of a multiple of 256), round-to-nearest.

    Written here because gguf-py 0.19 dequantizes K-quants but cannot quantize them; any valid bytes serve, since the
    test compares a file with its own dequantized weights. Layout per super-block of 256: ``d``, ``dmin`` (float16),
    12 bytes of 6-bit scales and mins of the 8 sub-blocks of 32 (packed as ``Q4_K.get_scale_min`` unpacks them),
    128 bytes of 4-bit codes (sub-blocks ``2g`` and ``2g+1`` in the low and high nibbles of 32 bytes).
    """
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    scale, offset = (hi - lo) / 15.0, -lo  # value ≈ scale·q − offset, q in 0..15
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (offset.max(-1) / 63.0).astype(np.float16)
    safe = lambda a: np.where(a == 0, 1.0, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(offset / safe(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step = safe(d.astype(np.float32)[:, None] * sc)
    q = np.clip(np.rint((x + (dmin.astype(np.float32)[:, None] * mn)[..., None]) / step[..., None]), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((len(x), 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(x), 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], 1)
    return blocks.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quantize_q4_k(w) if qtype == GGMLQuantizationType.Q4_K else quants.quantize(w, qtype)


def write_gguf(
    root: Path, tokenizer_dir: Path, qtype_name: str, seed: int = 0, halve: str | None = None, **config: int
) -> tuple[Path, Path | None]:
    """A GGUF file of a seeded tiny Llama (:data:`CONFIG`, updated by ``config``) quantized to ``qtype_name`` (its
    2-D weights; norms stay F32) and the plain checkpoint of its dequantized weights. Returns ``(gguf_file,
    reference_dir)``. ``halve`` names a tensor (as transformers names it) written with half its rows: a file with a
    tensor of the wrong shape."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    qtype = gguf.GGMLQuantizationType[qtype_name]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, **config})).eval()
    cfg = model.config
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"tiny-llama-{qtype_name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(CONFIG["rope_theta"])  # transformers 5 keeps it in rope_parameters
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tokenizer_dir)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    dequantized = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:  # llama.cpp writes a tied head once: token_embd
            continue
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy().astype(np.float32)
        if hf_name == halve:
            w = w[: len(w) // 2]
        if w.ndim == 1:  # norms: F32 in every llama.cpp file
            writer.add_tensor(names.get_name(base) + "." + suffix, w)
            dequantized[hf_name] = torch.from_numpy(w)
            continue
        q = quantize(w, qtype)
        # Quantization is per row, so permuting rows commutes with it: the reference needs no permutation.
        dequantized[hf_name] = torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(w.shape).copy())
        if base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            q = quantize(_llama_permute(w, heads), qtype)
        writer.add_tensor(names.get_name(base) + "." + suffix, q, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if halve is not None:  # no model has these shapes: no reference either
        return path, None

    if cfg.tie_word_embeddings:
        dequantized["lm_head.weight"] = dequantized["model.embed_tokens.weight"]
    model.load_state_dict(dequantized)
    ref = root / f"dequantized-{qtype_name}"
    model.save_pretrained(ref)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, ref / name)
    return path, ref


def _add_tokenizer(writer, tokenizer_dir: Path) -> None:
    """The stories260K tokenizer (a sentencepiece-style BPE with byte fallback) as llama.cpp's ``llama`` vocabulary."""
    import gguf

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in spec["added_tokens"] if a["special"]}
    types = [
        gguf.TokenType.UNKNOWN
        if i == 0
        else gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.BYTE
        if t.startswith("<0x") and t.endswith(">")
        else gguf.TokenType.NORMAL
        for i, t in enumerate(tokens)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
