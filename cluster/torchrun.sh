#!/usr/bin/env bash
# Headless runs of dtlab code under torchrun, on one node or many.
#
#   cluster/torchrun.sh [options] SCRIPT.py [ARGS...]
#   cluster/torchrun.sh [options] -m MODULE [ARGS...]
#
# One node (the default): `torchrun --standalone`, one process per GPU (or --nproc
# CPU processes on gloo). Several nodes: run the same command once on every node with
# the same --rdzv HOST:PORT (a port on the first node, reachable over the private
# network) and --rdzv-id; torchrun's c10d rendezvous gives each process its rank.
# Inside a Slurm job the node count, the rendezvous host (the job's first node) and
# the job id come from Slurm (see cluster/slurm/torchrun.sbatch).
#
# The script calls dtlab.launch.init_from_env() (or torch.distributed's own
# init_process_group) and then runs the same code as in the lab. To train a
# TrainConfig file with no script of your own, run dtlab's headless runner:
#
#   cluster/torchrun.sh --nproc 4 -m dtlab.cli run cfg.json --out runs/a
#
# (rank{R}.jsonl telemetry, trace.json for Perfetto and summary.json land in runs/a;
# see `dtlab run -h`).
#
# Options:
#   --nproc N          processes on this node (default: auto, one per GPU, else one
#                      per CPU core)
#   --nnodes N         nodes in the job (default: $SLURM_JOB_NUM_NODES, else 1)
#   --rdzv HOST:PORT   rendezvous endpoint, required with --nnodes > 1 (default under
#                      Slurm: the job's first node, port $DTLAB_RDZV_PORT or 29500)
#   --rdzv-id ID       the job's id, the same on every node (default: $SLURM_JOB_ID,
#                      else "dtlab")
#   --ifname IF        network interface for gloo and nccl (GLOO_SOCKET_IFNAME and
#                      NCCL_SOCKET_IFNAME); on one node gloo defaults to loopback
#   --python PATH      the Python with torch and dtlab (default: $DTLAB_PYTHON, else
#                      the repository's .venv, else python3)
#   --dry-run          print the command (with its environment) and exit
#
# Note: torchrun's rendezvous store is a TCP store, which listens on every interface
# of the node that hosts it, even with --standalone. On a machine reachable from an
# untrusted network, run single-node jobs through the lab or dtlab.launch.spawn (a
# file store) instead.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}
die() {
    echo "torchrun.sh: $*" >&2
    exit 2
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"

nproc="auto"
nnodes="${SLURM_JOB_NUM_NODES:-1}"
rdzv=""
rdzv_id="${SLURM_JOB_ID:-dtlab}"
ifname=""
python="${DTLAB_PYTHON:-}"
dry_run=0
module=""

while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc) nproc="${2:?--nproc needs a value}"; shift 2 ;;
        --nnodes) nnodes="${2:?--nnodes needs a value}"; shift 2 ;;
        --rdzv) rdzv="${2:?--rdzv needs HOST:PORT}"; shift 2 ;;
        --rdzv-id) rdzv_id="${2:?--rdzv-id needs a value}"; shift 2 ;;
        --ifname) ifname="${2:?--ifname needs an interface name}"; shift 2 ;;
        --python) python="${2:?--python needs a path}"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -m) module="${2:?-m needs a module name}"; shift 2; break ;;
        -h|--help) usage ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done

if [[ -z "$module" && $# -eq 0 ]]; then
    die "give a script (SCRIPT.py) or a module (-m MODULE) to run"
fi
[[ "$nproc" == "auto" || "$nproc" =~ ^[1-9][0-9]*$ ]] \
    || die "--nproc must be a positive integer or 'auto', not '$nproc'"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a positive integer, not '$nnodes'"

if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then
        python="$root/.venv/bin/python"
    else
        python="python3"
    fi
fi

env_vars=()
cmd=("$python" -m torch.distributed.run --nproc-per-node "$nproc" --max-restarts 0)
if [[ "$nnodes" -eq 1 && -z "$rdzv" ]]; then
    # one node: a private rendezvous on this machine, gloo on loopback
    cmd+=(--standalone --nnodes 1)
    env_vars+=("GLOO_SOCKET_IFNAME=${ifname:-${GLOO_SOCKET_IFNAME:-lo}}")
else
    if [[ -z "$rdzv" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
        head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"  # sed reads all: no SIGPIPE under pipefail
        rdzv="$head_node:${DTLAB_RDZV_PORT:-29500}"
    fi
    [[ -n "$rdzv" ]] || die "--nnodes $nnodes needs --rdzv HOST:PORT (a port on the first node)"
    [[ "$rdzv" =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--rdzv must be HOST:PORT, not '$rdzv'"
    cmd+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$rdzv" --rdzv-id "$rdzv_id")
    if [[ -n "$ifname" ]]; then
        env_vars+=("GLOO_SOCKET_IFNAME=$ifname" "NCCL_SOCKET_IFNAME=$ifname")
    fi
fi
if [[ -n "$module" ]]; then
    cmd+=(-m "$module")
fi
cmd+=("$@")

if [[ "$dry_run" -eq 1 ]]; then
    printf '%q ' "${env_vars[@]}" "${cmd[@]}"
    printf '\n'
    exit 0
fi
exec env "${env_vars[@]}" "${cmd[@]}"
