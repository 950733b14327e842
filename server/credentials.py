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

vLLM's argument errors print the tokens they refuse (``unrecognized
arguments: --api-kye KEY``), so what argparse would refuse around a secret
is refused here first, without the value: a close misspelling of a secret
option (:func:`misspelled_secret`), a secret-looking option after ``--``
(every token there is a positional argument to argparse), and, with vLLM's
parser at hand, any option vLLM does not know whose name ends like a secret's
(:func:`unknown_secret_option`). The command line ``echo-vllm serve``
prints shows ``***`` for the value of anything that looks like a secret
option (:func:`scrub`).

vLLM prints every argument it was given (its banner, ``non-default args``,
its errors), and it takes no other secret through its environment, so a
secret by any other route is refused, never passed on
(:func:`refuse_secret_values`): a secret-looking key of a JSON or dotted
value at any depth (``--additional-config '{"p": {"api_key": ...}}'``,
``--additional-config.p.hf_token X``) and the password of a URL
(``https://user:PASSWORD@host/model``: vLLM loads a model from a hub repo id
or a local folder and reads no credentials from the command line, so there
is nothing to hand it to).
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Collection, Mapping

from ..cli_args import LOOKALIKE_DASHES, hide_url_password, parse_json
from .flags import ServeArgsError

#: vLLM's secret options -> the environment variable vLLM reads instead.
SECRET_OPTIONS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}
#: --hf-token alone means "the stored login" (vLLM's ``const=True``).
_OPTIONAL_VALUE = frozenset({"--hf-token"})
#: The last word of an option name that may carry a secret (``--auth-token``).
SECRET_WORDS = frozenset({"key", "keys", "apikey", "token", "secret", "secrets", "password", "passwd"})
#: How close (difflib's ratio of the letters) a name must be to a secret
#: option's to count as its misspelling: ``--api-kye`` 0.83, ``--hf-tokn``
#: 0.92; ``--auth-token`` 0.75 is not one; the closest of vLLM 0.26's other options,
#: ``--tokenizer``, 0.63.
MISSPELLING_RATIO = 0.8
HIDDEN = "***"


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


def _letters(name: str) -> str:
    return name.lstrip("-").lower().replace("_", "").replace("-", "")


def misspelled_secret(name: str) -> str | None:
    """The secret option ``name`` is a near miss of, which argparse would
    refuse (printing the value that follows): a misspelling (``--api-kye``,
    ``--apikey``, ``-api-key``, ``--hf-tokn``) or an abbreviation too short
    to be unique (``--api``, ``--hf-``). None for a spelling
    :func:`secret_option` accepts, and for anything not close."""
    if not name.startswith("-") or secret_option(name):
        return None
    letters = _letters(name)
    if len(letters) < 2:
        return None
    for option in SECRET_OPTIONS:
        target = _letters(option)
        if name.startswith("--") and target.startswith(letters):
            return option
        if difflib.SequenceMatcher(None, letters, target).ratio() >= MISSPELLING_RATIO:
            return option
    return None


def looks_secret(name: str) -> bool:
    """Whether the option ``name`` (no ``=value``) may carry a secret: a
    secret option in any spelling, a near miss of one, or a name whose last
    word is one of :data:`SECRET_WORDS` (``--auth-token``, ``--password``)."""
    if not name.startswith("-") or name.strip("-") == "":
        return False
    option, *keys = name.lstrip("-").split(".")  # --additional-config.api_key: the key's last word too
    return bool(secret_option(name) or misspelled_secret(name) or any(map(_secret_word, [option, *keys[-1:]])))


def _secret_word(name: object) -> bool:
    """Whether the last word of ``name`` (``-``/``_`` separated) is one of :data:`SECRET_WORDS`."""
    return str(name).lower().replace("_", "-").split("-")[-1] in SECRET_WORDS


def secret_in(value: Any, where: str = "") -> str | None:
    """Where the JSON-like ``value`` (mappings, lists, text) holds a secret
    vLLM would print: ``"the key p.hf_token"`` for a key that looks like a
    secret (:func:`_secret_word`) and holds a value (not empty, not a
    boolean), ``"a URL with a password at p.url"`` for text holding one;
    None if nowhere. ``where``: the path of ``value`` itself."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if _secret_word(key) and not (item is None or isinstance(item, bool) or item == ""):
                return f"the key {path}"
            found = secret_in(item, path)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = secret_in(item, f"{where}[{i}]")
            if found:
                return found
    elif isinstance(value, str) and hide_url_password(value) != value:
        return "a URL with a password" + (f" at {where}" if where else "")
    return None


#: Why a secret may not travel on vLLM's command line, and what to do instead.
PRINTED = "vLLM prints every argument when it starts (banner, 'non-default args', errors)"
_INSTEAD = {
    "key": "which looks like a secret: {printed}; pass --api-key or --hf-token (handed to vLLM through its "
           "environment), or give the secret to what reads it through that program's own environment variable",
    "url": "{printed}; vLLM loads a model from a Hugging Face repo id or a local folder, not a URL with "
           "credentials (download it and serve the folder; --hf-token for a private hub repo, AWS_* variables "
           "for s3://); for another URL, give the credentials through that client's own environment (e.g. "
           "OTEL_EXPORTER_OTLP_HEADERS)",
}


def secret_refusal(where: str, found: str) -> ServeArgsError:
    """The refusal of a secret :func:`secret_in` found in ``where`` (an
    option, a file): what it is and the way to pass it instead."""
    instead = _INSTEAD["url" if found.startswith("a URL") else "key"]
    return ServeArgsError(f"{where} holds {found}, " + instead.format(printed=PRINTED))


#: What reads as a key in text that is not JSON (``{"api_key": "x"`` cut
#: short, ``{'token': 'x'}``): vLLM's error would print it with its value.
_KEY_LIKE = re.compile(r"""["']?([\w.-]+)["']?\s*:""")


def refuse_secret_values(argv: list[str]) -> None:
    """Refuse (:class:`ServeArgsError`, never showing the value) a command
    line that would hand vLLM a secret by a route other than
    :data:`SECRET_OPTIONS`: :func:`secret_in` any token (a JSON value is
    parsed, bounded: :func:`~echo_vllm.cli_args.parse_json`), or a dotted
    option with a key that looks like a secret on its path
    (``--additional-config.p.api_key``).
    JSON that :func:`~echo_vllm.cli_args.parse_json` refuses (too deep, a
    4300-digit integer, a key given twice with different values) is refused
    here too: vLLM's own parser would fail on it with a traceback, or keep
    the last value silently."""
    option = None  # the option the next token is a value of
    for token in argv:
        if token == "--":
            option = None
            continue
        if token.startswith("-") and token[1:2].isalpha() or token.startswith("--"):
            name, eq, text = token.partition("=")
            head, *keys = name.split(".")
            secret_key = next((k for k in keys if _secret_word(k)), None)
            if secret_key is not None:
                raise secret_refusal(head, f"the key {'.'.join(keys[:keys.index(secret_key) + 1])}")
            option = name
            if not eq:
                continue
        else:
            text = token
        where = option or "the model (a positional argument)"  # its text is not shown: it may hold a secret
        option = None
        found = None
        if text.lstrip().startswith(("{", "[")):
            try:
                found = secret_in(parse_json(text))
            except json.JSONDecodeError:  # text (a chat template), or JSON vLLM will refuse, printing it
                found = next((f"the key {key}" for key in _KEY_LIKE.findall(text) if _secret_word(key)), None)
            except ValueError as e:
                raise ServeArgsError(f"{where}: {e}") from None
        found = found or secret_in(text)
        if found:
            raise secret_refusal(where, found)


def _hide_json_secrets(token: str) -> str:
    """``token`` with the value of every secret-looking key (``hf_token``,
    nested too) shown as ``***`` when it is a JSON object
    (``--additional-config '{...}'``); any other token as it is."""
    def hide(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: HIDDEN if _secret_word(k) else hide(v) for k, v in value.items()}
        return [hide(v) for v in value] if isinstance(value, list) else value

    if not token.lstrip().startswith("{"):
        return token
    try:
        value = json.loads(token)
    except ValueError:
        return token
    return json.dumps(hide(value)) if hide(value) != value else token


def _secret_variable(name: str) -> bool:
    """Whether an environment assignment ``name=VALUE`` (a command line's
    leading words) may carry a secret: ``VLLM_API_KEY``, ``HF_TOKEN``, or a
    name whose last word is one of :data:`SECRET_WORDS`."""
    return name.isidentifier() and (name in SECRET_OPTIONS.values()
                                    or name.lower().split("_")[-1] in SECRET_WORDS)


def scrub(argv: list[str]) -> list[str]:
    """``argv`` as it may be printed: the value of every option that
    :func:`looks_secret` (``--x=VALUE``, or the tokens up to the next option)
    and of every secret environment assignment (``HF_TOKEN=VALUE``) shown as
    ``***``, after ``--`` too; so are the password of any URL
    (``https://user:***@host``) and the value of a secret-looking key of a
    JSON object (``--additional-config '{"hf_token": "***"}'``)."""
    shown: list[str] = []
    hiding = False
    for token in argv:
        if hiding and not token.startswith("-"):
            shown.append(HIDDEN)
            continue
        hiding = False
        token = _hide_json_secrets(hide_url_password(token))
        name, eq, _ = token.partition("=")
        if eq and _secret_variable(name):
            shown.append(f"{name}={HIDDEN}")
        elif looks_secret(name):
            shown.append(f"{name}={HIDDEN}" if eq else token)
            hiding = not eq
        else:
            shown.append(token)
    return shown


def _near_miss_error(name: str, option: str) -> ServeArgsError:
    return ServeArgsError(
        f"{name} is not an option of vllm serve; did you mean {option}? (refused here: vLLM's error would "
        "print the value that follows)")


def take_secrets(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without the values of :data:`SECRET_OPTIONS`, and the
    environment that hands them to vLLM. Refused (:class:`ServeArgsError`,
    never showing a value): an option without a value, an empty value (an
    empty key would leave the server open), several API keys (``--api-key A
    B`` or ``--api-key`` twice: ``VLLM_API_KEY`` holds one), a near miss of a
    secret option (:func:`misspelled_secret`), a secret-looking option
    after ``--``, and a secret by any other route (:func:`refuse_secret_values`).
    A repeated ``--hf-token``: the last one wins, as in argparse."""
    out: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            after = next((t.partition("=")[0] for t in argv[i + 1:] if looks_secret(t.partition("=")[0])), None)
            if after is not None:
                raise ServeArgsError(
                    f"{after} after '--': argparse reads every token after '--' as a positional argument, "
                    f"so vLLM would refuse it and print its value; put {after} before '--'")
            refuse_secret_values(out + argv[i:])
            return out + argv[i:], env
        name, eq, inline = token.partition("=")
        option = secret_option(name)
        if option is None:
            near = misspelled_secret(name)
            if near is not None:
                raise _near_miss_error(name, near)
            out.append(token)
            i += 1
            continue
        i += 1
        values = [inline] if eq else []
        # a token that begins with a look-alike of '-' is an option mistyped, not this one's value
        while not eq and i < len(argv) and argv[i][:1] != "-" and argv[i][:1] not in LOOKALIKE_DASHES:
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
        why_one = (f"echo-vllm serve hands the key to vLLM as {SECRET_OPTIONS[option]}, which holds one "
                   "(so vLLM's argument log never shows it)")
        if len(values) > 1:
            raise ServeArgsError(
                f"{name} takes exactly one value, got {len(values)}: {why_one}; give one key (and the model "
                f"name first: echo-vllm serve MODEL ... {option} KEY)")
        if option == "--api-key" and SECRET_OPTIONS[option] in env:
            raise ServeArgsError(f"{name} given more than once: {why_one}; give one {option}")
        if not values[0]:
            why = " (vLLM would then check no key at all)" if option == "--api-key" else ""
            raise ServeArgsError(f"{name} is empty{why}: give a value or drop the option")
        env[SECRET_OPTIONS[option]] = values[0]
    refuse_secret_values(out)
    return out, env


def unknown_secret_option(argv: list[str], known: Collection[str]) -> str | None:
    """The first option in ``argv`` (before ``--``) that :func:`looks_secret`
    but is none of ``known`` (a parser's option strings) nor an abbreviation
    of one: argparse would refuse it and print the value after it. None if
    there is none."""
    for token in argv:
        if token == "--":
            return None
        name = token.partition("=")[0]
        if not looks_secret(name):
            continue
        if name.startswith("--"):
            head, dot, tail = name[2:].partition(".")
            name = "--" + head.replace("_", "-")  # vLLM's spelling rule; a dotted path is the option's
        if name in known or any(option.startswith(name) for option in known if len(name) > 2):
            continue
        return name
    return None
