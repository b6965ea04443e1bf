# Sourced by the gpu_*.sh scripts: every stage under one deadline (DEADLINE seconds from the
# source, default the script's DEADLINE_DEFAULT): a stage gets at most the time left and is
# skipped, saying so, when less than its need is left.
T0=$(date +%s); DEADLINE=${DEADLINE:-${DEADLINE_DEFAULT:-530}}
guard() {  # guard NEED_S CMD...: run CMD within the time left, or skip it
    local need=$1 l; shift
    l=$(( DEADLINE - ($(date +%s) - T0) ))
    if [ "$l" -lt "$need" ]; then echo "SKIPPED ($l s left, needs $need): $*" | cut -c1-200; return; fi
    timeout "$l" "$@"; local rc=$?; [ $rc -ne 0 ] && echo "rc=$rc: $*" | cut -c1-200; return 0
}
