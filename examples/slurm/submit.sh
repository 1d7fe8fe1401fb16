#!/usr/bin/env bash
# Pre-flight, then sbatch: refuses in one line, naming the variable and the fix, what sbatch would refuse later
# ("Requested node configuration is not available") or leave pending forever.
#   [NODES=2] [GPUS_PER_NODE=8] [PARTITION=name] examples/slurm/submit.sh sft|grpo [--key value ...]
#   ACCELERATOR=cpu PROCS_PER_NODE=2 ...    CPU ranks instead of one rank per GPU (no GPUs are requested)
# The --key value pairs go to `python -m rl_lightning fit`; any sbatch option via Slurm's own SBATCH_* variables
# (SBATCH_TIMELIMIT, SBATCH_ACCOUNT, SBATCH_WAIT...). The job runs in the current directory (outputs/, mlflow.db).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
count() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1='$2' is not a positive count; set $1=$3"; }

task=${1:-}
[[ $task == sft || $task == grpo ]] || die "task '$task': the first argument is sft or grpo (examples/slurm/<task>.sbatch)"
shift
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ACCELERATOR=${ACCELERATOR:-gpu}
count NODES "$NODES" 2
[[ $ACCELERATOR == gpu || $ACCELERATOR == cpu ]] || die "ACCELERATOR='$ACCELERATOR': set ACCELERATOR=gpu or cpu"

partition=${PARTITION:-${SBATCH_PARTITION:-}}
[[ -n $partition ]] || partition=$(sinfo -h -o '%P' | sed -n 's/\*$//p' | head -n 1)
[[ -n $partition ]] || die "PARTITION is unset and the cluster has no default partition; set PARTITION=<name> (sinfo)"
nodes_gres=$(sinfo -h -p "$partition" -o '%D %G')  # "<nodes> <gres>" per node group, e.g. "4 gpu:h100:8(S:0-1)"
[[ -n $nodes_gres ]] || die "PARTITION=$partition: sinfo knows no such partition; set PARTITION to one sinfo lists"
total_nodes=$(awk '{ n += $1 } END { print n + 0 }' <<<"$nodes_gres")
((NODES <= total_nodes)) || die "NODES=$NODES: partition '$partition' has $total_nodes node(s); set \
NODES=$total_nodes or fewer, or PARTITION=<a larger partition>"

sbatch_args=(--nodes "$NODES")
[[ -z ${PARTITION:-} ]] || sbatch_args+=(--partition "$PARTITION")
if [[ $ACCELERATOR == gpu ]]; then
    count GPUS_PER_NODE "$GPUS_PER_NODE" 8
    max_gpus=$(awk '{ n = split($2, g, ","); for (i = 1; i <= n; i++) if (g[i] ~ /^gpu/) {
        sub(/\(.*/, "", g[i]); c = g[i]; sub(/.*:/, "", c); if (c + 0 > m) m = c + 0 } } END { print m + 0 }' \
        <<<"$nodes_gres")
    ((max_gpus > 0)) || die "GPUS_PER_NODE=$GPUS_PER_NODE: partition '$partition' has no GPUs (sinfo Gres: \
$(awk '{ print $2 }' <<<"$nodes_gres" | sort -u | paste -sd ' ')); set PARTITION=<a GPU partition>, or ACCELERATOR=cpu"
    ((GPUS_PER_NODE <= max_gpus)) || die "GPUS_PER_NODE=$GPUS_PER_NODE: the nodes of partition '$partition' have at \
most $max_gpus GPU(s) each; set GPUS_PER_NODE=$max_gpus (and raise NODES for more ranks), or PARTITION=<larger nodes>"
    sbatch_args+=(--gpus-per-node "$GPUS_PER_NODE")
else
    PROCS_PER_NODE=${PROCS_PER_NODE:-1}
    count PROCS_PER_NODE "$PROCS_PER_NODE" 1
    sbatch_args+=(--gpus-per-node 0)
    export PROCS_PER_NODE
fi
export REPO ACCELERATOR
exec sbatch "${sbatch_args[@]}" "$REPO/examples/slurm/$task.sbatch" "$@"
