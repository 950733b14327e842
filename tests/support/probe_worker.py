"""A vLLM worker class for vLLM's own launchers, on CPU (``--worker-cls
support.probe_worker.ProbeWorker``).

vLLM's launchers (the multiprocessing executor on one node or across
nodes, a node's ``vllm serve --headless``, the Ray executor) start their
workers through ``WorkerWrapperBase.init_worker``, which loads the
``vllm.general_plugins`` (Echo's hook), then ``init_device``, where the
worker joins the distributed environment with vLLM's
``init_worker_distributed_environment``: that call creates the TP group,
and with it Echo's communicator. vLLM's ``CPUWorker`` cannot be built from
the CUDA wheel (its ``__init__`` calls ``torch.ops._C.init_cpu_memory_env``,
a CPU-build kernel), so this worker keeps vLLM's path up to the groups and
replaces the model runner with :class:`support.vllm_cpu.ToyStack` layers
(vLLM's own ``VocabParallelEmbedding`` / ``RowParallelLinear``), whose
forward passes make the residual all-reduces a decoder makes.

The launcher's driver asks each worker through ``collective_rpc``:
:meth:`ProbeWorker.echo_report` (what the plugin and the TP group became),
:meth:`ProbeWorker.echo_passes` (forward passes: every call's partial and
output).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.v1.worker.worker_base import WorkerBase

#: The toy decoder every probe builds (1 + 2 * LAYERS all-reduces a pass).
LAYERS, HIDDEN, VOCAB = 2, 128, 512
TOKENS = (5, 3, 8)
SEED = 1234


def toy_stack():
    from support.vllm_cpu import ToyStack

    return ToyStack.random(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, tokens=TOKENS, seed=SEED)


class ProbeWorker(WorkerBase):
    """vLLM's worker interface down to the distributed environment; the
    model is :func:`toy_stack`."""

    def init_device(self) -> None:
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        self.device = torch.device("cpu")
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)

    def load_model(self) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.layers = toy_stack().vllm_layers()

    def shutdown(self) -> None:
        pass

    def echo_report(self) -> dict[str, Any]:
        """What this worker's process became: the plugin's status, the TP
        group, vLLM's own node test of it, and Echo's communicator."""
        from vllm.distributed import parallel_state as ps

        from echo_vllm.vllm_glue import plugin, session

        tp = ps.get_tp_group()
        comm = tp.__dict__.get("_echo_comm")
        active = session.current()
        report = dict(
            pid=os.getpid(), rank=self.rank, local_rank=self.local_rank, tp_rank=tp.rank_in_group,
            tp_ranks=list(tp.ranks), plugin_status=plugin._status,
            same_node_as_tp0=[bool(b) for b in ps.in_the_same_node_as(tp.cpu_group, source_rank=0)],
            node_count=ps._NODE_COUNT, echo_comm=comm is not None,
            transport=type(comm.transport).__name__ if comm is not None else None,
            environ={k: v for k, v in os.environ.items() if k.startswith(("ECHO_", "PROMETHEUS_"))},
        )
        if active is not None:
            report["snapshot"] = active.stats.snapshot()
        return report

    def echo_passes(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """One forward pass per batch of :func:`toy_stack` through vLLM's
        layers, in a forward context: ``(pass, partial, output)`` of every
        all-reduce of the TP group, in order."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.forward_context import set_forward_context

        from support.vllm_cpu import toy_mlp_in, toy_norm

        tp = ps.get_tp_group()
        hooked = type(tp)._all_reduce_out_place
        calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        current = [0]

        def spy(x: torch.Tensor) -> torch.Tensor:
            partial = x.clone()  # vLLM's CPU all-reduce works in place
            y = hooked(tp, x)
            calls.append((current[0], partial, y.clone()))
            return y

        tp._all_reduce_out_place = spy
        emb, o, down = self.layers
        try:
            with set_current_vllm_config(self.vllm_config):
                for current[0], tok in enumerate(toy_stack().ids):
                    with set_forward_context(None, self.vllm_config, num_tokens=len(tok)):
                        h = emb(tok)
                        for layer in range(LAYERS):
                            h = h + o[layer](toy_norm(h))
                            h = h + down[layer](toy_mlp_in(h))
        finally:
            tp.__dict__.pop("_all_reduce_out_place")
        return calls
