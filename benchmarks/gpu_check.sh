#!/usr/bin/env bash
# GPU check for issue 6 (run it whenever a GPU machine is lent; CI never depends on it): on one CUDA device,
# in under 5 minutes, the throughput / framework-overhead benchmark and an MFU estimate for a ~1.1B Llama built
# from a config, plus the CUDA INT4 paths (quant=int4, and AWQ: quant=awq quant.name=int4; precision=bf16-true),
# then GPTQ int4 and int8 (quant=gptq: about a minute each more; --skip-gptq leaves them out). Prints a Markdown table.
#
#   bash benchmarks/gpu_check.sh [--peak-tflops 989] [--text-bytes 400000] [--skip-gptq]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: FAILED: $PY cannot import torch; set PYTHON=/path/to/venv/bin/python" >&2
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: FAILED: no CUDA device visible to torch (torch.cuda.is_available() is False); this check needs one GPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 450 "$PY" benchmarks/gpu_check.py "$@"
