"""vLLM glue: Echo inside stock vLLM's tensor-parallel all-reduce.

* :mod:`.plugin`       -- the ``vllm.general_plugins`` entry point: installs the hook
* :mod:`.hook`         -- the ``GroupCoordinator`` patches, nothing else
* :mod:`.startup`      -- what happens when vLLM creates the TP group
* :mod:`.session`      -- the process's one Echo session, and its registry
* :mod:`.communicator` -- the ``EchoCommunicator`` of one TP group, built from vLLM's
* :mod:`.settings`     -- what ``--additional-config`` asks for (``tp_comm``, ``echo_*``)
* :mod:`.guards`       -- the rule book: what the settings cannot run with (plugin and ``serve``)
* :mod:`.bypass`       -- model code that sums over the TP group around the hook (refused or reported)
* :mod:`.tracking`     -- call index per forward pass, counters under CUDA graphs
* :mod:`.metrics`      -- Prometheus export of the counters
* :mod:`.pynccl_transport` -- Echo's collectives over vLLM's pynccl communicator
* :mod:`.emulation`    -- one-device TP=P emulation (custom ops + layer patches)
* :mod:`.compat`       -- every vLLM symbol used, version checks

Importing this package does not import vLLM; the plugin
(:func:`echo_vllm.vllm_glue.plugin.register`) installs the hook.
"""

from .guards import Conflict, EchoEngineConfigError, EngineFacts, check_engine_config, conflicts
from .settings import TpCommSettings


def current_stats():
    """This process's Echo counters (a :class:`~.tracking.StepStats`, an
    :class:`~echo_vllm.stats.EchoStats`), or None when Echo is not active."""
    from .session import current_stats as _current

    return _current()


__all__ = [
    "Conflict",
    "EchoEngineConfigError",
    "EngineFacts",
    "TpCommSettings",
    "check_engine_config",
    "conflicts",
    "current_stats",
]
