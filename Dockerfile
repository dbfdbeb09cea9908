# megatron-lite on NVIDIA GPUs (H100 clusters): PyTorch NGC image (CUDA, NCCL, cuDNN, Transformer
# Engine and flash-attn preinstalled), plus this project and its logging/tokenizer extras.
#   docker build -t megatron-lite .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm megatron-lite \
#       torchrun --nproc_per_node=8 pretrain_gpt.py --model llama3-8b --tensor-model-parallel-size 8 --bf16 \
#       --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --micro-batch-size 1 \
#       --global-batch-size 64 --train-iters 100
FROM nvcr.io/nvidia/pytorch:24.10-py3

ENV PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=8 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace/megatron-lite
COPY pyproject.toml README.md install.sh ./
COPY megatron_lite ./megatron_lite
COPY models ./models
COPY tools ./tools
COPY benchmarks ./benchmarks
COPY pretrain_gpt.py ./
# The image's own CUDA build of torch satisfies torch>=2.4: install.sh leaves it alone.
RUN bash install.sh tokenizers,logging

CMD ["torchrun", "--nproc_per_node=gpu", "pretrain_gpt.py"]
