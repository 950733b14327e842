# Stand-in for vllm/vllm-openai where no registry is reachable: the
# debootstrapped Debian of docker/make_base.sh plus vLLM from PyPI (the same
# wheel, and torch, that `pip install vllm==X` gives on a CPU machine; it
# imports and parses arguments without a GPU). Built by docker/make_base.sh:
#
#   docker build --network host --build-arg DEBIAN=echo-vllm-base/debian:bookworm \
#       -f docker/vllm-base.Dockerfile -t echo-vllm-base/vllm-cpu:0.26.0 docker
ARG DEBIAN=echo-vllm-base/debian:bookworm
FROM ${DEBIAN}

# A venv first on PATH: Debian's own python3 is externally managed (PEP 668),
# and `python3 -m pip` in the top-level Dockerfile must install into it.
RUN python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

ARG VLLM_VERSION=0.26.0
RUN set -eux; \
    python3 -m pip install --no-cache-dir --upgrade pip; \
    python3 -m pip install --no-cache-dir --default-timeout=180 "vllm==${VLLM_VERSION}"; \
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

CMD ["/bin/bash"]
