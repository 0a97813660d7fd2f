# The swerve app image: api, worker and orchestrator run from it with different commands.
# No registry is reachable on the development machines; set BASE_IMAGE to a locally built
# Python 3.11 image there (see sandboxes/ for the debootstrap recipe).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# The bubblewrap sandboxes' launcher (sandboxes/launch.c), compiled here so the app image needs
# no compiler: named by its source's hash as sandboxes/launcher.py looks for it.
FROM ${BASE_IMAGE} AS launcher
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY sandboxes/launch.c /src/launch.c
RUN mkdir -p /opt/swerve/launcher \
    && gcc -O2 -Wall -o "/opt/swerve/launcher/swerve-launch-$(sha256sum /src/launch.c | cut -c1-16)" /src/launch.c

FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends git bubblewrap slirp4netns iptables iproute2 util-linux ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 swerve \
    && mkdir /data && chown swerve:swerve /data

COPY --from=launcher /opt/swerve/launcher /opt/swerve/launcher
ENV SWERVE_LAUNCHER_DIR=/opt/swerve/launcher

WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY envs ./envs
COPY sandboxes ./sandboxes
COPY trainer ./trainer
# EXTRAS="[model,trainer]" makes the trainer's image (compose's rl profile): torch from TORCH_INDEX
# (the CPU wheels by default; a CUDA index for GPU nodes) and torchtitan without its extra deps.
ARG EXTRAS=""
# PIP_FIND_LINKS may name a folder or page of wheels where that index is out of reach
# (PIP_TRUSTED_HOST: its host, when served over plain HTTP).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
ARG PIP_TRUSTED_HOST=""
ARG TORCHTITAN_VERSION=0.3.0
RUN if [ -n "$EXTRAS" ]; then \
      pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ".$EXTRAS" \
      && pip install --no-deps "torchtitan==$TORCHTITAN_VERSION"; \
    else pip install .; fi

USER swerve
ENV SWERVE_DATA_DIR=/data
EXPOSE 8000
CMD ["swerve", "serve", "--host", "0.0.0.0", "--port", "8000"]
