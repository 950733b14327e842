"""Thin glue: run vLLM's own ``vllm serve`` in this process.

The same steps as ``vllm.entrypoints.cli.main.main`` for the ``serve``
subcommand (environment setup, vLLM's parser, ``validate``, dispatch), with
steps added around parsing: an unknown secret-looking option is refused
before vLLM's parser could print its value; a model path that does not
exist is refused by name (vLLM would take it for a hub repo id); on a host without an accelerator
vLLM parses on the CPU platform and the start is refused after parsing (one
line, not a traceback); :func:`verify_parsed` checks that vLLM read the
settings the rewrite decided. Checked against vLLM 0.26.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from ..vllm_glue import compat
from .credentials import unknown_secret_option
from .rewrite import ServeArgsError, ServeSettings, verify_parsed

#: vLLM versions this glue was written against: [min, max) as (major, minor) --
#: the plugin's range. Unlike the plugin, which tries a newer vLLM with a
#: warning when the hooked method exists, ``echo-vllm serve`` refuses one: it
#: rewrites the command line against vLLM's parser, which changes more often.
SUPPORTED_VLLM = (compat.MIN_VERSION, compat.UNTESTED_FROM)


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version; a clear error outside the supported range."""
    try:
        version = version or metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise ServeArgsError("vLLM is not installed: pip install 'echo-vllm[vllm]'") from None
    low, high = SUPPORTED_VLLM
    try:
        nums = compat.version_tuple(version)
    except ValueError:
        raise ServeArgsError(f"vLLM version {version!r} cannot be read") from None
    if not (low <= nums < high):
        raise ServeArgsError(
            f"vLLM {version} is not supported (need >={low[0]}.{low[1]},<{high[0]}.{high[1]})")
    return version


#: Set when :func:`ensure_platform_for_parsing` found no platform: vLLM's
#: parser then runs on the CPU one, and :func:`serve` refuses to start.
_no_device: bool = False


def ensure_platform_for_parsing() -> None:
    """vLLM's argument defaults need a device type; on a machine without an
    accelerator (``--help`` on a laptop, CI) use the CPU platform, as
    ``vllm bench`` does, so that parsing works (and vLLM's own one-line
    refusals of bad flags with it). :func:`serve` still refuses to start
    there (:func:`require_accelerator`). Serving is unaffected on a GPU host."""
    global _no_device
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
        _no_device = True


def _nvml_says() -> str:
    """What NVML (what vLLM's CUDA detection asks) says, in a few words."""
    try:
        from vllm.utils.import_utils import import_pynvml

        pynvml = import_pynvml()
        pynvml.nvmlInit()
    except Exception as e:  # no driver library, no kernel module, no permission
        reason = " ".join(str(e).split())[:80] or type(e).__name__
        return f"NVIDIA's driver is not reachable: {reason}"
    try:
        return f"NVML lists {pynvml.nvmlDeviceGetCount()} NVIDIA GPU(s)"
    except Exception:
        return "NVML lists no NVIDIA GPU"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def require_accelerator() -> None:
    """Refuse to start on a host where vLLM detected no accelerator: its
    parser ran on the CPU platform (:func:`ensure_platform_for_parsing`),
    and vLLM would otherwise end in a traceback."""
    if _no_device:
        raise ServeArgsError(
            f"no GPU: vLLM finds no accelerator on this host (no CUDA, ROCm, TPU or XPU platform; {_nvml_says()}); "
            "the arguments are fine, run it on a GPU host")


def model_problem(model: str) -> str | None:
    """Why vLLM cannot load ``model`` (``--model``, the positional model or
    ``--tokenizer``) from where it says (None: it may): a local path that
    does not exist, which vLLM hands on to the Hugging Face hub, whose check
    of a repo id's form then fails in a traceback. A name of that form
    (``NAME``, ``ORG/NAME``) and a cloud URL (``s3://``) are vLLM's to load."""
    if os.path.exists(model) or "://" in model:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        link = " (a link whose target is missing)" if os.path.islink(model) else ""
        return (f"no such file or folder{link}, and not a Hugging Face repo id (NAME or ORG/NAME, at most 96 "
                "letters, digits, '-', '_', '.')")
    return None


def check_model(args: Any) -> None:
    """Refuse a model or tokenizer vLLM would fail to find with a
    traceback (:func:`model_problem`), naming it."""
    for option, value in (("model", getattr(args, "model_tag", None) or getattr(args, "model", None)),
                          ("--tokenizer", getattr(args, "tokenizer", None))):
        problem = model_problem(value) if isinstance(value, str) else None
        if problem:
            raise ServeArgsError(f"{option} {value!r:.100}: {problem}")


def build_parser() -> Any:
    """vLLM's top-level parser with only the ``serve`` subcommand (whose
    ``validate`` step is available as ``parser.echo_serve_command``, its
    option strings as ``parser.echo_serve_options``)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import VLLM_SUBCMD_PARSER_EPILOG
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI (via echo-vllm)",
                                    epilog=VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="serve"))
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = ServeSubcommand()
    serve_parser = command.subparser_init(subparsers)
    serve_parser.set_defaults(dispatch_function=command.cmd)
    parser.echo_serve_command = command
    parser.echo_serve_options = {o for action in serve_parser._actions for o in action.option_strings}
    return parser


def parse(vllm_argv: list[str], parser: Any = None) -> Any:
    """vLLM's namespace for ``vllm serve <vllm_argv>`` (vLLM prints and exits on errors)."""
    return (parser or build_parser()).parse_args(["serve", *vllm_argv])


def print_help(extra: list[str]) -> int:
    """vLLM's own ``vllm serve --help`` (``--help=Group`` forms included)."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    ensure_platform_for_parsing()
    try:
        parse(extra)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def check_plugin(settings: ServeSettings) -> None:
    """Echo (or its emulation) runs only where vLLM's processes load the
    plugin's hook; without it vLLM would serve its own all-reduce under an
    Echo label. Refuse to start instead, naming the reason."""
    from ..vllm_glue.plugin import launch_problem

    problem = launch_problem()
    if problem is not None:
        asked = f"--tp-comm {settings.tp_comm}" + (
            f" --echo-emulate-tp {settings.emulate_tp}" if settings.emulate_tp else "")
        raise ServeArgsError(f"{asked} needs echo-vllm's vLLM plugin, but {problem}")


def serve(vllm_argv: list[str], settings: ServeSettings, on_ready: Any = None) -> int:
    """Parse with vLLM's parser, check, then hand over to ``vllm serve``.

    ``on_ready(args)`` runs after every check has passed (vLLM's parsing and
    ``validate``, :func:`verify_parsed`, the plugin, a device present), right
    before vLLM's ``serve`` starts: what a refused command must not do
    belongs there."""
    check_vllm_version()
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    ensure_platform_for_parsing()
    parser = build_parser()
    unknown = unknown_secret_option(vllm_argv, parser.echo_serve_options)
    if unknown is not None:
        raise ServeArgsError(f"{unknown} is not an option of vllm serve (refused here: vLLM's error would "
                             "print the value that follows)")
    args = parse(vllm_argv, parser)
    check_model(args)
    parser.echo_serve_command.validate(args)
    problems = verify_parsed(args, settings)
    if problems:
        raise ServeArgsError(
            "vLLM parsed settings the rewrite did not see (abbreviated option or --config file?): "
            + "; ".join(problems))
    if settings.glue_active:
        check_plugin(settings)
    require_accelerator()
    if on_ready is not None:
        on_ready(args)
    args.dispatch_function(args)
    return 0
