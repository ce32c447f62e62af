#!/usr/bin/env bash
# The cluster launchers for real, on this one machine: Open MPI's mpirun,
# MPICH's mpiexec and
# a one-node Slurm started here (munged, slurmctld and slurmd on localhost,
# in WORK_DIR, stopped at the end) train the same 3 steps as
# `scaletrain launch`, loss for loss: `mpirun -np 2`, `mpiexec -n 2`,
# `srun -n2`, `sbatch -n2`
# with srun inside, `sbatch -n2` with `scaletrain launch` inside (its
# workers from the allocation) and `srun -n1 scaletrain launch`. A
# trainer run directly in an sbatch -n2 script is refused at once, exit 2
# (Note [Slurm's batch step] in comm/env.cpp).
# Usage: cluster.sh SCALETRAIN_BIN WORK_DIR
set -euo pipefail
bin=$(realpath "$1") work=$2
for tool in mpirun.openmpi mpiexec.hydra srun sbatch sinfo slurmctld slurmd munged; do
  command -v "$tool" >/dev/null || { echo "cluster.sh: $tool is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
done
rm -rf "$work" && mkdir -p "$work" && work=$(realpath "$work")
cd "$work"

for _ in $(seq 200); do printf 'In the beginning was the word. '; done > corpus.txt
"$bin" prepare corpus.txt -o corpus.tok > /dev/null
cat > run.yaml <<EOF
data:
  path: $work/corpus.tok
model:
  block_size: 16
train:
  steps: 3
  global_batch: 4
  micro_batch: 2
  sample_tokens: 0
metrics:
  progress: false
EOF
train="$bin train $work/run.yaml --metrics.path"
losses() {
  /usr/bin/python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(" ".join(repr(r["loss"]) for r in rows if "record" not in r))' "$1"
}
same_as_local() {  # NAME METRICS
  local got
  got=$(losses "$2")
  [ "$got" = "$want" ] || { echo "cluster.sh: $1 gave losses [$got], scaletrain launch [$want]" >&2; exit 1; }
  echo "cluster.sh: $1: the same 3 losses as scaletrain launch"
}
clean_env=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT OMP_NUM_THREADS=1)

"${clean_env[@]}" "$bin" launch --nproc-per-node 2 --threads 1 --timeout 120 -- $train="$work/local.jsonl" > /dev/null
want=$(losses local.jsonl)
[ "$(wc -w <<< "$want")" = 3 ] || { echo "cluster.sh: the local run gave [$want]" >&2; exit 1; }

# Open MPI: ranks from OMPI_COMM_WORLD_*, the store port from the job id.
"${clean_env[@]}" timeout 180 mpirun.openmpi --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS \
  $train="$work/mpirun.jsonl" > mpirun.log 2>&1 || { cat mpirun.log >&2; exit 1; }
same_as_local "mpirun -np 2" mpirun.jsonl
no_open_store() {  # LOG: the job's identity gave the store a secret (WorldInfo::job_secret)
  ! grep -q "SCALETRAIN_STORE_SECRET is not set" "$1" || { echo "cluster.sh: $1: a store without a secret" >&2; exit 1; }
}
no_open_store mpirun.log
# RANK and WORLD_SIZE exported by hand would make both ranks rank 0 of 1
# (Note [Stale RANK and WORLD_SIZE]): refused, not two silent runs.
set +e
"${clean_env[@]}" RANK=0 WORLD_SIZE=1 timeout 180 mpirun.openmpi --allow-run-as-root --oversubscribe -np 2 -x RANK -x WORLD_SIZE \
  $train="$work/stale.jsonl" > stale.log 2>&1
code=$?
set -e
[ "$code" != 0 ] && grep -q "RANK=0 and WORLD_SIZE=1 are set, but mpirun started this process as rank 1 of 2" stale.log &&
  [ ! -e stale.jsonl ] || { echo "cluster.sh: stale RANK/WORLD_SIZE under mpirun were not refused (exit $code):" >&2; cat stale.log >&2; exit 1; }

# MPICH's Hydra: ranks from PMI_RANK and PMI_SIZE; no job id reaches the
# ranks, so the port is given.
"${clean_env[@]}" timeout 180 mpiexec.hydra -n 2 -env OMP_NUM_THREADS 1 -env MASTER_PORT "$(/usr/bin/python3 -c \
  'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
  $train="$work/mpich.jsonl" > mpich.log 2>&1 || { cat mpich.log >&2; exit 1; }
same_as_local "mpiexec.hydra -n 2 (MPICH)" mpich.jsonl

# A one-node Slurm of our own: its own munge key and socket, free ports.
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p munge state spool && chmod 700 munge
head -c 1024 /dev/urandom > munge/munge.key && chmod 400 munge/munge.key
stop() {
  for pid in slurmd.pid slurmctld.pid; do [ -s "$work/$pid" ] && kill "$(cat "$work/$pid")" 2>/dev/null || true; done
  [ -s "$work/munge/munged.pid" ] && kill "$(cat "$work/munge/munged.pid")" 2>/dev/null || true
}
trap stop EXIT
munged -f --key-file="$work/munge/munge.key" --socket="$work/munge/socket" --pid-file="$work/munge/munged.pid" \
  --log-file="$work/munge/munged.log" --seed-file="$work/munge/munged.seed"
host=localhost  # the node's name (slurmd -N): it resolves on any machine
cat > slurm.conf <<EOF
ClusterName=scaletrain
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/socket
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$work/slurm.conf
slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF" -N "$host"
for i in $(seq 120); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  [ "$i" = 120 ] && { echo "cluster.sh: the Slurm node never became idle" >&2; sinfo >&2 || true; cat slurmd.log slurmctld.log >&2; exit 1; }
  sleep 0.5
done
# The store is served at the first host of the node list ("localhost").

"${clean_env[@]}" timeout 180 srun -N1 -n2 $train="$work/srun.jsonl" > srun.log 2>&1 || { cat srun.log >&2; exit 1; }
same_as_local "srun -n2" srun.jsonl
no_open_store srun.log

# One launcher per node under srun (Note [Launch inside a Slurm allocation]);
# two on one node are refused.
"${clean_env[@]}" timeout 180 srun -N1 -n1 "$bin" launch --nproc-per-node 2 --threads 1 --timeout 120 -- \
  $train="$work/srun_launch.jsonl" > srun_launch.log 2>&1 || { cat srun_launch.log >&2; exit 1; }
same_as_local "srun -n1 scaletrain launch" srun_launch.jsonl
set +e
"${clean_env[@]}" timeout 60 srun -N1 -n2 "$bin" launch --nproc-per-node 1 -- true > srun_two.log 2>&1
code=$?
set -e
[ "$code" = 2 ] && grep -q "srun started 2 launchers on this node" srun_two.log ||
  { echo "cluster.sh: two launchers on one node were not refused (exit $code):" >&2; cat srun_two.log >&2; exit 1; }

cat > batch_srun.sh <<EOF
#!/bin/bash
srun $train=$work/sbatch_srun.jsonl
EOF
cat > batch_launch.sh <<EOF
#!/bin/bash
$bin launch --threads 1 --timeout 120 -- $train=$work/sbatch_launch.jsonl
EOF
cat > batch_direct.sh <<EOF
#!/bin/bash
$train=$work/sbatch_direct.jsonl
echo "exit code \$?"
EOF
for job in batch_srun batch_launch batch_direct; do
  "${clean_env[@]}" timeout 240 sbatch --wait -N1 -n2 -o "$work/$job.out" "$job.sh" > /dev/null ||
    { echo "cluster.sh: sbatch $job.sh failed" >&2; cat "$job.out" >&2; exit 1; }
done
same_as_local "sbatch -n2 with srun inside" sbatch_srun.jsonl
same_as_local "sbatch -n2 with scaletrain launch inside" sbatch_launch.jsonl
grep -q "scaletrain launch: from Slurm job .* (its batch script): nnodes 1 (batch script), node rank 0, nproc-per-node 2 (SLURM_TASKS_PER_NODE)" batch_launch.out ||
  { echo "cluster.sh: the launcher in the batch script did not say where its size came from:" >&2; cat batch_launch.out >&2; exit 1; }
grep -q "exit code 2" batch_direct.out && grep -q "batch script of Slurm job .*, one task of 2 (SLURM_NTASKS)" batch_direct.out ||
  { echo "cluster.sh: a trainer run directly in an sbatch -n2 script was not refused at once:" >&2; cat batch_direct.out >&2; exit 1; }
[ ! -e sbatch_direct.jsonl ] || { echo "cluster.sh: the refused run wrote metrics" >&2; exit 1; }
echo "cluster.sh: a trainer run directly in sbatch -n2 is refused: $(grep -m1 'batch script' batch_direct.out)"
