"""``echo-vllm serve MODEL [vllm serve args] --tp-comm {nccl,echo} [echo args]``.

1. :func:`~echo_vllm.server.rewrite.rewrite_args` turns the command line into
   a ``vllm serve`` one (Echo's flags -> ``--additional-config``, bypassing
   compilation passes off, contradictions rejected in one line);
2. with Echo on (or the emulation's exact baseline), Prometheus
   multiprocess mode is switched on before vLLM is imported, so the workers'
   Echo counters reach ``/metrics``
   (:mod:`echo_vllm.vllm_glue.metrics`); a directory the user set in
   ``PROMETHEUS_MULTIPROC_DIR`` is cleared of an earlier run's value files
   first (:func:`clear_multiprocess_dir`);
3. vLLM's own ``vllm serve`` runs in this process
   (:mod:`~echo_vllm.server.vllm_serve`).

What it prints of a command line has the secrets masked (:func:`masked_argv`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

from .flags import format_help
from .rewrite import ServeArgsError, ServeSettings, rewrite_args

logger = logging.getLogger("echo_vllm")

#: vLLM options whose values are secrets, with how many values argparse
#: takes for each ("+": one or more, "?": one or none).
SECRET_OPTIONS = {"--api-key": "+", "--hf-token": "?"}
MASK = "MASKED"  # no shell metacharacters: shlex prints it bare


def _secret_option(name: str) -> str | None:
    """The secret option ``name`` spells: itself, with underscores
    (``--api_key``), or an abbreviation argparse expands to it; None if none."""
    name = name.replace("_", "-")
    for option in SECRET_OPTIONS:
        # argparse expands a unique prefix; vLLM's other options share the
        # first word (--api-server-count, --hf-overrides), so one more letter
        shortest = option[:option.index("-", 2) + 2]
        if option.startswith(name) and name.startswith(shortest):
            return option
    return None


def masked_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of :data:`SECRET_OPTIONS` replaced by
    :data:`MASK`, in both ``--api-key X`` (every value argparse would take)
    and ``--api-key=X`` forms: what the CLI prints of a command line.
    Tokens after ``--`` are positional and kept."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        name, eq, _ = token.partition("=")
        option = _secret_option(name) if name.startswith("--") else None
        out.append(f"{name}={MASK}" if option and eq else token)
        i += 1
        if option and not eq:
            nargs = SECRET_OPTIONS[option]
            # "+": the first token is a value even if it starts with "-" (argparse would refuse the line)
            if nargs == "+" and i < len(argv) and argv[i] != "--":
                out.append(MASK)
                i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                out.append(MASK)
                i += 1
                if nargs == "?":
                    break
    return out


def clear_multiprocess_dir(path: str | None) -> list[str]:
    """Remove an earlier run's prometheus_client value files (``*.db``)
    from the multiprocess directory ``path``; returns their names (sorted).
    Left in place they would be summed into this server's ``/metrics``
    (prometheus_client requires the directory wiped between runs). Other
    files and subdirectories stay; a missing directory has nothing."""
    if not path or not os.path.isdir(path):
        return []
    stale = sorted(e.name for e in os.scandir(path) if e.is_file() and e.name.endswith(".db"))
    for name in stale:
        os.remove(os.path.join(path, name))
    return stale


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def config_labels(settings: ServeSettings) -> dict[str, str]:
    """Labels of ``echo:config_info``: the settings a dashboard filters on."""
    labels = {"tp_comm": settings.tp_comm, "tensor_parallel_size": settings.tensor_parallel_size,
              "emulate_tp": settings.emulate_tp}
    if settings.echo is not None:
        labels.update(settings.echo.to_dict())
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in labels.items()}


def _help(argv: list[str]) -> int:
    from . import vllm_serve

    searched = [a for a in argv if a.startswith("--help=")]
    if not searched:
        print(format_help())
        print("\n" + "=" * 32 + " vllm serve options " + "=" * 32)
    sys.stdout.flush()
    return vllm_serve.print_help(searched or ["--help"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _wants_help(argv):
        return _help(argv)
    try:
        vllm_argv, settings = rewrite_args(argv)
    except ServeArgsError as e:
        print(f"echo-vllm serve: error: {e}", file=sys.stderr)
        return 2
    print(f"echo-vllm serve: tp_comm={settings.tp_comm}; running: vllm serve {shlex.join(masked_argv(vllm_argv))}",
          file=sys.stderr, flush=True)

    on_parsed = None
    if settings.glue_active:
        from ..vllm_glue import metrics

        # a user-set directory may hold the last run's values (a temporary one starts empty)
        stale = clear_multiprocess_dir(os.environ.get(metrics.MULTIPROC_ENV))
        path = metrics.prepare_multiprocess_dir()  # before vLLM imports prometheus_client
        print(f"echo-vllm serve: Prometheus multiprocess dir {path}", file=sys.stderr, flush=True)
        if stale:
            print(f"echo-vllm serve: removed {len(stale)} metric file(s) (*.db) of an earlier run from {path}: "
                  f"a user-set {metrics.MULTIPROC_ENV} is cleared at every start, so give each server its own",
                  file=sys.stderr, flush=True)

        def on_parsed(_args):
            metrics.publish_config(config_labels(settings))

    from . import vllm_serve

    try:
        return vllm_serve.serve(vllm_argv, settings, on_parsed=on_parsed)
    except ServeArgsError as e:
        print(f"echo-vllm serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
