"""Helpers for tests and GPU checks: a tiny local Qwen3 model folder
(:mod:`.tiny_model`) and real vLLM layers on CPU (:mod:`.vllm_cpu`)."""
