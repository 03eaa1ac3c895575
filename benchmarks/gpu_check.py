"""The GPU part of issue 6, called by ``gpu_check.sh``: throughput, framework overhead, MFU and the INT4 path.

On one CUDA device: a ~1.1B Llama (TinyLlama's shape: hidden 2048, 22 layers, 32 heads / 4 KV heads,
vocab 32k) built from a config with random weights and saved in bf16, evaluated by lit-ppl (``bf16-true``,
rolling windows of 2048, batch 8) over WikiText-2 validation, against the raw ``inference_mode`` loop on
the same batches (target 1's ratio), then with ``quant=int4`` (torchao's CUDA tinygemm kernel) and with
``quant=awq quant.name=int4`` (AWQ calibrated on Shakespeare, issue 13), then GPTQ (``quant=gptq``, int4 and int8:
torchao's CUDA-only ``gptq_quantize`` from Hessians that lit-ppl sums in float64; int4 also needs the ``mslk``
package, and without it the run is reported as refused, with lit-ppl's one-line reason). MFU is the
achieved model FLOP/s over the device's dense bf16 peak:

    FLOPs/token = 2 · (non-embedding parameters) + 2 · hidden · vocab (the head)
                  + 4 · layers · hidden · (mean attended positions ≈ (seq_len + 1) / 2)

It fails loudly (exit status 2) without CUDA. Budget: under 5 minutes including the model's creation, plus about
a minute per GPTQ run (torchao's column loop, 154 layers); ``--skip-gptq`` leaves them out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s.
PEAKS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12,
         "A10G": 70e12, "L4": 121e12}  # fmt: skip
TINYLLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from the GPU name)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--text-bytes", type=int, default=0, help="cut the text (0: whole, ~670k tokens)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-gptq", action="store_true", help="leave out the two GPTQ runs")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_gpu_check")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: FAILED: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
    from common import WIKITEXT, cut_text, lit_ppl, load_model, make_llama, raw_batches, raw_loop, require_shared, table

    require_shared()
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in PEAKS.items() if k in name), None)
    if peak is None:
        sys.exit(f"gpu_check: unknown bf16 peak for {name!r}: pass --peak-tflops")
    t0 = time.perf_counter()
    model = make_llama(args.work / "llama1b", dtype=torch.bfloat16, device="cuda", **TINYLLAMA)
    text = cut_text(WIKITEXT, args.text_bytes or None, args.work / "text.txt")
    print(f"{name}: model ready in {time.perf_counter() - t0:.0f} s", flush=True)

    common = ("precision=bf16-true", f"eval.seq_len={args.seq_len}", f"batch_size={args.batch_size}",
              "trainer.accelerator=gpu", "trainer.devices=1")  # fmt: skip
    lm = load_model(model, torch.bfloat16).cuda()
    batches = raw_batches(model, text, args.work, args.seq_len, args.batch_size)
    n_params = sum(p.numel() for p in lm.parameters())
    embed = lm.get_input_embeddings().weight.numel()
    cfg = lm.config
    flops_per_token = (
        2 * (n_params - embed)
        + 2 * cfg.hidden_size * cfg.vocab_size
        + 4 * cfg.num_hidden_layers * cfg.hidden_size * (args.seq_len + 1) / 2
    )
    raw_tps = lit_tps = 0.0
    for _ in range(args.repeats):  # the first pass of each also warms up cuBLAS / the allocator
        tokens, seconds, raw_sum = raw_loop(lm, batches, device="cuda")
        raw_tps = max(raw_tps, tokens / seconds)
        r = lit_ppl(model, text, args.work, *common, trainer="default")
        lit_tps = max(lit_tps, r["tokens"] / r["seconds"])
    if r["tokens"] != tokens or abs(r["nll_sum"] - raw_sum) > 1e-3 * abs(raw_sum):
        sys.exit(f"gpu_check: lit-ppl and the raw loop disagree: {r['tokens']} vs {tokens} tokens, "
                 f"NLL {r['nll_sum']} vs {raw_sum}")  # fmt: skip
    del lm
    torch.cuda.empty_cache()
    q = lit_ppl(model, text, args.work, *common, "quant=int4", trainer="default")
    # AWQ on int4 (issue 13): torchao's CUDA int4 tensor takes the activation pre-scale that the CPU ones lack.
    # The calibration text is Shakespeare, not the evaluated WikiText-2 (lit-ppl refuses the evaluated text).
    from common import SHARED

    awq = ("quant=awq", "quant.name=int4", "quant.group_size=128", "quant.calibration.tokens=16384",
           f"quant.calibration.path={SHARED / 'tinyshakespeare.txt'}",
           f"quant.calibration.cache_dir={args.work / 'cache'}")  # fmt: skip
    a = lit_ppl(model, text, args.work, *common, *awq, trainer="default")
    if not all(m.get("method") == "awq" for m in a["quant"]["modules"].values() if m["config"]):
        sys.exit(f"gpu_check: quant=awq int4 left layers uncalibrated: {a['quant']['modules']}")
    gptq: dict[str, dict | str] = {}
    for bits in () if args.skip_gptq else ("int4", "int8"):
        # The same calibration text and size as AWQ; int4 GPTQ needs mslk (lit-ppl refuses without it).
        run = ("quant=gptq", f"quant.name={bits}", *awq[2:])
        try:
            gptq[bits] = lit_ppl(model, text, args.work, *common, *run, trainer="default")
        except ValueError as err:
            gptq[bits] = f"refused: {err}"
            continue
        if not all(m.get("method") == "gptq" for m in gptq[bits]["quant"]["modules"].values() if m["config"]):
            sys.exit(f"gpu_check: quant=gptq {bits} left layers uncalibrated: {gptq[bits]['quant']['modules']}")
        if gptq[bits]["quant"]["consistency"]["world_size"] != 1:
            sys.exit("gpu_check: expected one rank")
    rows = [
        {"run": "raw loop bf16", "tok/s": raw_tps, "MFU": f"{flops_per_token * raw_tps / peak:.1%}", "ppl": "-"},
        {"run": "lit-ppl bf16", "tok/s": lit_tps, "MFU": f"{flops_per_token * lit_tps / peak:.1%}",
         "ppl": f"{r['ppl']:.2f}"},
        {"run": "lit-ppl int4 (tinygemm)", "tok/s": q["tokens"] / q["seconds"], "MFU": "-", "ppl": f"{q['ppl']:.2f}"},
        {"run": "lit-ppl int4 AWQ (tinygemm)", "tok/s": a["tokens"] / a["seconds"], "MFU": "-",
         "ppl": f"{a['ppl']:.2f}"},
    ]  # fmt: skip
    for bits, g in gptq.items():
        if isinstance(g, dict):
            rows.append({"run": f"lit-ppl {bits} GPTQ", "tok/s": g["tokens"] / g["seconds"], "MFU": "-",
                         "ppl": f"{g['ppl']:.2f}"})  # fmt: skip
    print(
        f"\n{name} · {n_params / 1e9:.2f}B params · {r['tokens']:,} tokens · rolling {args.seq_len} · batch "
        f"{args.batch_size} · {flops_per_token / 1e9:.2f} GFLOP/token · peak {peak / 1e12:.0f} TFLOP/s"
    )
    print(table(rows, ["run", "tok/s", "MFU", "ppl"]))
    print(f"\nframework overhead ratio (lit-ppl / raw): {lit_tps / raw_tps:.3f} (goal >= 0.95)")
    # Issue 11: the checkpoint is read straight to the GPU (device_map), never through a host copy of the model.
    ckpt_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    rss = r["rank_peak_rss_mb"][0]
    print(f"host peak RSS while {ckpt_mb:,.0f} MB of bf16 weights load to the GPU: {rss:,.0f} MB "
          f"(a host copy would add {ckpt_mb:,.0f} MB to the interpreter's ~1 GB)")  # fmt: skip
    print(f"int4 vs bf16 perplexity: {q['ppl'] / r['ppl'] - 1:+.2%} (random weights: only a sanity check)")
    cal = a["quant"]["calibration"]
    print(f"int4 AWQ: {cal['tokens']:,} calibration tokens, {cal['seconds']:.1f} s; {a['ppl'] / r['ppl'] - 1:+.2%} ppl")
    for bits, g in gptq.items():
        if isinstance(g, str):
            print(f"{bits} GPTQ: {g}")
        else:
            cal = g["quant"]["calibration"]
            print(f"{bits} GPTQ: {cal['tokens']:,} calibration tokens, {cal['seconds']:.1f} s (Hessians + GPTQ); "
                  f"{g['ppl'] / r['ppl'] - 1:+.2%} ppl")  # fmt: skip
    if args.skip_gptq:
        print("GPTQ: skipped (--skip-gptq)")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
