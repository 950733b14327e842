"""The rule book of ``tp_comm``: what Echo's settings cannot run with.

:func:`conflicts` is one pure function: the conflicts of a configuration
(Echo's settings, :class:`~.settings.TpCommSettings`, and the few engine
facts that matter, :class:`EngineFacts`), each with the flag to change.
Both sides call it: the plugin when vLLM creates the tensor-parallel group
(:func:`check_engine_config`, on the finalized ``VllmConfig``), and
``echo-vllm serve`` before it starts vLLM (``echo_vllm.server.rewrite``,
from its command line), which turns every conflict into an argument error.
What a single setting may hold (``tp_comm`` values, P >= 2, ...) is
:class:`~.settings.TpCommSettings`' own validation, which both sides parse
through as well.

Why each rule:

* ``pass_config.fuse_allreduce_rms`` (FlashInfer all-reduce + RMSNorm fusion,
  on by default on sm90/sm100 with TP > 1) replaces the all-reduce node of
  the compiled graph with a fused kernel: the hook would never see those
  calls and Echo would silently not run.
* ``pass_config.enable_sp`` / ``fuse_gemm_comms`` (vLLM 0.26; gone in 0.33)
  turn all-reduces into reduce-scatter + all-gather pairs: same problem.
* dual-batch overlap (``enable_dbo``, ``ubatch_size > 1``) interleaves two
  micro-batches' all-reduces, which would mix two residual streams in one
  feedback chain.
* stochastic rounding under CUDA graphs: a replay repeats the captured
  noise draw.
* the emulation computes TP=P's partials on one device: it needs TP=1.
* hosts (``echo_host_map``, ``echo_topology``): a host map names one host
  per rank of the TP group; where vLLM's multiprocessing launch spreads
  the group over nodes (:func:`launch_tp_hosts`), a map that places the
  ranks otherwise is a mistake (on one node a map emulates hosts), and
  ``two_level`` on a layout it cannot serve (the whole TP group on one
  node without a map, one rank per node) would only fail at start. Under
  Ray the placement group decides, at start.
* Echo at TP=1 without the emulation has no all-reduce to replace, and
  ``tp_comm_postnorm`` without Echo has nothing to decide: the engine runs
  (vLLM's own all-reduce, logged), ``echo-vllm serve`` refuses them.

One more refusal needs no hook: when the plugin could not install its hook
(:mod:`echo_vllm.vllm_glue.plugin`), an engine that asks for Echo must not start at
all -- vLLM would run its own all-reduce under an Echo label
(:func:`check_hook_installed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cli_args import MAX_RANKS
from ..config import EchoConfigError
from ..hosts import TWO_LEVEL, HostMap, choose_topology, host_map_refusal
from . import compat
from .settings import EMULATE_KEY, POSTNORM_KEY, TpCommSettings


class EchoEngineConfigError(EchoConfigError):
    """The vLLM engine configuration conflicts with Echo."""


#: vLLM 0.26 compilation passes (pass_config fields) that remove or replace
#: the all-reduce Echo hooks, and what each does instead. ``echo-vllm serve``
#: turns them off (server/rewrite.py); here the engine refuses them.
BYPASS_PASSES = {
    "fuse_allreduce_rms": "replaces all-reduce + RMSNorm with FlashInfer's fused kernel",
    "enable_sp": "replaces the all-reduce with reduce-scatter + all-gather (sequence parallelism)",
    "fuse_gemm_comms": "fuses GEMMs with reduce-scatter/all-gather (async TP)",
}


@dataclass(frozen=True)
class EngineFacts:
    """What the rules read of an engine: its finalized ``VllmConfig``
    (:meth:`from_vllm_config`), or what ``echo-vllm serve``'s command line
    says it will be."""

    tensor_parallel_size: int = 1
    enable_dbo: bool = False
    ubatch_size: int = 0
    passes_on: tuple[str, ...] = ()
    """The :data:`BYPASS_PASSES` that are on."""
    cudagraphs: bool = False
    """The engine may replay CUDA graphs (``echo-vllm serve`` reads it from
    its command line: on unless ``--enforce-eager``, ``-O0`` or
    ``cudagraph_mode`` NONE, so the refusal comes before vLLM starts)."""
    tp_hosts: tuple[int, ...] | None = None
    """The node of each rank of the (first) TP group where the launch fixes
    it (:func:`launch_tp_hosts`); None where it does not (Ray, data
    parallelism across nodes): then vLLM's node test tells, at start."""

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "EngineFacts":
        parallel = getattr(vllm_config, "parallel_config", None)
        pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        return cls(
            tensor_parallel_size=tp,
            enable_dbo=bool(getattr(parallel, "enable_dbo", False)),
            ubatch_size=int(getattr(parallel, "ubatch_size", 0) or 0),
            # getattr: vLLM 0.33 has no enable_sp / fuse_gemm_comms
            passes_on=tuple(name for name in BYPASS_PASSES if getattr(pass_config, name, None)),
            cudagraphs=compat.cudagraphs_enabled(vllm_config),
            tp_hosts=launch_tp_hosts(tp, int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
                                     int(getattr(parallel, "data_parallel_size", 1) or 1),
                                     int(getattr(parallel, "nnodes", 1) or 1),
                                     getattr(parallel, "distributed_executor_backend", None)),
        )


#: ``distributed_executor_backend`` values whose workers vLLM places by
#: ``--nnodes`` (None: not chosen yet, vLLM's default is ``mp`` then).
MP_EXECUTORS = (None, "mp", "uni")


def launch_tp_hosts(tp: int, pp: int, dp: int, nnodes: int, executor: Any) -> tuple[int, ...] | None:
    """The node of each rank of the first TP group as vLLM 0.26 launches
    ``tp * pp`` workers over ``nnodes`` nodes, or None where the launch
    does not fix it.

    The multiprocessing launch (``--nnodes``, ``executor`` ``mp`` or
    unset) gives node ``k`` the global ranks ``k*L .. (k+1)*L - 1``, ``L =
    tp * pp / nnodes`` (``MultiprocExecutor``: ``global_start_rank``), and
    a TP group is ``tp`` consecutive ranks: TP rank ``r`` runs on node
    ``r // L``. Ray's placement group decides at start, an external
    launcher (torchrun) or an executor class places the ranks itself, and
    data parallelism's engines split the nodes: None for those."""
    if executor not in MP_EXECUTORS or tp > MAX_RANKS:  # a group larger than Echo runs has no host map to check
        return None
    if nnodes == 1:
        return (0,) * tp
    if dp != 1 or (tp * pp) % nnodes:
        return None  # vLLM refuses the second itself (world_size must be divisible by nnodes)
    per_node = tp * pp // nnodes
    return tuple(r // per_node for r in range(tp))


@dataclass(frozen=True)
class Conflict:
    """One thing a configuration cannot do, and what to change."""

    message: str
    refused: bool = True
    """False: the engine still starts, with vLLM's own all-reduce (logged);
    ``echo-vllm serve`` refuses every conflict."""


def conflicts(settings: TpCommSettings, engine: EngineFacts) -> list[Conflict]:
    """Every conflict of ``settings`` with ``engine`` (empty: fine)."""
    out: list[Conflict] = []
    tp = engine.tensor_parallel_size
    if settings.emulated and tp != 1:
        out.append(Conflict(
            f"{EMULATE_KEY}={settings.emulate_world_size} emulates tensor parallelism on one "
            f"device and needs --tensor-parallel-size 1 (got {tp}); drop {EMULATE_KEY} "
            "to run Echo on the real group"))
    if settings.tp_comm == "echo" and not settings.emulated and tp == 1:
        out.append(Conflict(
            "tp_comm=echo needs --tensor-parallel-size > 1 (or tp_comm_emulate=P to emulate TP=P on one "
            "device): at TP=1 there is no all-reduce to replace, and vLLM runs unchanged", refused=False))
    if settings.active and not settings.emulated and tp > 1:
        for name in engine.passes_on:
            out.append(Conflict(
                f"compilation pass {name} is on; it {BYPASS_PASSES[name]}, removing the all-reduce Echo "
                f"replaces. Turn it off: vllm serve ... -cc.pass_config.{name}=false "
                f"(Python: compilation_config={{'pass_config': {{'{name}': False}}}})"))
    if settings.tp_comm == "echo" and settings.echo.rounding == "stochastic" and engine.cudagraphs:
        out.append(Conflict(
            "echo_rounding=stochastic draws its noise from a torch generator; a CUDA-graph replay would "
            "repeat the captured draw every step. Run eager (--enforce-eager) or use echo_rounding=nearest"))
    if settings.active and (engine.enable_dbo or engine.ubatch_size > 1):
        who = "tp_comm=echo" if settings.tp_comm == "echo" else f"{EMULATE_KEY}={settings.emulate_world_size}"
        given = "--enable-dbo" if engine.enable_dbo else f"--ubatch-size {engine.ubatch_size}"
        out.append(Conflict(
            f"{who} cannot run with {given}: dual-batch overlap interleaves two micro-batches' all-reduces "
            "in one feedback chain. Turn it off: drop --enable-dbo / --ubatch-size "
            "(Python: enable_dbo=False, ubatch_size=0)"))
    if settings.tp_comm == "echo" and not settings.emulated and tp > 1:
        out.extend(_host_conflicts(settings, engine))
    if settings.postnorm is not None and settings.tp_comm != "echo":
        out.append(Conflict(
            f"{POSTNORM_KEY}={settings.postnorm} needs tp_comm=echo (it decides what Echo does on "
            "post-norm models)", refused=False))
    return out


def _host_conflicts(settings: TpCommSettings, engine: EngineFacts) -> list[Conflict]:
    """A host map that does not fit the TP group or the launch; two-level
    on a layout it cannot serve."""
    tp, echo = engine.tensor_parallel_size, settings.echo
    refusal = host_map_refusal(echo.host_map, tp)
    if refusal:
        return [Conflict(f"echo_{refusal} (--tensor-parallel-size {tp})")]
    launch = HostMap.of(engine.tp_hosts) if engine.tp_hosts is not None else None
    # on one node a host map emulates hosts; across nodes the launch has placed the ranks
    if echo.host_map is not None and launch is not None and launch.hosts > 1 and HostMap.of(echo.host_map) != launch:
        return [Conflict(
            f"echo_host_map={','.join(map(str, echo.host_map))} puts the TP group's ranks on other hosts than "
            f"the launch does: it runs them on nodes {','.join(map(str, launch.host_of_rank))} "
            f"({launch.describe()}, from --nnodes and the parallel sizes); drop echo_host_map (vLLM's node "
            "test tells the hosts) or make it agree")]
    hosts = echo.host_map if echo.host_map is not None else engine.tp_hosts
    if echo.topology == TWO_LEVEL and hosts is not None:
        try:
            choose_topology(hosts, TWO_LEVEL)
        except EchoConfigError as e:
            where = "echo_host_map" if echo.host_map is not None else "--nnodes and the parallel sizes"
            return [Conflict(f"echo_{e} (hosts from {where}); use echo_topology=auto or flat")]
    return []


def check_engine_config(vllm_config: Any, settings: TpCommSettings) -> list[str]:
    """Raise :class:`EchoEngineConfigError` naming every refused conflict of
    the engine; returns the others' messages (to log)."""
    found = conflicts(settings, EngineFacts.from_vllm_config(vllm_config))
    refused = [c.message for c in found if c.refused]
    if refused:
        raise EchoEngineConfigError(
            "echo-vllm cannot run with this vLLM configuration "
            f"(tp_comm={settings.tp_comm!r}):\n  - " + "\n  - ".join(refused)
        )
    return [c.message for c in found if not c.refused]


def check_hook_installed(vllm_config: Any, problem: str | None) -> None:
    """Raise :class:`EchoEngineConfigError` if the engine asks for Echo (or
    the emulation) while the hook is not installed; ``problem`` says why it
    is not (None: it is). Engines that do not ask for Echo pass untouched."""
    if problem is None:
        return
    settings = TpCommSettings.from_vllm_config(vllm_config)
    if not settings.active:
        return
    asked = f"tp_comm={settings.tp_comm!r}" + (
        f", tp_comm_emulate={settings.emulate_world_size}" if settings.emulated else ""
    )
    raise EchoEngineConfigError(
        f"this engine asks for echo-vllm ({asked}) but echo-vllm's vLLM plugin could not "
        f"install its hook: {problem}. vLLM would run its own all-reduce instead. Fix the installation, "
        "or drop tp_comm / tp_comm_emulate from --additional-config to run stock vLLM."
    )
