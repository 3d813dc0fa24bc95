#!/usr/bin/env bash
# A local SLURM cluster for tests/test_slurm.py: munged, slurmctld and two slurmd (nodes n1 and n2, one host; Debian's
# slurm-wlm build allows several), every file under DIR, nothing under /etc. PORTS: four ports, the controller's,
# slurmd's default and the two nodes' (16817-16820 if unset; tests/test_slurm.py gives four the system found free, so a
# former cluster's daemons still on theirs, as a killed test session leaves them, stop nothing).
#   bash tests/slurm/cluster.sh DIR        # start; prints "ready" once both nodes are idle
#   bash tests/slurm/cluster.sh DIR stop   # stop
set -euo pipefail
D="$1"
if [ "${2:-}" = stop ]; then
  SLURM_CONF="$D/slurm.conf" scontrol shutdown 2>/dev/null || true
  sleep 1
  [ -f "$D/munge/munged.pid" ] && kill "$(cat "$D/munge/munged.pid")" 2>/dev/null || true
  exit 0
fi
read -r ctld_port slurmd_port n1_port n2_port <<< "${PORTS:-16817 16818 16819 16820}"
mkdir -p "$D"/{state,spool,log,munge}
chmod 700 "$D/munge"
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
[ -f "$D/munge/munge.key" ] || mungekey --create --keyfile "$D/munge/munge.key" --force
chown -R root "$D/munge"
munged --key-file "$D/munge/munge.key" --socket "$D/munge/munge.socket" --pid-file "$D/munge/munged.pid" \
  --log-file "$D/log/munged.log" --seed-file "$D/munge/munged.seed" --force
cat > "$D/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again cred_expire + 1 s after its requeue (default 120 s: 2 of the pre-emption test's 4 min)
AuthInfo=socket=$D/munge/munge.socket,cred_expire=30
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# pending jobs tried every 5 s (defaults: backfill 30 s, the main loop 60 s): a requeued job starts once it may
SchedulerParameters=bf_interval=5,sched_interval=5
MpiDefault=none
ReturnToService=2
KillWait=30
InactiveLimit=0
MinJobAge=300
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n1_port CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n2_port CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF="$D/slurm.conf"
slurmctld -f "$D/slurm.conf"
for n in n1 n2; do mkdir -p "$D/spool/$n"; slurmd -f "$D/slurm.conf" -N "$n"; done
for i in $(seq 60); do
  if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then echo ready; exit 0; fi
  sleep 1
done
sinfo; tail -20 "$D/log/slurmctld.log" "$D"/log/slurmd-*.log; exit 1
