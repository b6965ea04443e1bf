#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for testing the workflow's SLURM profile (profiles/slurm).
# Debian 12 (slurm-wlm 22.05, munge 0.5), run as root, no systemd: the daemons are started here as
# plain daemons and stopped by the PIDs recorded at start.
#
#   .ci/slurm-cluster.sh install   apt-get install slurm-wlm munge (skipped when already installed)
#   .ci/slurm-cluster.sh up        write slurm.conf + gres.conf, start munged, slurmctld, slurmd,
#                                  wait until the node is idle, submit one job and wait for it
#   .ci/slurm-cluster.sh status    the daemons, sinfo, queue
#   .ci/slurm-cluster.sh down      stop the daemons by their recorded PIDs
#   .ci/slurm-cluster.sh logs      print the daemon logs
#
# The node advertises placeholder GPUs, typed like a real site's GRES (gres.conf Name=gpu Type=h100
# File=<an empty file>), so that a rule with resources gpu=1, gpu_model=h100 -- which the Snakemake
# SLURM executor submits as `sbatch --gpus=h100:1` -- is accepted and runs. Nothing uses the files;
# with TaskPlugin=task/none no device cgroup is set up. (slurmd drops a gpu GRES with no File=.)
#
# Environment:
#   SLURM_FAKE_GPUS   typed placeholder GPUs, "type:count ..." (default "h100:1 rtx_pro_6000:1";
#                     "" = none)
#   SLURM_TEST_PARTITION  partition name (default "debug", the default partition)
#   SLURM_STATE_DIR   PIDs and the smoke job's output (default /tmp/specpilot-slurm)
#
# Any failure prints the daemon logs and exits non-zero.
set -euo pipefail

NODE=$(hostname -s)
PARTITION=${SLURM_TEST_PARTITION:-debug}
FAKE_GPUS=${SLURM_FAKE_GPUS-h100:1 rtx_pro_6000:1}
STATE=${SLURM_STATE_DIR:-/tmp/specpilot-slurm}
PIDS=$STATE/pids
CONF=/etc/slurm/slurm.conf
MARK="# written by specpilot .ci/slurm-cluster.sh"
LOGS=(/var/log/munge/munged.log /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log)

log() { printf '[slurm-cluster %s] %s\n' "$(date +%T)" "$*" >&2; }

print_logs() {
    local f
    for f in "${LOGS[@]}"; do
        echo "===== $f (last 60 lines) =====" >&2
        if [ -f "$f" ]; then tail -n 60 "$f" >&2; else echo "(missing)" >&2; fi
    done
}

die() {
    log "FAILED: $*"
    print_logs
    exit 1
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 4; i++)); do
        if "$@" > /dev/null 2>&1; then return 0; fi
        sleep 0.25
    done
    die "timed out after ${secs}s waiting for $what"
}

install() {
    if command -v slurmctld > /dev/null && command -v slurmd > /dev/null \
        && command -v munged > /dev/null && command -v sbatch > /dev/null; then
        log "slurm-wlm and munge already installed: $(slurmctld -V)"
        return
    fi
    [ "$(id -u)" = 0 ] || die "install needs root"
    log "apt-get install slurm-wlm munge"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
    log "installed $(slurmctld -V)"
}

write_config() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script: refusing to replace a real cluster's config"
    fi
    mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/lib/slurm/fakegpu \
        /var/log/slurm /run/slurm
    chown slurm:slurm /var/lib/slurm/slurmctld /var/log/slurm /run/slurm

    # the node's hardware exactly as slurmd sees it, e.g.
    # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
    local hw gres="" spec type count i
    hw=$(slurmd -C | head -n 1)
    [[ $hw == NodeName=* ]] || die "unexpected 'slurmd -C' output: $hw"

    : > /etc/slurm/gres.conf.new
    for spec in $FAKE_GPUS; do
        type=${spec%%:*}
        count=${spec#*:}
        [[ $type =~ ^[A-Za-z0-9_.]+$ && $count =~ ^[0-9]+$ ]] || die "bad SLURM_FAKE_GPUS entry: $spec"
        gres+="${gres:+,}gpu:${type}:${count}"
        for ((i = 0; i < count; i++)); do
            touch "/var/lib/slurm/fakegpu/${type}-$i"
            echo "NodeName=$NODE Name=gpu Type=$type File=/var/lib/slurm/fakegpu/${type}-$i" \
                >> /etc/slurm/gres.conf.new
        done
    done
    mv /etc/slurm/gres.conf.new /etc/slurm/gres.conf

    cat > "$CONF.new" << EOF
$MARK -- a test cluster on localhost
ClusterName=specpilot-test
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MpiDefault=none
# no cgroups, no systemd: plain process tracking, no task containment
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# no slurmdbd: no accounting, so 'sacct' does not work and Snakemake must poll with 'squeue'
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
# finished jobs stay visible to squeue/scontrol for 30 min (the test reads them back): the Snakemake SLURM executor trusts
# 'squeue' as its status command only when MinJobAge >= 3 x its first status-check delay
MinJobAge=1800
${gres:+GresTypes=gpu}
${hw} ${gres:+Gres=$gres} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=${PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.new" "$CONF"
    log "wrote $CONF (node ${NODE}${gres:+, GRES $gres})"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null; }

record() { # record NAME PIDFILE: remember a started daemon's PID for 'down'
    local pid
    pid=$(cat "$2")
    touch "$PIDS"
    { grep -v "^$1 " "$PIDS" || true; echo "$1 $pid"; } > "$PIDS.new"
    mv "$PIDS.new" "$PIDS"
}

node_state() { sinfo -h -n "$NODE" -o %T 2> /dev/null | head -n 1; }

node_usable() { [[ "$(node_state)" =~ ^(idle|mixed|allocated)$ ]]; }

start_munge() {
    if pid_alive /run/munge/munged.pid; then
        log "munged already running (pid $(cat /run/munge/munged.pid))"
        record munged /run/munge/munged.pid
        return
    fi
    # Debian's postinst creates the key; make one if it did not
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    wait_for 10 "munged's pid file" test -s /run/munge/munged.pid
    record munged /run/munge/munged.pid
    munge -n | unmunge > /dev/null || die "munge cannot encode/decode a credential"
}

smoke_job() {
    local jid st=""
    mkdir -p "$STATE/jobs"
    jid=$(sbatch --parsable -o "$STATE/jobs/smoke-%j.out" --wrap 'hostname') || die "sbatch failed"
    for _ in $(seq 240); do
        st=$(scontrol show job "$jid" 2> /dev/null | grep -o 'JobState=[A-Z_]*' || true)
        case "$st" in JobState=COMPLETED | JobState=FAILED | JobState=CANCELLED | JobState=NODE_FAIL) break ;; esac
        sleep 0.25
    done
    [ "$st" = JobState=COMPLETED ] || die "smoke job $jid: ${st:-no state}"
    log "smoke job $jid COMPLETED on $(cat "$STATE/jobs/smoke-$jid.out")"
}

up() {
    [ "$(id -u)" = 0 ] || die "up needs root"
    command -v slurmctld > /dev/null || die "slurm is not installed: run '$0 install' first"
    local t0=$SECONDS
    mkdir -p "$STATE"
    write_config
    start_munge
    if pid_alive /run/slurm/slurmctld.pid; then
        scontrol reconfigure || die "scontrol reconfigure failed"
    else
        rm -f /run/slurm/slurmctld.pid
        slurmctld || die "slurmctld did not start" # daemonizes, drops to SlurmUser
    fi
    wait_for 30 "slurmctld's pid file" test -s /run/slurm/slurmctld.pid
    record slurmctld /run/slurm/slurmctld.pid
    wait_for 60 "slurmctld to answer 'scontrol ping'" scontrol ping
    if ! pid_alive /run/slurm/slurmd.pid; then
        rm -f /run/slurm/slurmd.pid
        slurmd || die "slurmd did not start" # daemonizes, runs as root
    fi
    wait_for 30 "slurmd's pid file" test -s /run/slurm/slurmd.pid
    record slurmd /run/slurm/slurmd.pid
    # a node drained in an earlier run stays drained (state lives in StateSaveLocation): resume it
    for _ in $(seq 60); do
        node_usable && break
        if [[ "$(node_state)" =~ drain ]]; then
            scontrol show node "$NODE" | grep -E 'Reason' >&2 || true
            scontrol update nodename="$NODE" state=resume || true
        fi
        sleep 1
    done
    node_usable || die "node $NODE is not usable: state '$(node_state)'"
    smoke_job
    sinfo >&2
    log "cluster up in $((SECONDS - t0)) s; pids: $(tr '\n' ' ' < "$PIDS")"
}

down() {
    local name pid
    if [ ! -s "$PIDS" ]; then
        log "no recorded pids ($PIDS): nothing to stop"
        return
    fi
    # slurmd first, then the controller, then munge
    for name in slurmd slurmctld munged; do
        pid=$(awk -v n="$name" '$1 == n {print $2}' "$PIDS")
        [ -n "$pid" ] || continue
        if kill -0 "$pid" 2> /dev/null; then
            kill -TERM "$pid"
            for _ in $(seq 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
            if kill -0 "$pid" 2> /dev/null; then
                log "$name (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
                kill -KILL "$pid" 2> /dev/null || true
            fi
            log "stopped $name (pid $pid)"
        else
            log "$name (pid $pid) was not running"
        fi
    done
    rm -f "$PIDS"
}

status() {
    local f
    for f in /run/munge/munged.pid /run/slurm/slurmctld.pid /run/slurm/slurmd.pid; do
        if pid_alive "$f"; then ps -o pid=,user=,etime=,args= -p "$(cat "$f")"; else echo "not running: $f"; fi
    done
    scontrol ping || true
    sinfo || true
    squeue || true
}

case "${1:-}" in
    install) install ;;
    up) up ;;
    down) down ;;
    status) status ;;
    logs) print_logs 2>&1 ;;
    *)
        echo "usage: $0 install|up|status|down|logs" >&2
        exit 2
        ;;
esac
