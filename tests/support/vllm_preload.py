"""What the vLLM tests' fork server imports once (``vllm_cpu.run_vllm_processes``),
so that each rank forked from it starts with it done:

* vLLM on the CPU platform (``use_cpu_platform`` first, as every rank does),
  the modules every rank imports: configs, groups, forward context, the
  parallel layers;
* Inductor's check of the CPU's vector instructions (one compile and one
  Python process per instruction set, ~13 s), which a rank would run on its
  first ``torch.compile``, vLLM's embedding included.

Nothing here registers the plugin, loads vLLM's plugins or imports a model:
the tests check that the ranks do those themselves.
"""

from support.vllm_cpu import use_cpu_platform

use_cpu_platform()

import vllm.config  # noqa: E402,F401
import vllm.distributed.parallel_state  # noqa: E402,F401
import vllm.forward_context  # noqa: E402,F401
import vllm.model_executor.layers.linear  # noqa: E402,F401
import vllm.model_executor.layers.vocab_parallel_embedding  # noqa: E402,F401
from torch._inductor import cpu_vec_isa  # noqa: E402

cpu_vec_isa.valid_vec_isa_list()
