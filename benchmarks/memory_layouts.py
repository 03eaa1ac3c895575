"""Issue 31 — host memory per phase and per rank: 1 process vs ``fsdp`` × 2 vs ``tp``, side by side.

Each layout runs in fresh processes (one per rank, gloo on 127.0.0.1) that go through lit-ppl's own placement
pipeline (:func:`lit_ppl.model.placement.place`, as ``PerplexityModule.configure_model`` calls it), the scoring
path's self-check (:func:`lit_ppl.model.scorer.check_scorer`) and the scorer's forward, and read their RSS
(``VmRSS``) and its high-water mark (``VmHWM``, the figure ``results.json`` reports as ``rank_peak_rss_mb``) after
each phase:

* ``interpreter``: torch, Lightning, transformers and lit-ppl imported, the process group up;
* ``materialise``: split layouts: the model built on meta, split / sharded, its parameters allocated empty;
* ``load``: ``place`` returned (the weights read and in place; with ``--quant``, quantized and sharded too);
* ``quantize``: with ``--quant NAME`` (``quant=NAME``, round to nearest): the weights read and quantized (each
  decoder weight as it is read, its rows kept at once under ``fsdp``), before the rest is sharded;
* ``check``: ``check_scorer`` (what every run does before its first batch);
* ``first step``: one step of ``--batch`` windows of ``--seq-len`` seeded random token ids (memory does not depend
  on which ids), every position scored;
* ``evaluate``: ``--steps`` steps in all (a data-parallel rank runs its own; tensor-parallel ranks the same ones).

The table gives the high-water mark after each phase (MB; the phase that raised it is where the peak comes from)
and each rank's weight bytes. ``chunk_size=auto`` within 256 MiB, as the schema's defaults.

SmolLM2-135M's 9 attention heads (3 KV heads) do not split in 2: its tensor-parallel row is ``tp3``.

    python benchmarks/memory_layouts.py                       # SmolLM2-135M float32: ~4 min on 2 cores
    python benchmarks/memory_layouts.py --model DIR --layouts 1,fsdp2
    python benchmarks/memory_layouts.py --model DIR --layouts 1,fsdp2 --quant int8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from common import ROOT, table

SMOLLM2 = Path("~/.cache/lit_ppl/models/smollm2-135m").expanduser()
LAYOUTS = {"1": (1, 1, 1), "fsdp2": (2, 2, 1), "tp2": (2, 1, 2), "tp3": (3, 1, 3)}  # world, dp_shard, tp
PHASES = ("interpreter", "materialise", "quantize", "load", "check", "first step", "evaluate")


def status_mb() -> tuple[float, float]:
    """``(VmRSS, VmHWM)`` of this process in MB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def child(args: argparse.Namespace) -> dict:
    import lightning.pytorch  # noqa: F401 (a run's interpreter holds it: the same baseline as rank_peak_rss_mb's)
    import torch
    import torch.distributed as dist

    from lit_ppl.model import placement
    from lit_ppl.model.nll import auto_chunk
    from lit_ppl.model.scorer import check_scorer
    from lit_ppl.model.spec import ModelSpec
    from lit_ppl.parallel.layout import Layout
    from lit_ppl.runtime.memory import keep_freed_memory_in_heap

    torch.set_num_threads(args.threads)
    world, dp_shard, tp = LAYOUTS[args.layout]
    phases: dict[str, tuple[float, float]] = {}
    layout = None
    if world > 1:
        dist.init_process_group("gloo")
        layout = Layout(dp_replicate=1, dp_shard=dp_shard, tp=tp)
    phases["interpreter"] = status_mb()
    materialize = placement.materialize

    def measured(*a: object, **k: object) -> None:  # the phase boundary inside place(): after the empty allocation
        materialize(*a, **k)
        phases["materialise"] = status_mb()

    placement.materialize = measured
    quantizer = None
    if args.quant:
        from lit_ppl.config.quant import quant_config
        from lit_ppl.quant.quantizer import Quantizer

        quantizer = Quantizer(quant_config({"name": args.quant}))
        quantize = quantizer.quantize

        def quantized(*a: object, **k: object) -> object:  # the phase boundary: quantized, not yet sharded
            report = quantize(*a, **k)
            phases["quantize"] = status_mb()
            return report

        quantizer.quantize = quantized
    keep_freed_memory_in_heap()  # as PerplexityModule.on_validation_start does on CPU
    spec = ModelSpec(path=str(args.model))
    vocab, _ = spec.limits()
    device = torch.device("cpu")

    def broadcast(obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    where = placement.Placement(
        layout, device, auto_chunk("auto", vocab, 256), broadcast if world > 1 else (lambda o: o)
    )
    scorer, _ = placement.place(spec, where, torch.float32, quantizer)
    phases["load"] = status_mb()
    check_scorer(scorer, device)
    phases["check"] = status_mb()
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() // tp if world > 1 else 0))
    nll_sum = 0.0
    with torch.inference_mode():
        for step in range(args.steps):
            ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen)
            index = torch.arange(args.batch * args.seq_len)
            nll_sum += float(scorer(ids[:, :-1], index, ids[:, 1:].reshape(-1)).double().sum())
            if step == 0:
                phases["first step"] = status_mb()
    phases["evaluate"] = status_mb()
    weights = placement.weight_bytes(scorer) / 2**20
    if world > 1:
        dist.destroy_process_group()
    return {"phases": phases, "weights_mb": weights, "nll_sum": nll_sum}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(args: argparse.Namespace, name: str) -> list[dict]:
    world = LAYOUTS[name][0]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        cmd = [sys.executable, __file__, "--child", name, "--model", str(args.model), "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--threads", str(args.threads),
               *(["--quant", args.quant] if args.quant else [])]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            sys.exit(f"{name} rank {rank} failed:\n{err[-3000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument("--layouts", default="1,fsdp2,tp3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quant", default=None, help="quant=NAME by round to nearest (int8, int4)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.layout = args.child
        print(json.dumps(child(args)))
        return
    rows = []
    for name in args.layouts.split(","):
        for rank, out in enumerate(run_layout(args, name)):
            ph = out["phases"]
            row = {"layout": name, "rank": rank, "weights MB": out["weights_mb"]}
            row |= {p: ph[p][1] if p in ph else "—" for p in PHASES}
            rows.append(row | {"peak MB": max(hwm for _, hwm in ph.values())})
    one_peak = max((r["peak MB"] for r in rows if r["layout"] == "1"), default=None)
    for row in rows:
        row["peak / 1 process"] = row["peak MB"] / one_peak if one_peak else "—"
    print(f"{args.model.name}: high-water RSS (MB) after each phase, per rank\n")
    print(table(rows, ["layout", "rank", "weights MB", *PHASES, "peak MB", "peak / 1 process"]))


if __name__ == "__main__":
    main()
