"""Benchmarks: ``echo-vllm bench kernels`` (one GPU: every stage kernel, and a
projection of the all-reduce speedup) and ``echo-vllm bench allreduce``
(NCCL on N GPUs under torchrun, or gloo processes on CPU). See ``cli``."""
