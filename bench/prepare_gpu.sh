#!/usr/bin/env bash
# Run here, on a machine that reaches PyPI, before the first call to the GPU machine: stages what the GPU acceptance session
# carries (bench/gpu_session.sh; the calls are in bench/README.md) into .vstage/, which git ignores:
#   .vstage/p00 ..       vLLM 0.25.0's wheels for torch 2.11+cu130 (shared/tools/stage_vllm.sh), one folder a call
#   .vstage/deps         our dependencies that the device image lacks (bench/gpu_deps.txt), Python 3.12 wheels
# and checks that each call's carried folders plus the working tree fit the 64 MiB a call carries.
#   STAGE_VLLM   the staging script (default: ../shared/tools/stage_vllm.sh beside this checkout)
#   PART_MIB     the size of one part (default: the most that fits a call beside the working tree and the deps,
#                which travel with part 0; the tree grew past what a fixed 56 left room for on 2026-11-30)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAGE_VLLM=${STAGE_VLLM:-$ROOT/../shared/tools/stage_vllm.sh}
LIMIT=$((64 * 1048576))
grep -qx '/.vstage/' .git/info/exclude 2>/dev/null || echo '/.vstage/' >> .git/info/exclude

[ -f "$STAGE_VLLM" ] || { echo "error: $STAGE_VLLM not found; set STAGE_VLLM=path/to/stage_vllm.sh" >&2; exit 1; }

DEPS=/tmp/vstage-deps  # here first: the staging below empties .vstage
rm -rf "$DEPS" && mkdir -p "$DEPS"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$DEPS" -r bench/gpu_deps.txt 2>&1 | grep -v 'is ignored' || true
want=$(grep -cE '^[A-Za-z]' bench/gpu_deps.txt)
have=$(ls "$DEPS"/*.whl | wc -l)
[ "$want" = "$have" ] || { echo "error: $DEPS holds $have wheels, bench/gpu_deps.txt names $want" >&2; exit 1; }

# what one call carries: the working tree git would send (tracked and untracked-not-ignored files) and its folders
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
# a part as large as fits the first call (the tree, the deps and 1 MiB to spare): fewer calls, each ~6 s of the lease
fit=$(( (LIMIT - tree - $(du -sb "$DEPS" | cut -f1)) / 1048576 - 1 ))
[ "$fit" -ge 8 ] || { echo "error: the working tree and the deps leave $fit MiB of a call's 64 for vLLM's parts;" \
                       "make the tree smaller (git ls-files -co --exclude-standard: what a call sends)" >&2; exit 1; }
PART_MIB=${PART_MIB:-$fit}
echo "parts of $PART_MIB MiB (the most a call fits beside the tree and the deps: $fit)"
PART_MIB=$PART_MIB LAYOUT=.vstage bash "$STAGE_VLLM" /tmp/vstage-build
cp -r "$DEPS" .vstage/deps
parts=(.vstage/p??)
ok=1
for i in "${!parts[@]}"; do
  extra=""
  [ "$i" = 0 ] && extra=.vstage/deps
  size=$((tree + $(du -sb "${parts[$i]}" $extra | awk '{s += $1} END {print s}')))
  printf 'call %d carries %s%s: %.1f MiB (limit 64)\n' $((i + 1)) "${parts[$i]}" "${extra:+ and $extra}" \
    "$(echo "$size / 1048576" | bc -l)"
  [ "$size" -lt "$LIMIT" ] || ok=0
done
[ "$ok" = 1 ] || { echo "error: a call carries more than 64 MiB; lower PART_MIB" >&2; exit 1; }
last=$((${#parts[@]} - 1))
echo
echo "The calls, back to back (the machine keeps /tmp only while it is in use):"
for i in "${!parts[@]}"; do
  carry="${parts[$i]}"
  [ "$i" = 0 ] && carry="${parts[$i]} and .vstage/deps"
  if [ "$i" = "$last" ]; then
    echo "  call $((i + 1)): carry $carry; bash bench/gpu_session.sh part $i && bash bench/gpu_session.sh finish S   (T s)"
  else
    echo "  call $((i + 1)): carry $carry; bash bench/gpu_session.sh part $i   (120 s)"
  fi
done
echo "  call $((last + 2)): carry nothing; bash bench/gpu_session.sh more S5   (T5 s)"
echo "  T: what the lease leaves after the first $last calls, less 5 minutes (at most 600); S = T - 20."
echo "  T5: what the lease leaves then, less a minute (the last call starts no machine: the one still warm);"
echo "      S5 = T5 - 10. It runs the checks the finish did not reach or stopped."
