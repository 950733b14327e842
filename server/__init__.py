"""``echo-vllm serve``: vLLM's own OpenAI-compatible server with Echo as the
tensor-parallel all-reduce.

- :mod:`.flags`   Echo's command-line flags, derived from :class:`EchoConfig`
- :mod:`.rewrite` the pure argv rewrite ``echo-vllm serve ...`` -> ``vllm serve ...``
- :mod:`.cli`     ``main(argv)``: rewrite, set up metrics, run vLLM in-process
- :mod:`.probe`   HTTP checks against a running server (GPU-host script)

Nothing here re-implements the OpenAI API: the server is vLLM's.
"""
