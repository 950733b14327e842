"""Secrets on ``echo-vllm serve``'s command line reach vLLM through its environment.

vLLM logs its parsed arguments at start (``non-default args: {...}``), so an
``--api-key`` or ``--hf-token`` left on its command line is printed in
clear. :func:`take_secrets` takes them off the command line, in every
spelling argparse accepts (``--api-key X``, ``--api-key=X``, ``--api_key``,
an abbreviation such as ``--api-k``), and returns the environment variables
vLLM 0.26 reads in their place: ``VLLM_API_KEY`` (what the API server
checks when ``--api-key`` is not given) and ``HF_TOKEN`` (huggingface_hub's
token, what ``--hf-token TOKEN`` passes). ``--hf-token`` without a value
(use the stored login) holds no secret and stays.
"""

from __future__ import annotations

from .flags import ServeArgsError

#: vLLM's secret options -> the environment variable vLLM reads instead.
SECRET_OPTIONS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}
#: --hf-token alone means "the stored login" (vLLM's ``const=True``).
_OPTIONAL_VALUE = frozenset({"--hf-token"})


def secret_option(name: str) -> str | None:
    """The secret option ``name`` spells: itself, with underscores
    (``--api_key``), or an abbreviation argparse expands to it; None if none."""
    if not name.startswith("--"):
        return None
    name = name.replace("_", "-")
    for option in SECRET_OPTIONS:
        # argparse expands a unique prefix; vLLM's other options share the
        # first word (--api-server-count, --hf-overrides), so one more letter
        shortest = option[:option.index("-", 2) + 2]
        if option.startswith(name) and name.startswith(shortest):
            return option
    return None


def take_secrets(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without the values of :data:`SECRET_OPTIONS`, and the
    environment that hands them to vLLM. The last occurrence wins, as in
    argparse. Refused (:class:`ServeArgsError`): an option without a value,
    an empty value (an empty key would leave the server open), and several
    API keys (``VLLM_API_KEY`` holds one). Tokens after ``--`` are kept."""
    out: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:], env
        name, eq, inline = token.partition("=")
        option = secret_option(name)
        if option is None:
            out.append(token)
            i += 1
            continue
        i += 1
        values = [inline] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("-"):
            values.append(argv[i])
            i += 1
            if option in _OPTIONAL_VALUE:
                break
        if not values:
            if option in _OPTIONAL_VALUE:
                out.append(option)  # no value: vLLM uses the stored login
                env.pop(SECRET_OPTIONS[option], None)
                continue
            raise ServeArgsError(f"{name} needs a value (write {name}=VALUE for one that starts with '-')")
        if len(values) > 1:
            raise ServeArgsError(
                f"{name} with {len(values)} keys: echo-vllm serve hands the key to vLLM as "
                f"{SECRET_OPTIONS[option]}, which holds one (so vLLM's argument log never shows it); give one key")
        if not values[0]:
            why = " (vLLM would then check no key at all)" if option == "--api-key" else ""
            raise ServeArgsError(f"{name} is empty{why}: give a value or drop the option")
        env[SECRET_OPTIONS[option]] = values[0]
    return out, env
