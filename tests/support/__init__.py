"""Helpers for tests and GPU check scripts (not part of the wheel): a tiny
local Qwen3 model folder (:mod:`.tiny_model`), real vLLM layers on CPU
(:mod:`.vllm_cpu`) and CUDA-graph accounting through vLLM's calls
(:mod:`.vllm_graphs`). ``pytest`` puts ``tests/`` on the path
(pyproject's ``pythonpath``); scripts add it themselves."""
