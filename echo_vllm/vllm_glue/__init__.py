"""vLLM glue: Echo inside stock vLLM's tensor-parallel all-reduce.

* :mod:`.settings`  -- what ``--additional-config`` asks for (``tp_comm``, ``echo_*``)
* :mod:`.guards`    -- engine settings Echo refuses at start-up, by flag name
* :mod:`.hook`      -- the ``GroupCoordinator`` patches and the per-process session
* :mod:`.tracking`  -- call index per forward pass, counters under CUDA graphs
* :mod:`.pynccl_transport` -- Echo's collectives over vLLM's pynccl communicator
* :mod:`.emulation` -- one-device TP=P emulation (custom ops + layer patches)
* :mod:`.compat`    -- every vLLM symbol used, version checks

Importing this package does not import vLLM; the plugin
(:func:`echo_vllm.plugin.register`) installs the hook.
"""

from .guards import EchoEngineConfigError, check_engine_config, conflicts
from .settings import TpCommSettings


def current_stats():
    """This process's Echo counters (a :class:`~.tracking.StepStats`, an
    :class:`~echo_vllm.stats.EchoStats`), or None when Echo is not active."""
    from .hook import current_stats as _current

    return _current()


__all__ = [
    "EchoEngineConfigError",
    "TpCommSettings",
    "check_engine_config",
    "conflicts",
    "current_stats",
]
