# echo-vllm on vLLM's OpenAI-compatible server image, by default the official
# one at the vLLM version pyproject.toml pins (tests/server/test_docker.py
# checks they agree).
#
#   docker build -t echo-vllm:0.1.0 .                    # from the repository root
#   docker run --gpus all --ipc=host -p 127.0.0.1:8000:8000 \
#       -v hf-cache:/root/.cache/huggingface \
#       echo-vllm:0.1.0 Qwen/Qwen3-8B --tensor-parallel-size 4 --tp-comm echo
#
# Arguments after the image name go to `echo-vllm serve` (Echo's flags and
# every `vllm serve` flag). docker/compose.yaml is a ready-made TP=4 service.
# Where no registry is reachable, BASE can be a local image with Python and
# vLLM installed: docker/make_base.sh makes one, docker/build_and_smoke.sh
# builds this file on it and smoke-tests the result (docker/README.md).
ARG BASE=vllm/vllm-openai:v0.26.0
FROM ${BASE}

WORKDIR /opt/echo-vllm
COPY pyproject.toml README.md ./
COPY echo_vllm ./echo_vllm

# The image's torch, triton and vLLM stay exactly as built (constraints from
# what is installed); only echo-vllm and its small pure-Python dependencies
# are added. The official image ships uv; pip is the fallback.
RUN set -eux; \
    if command -v uv >/dev/null 2>&1; then \
        PIP="uv pip install --system --no-cache"; FREEZE="uv pip freeze --system"; \
    else \
        PIP="python3 -m pip install --no-cache-dir"; FREEZE="python3 -m pip freeze"; \
    fi; \
    $FREEZE | grep -iE '^(torch|triton|vllm|numpy)==' > /tmp/keep.txt; \
    grep -q '^vllm==' /tmp/keep.txt; \
    $PIP --constraint /tmp/keep.txt . ; \
    python3 -c "import importlib.metadata as m; assert any(e.name == 'echo_vllm' for e in m.entry_points(group='vllm.general_plugins')), 'vLLM plugin entry point missing'"; \
    command -v echo-vllm

ENTRYPOINT ["echo-vllm", "serve"]
CMD ["--help"]
