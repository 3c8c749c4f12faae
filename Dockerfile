# minimal_fsdp in a CUDA container: PyTorch (CUDA wheels from PyPI), MPI from wheels, and this package.
#
#   docker build -t minimal_fsdp .
#   docker run --rm --gpus all --ipc=host -v $PWD/runs:/workspace/runs minimal_fsdp \
#       mpiexec -n 4 python basic_training.py --checkpoint_dir /workspace/runs/checkpoints --log_dir /workspace/runs/logs
#
# --ipc=host (or a large --shm-size) gives NCCL and torch the shared memory they use between ranks. The torch
# wheel brings its own CUDA runtime, so the host only needs a driver new enough for it. For another CUDA
# build of torch, point PIP_EXTRA_INDEX_URL at PyTorch's wheel index for that CUDA version.
# Extras: --build-arg EXTRAS=mpi,wandb,plot,debug (see setup.py).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

ARG EXTRAS=mpi
ARG PIP_EXTRA_INDEX_URL=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip

WORKDIR /workspace/minimal_fsdp
# Dependencies first, so editing the source does not reinstall torch.
COPY requirements.txt ./
RUN pip install ${PIP_EXTRA_INDEX_URL:+--extra-index-url "$PIP_EXTRA_INDEX_URL"} -r requirements.txt
COPY . .
RUN pip install -e ".[${EXTRAS}]"

CMD ["python", "basic_training.py", "--help"]
