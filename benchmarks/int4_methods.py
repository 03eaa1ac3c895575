"""INT4 methods side by side: round-to-nearest, HQQ, AWQ, GPTQ (one pass, sequential, act-order) vs the float model.

Each row is one ``python -m lit_ppl.validate``-equivalent run (in process) with ``compare=unquantized``: the same
evaluated text, the float model as reference, so PPL, mean KLD, KLD p99 and same-top-1 are measured on the same
tokens. Calibrated methods read a different part of the same corpus (the bytes after the evaluated ones), so they
are never calibrated on the text they are evaluated on.

    python benchmarks/int4_methods.py                                  # SmolLM2-135M, WikiText-2, g64 and g128
    python benchmarks/int4_methods.py --model ../shared/data/stories260K --text ../shared/data/tinyshakespeare.txt

Figures: benchmarks/README.md ("INT4 methods").
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import STORIES, WIKITEXT, lit_ppl, table

SMOLLM2 = Path("~/.cache/lit_ppl/models/smollm2-135m").expanduser()
METHODS = {
    "rtn": ["quant=int4"],
    "hqq": ["quant=int4", "quant.method=hqq"],
    "awq": ["quant=awq", "quant.name=int4"],
    "gptq": ["quant=gptq"],
    "gptq-seq": ["quant=gptq", "quant.gptq.sequential=true"],
    "gptq-act": ["quant=gptq", "quant.gptq.act_order=true"],
}


def split_text(src: Path, eval_bytes: int, calib_bytes: int, work: Path) -> tuple[Path, Path]:
    """The first ``eval_bytes`` of ``src`` (evaluated) and the next ``calib_bytes`` (calibration), cut at lines."""
    text = src.read_bytes()
    cut = text.rfind(b"\n", 0, eval_bytes) + 1
    end = text.rfind(b"\n", 0, cut + calib_bytes) + 1
    (work / "eval.txt").write_bytes(text[:cut])
    (work / "calib.txt").write_bytes(text[cut:end])
    return work / "eval.txt", work / "calib.txt"


def calibrated_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a benchmark that evaluates one part of a text and calibrates on the next."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2 if SMOLLM2.is_dir() else STORIES)
    parser.add_argument("--text", type=Path, default=WIKITEXT)
    parser.add_argument("--eval-bytes", type=int, default=40_000)
    parser.add_argument("--calib-bytes", type=int, default=40_000)
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--grid", type=int, default=10, help="AWQ's candidate scales per layer")
    parser.add_argument("--precision", default="32-true")
    return parser


def calibrated_texts(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, list[str]]:
    """``(work dir, evaluated text, calibration overrides)`` of :func:`calibrated_parser`'s options."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    evaluated, calib = split_text(args.text, args.eval_bytes, args.calib_bytes, work)
    cal = [
        f"quant.calibration.path={calib}",
        f"quant.calibration.tokens={args.calib_tokens}",
        f"quant.calibration.seq_len={args.seq_len}",
        f"quant.calibration.grid={args.grid}",
        "quant.calibration.batch_size=4",
    ]
    return work, evaluated, cal


def main() -> None:
    parser = calibrated_parser(__doc__)
    parser.add_argument("--group", type=int, action="append", help="int4 group sizes (default: 64 and 128)")
    parser.add_argument("--method", action="append", choices=list(METHODS), help="default: all")
    args = parser.parse_args()
    work, evaluated, cal = calibrated_texts(args, "int4_methods_")
    rows = []
    for group in args.group or [64, 128]:
        for method in args.method or list(METHODS):
            extra = [*METHODS[method], f"quant.group_size={group}", "compare=unquantized"]
            extra += [f"eval.seq_len={args.seq_len}", f"precision={args.precision}", "report.plots=false"]
            extra += cal if method not in ("rtn", "hqq") else []
            t0 = time.perf_counter()
            r = lit_ppl(args.model, evaluated, work / f"{method}-g{group}", *extra)
            c, q = r["compare"], r["quant"]
            rows.append(
                {
                    "method": method,
                    "group": group,
                    "ppl": r["ppl"],
                    "ppl_base": c["ppl_base"],
                    "kld_mean": c["kld_mean"],
                    "kld_p99": c["kld_p99"],
                    "same_top1": c["same_top"],
                    "adapted": len(q["adapted"]),
                    "skipped": len(q["skipped"]),
                    "quantized": q["quantized_modules"],
                    "tokens": r["tokens"],
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(
        f"\n{args.model.name}, {args.text.name}: first {args.eval_bytes:,} bytes evaluated (seq_len {args.seq_len}), "
        f"the next {args.calib_bytes:,} bytes calibrate ({args.calib_tokens} tokens), precision {args.precision}\n"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
