# megatron-lite on NVIDIA GPUs (H100 clusters), on NVIDIA's PyTorch NGC image (CUDA, NCCL, cuDNN,
# Transformer Engine and flash-attn preinstalled), plus this project with its tokenizer and logging
# extras. 25.12 is PyTorch 2.10 on CUDA 13.1 (NVIDIA's PyTorch release notes, rel-25-12); choose
# another release with --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3.
#
#   docker build -t megatron-lite .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm megatron-lite
#       (the built-in default run on every GPU of the machine), or a real one:
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm megatron-lite \
#       torchrun --nproc_per_node=8 pretrain_gpt.py --model llama3-8b --tensor-model-parallel-size 2 \
#       --sequence-parallel --use-distributed-optimizer --bf16 --mock-data --tokenizer-type NullTokenizer \
#       --vocab-size 128256 --micro-batch-size 1 --global-batch-size 64 --train-iters 100
#
# On SLURM with pyxis/enroot: `enroot import -o megatron-lite.sqsh dockerd://megatron-lite`, then
# examples/slurm/pretrain_llama3_8b.sh with CONTAINER_IMAGE=$PWD/megatron-lite.sqsh.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

# CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware work queue, so communication kernels run in the
# order they were issued (what tensor / sequence parallelism with overlapped collectives expects).
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective ends the process (and the
# job) instead of leaving the other ranks hanging.
ENV PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=8 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_DEBUG=WARN

WORKDIR /workspace/megatron-lite
COPY pyproject.toml README.md install.sh ./
COPY megatron_lite ./megatron_lite
COPY models ./models
COPY tools ./tools
COPY benchmarks ./benchmarks
COPY examples ./examples
COPY pretrain_gpt.py ./
# The image's own CUDA build of torch satisfies torch>=2.4, so install.sh leaves it alone; the
# cuda extra (flash-attn, Transformer Engine) is not installed: the image already has both. pip
# honours the image's /etc/pip/constraint.txt (its own packages keep their versions).
RUN bash install.sh tokenizers,logging

CMD ["torchrun", "--nproc_per_node=gpu", "pretrain_gpt.py"]
