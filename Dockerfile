# echo-vllm on vLLM's OpenAI-compatible server image, by default the official
# one at the vLLM version pyproject.toml pins (tests/server/test_docker.py
# checks they agree).
#
#   docker build -t echo-vllm:0.1.0 --build-arg GIT_COMMIT=$(git rev-parse HEAD) .
#   docker run --gpus all --ipc=host -p 127.0.0.1:8000:8000 \
#       -v hf-cache:/home/echo-vllm/.cache/huggingface \
#       echo-vllm:0.1.0 Qwen/Qwen3-8B --tensor-parallel-size 4 --tp-comm echo
#
# Arguments after the image name go to `echo-vllm serve` (Echo's flags and
# every `vllm serve` flag). The container runs as the non-root user
# echo-vllm (UID/GID 10001); the HEALTHCHECK asks /health on port
# $ECHO_HEALTH_PORT (8000, vLLM's default: set it to what --port says).
# docker/compose.yaml is a ready-made TP=4 service. Where no registry is
# reachable, BASE can be a local image with Python and vLLM installed:
# docker/make_base.sh makes one, docker/build_and_smoke.sh builds this file
# on it and smoke-tests the result; that image is tagged `-cpu` and cannot
# serve (docker/README.md).
ARG BASE=vllm/vllm-openai:v0.26.0
FROM ${BASE}

# The user the server runs as: not root. Fixed numbers, so Kubernetes'
# runAsNonRoot and a volume's ownership can be checked by number. Its home
# holds what vLLM, torch and Triton write at run time (~/.cache, ~/.triton)
# and the Hugging Face cache, where a volume goes.
RUN set -eux; \
    groupadd --gid 10001 echo-vllm; \
    useradd --uid 10001 --gid 10001 --create-home --home-dir /home/echo-vllm \
        --shell /bin/bash echo-vllm; \
    mkdir -p /home/echo-vllm/.cache/huggingface; \
    chown -R 10001:10001 /home/echo-vllm

WORKDIR /opt/echo-vllm
COPY pyproject.toml README.md ./
COPY echo_vllm ./echo_vllm
COPY server ./server
COPY eval ./eval

# The image's torch, triton and vLLM stay exactly as built (constraints from
# what is installed); only echo-vllm and its small pure-Python dependencies
# are added, as a regular (non-editable) install into site-packages. The
# setuptools build leaves build/ and echo_vllm.egg-info next to the sources:
# they are removed, and the build fails if any is left. The installed
# version must be ECHO_VERSION (the label below says it). The official image
# ships uv; pip is the fallback.
ARG ECHO_VERSION=0.1.0
RUN set -eux; \
    if command -v uv >/dev/null 2>&1; then \
        PIP="uv pip install --system --no-cache"; FREEZE="uv pip freeze --system"; \
    else \
        PIP="python3 -m pip install --no-cache-dir"; FREEZE="python3 -m pip freeze"; \
    fi; \
    $FREEZE | grep -iE '^(torch|triton|vllm|numpy)==' > /tmp/keep.txt; \
    grep -q '^vllm==' /tmp/keep.txt; \
    $PIP --constraint /tmp/keep.txt . ; \
    rm -rf build ./*.egg-info /tmp/keep.txt; \
    leftover=$(find . \( -name build -o -name '*.egg-info' \) -print); \
    if [ -n "$leftover" ]; then echo "build leftovers in $PWD: $leftover" >&2; exit 1; fi; \
    python3 -c "import importlib.metadata as m; assert any(e.name == 'echo_vllm' for e in m.entry_points(group='vllm.general_plugins')), 'vLLM plugin entry point missing'"; \
    python3 -c "import importlib.metadata as m, sys; v = m.version('echo-vllm'); assert v == sys.argv[1], (v, sys.argv[1])" "$ECHO_VERSION"; \
    command -v echo-vllm

ENV HOME=/home/echo-vllm \
    HF_HOME=/home/echo-vllm/.cache/huggingface \
    ECHO_HEALTH_PORT=8000
USER 10001:10001
# a writable working directory (the demo writes out/ here), away from the
# sources: `python3 -c` imports the installed package, not /opt/echo-vllm
WORKDIR /home/echo-vllm

# For the server: /health answers 200 once vLLM has loaded the model, which
# takes minutes (weights download, torch.compile, CUDA graphs), hence the long
# start period, during which failures do not count. A container that does not
# serve (--help, `echo-vllm demo`, the CPU image of docker/build_and_smoke.sh)
# exits or stays "starting"/"unhealthy" harmlessly: no restart policy acts on
# it; `docker run --no-healthcheck` turns it off.
HEALTHCHECK --interval=30s --timeout=10s --start-period=15m --retries=5 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('ECHO_HEALTH_PORT', '8000'), timeout=5)"]

# Last, so a new commit does not rebuild the layers above. GIT_COMMIT: the
# commit built (`git rev-parse HEAD`); SOURCE_URL: where that commit can be
# fetched (no public address is recorded in this repository).
ARG BASE
ARG GIT_COMMIT=unknown
ARG SOURCE_URL=unknown
LABEL org.opencontainers.image.title="echo-vllm" \
      org.opencontainers.image.description="vLLM's OpenAI-compatible server with Echo, an error-compensated 4-bit tensor-parallel all-reduce" \
      org.opencontainers.image.version="${ECHO_VERSION}" \
      org.opencontainers.image.revision="${GIT_COMMIT}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE}"

ENTRYPOINT ["echo-vllm", "serve"]
CMD ["--help"]
