#!/usr/bin/env bash
# One entry point. Sets up .venv on first use, checks the config once, then starts every rank with torchrun:
#   bash launch.sh                                   # the embedded tiny default (CPU or GPU)
#   bash launch.sh train_ppo.py --config configs/x.yaml --actor.lr 1e-6
#   NPROC=8 bash launch.sh train_grpo.py ...         # ranks per node (default: GPUs, or 2 on CPU)
# Under SLURM (SLURM_JOB_ID set, one task per node via srun) the node count, node rank and rendezvous
# address come from SLURM's variables; see slurm/.
# A stop signal that comes before the ranks can take it (while the environment is set up, the input is checked or
# the ranks start: SLURM's pre-emption warning comes once, whenever the clock says) is kept in this file, which every
# rank reads once its own handlers are in place (lib/stops.py); a later one is kept too, then passed on.
stop_request="${SPMD_RL_STOP_REQUEST:-$(mktemp "${TMPDIR:-/tmp}/spmd-rl-request.XXXXXX")}"
export SPMD_RL_STOP_REQUEST="$stop_request"
runner=
keep() {  # SIGNAL: keep it for the ranks, then pass it on to those running
  echo "$1" > "$stop_request"
  if [ -z "$runner" ]; then
    echo "launch.sh: SIG$1 before the ranks started: they stop after their first step, with a checkpoint" >&2
  else pkill "-$1" -P "$runner" 2>/dev/null || true; fi
}
trap 'keep USR1' USR1
trap 'rm -f "$stop_request"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

script=train_grpo.py
if [ $# -gt 0 ] && [[ "$1" == *.py ]]; then script="$1"; shift; fi
[ -f "$script" ] || { echo "error: no script $script (use train_grpo.py or train_ppo.py)" >&2; exit 2; }

if [ -z "${NPROC:-}" ]; then
  if has_gpu; then NPROC=$(nvidia-smi -L | wc -l); else NPROC=$(( $(nproc) >= 2 ? 2 : 1 )); fi
fi

if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NODEID:-}" ]; then
  master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  # the address SLURM reaches the first node at (NodeAddr), where it differs from the node's name
  addr=$(scontrol show node "$master" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
  master="${addr:-$master}"
  rdzv=(--nnodes "${SLURM_NNODES:-1}" --node-rank "$SLURM_NODEID" --rdzv-id "$SLURM_JOB_ID"
        --rdzv-backend c10d --rdzv-endpoint "$master:${MASTER_PORT:-29500}")
else
  rdzv=(--standalone --nnodes 1)
fi
# A CPU rank per core: more threads per rank than cores makes gloo runs slower, not faster.
has_gpu || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
# Every check of the input (config, paths, data rows, custom reward) in one process: one message, before any rank.
# (SIGUSR1 ignored there, as in torchrun: this script keeps it)
# It writes the run's trainer.max_restarts into $check_out, for torchrun.
check_out=$(mktemp "${TMPDIR:-/tmp}/spmd-rl-check.XXXXXX")
trap 'rm -f "$stop_request" "$check_out"' EXIT
(trap '' USR1; SPMD_RL_CHECK_OUT="$check_out" exec python -m lib.check "$script" "$(( NPROC * ${SLURM_NNODES:-1} ))" "$@") \
  || exit $?
max_restarts=$(head -c 8 "$check_out"); max_restarts=${max_restarts:-0}
export SPMD_RL_CHECKED=1  # the ranks check again, but do not probe the judge's endpoint a second time
# Stopping: each rank finishes its step, every rank saves a checkpoint, and the run exits 0. Whichever processes the
# signal reaches:
# - this script (Ctrl-C, a batch-shell signal): it sends the ranks the signal it got (so that a rank's "stopped by"
#   names what the user sent, whichever copy arrives first when the signal went to every process of the job);
# - every process of the job (scancel's SIGTERM, SLURM's pre-emption SIGUSR1): the ranks stop themselves, the reward
#   workers ignore it, and torchrun ignores SIGUSR1 (inherited here; left to itself it would die of it at once);
# - torchrun alone (kill, docker stop): it passes a SIGTERM on to the ranks and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT
#   seconds (set here, default 600; torch >= 2.12 reads it, older ones wait 30) for them to save before killing them.
# torchrun runs in its own session so that a terminal's Ctrl-C reaches only this script.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
# A failure (a rank killed or crashed, a hang the watchdog ended: lib/watchdog.py) restarts every rank, up to
# trainer.max_restarts times; each restart resumes from the newest whole checkpoint (lib/restarts.py, docs/faults.md).
# A rank that ends the run on purpose (exit 2: a refusal, 3: the canary or bad steps; lib/exits.py) has printed its
# one message: it writes the code here and exits 0, so torchrun adds no traceback of its own; this script exits with
# the code. A crash still fails torchrun, which shows all it shows.
stop_file=$(mktemp "${TMPDIR:-/tmp}/spmd-rl-stop.XXXXXX")
trap 'rm -f "$stop_file" "$stop_request" "$check_out"' EXIT
(trap '' USR1; SPMD_RL_STOP_FILE="$stop_file" exec setsid torchrun "${rdzv[@]}" --nproc-per-node "$NPROC" \
  --max-restarts "$max_restarts" "$script" "$@") &
runner=$!
trap 'pkill -INT -P "$runner" 2>/dev/null || true' INT  # Ctrl-C: a rank still starting aborts
trap 'keep TERM' TERM
status=0
while true; do
  status=0; wait "$runner" || status=$?  # (set -e is on: a failing wait must not end this script)
  kill -0 "$runner" 2>/dev/null || break  # a trapped signal interrupted the wait: keep waiting
done
why=
if [ "$status" = 0 ] && [ -s "$stop_file" ]; then
  read -r status why < "$stop_file" || true
fi
# SLURM's pre-emption warning stopped the run before its end (a checkpoint written): with SPMD_RL_REQUEUE=1 the job
# goes back in the queue (the template's --requeue allows it) and resumes when it runs again; one node asks.
if [ "$why" = preempted ] && [ "${SPMD_RL_REQUEUE:-0}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ] \
   && [ "${SLURM_NODEID:-0}" = 0 ]; then
  if scontrol requeue "$SLURM_JOB_ID"; then
    echo "launch.sh: job $SLURM_JOB_ID requeued (SPMD_RL_REQUEUE=1): it resumes from its checkpoint when it runs again" >&2
  else
    echo "launch.sh: scontrol requeue $SLURM_JOB_ID failed: submit the same command again to resume" >&2
  fi
fi
exit "$status"
