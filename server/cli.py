"""``echo-vllm serve MODEL [vllm serve args] --tp-comm {nccl,echo} [echo args]``.

1. :func:`~echo_vllm.cli_args.check_argv` refuses an option spelled with a
   look-alike of ``-`` (never showing what follows it);
   :func:`~echo_vllm.server.credentials.take_secrets` takes ``--api-key`` /
   ``--hf-token`` off the command line: they reach vLLM through the
   environment variables it reads, so no log ever shows them; a secret by
   any other route (a JSON key, a URL's password) is refused (the command
   line printed shows ``***`` for anything else that looks like a secret);
2. :func:`~echo_vllm.server.rewrite.rewrite_args` turns the command line into
   a ``vllm serve`` one (Echo's flags -> ``--additional-config``, bypassing
   compilation passes off, contradictions rejected in one line), and with
   the glue active the ``ECHO_*`` variables are checked here, not in the
   engine's workers minutes later;
3. with Echo on (or the emulation's exact baseline), Prometheus
   multiprocess mode is switched on before vLLM is imported, so the workers'
   Echo counters reach ``/metrics``
   (:mod:`echo_vllm.vllm_glue.metrics`): in a private temporary folder, or
   in the user's ``PROMETHEUS_MULTIPROC_DIR`` if it is empty (or holds only
   an earlier run's value files); anything else there is refused, never
   deleted;
4. with the glue active, vLLM's older Ray executor is told to copy Echo's
   variables (``ECHO_*``, ``PROMETHEUS_MULTIPROC_DIR``, ``TRITON_INTERPRET``)
   to its workers, as the multiprocessing launch's workers inherit them
   (:func:`ray_copy_env`; that executor copies only its own prefixes, the
   default one, ``RayExecutorV2``, the driver's whole environment);
5. vLLM's own ``vllm serve`` runs in this process
   (:mod:`~echo_vllm.server.vllm_serve`): vLLM parses and checks the
   arguments (on a host without a GPU too, where the start is then refused),
   and only once every check has passed are an earlier run's value files
   removed from the user's folder: a refused command removes nothing.

Every refusal is one line, ``echo-vllm serve: error: ...``, exit 2.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import Mapping

from .. import envs
from ..cli_args import UsageError, check_argv
from .credentials import scrub, take_secrets
from .flags import format_help
from .rewrite import ServeArgsError, ServeSettings, rewrite_args

logger = logging.getLogger("echo_vllm")


def _say(text: str) -> None:
    print(f"echo-vllm serve: {text}", file=sys.stderr, flush=True)


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def config_labels(settings: ServeSettings) -> dict[str, str]:
    """Labels of ``echo:config_info``: the settings a dashboard filters on."""
    labels = {"tp_comm": settings.tp_comm, "tensor_parallel_size": settings.tensor_parallel_size,
              "emulate_tp": settings.emulate_tp}
    if settings.echo is not None:
        labels.update(settings.echo.to_dict())
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in labels.items()}


#: What vLLM's Ray executor must copy from the engine's environment to its
#: workers for Echo: vLLM 0.26's ``RayDistributedExecutor``
#: (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``; ``vllm/ray/ray_env.py``) copies
#: ``VLLM_``, ``NCCL_``, ``HF_``... and what these two variables list.
RAY_PREFIXES_VAR, RAY_NAMES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
RAY_PREFIXES, RAY_NAMES = ("ECHO_",), ("PROMETHEUS_MULTIPROC_DIR", "TRITON_INTERPRET")


def ray_copy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The two variables with Echo's prefixes and names added to what
    ``environ`` already lists (comma-separated, as vLLM reads them)."""
    out = {}
    for var, wanted in ((RAY_PREFIXES_VAR, RAY_PREFIXES), (RAY_NAMES_VAR, RAY_NAMES)):
        listed = [item.strip() for item in environ.get(var, "").split(",") if item.strip()]
        out[var] = ",".join(listed + [item for item in wanted if item not in listed])
    return out


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
    from ..vllm_glue import metrics

    try:
        # the secrets first: a key's value is never shown, whatever it begins with
        argv, secret_env = take_secrets(argv)
        argv = check_argv(argv)
        vllm_argv, settings = rewrite_args(argv)
        if settings.glue_active:
            envs.read()  # the engine's workers read them: refuse a bad value now
            path, _ = metrics.prepare_multiprocess_dir(remove_stale=False)  # before vLLM imports prometheus_client
    except (UsageError, ServeArgsError, metrics.MultiprocessDirError) as e:
        _say(f"error: {e}")
        return 2
    _say(f"tp_comm={settings.tp_comm}; running: vllm serve {shlex.join(scrub(vllm_argv))}")
    for name in sorted(secret_env):
        _say(f"{name} set from the command line (handed to vLLM through the environment, kept out of every log)")
    for warning in settings.warnings + tuple(envs.unknown_variables() if settings.glue_active else ()):
        _say(f"warning: {warning}")

    on_ready = None
    if settings.glue_active:
        _say(f"Prometheus multiprocess dir {path}")

        def on_ready(_args):
            # every check has passed (vLLM's parsing too): only now is anything removed
            path, stale = metrics.prepare_multiprocess_dir()
            if stale:
                _say(f"removed {len(stale)} prometheus_client value file(s) of an earlier run from {path} "
                     f"({', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''})")
            metrics.publish_config(config_labels(settings))

    from . import vllm_serve

    os.environ.update(secret_env)
    if settings.glue_active:
        os.environ.update(ray_copy_env(os.environ))
    try:
        return vllm_serve.serve(vllm_argv, settings, on_ready=on_ready)
    except (ServeArgsError, metrics.MultiprocessDirError) as e:
        _say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
