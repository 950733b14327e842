"""echo-vllm: Echo, an error-compensated 4-bit all-reduce, for vLLM tensor parallelism.

Core objects (no vLLM needed)::

    from echo_vllm import CallSlot, EchoConfig, StackedCommunicator, VirtualTransport
    comm = StackedCommunicator(EchoConfig(), VirtualTransport(4))   # 4 ranks on one device
    y = comm.all_reduce(partials_stacked_4xTxH, slot=CallSlot(t))    # t-th call of a forward
    # pass: 4-bit from t = first_exact_calls (5) on, for messages >= min_bytes

One rank of a real group: ``EchoCommunicator(config, ProcessGroupTransport())``,
its input that rank's tensor; ``stream=ResidualStream(hidden_size, ...)`` says
which messages are the model's residual stream, ``path=Path.EXACT`` forces a
call onto the 16-bit all-reduce.
"""

from .backends import BACKENDS, EchoBackend, choose_backend, make_backend
from .communicator import EchoCommunicator, ResidualStream
from .config import EchoConfig, EchoConfigError
from .emulation import StackedCommunicator
from .feedback import FeedbackChain
from .numbering import CallSlot
from .policy import CallInfo, Decision, Path, Reason, decide
from .quant import WireLayout
from .stats import CallRecord, EchoStats
from .transport import EchoShapeMismatch, ProcessGroupTransport, Transport, VirtualTransport

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "CallInfo",
    "CallSlot",
    "CallRecord",
    "Decision",
    "EchoBackend",
    "EchoCommunicator",
    "EchoConfig",
    "EchoConfigError",
    "EchoShapeMismatch",
    "EchoStats",
    "FeedbackChain",
    "Path",
    "ProcessGroupTransport",
    "Reason",
    "ResidualStream",
    "StackedCommunicator",
    "Transport",
    "VirtualTransport",
    "WireLayout",
    "choose_backend",
    "decide",
    "make_backend",
]
