#!/bin/bash
# Llama-3-8B pretraining on 2 nodes x 8 H100 (16 GPUs): TP 2 (inside a node, with sequence
# parallelism) x DP 8, distributed optimizer (ZeRO-1) with overlapped gradient reduce-scatter and
# parameter all-gather, bf16, sequence 8192, global batch 128 sequences (1M tokens) per step.
# tools/plan.py puts this layout at ~64 GiB per GPU; for more headroom use TP=4 (~37 GiB):
#   python tools/plan.py --model llama3-8b --bf16 --tensor-model-parallel-size 2 --sequence-parallel \
#       --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 128 --world-size 16
#
# Submit from the repository root (bare metal: the project installed in the nodes' Python env):
#   DATA_PATH=/data/llama3/web_text_document TOKENIZER=/models/Meta-Llama-3-8B sbatch examples/slurm/pretrain_llama3_8b.sh
# or in the Dockerfile's image through pyxis/enroot (`enroot import -o megatron-lite.sqsh dockerd://megatron-lite`):
#   CONTAINER_IMAGE=$PWD/megatron-lite.sqsh CONTAINER_MOUNTS=/data:/data,/models:/models,/checkpoints:/checkpoints \
#       DATA_PATH=... TOKENIZER=... CKPT_DIR=/checkpoints/llama3-8b sbatch examples/slurm/pretrain_llama3_8b.sh
#
#SBATCH --job-name=llama3-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# --- what to train on, where to save ------------------------------------------------------------
# DATA_PATH: a Megatron .bin/.idx prefix (tools/preprocess_data.py), or a blend "0.7 /a_text_document 0.3 /b_text_document"
DATA_PATH=${DATA_PATH:-/data/llama3/web_text_document}
TOKENIZER=${TOKENIZER:-/models/Meta-Llama-3-8B}   # a local Hugging Face tokenizer directory
CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/llama3-8b}  # --save and --load: a resubmitted job resumes
TP=${TP:-2}
TRAIN_ITERS=${TRAIN_ITERS:-10000}                 # x 1M tokens
EXIT_MINUTES=${EXIT_MINUTES:-230}                 # save and exit before --time runs out
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}              # set: run inside this image with pyxis
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}
GPUS_PER_NODE=8

# --- the environment NCCL and PyTorch runs expect -----------------------------------------------
export CUDA_DEVICE_MAX_CONNECTIONS=1              # one hardware queue: communication kernels keep their issue order
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1          # a failed or hung collective kills the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}             # INFO prints the rings/trees and the transports NCCL chose
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # NCCL's bootstrap / socket interfaces (this
                                                  # value is its default; sites often name one: ib0, eth0, bond0)
if [ -n "${NCCL_IB_HCA:-}" ]; then                # InfiniBand / RoCE adapters (default: all), e.g.
    export NCCL_IB_HCA                            # NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3 to leave storage NICs out
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}      # CPU threads per rank (data loading, CPU ops)
export PYTHONUNBUFFERED=1

nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes%%$'\n'*}                        # the rendezvous host: the allocation's first node
read -r -a data_path <<< "$DATA_PATH"

LAUNCH=(torchrun --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv-id "$SLURM_JOB_ID"
        --rdzv-backend c10d --rdzv-endpoint "$head_node:29500")
ARGS=(
    --model llama3-8b --bf16
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 128
    --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --data-path "${data_path[@]}" --split 99,1,0
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 --async-save --keep-last 3
    --exit-duration-in-mins "$EXIT_MINUTES"
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --metrics-file "$CKPT_DIR/metrics.jsonl"
)

if [ -n "$CONTAINER_IMAGE" ]; then
    SRUN=(srun --container-image="$CONTAINER_IMAGE" --container-workdir=/workspace/megatron-lite)
    [ -n "$CONTAINER_MOUNTS" ] && SRUN+=(--container-mounts="$CONTAINER_MOUNTS")
else
    SRUN=(srun)
fi
# One torchrun per node (--ntasks-per-node=1), which starts the node's 8 ranks.
"${SRUN[@]}" "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}"
