#!/usr/bin/env bash
# Idempotent environment set-up for development and CI.
#   .venv      Python 3.12 + jax/jaxlib 0.11.2 (the GPU machine's versions) + this package, editable.
#   .venv-ref  Python 3.11 "oracle": CPU torch 2.13.0 (a local wheel exists only for 3.11) and
#              transformers, used only by tests/oracle/hf_reference.py for reference logits.
#   SmolLM2-135M-Instruct GGUF fetched into $FATHOM_CACHE (default ~/.cache/fathom_jax).
set -euo pipefail
cd "$(dirname "$0")/.."

PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
PY311=${PY311:-/root/.pyenv/versions/3.11.7/bin/python3.11}
command -v "$PY312" >/dev/null || PY312=python3.12
command -v "$PY311" >/dev/null || PY311=python3.11

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY312"
  "$PY312" -m venv .venv
fi
echo "[setup] installing fathom-jax[test] into .venv"
.venv/bin/python -m pip install -q -e '.[test]'

# Pinned so reference outputs do not drift with transformers releases.
ORACLE_PKGS=(torch==2.13.0 transformers==5.24.0 accelerate==1.15.0 safetensors gguf==0.19.0 numpy)
if ! .venv-ref/bin/python -c "import torch, transformers, accelerate, gguf, safetensors, numpy" 2>/dev/null; then
  echo "[setup] creating oracle venv .venv-ref with $PY311"
  [ -x .venv-ref/bin/python ] || "$PY311" -m venv .venv-ref
  .venv-ref/bin/python -m pip install -q "${ORACLE_PKGS[@]}"
fi

echo "[setup] fetching SmolLM2 (cached after the first run)"
.venv/bin/python -c "from fathom_jax.models.hub import fetch_model; print(fetch_model('smollm2'))"
echo "[setup] done"
