#!/usr/bin/env bash
# The test command: set up .venv if needed, then pytest (CPU by default; gpu/vllm tests skip with a reason).
# Extra arguments go to pytest, e.g. `bash test.sh -m "not slow" -x`.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec python -m pytest "$@"
