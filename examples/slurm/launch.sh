#!/usr/bin/env bash
# The body of sft.sbatch / grpo.sbatch, run by the batch script on the allocation's first node: one `srun` task per
# node, each a torchrun that starts PROCS_PER_NODE ranks and meets the others at a c10d rendezvous on the first node
# of $SLURM_JOB_NODELIST. The fit command gets --trainer.num_nodes / --trainer.devices equal to what was launched
# (rl_lightning refuses a mismatch at start-up). DRY_RUN=1 prints the command instead of running it.
#
# Variables: REPO (the rl_lightning checkout; default: the submit directory), PYTHON (default: python),
# ACCELERATOR (gpu | cpu, default gpu), PROCS_PER_NODE (default: the GPUs per node the job asked for),
# RDZV_HOST (default: the first node's address), RDZV_PORT (default: 20000 + job id % 20000, so jobs sharing a node
# do not collide).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

recipe=${1:?usage: launch.sh RECIPE [--key value ...]}
shift
[[ -n ${SLURM_JOB_NODELIST:-} && -n ${SLURM_JOB_NUM_NODES:-} ]] \
    || die "SLURM_JOB_NODELIST is unset: this runs inside a Slurm job; submit with examples/slurm/submit.sh"
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
# a recipe file in REPO (the submit directory), else as given: a bundled recipe's name (grpo, real/grpo) or a path
# the CLI reads itself (an unknown one is one error line from the first rank)
config=$recipe
if [[ -f $REPO/$recipe ]]; then config=$REPO/$recipe; fi
ACCELERATOR=${ACCELERATOR:-gpu}
gpus=${SLURM_GPUS_PER_NODE:-}
gpus=${gpus##*:}  # "h100:8" -> "8"
PROCS_PER_NODE=${PROCS_PER_NODE:-$gpus}
[[ $PROCS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "PROCS_PER_NODE='$PROCS_PER_NODE' is not a positive count; set \
PROCS_PER_NODE (CPU runs) or submit with GPUS_PER_NODE (one process per GPU)"
if [[ $ACCELERATOR == gpu && -n $gpus && $PROCS_PER_NODE != "$gpus" ]]; then
    die "PROCS_PER_NODE=$PROCS_PER_NODE: the job has $gpus GPU(s) per node and runs one process per GPU; unset \
PROCS_PER_NODE or set it to $gpus"
fi
nodes=$SLURM_JOB_NUM_NODES
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Where Slurm itself reaches that node (its NodeAddr: the name unless slurm.conf maps it); RDZV_HOST overrides.
head_addr=$(scontrol show node "$head_node" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' || true)
RDZV_HOST=${RDZV_HOST:-${head_addr:-$head_node}}
RDZV_PORT=${RDZV_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

command=(srun --nodes "$nodes" --ntasks-per-node 1 --kill-on-bad-exit=1
    "${PYTHON:-python}" -m torch.distributed.run
    --nnodes "$nodes" --nproc-per-node "$PROCS_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-0}"
    -m rl_lightning fit --config "$config"
    --trainer.accelerator "$ACCELERATOR" --trainer.num_nodes "$nodes" --trainer.devices "$PROCS_PER_NODE" "$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
echo "rendezvous $RDZV_HOST:$RDZV_PORT (first node $head_node), $nodes node(s) x $PROCS_PER_NODE process(es)"
exec "${command[@]}"
