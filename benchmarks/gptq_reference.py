"""lit-ppl's GPTQ solver against independent ones on the same layer, Hessian and int4 grid (issue 32).

lit-ppl's own statistics (:func:`lit_ppl.quant.calibrated.gptq.gptq_hessians`) capture ``XᵀX`` of every linear
layer of the chosen decoder blocks on the calibration text; each layer is quantized to int4 with the group size
lit-ppl gives it (``quant.group_fallback``: SmolLM2's 576-wide inputs take g64 at g128) and torchao's symmetric
grid (lit-ppl's int4: ``IntxWeightOnlyConfig``'s default, scale ``amax/7.5``, codes −8…7), act-order off and on, by

- ``lit``: :func:`lit_ppl.quant.calibrated.gptq_solver.gptq_tensor` (float64, lazy blocks of 128 columns);
- ``ist``: the authors' code (IST-DASLab/gptq ``gptq.py`` + ``quant.py``, ``GPTQ.fasterquant``; float32 as
  published), act-order with ``static_groups`` (the only grid a contiguous-group int4 tensor can hold);
- ``ist_bg``: the same with ``blocksize`` = the group size: the authors' code reads a group's grid from ``W``,
  which inside a lazy block has not yet received the block's earlier error feedback (``W1`` has); with one group
  per block both read the updated columns, lit-ppl's choice (the authors' read, tried in lit-ppl, raised the
  held-out KLD: benchmarks/README.md);
- ``llmc``: llm-compressor's ``quantize_weight`` (its grid: every group's scale from the original weight before
  any update, also without act-order; act-order is its ``actorder="weight"``), where it is installed.

The references run in another interpreter (``--ref-python``, a venv with torch and llm-compressor; not a
dependency of lit-ppl), reading the ``(W, XᵀX, group, act-order)`` problems from a ``.pt`` file. Every solution's
reconstruction error ``tr(ΔW XᵀX ΔWᵀ)`` (``ΔW = W − Q``) is computed here in float64, with RTN's beside it.

    python3 -m venv /work/venv-ref && /work/venv-ref/bin/pip install torch==2.13.0 llmcompressor
    git clone https://github.com/IST-DASLab/gptq /tmp/ist-gptq   # or any copy of its gptq.py and quant.py
    python benchmarks/gptq_reference.py --ref-python /work/venv-ref/bin/python --ist-gptq /tmp/ist-gptq

Figures: benchmarks/README.md ("GPTQ against independent solvers").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def capture(args: argparse.Namespace, work: Path) -> dict[str, dict[str, Any]]:
    """``{layer: {W, xtx, count, group}}`` from lit-ppl's own Hessians on the calibration text."""
    from common import load_model
    from int4_methods import split_text

    from lit_ppl.config.quant import quant_config
    from lit_ppl.model.spec import ModelSpec
    from lit_ppl.quant.calibrated.gptq import gptq_hessians
    from lit_ppl.quant.calibrated.text import Calibration, CalibrationSpec, prepare_calibration
    from lit_ppl.quant.schemes import Scheme, fit_group

    _, calib = split_text(args.text, args.eval_bytes, args.calib_bytes, work)
    cal_cfg = {"path": str(calib), "tokens": args.calib_tokens, "seq_len": args.seq_len, "batch_size": 4}
    spec = CalibrationSpec.from_cfg(quant_config({"calibration": {**cal_cfg, "cache_dir": str(work)}}).calibration, "")
    cal = Calibration(spec, prepare_calibration(spec, ModelSpec(path=str(args.model)).tokenizer(), None))
    lm = load_model(args.model, torch.float32)
    names = [f"model.layers.{b}.{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}" for b in args.blocks for t in TYPES]
    hessians = gptq_hessians(lm, names, cal, 0, 1)
    out = {}
    for n in names:
        mod = lm.get_submodule(n)
        group = fit_group(Scheme("int4", args.group), mod.weight, mod).group_size
        w = mod.weight.detach().clone()
        out[n] = {"W": w, "xtx": hessians[n]["xtx"], "count": int(hessians[n]["count"]), "group": group}
    return out


def lit_solve(problem: dict[str, Any], act_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """lit-ppl's GPTQ and torchao's RTN of one problem, dequantized."""
    from lit_ppl.config.quant import GptqConfig
    from lit_ppl.quant.calibrated.awq import quantize_weight
    from lit_ppl.quant.calibrated.gptq_solver import gptq_tensor
    from lit_ppl.quant.schemes import Scheme, torchao_config

    config = torchao_config(Scheme("int4", problem["group"]), "intx")[0]
    q, _ = gptq_tensor(problem["xtx"], problem["W"], config, GptqConfig(act_order=act_order))
    return q.dequantize(), quantize_weight(problem["W"], config).dequantize()


def reference(problems_path: Path, out_path: Path, ist: Path | None) -> None:
    """Run in the reference interpreter: the independent solvers on every problem (imports only torch and them)."""
    torch.set_num_threads(1)  # two OpenMP threads collapse on a loaded 2-core machine (benchmarks/README.md)
    problems = torch.load(problems_path)
    out: dict[str, torch.Tensor] = {}
    solvers = {}
    if ist is not None:
        solvers["ist"] = lambda p, a: _ist(ist, p, a, 128)
        solvers["ist_bg"] = lambda p, a: _ist(ist, p, a, p["group"])
    try:
        import llmcompressor  # noqa: F401

        solvers["llmc"] = _llmc
    except ImportError as err:
        print(f"llm-compressor not importable here ({err}): its column is left out", file=sys.stderr)
    for name, p in problems.items():
        for act_order in (False, True):
            for label, solve in solvers.items():
                t0 = time.perf_counter()
                out[f"{name}|{int(act_order)}|{label}"] = solve(p, act_order).to(torch.float32)
                out[f"{name}|{int(act_order)}|{label}|s"] = torch.tensor(time.perf_counter() - t0)
        print(f"reference solvers: {name} done", file=sys.stderr, flush=True)
    torch.save(out, out_path)


def _ist(path: Path, p: dict[str, Any], act_order: bool, blocksize: int) -> torch.Tensor:
    """The authors' ``GPTQ.fasterquant`` (float32, as published) on ``H = 2/n XᵀX`` (its own normalisation)."""
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    torch.cuda.synchronize = lambda *a: None  # the authors' code syncs CUDA after solving; nothing to sync on CPU
    import contextlib
    import io

    from gptq import GPTQ
    from quant import Quantizer

    layer = torch.nn.Linear(p["W"].shape[1], p["W"].shape[0], bias=False)
    layer.weight.data = p["W"].clone().float()
    g = GPTQ(layer)
    g.quantizer = Quantizer()
    g.quantizer.configure(4, perchannel=True, sym=True, mse=False)
    g.H = (p["xtx"] * (2.0 / p["count"])).float()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its time and its own loss estimate
        g.fasterquant(
            blocksize=blocksize, percdamp=0.01, groupsize=p["group"], actorder=act_order, static_groups=act_order
        )
    return layer.weight.data.clone()


def _llmc(p: dict[str, Any], act_order: bool) -> torch.Tensor:
    """llm-compressor's ``quantize_weight`` (0.14: int4 symmetric groups, every group's grid from the original
    weight by compressed-tensors' ``calculate_qparams``, as its min-max observer gives it; act-order ``"weight"``)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    w, g = p["W"].float(), p["group"]
    qargs = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=g, actorder="weight" if act_order else None
    )
    groups = w.reshape(w.shape[0], -1, g)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), qargs)
    h = (p["xtx"] * (2.0 / p["count"])).float()  # its normalisation: 2/n XᵀX
    quantized, _, fallback = quantize_weight(w[None].clone(), h[None], scale[None], zero[None], None, qargs, 128, 0.01)
    assert not bool(fallback.any()), "llm-compressor fell back to round-to-nearest"
    return quantized[0]


def main() -> None:
    from common import WIKITEXT, table
    from int4_methods import SMOLLM2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--text", type=Path, default=WIKITEXT)
    parser.add_argument("--eval-bytes", type=int, default=20_000)
    parser.add_argument("--calib-bytes", type=int, default=40_000)
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 15, 29])
    parser.add_argument("--ref-python", type=Path, required=True, help="an interpreter with torch (+ llmcompressor)")
    parser.add_argument("--ist-gptq", type=Path, help="a copy of IST-DASLab/gptq (gptq.py, quant.py)")
    parser.add_argument("--reference", nargs=2, type=Path, help=argparse.SUPPRESS)  # the reference interpreter's part
    args = parser.parse_args()
    torch.set_num_threads(1)  # two OpenMP threads collapse on a loaded 2-core machine (benchmarks/README.md)
    work = Path(tempfile.mkdtemp(prefix="gptq_reference_"))
    t0 = time.perf_counter()
    problems = capture(args, work)
    print(f"captured {len(problems)} layers' XᵀX in {time.perf_counter() - t0:.0f} s", flush=True)
    torch.save(problems, work / "problems.pt")
    cmd = [str(args.ref_python), __file__, "--ref-python", "-", "--reference", str(work / "problems.pt")]
    cmd += [str(work / "ref.pt")] + (["--ist-gptq", str(args.ist_gptq)] if args.ist_gptq else [])
    subprocess.run(cmd, check=True)
    ref = torch.load(work / "ref.pt")
    rows = []
    for name, p in problems.items():
        for act_order in (False, True):
            t1 = time.perf_counter()
            lit, rtn = lit_solve(p, act_order)
            row: dict[str, Any] = {"layer": name.removeprefix("model.layers."), "g": p["group"]}
            row |= {"act": "on" if act_order else "off", "s_lit": time.perf_counter() - t1}
            err = _err(p, lit)
            row |= {"rtn err": f"{_err(p, rtn):.4g}", "lit err": f"{err:.4g}", "lit/rtn": err / _err(p, rtn)}
            for label in ("ist", "ist_bg", "llmc"):
                key = f"{name}|{int(act_order)}|{label}"
                if key in ref:
                    row[f"lit/{label}"] = err / _err(p, ref[key])
                    row[f"max abs Δ {label}"] = float((lit - ref[key]).abs().max())
                    row[f"s_{label}"] = float(ref[f"{key}|s"])
            rows.append(row)
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    for act in ("off", "on"):
        sub = [r for r in rows if r["act"] == act]
        for label in ("ist", "ist_bg", "llmc"):
            ratios = [r[f"lit/{label}"] for r in sub if f"lit/{label}" in r]
            if ratios:
                print(f"act-order {act}: lit/{label} min {min(ratios):.4f} max {max(ratios):.4f} over {len(ratios)}")
        print(f"act-order {act}: lit/rtn mean {sum(r['lit/rtn'] for r in sub) / len(sub):.3f}")


def _err(p: dict[str, Any], q: torch.Tensor) -> float:
    """``tr(ΔW XᵀX ΔWᵀ) / n``: the summed squared output error per calibration token."""
    d = p["W"].double() - q.double()
    return float(((d @ p["xtx"]) * d).sum()) / p["count"]


if __name__ == "__main__":
    if "--reference" in sys.argv:  # the reference interpreter: no lit-ppl imports
        i = sys.argv.index("--reference")
        ist = sys.argv[sys.argv.index("--ist-gptq") + 1] if "--ist-gptq" in sys.argv else None
        reference(Path(sys.argv[i + 1]), Path(sys.argv[i + 2]), Path(ist) if ist else None)
    else:
        main()
