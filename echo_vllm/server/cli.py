"""``echo-vllm serve MODEL [vllm serve args] --tp-comm {nccl,echo} [echo args]``.

1. :func:`~echo_vllm.server.rewrite.rewrite_args` turns the command line into
   a ``vllm serve`` one (Echo's flags -> ``--additional-config``, bypassing
   compilation passes off, contradictions rejected in one line);
2. with Echo on (or the emulation's exact baseline), Prometheus
   multiprocess mode is switched on before vLLM is imported, so the workers'
   Echo counters reach ``/metrics``
   (:mod:`echo_vllm.vllm_glue.metrics`);
3. vLLM's own ``vllm serve`` runs in this process
   (:mod:`~echo_vllm.server.vllm_serve`).
"""

from __future__ import annotations

import logging
import shlex
import sys

from .flags import format_help
from .rewrite import ServeArgsError, ServeSettings, rewrite_args

logger = logging.getLogger("echo_vllm")


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
    print(f"echo-vllm serve: tp_comm={settings.tp_comm}; running: vllm serve {shlex.join(vllm_argv)}",
          file=sys.stderr, flush=True)

    on_parsed = None
    if settings.glue_active:
        from ..vllm_glue import metrics

        path = metrics.prepare_multiprocess_dir()  # before vLLM imports prometheus_client
        print(f"echo-vllm serve: Prometheus multiprocess dir {path}", file=sys.stderr, flush=True)

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
