#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, from Debian's packages, for the `slurm` tests:
#   sudo bash slurm/local_cluster.sh          # install (apt) if needed, write the config, start munged, slurmctld, slurmd
#   sbatch / squeue / scancel then work; tests/test_slurm.py skips when `sinfo` cannot reach a controller.
# slurmctld and slurmd run as root on this host, one node with 2 CPUs, no cgroups
# (proctrack/linuxproc, task/none): containers and CI machines rarely allow cgroup plugins.
# Exits 0 with a one-line note when it cannot install or start (no root, no apt): the tests then skip.
set -uo pipefail

note() { echo "slurm/local_cluster.sh: $*" >&2; }

if [ "$(id -u)" != 0 ]; then note "needs root (apt-get, daemons); slurm tests will skip"; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || { note "no apt-get here; slurm tests will skip"; exit 0; }
    # slurm-wlm pulls slurmctld, slurmd and the client commands; munge authenticates them to each other.
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurm-wlm munge >/dev/null; }; then
        note "apt-get could not install slurm-wlm and munge; slurm tests will skip"; exit 0
    fi
fi

host=$(hostname -s)
conf_dir=/etc/slurm
mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
# The package's post-install makes a key; make one if that step did not run (e.g. no systemd).
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key

cat > "$conf_dir/slurm.conf" <<CONF
# Written by slurm/local_cluster.sh: one node, 2 CPUs, no cgroups, for tests.
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (120 by default): short here, for tests.
AuthInfo=cred_expire=5
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
KillWait=30
NodeName=$host CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

running() { ps -C "$1" -o stat= 2>/dev/null | grep -q '^[^Z]'; }  # a live process of that name (zombies do not count)
if ! running munged; then
    runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force || { note "munged did not start"; exit 0; }
fi
# A fresh start: forget jobs of an earlier session (-c), then the node daemon.
running slurmctld || slurmctld -c || { note "slurmctld did not start; see /var/log/slurm/slurmctld.log"; exit 0; }
running slurmd || slurmd || { note "slurmd did not start; see /var/log/slurm/slurmd.log"; exit 0; }
for _ in $(seq 30); do
    if timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        note "cluster up: $(sinfo -h -o '%P %D %c %T')"; exit 0
    fi
    sleep 1
done
note "slurmd did not register with slurmctld in time (see /var/log/slurm/); slurm tests will skip"
exit 0
