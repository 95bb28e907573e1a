#!/usr/bin/env bash
# `lit-lm fit` under torchrun on this node; run the same line on every node. On a failure torchrun restarts all
# workers (up to MAX_RESTARTS) and they resume from the newest *complete* checkpoint (`--ckpt_path last`); on
# SIGUSR1/SIGTERM the workers save and stop, and this script exits 75 (requeue: run the same line again).
#
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=node0 scripts/launch/torchrun.sh \
#       --config configs/default.yaml --config configs/strategies/zero3.yaml
#
# Environment (defaults): NNODES (1), NPROC_PER_NODE (1), MASTER_ADDR (127.0.0.1) and MASTER_PORT (29500) of
# the c10d rendezvous, RDZV_ID (lit-lm: the same on every node of one job), MAX_RESTARTS (3), RUN_DIR
# (runs/torchrun: trainer.default_root_dir) and CKPT_DIR ($RUN_DIR/checkpoints). CKPT_DIR must stay the same
# across restarts, or "last" finds nothing: it is set as the dirpath of the *last* callback of the config (the
# default config's ModelCheckpoint); set CKPT_DIR= (empty) if your config sets ModelCheckpoint.dirpath itself.
set -euo pipefail
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RUN_DIR=${RUN_DIR:-runs/torchrun}
CKPT_DIR=${CKPT_DIR-$RUN_DIR/checkpoints}
# A fresh store for every attempt, hosted by worker rank 0. torch's default (workers share the rendezvous agent's
# TCPStore, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0) keeps the failed attempt's keys: after a restart a rank can read
# its peer's old gloo/NCCL address and fail or hang in init_process_group (pytorch/pytorch#135712; seen here).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
ckpt_args=()
[[ -n "$CKPT_DIR" ]] && ckpt_args=(--trainer.callbacks.dirpath "$CKPT_DIR")

# Preemption (SLURM's --signal=USR1 before the time limit, SIGTERM): the workers save a checkpoint at a step they
# all agree on and exit 0 (lit_lm/strategies/preemption.py); this script exits with 75 (REQUEUE_EXIT_CODE) so that
# slurm.sbatch requeues the job, which resumes with --ckpt_path last. The torchrun agent ignores both signals: it
# would shut the workers down (SIGTERM) or die (SIGUSR1) before they save. SLURM signals every process of the
# step, workers included; a signal sent to this script alone is passed on to the workers (the agent's children).
preempted=0
on_signal() {
    preempted=1
    [[ -n "${agent:-}" ]] && pkill "-$1" -P "$agent" 2>/dev/null
    return 0
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
(
    trap '' USR1 TERM
    exec "${PYTHON:-python}" -m torch.distributed.run \
        --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
        --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \
        --rdzv-id "${RDZV_ID:-lit-lm}" --max-restarts "${MAX_RESTARTS:-3}" --signals-to-handle SIGINT,SIGHUP,SIGQUIT \
        -m lit_lm fit "$@" \
        --trainer.devices "$NPROC_PER_NODE" --trainer.num_nodes "$NNODES" \
        --trainer.default_root_dir "$RUN_DIR" "${ckpt_args[@]}" --ckpt_path last
) &
agent=$!
while :; do
    rc=0
    wait "$agent" || rc=$?
    kill -0 "$agent" 2>/dev/null || break  # else a trapped signal interrupted the wait
done
if (( preempted )); then
    echo "[lit-lm] torchrun.sh: preempted; exiting 75 for a requeue (resume: the same command)" >&2
    exit 75
fi
exit "$rc"
