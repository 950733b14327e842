"""Helpers for tests (not part of the wheel): real vLLM layers on CPU
(:mod:`.vllm_cpu`), CUDA-graph accounting through vLLM's calls
(:mod:`.vllm_graphs`), batch-invariance checks (:mod:`.invariance`),
inputs at the edges of each dtype's range and one call's error bound
(:mod:`.extremes`) and a stand-in rank of a process group
(:mod:`.fake_group`). ``pytest`` puts
``tests/`` on the path (pyproject's ``pythonpath``). Scripts never import
from here: what they share with the tests lives in the package
(:mod:`echo_vllm.testing_models`)."""
