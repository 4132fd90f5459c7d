# syntax=docker/dockerfile:1
# One image for Gaudi (default), NVIDIA and CPU: the base image brings PyTorch for its device.
#
#   Gaudi:  docker build -t bert-pretraining .
#   NVIDIA: docker build -t bert-pretraining:cuda \
#             --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.05-py3 --build-arg DEEPSPEED_SPEC=deepspeed==0.19.8 .
#   CPU:    docker build -t bert-pretraining:cpu --build-arg BASE_IMAGE=python:3.11-slim \
#             --build-arg DEEPSPEED_SPEC=deepspeed==0.19.8 --build-arg PROJECT_EXTRAS=cpu \
#             --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Run (multi-node: host networking so that sshd on port 3022 and the rendezvous port are reachable):
#   docker run --rm -it --network host --ipc host \
#     -v /path/to/shards:/data:ro -v /path/to/results:/results bert-pretraining \
#     scripts/run_8nodes.sh --preset bert-1.5b-phase1 --hostfile /results/hostfile \
#       --input_dir /data --output_dir /results/bert-1.5b-phase1
# Gaudi also needs `--runtime habana -e HABANA_VISIBLE_DEVICES=all -e OMPI_MCA_btl_vader_single_copy_mechanism=none
# --cap-add sys_nice`; NVIDIA needs `--gpus all`. See README.md, "The container".

# torch 2.6 or later: transformers 5, which pip picks, runs its models (the Hugging Face export) on no older one.
ARG BASE_IMAGE=vault.habana.ai/gaudi-docker/1.21.0/ubuntu22.04/habanalabs/pytorch-installer-2.6.0:latest
FROM ${BASE_IMAGE}

# The Habana fork of DeepSpeed, at the tag matching the Gaudi software in BASE_IMAGE.
ARG DEEPSPEED_SPEC=git+https://github.com/HabanaAI/DeepSpeed.git@1.21.0
# Extras of this project to install: empty for Gaudi and NVIDIA (torch comes from the base image),
# "cpu" to pin the CPU-verified set (then point PIP_EXTRA_INDEX_URL at the CPU wheels of torch).
ARG PROJECT_EXTRAS=""
ARG PIP_EXTRA_INDEX_URL=""
ARG SSH_PORT=3022

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# sshd and pdsh for the DeepSpeed multi-node launcher; git for the DeepSpeed fork.
# Package versions are not pinned: the base images run different Ubuntu/Debian releases.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-server openssh-client pdsh git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The CPU variant needs a C++ compiler: deepspeed.init_distributed on CPU compiles DeepSpeed's shared-memory
# collectives (the deepspeed_shm_comm op, `c++ -fopenmp`) on first use. python:3.11-slim has none; the Gaudi
# and NVIDIA base images bring theirs. Not pinned, as above.
# hadolint ignore=DL3008
RUN if [ "${PROJECT_EXTRAS}" = "cpu" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# sshd on port 3022, as in Habana's containers, with key-based root login only.
RUN mkdir -p /run/sshd /root/.ssh /etc/ssh/ssh_config.d \
    && chmod 700 /root/.ssh \
    && sed -i "s/^#\?Port .*/Port ${SSH_PORT}/" /etc/ssh/sshd_config \
    && sed -i "s/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/" /etc/ssh/sshd_config \
    && sed -i "s/^#\?PasswordAuthentication .*/PasswordAuthentication no/" /etc/ssh/sshd_config \
    && printf 'Host *\n    Port %s\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n' "${SSH_PORT}" \
       > /etc/ssh/ssh_config.d/bert-pretraining.conf

WORKDIR /workspace/bert-pretraining
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PDSH_RCMD_TYPE=ssh

# DeepSpeed first, so that the project's `deepspeed>=0.14` range is met by the fork and never replaced.
# The spec is a build argument (a fork tag or an exact version), so DL3013's pinning is done there.
# The CPU variant installs it with the project's `cpu` pins below, in one resolution: alone, it would pull
# the newest torch, which the pins then replace (two torch downloads, one left in this layer).
# hadolint ignore=DL3013
RUN if [ "${PROJECT_EXTRAS}" != "cpu" ]; then python -m pip install "${DEEPSPEED_SPEC}"; fi

COPY pyproject.toml README.md ./
COPY modeling.py run_pretraining.py ./
COPY data ./data
COPY training ./training
COPY configs ./configs
COPY scripts ./scripts
# This project from the build context; its dependencies are ranges (or the exact `cpu` pins) in pyproject.toml.
# The check: transformers must run its models with the base image's torch (modeling.require_transformers_torch).
# hadolint ignore=DL3013
RUN if [ "${PROJECT_EXTRAS}" = "cpu" ]; then set -- "${DEEPSPEED_SPEC}"; else set --; fi \
    && python -m pip install ".${PROJECT_EXTRAS:+[${PROJECT_EXTRAS}]}" "$@" \
    && python -c "import deepspeed, modeling, training.presets; modeling.require_transformers_torch(); \
print('deepspeed', deepspeed.__version__)"
# CPU variant: start a one-rank gloo process group as training does, which compiles the shm op with the compiler
# installed above (and leaves it built in the image). Gaudi and NVIDIA builds have no device to start one on.
# MASTER_PORT=0: the one rank's store takes any free port.
RUN if [ "${PROJECT_EXTRAS}" = "cpu" ]; then \
        DS_ACCELERATOR=cpu RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=0 python -c "import deepspeed; deepspeed.init_distributed(dist_backend='gloo'); \
import torch.distributed as dist; assert dist.get_world_size() == 1; print('init_distributed on gloo: ok')"; \
    fi

VOLUME ["/data", "/results"]
EXPOSE ${SSH_PORT}

# Start sshd (other nodes' pdsh connects to it), then run the given command.
ENTRYPOINT ["/bin/bash", "-c", "ssh-keygen -A >/dev/null && /usr/sbin/sshd && exec \"$@\"", "--"]
CMD ["bash"]
