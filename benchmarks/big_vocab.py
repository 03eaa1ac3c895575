"""A random Llama of a 270M model's size with a 262k vocabulary, as a Q4_K GGUF and as the same weights dequantized
in a safetensors checkpoint: the model of issue 31's memory figures, where the 768 MiB tied embedding dominates.

    python benchmarks/big_vocab.py DIR     # ~3 minutes; then, for example:
    python benchmarks/memory_layouts.py --model DIR/tiny-llama-Q4_K.gguf --layouts 1,fsdp2 --steps 2
    python benchmarks/memory_layouts.py --model DIR/dequantized-Q4_K --layouts 1,fsdp2,tp2 --steps 2
    python benchmarks/saved_reference.py --part 1 --model DIR/dequantized-Q4_K --max-bytes 12000 --seq 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import ROOT, STORIES, require_shared

SHAPE = {"vocab_size": 262_144, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12}
SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 2048}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    require_shared()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.gguf_files import write_gguf  # the GGUF writer the tests use (transformers writes none)

    gguf, checkpoint = write_gguf(args.out, STORIES, "Q4_K", **SHAPE)
    print(f"{gguf} ({gguf.stat().st_size:,} bytes)\n{checkpoint}")


if __name__ == "__main__":
    main()
