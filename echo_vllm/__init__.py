"""echo-vllm: Echo, an error-compensated 4-bit all-reduce, for vLLM tensor parallelism.

Core objects (no vLLM needed)::

    from echo_vllm import EchoConfig, EchoCommunicator, VirtualTransport
    comm = EchoCommunicator(EchoConfig(), VirtualTransport(4))
    y = comm.all_reduce(partials_stacked_4xTxH, call_index=t)   # t-th call of a forward
    # pass: 4-bit from t = first_exact_calls (5) on, for messages >= min_bytes
"""

from .allreduce import EchoAllReduce
from .backends import BACKENDS, EchoBackend, choose_backend, make_backend
from .communicator import EchoCommunicator
from .config import EchoConfig, EchoConfigError
from .feedback import FeedbackChain
from .policy import CallInfo, Decision, Path, Reason, decide
from .quant import WireLayout
from .stats import CallRecord, EchoStats
from .transport import EchoShapeMismatch, ProcessGroupTransport, Transport, VirtualTransport

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "CallInfo",
    "CallRecord",
    "Decision",
    "EchoAllReduce",
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
    "Transport",
    "VirtualTransport",
    "WireLayout",
    "choose_backend",
    "decide",
    "make_backend",
]
