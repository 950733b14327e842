#!/usr/bin/env python3
"""Experiment: can Echo's error feedback be made to cancel on a post-norm model?

On a sandwich-norm decoder (Gemma-2/3) call k's output y_k reaches the
residual stream as N_k(y_k) = (1 + w_k) * y_k / rms(y_k). An error d in y_k
lands there, to first order, as J_k * d with J_k = (1 + w_k) / rms(y_k) (per
token and channel; the Jacobian's radial term is ignored). Echo feeds call
k's error E_k into call k+1, so the residual receives J_{k+1} E_k - J_k E_k:
no cancellation, and since consecutive J differ by orders of magnitude it
diverges (EVAL.md, "Post-norm models"). Rescaling the carried error by
c = J_k / J_{k+1} before call k+1 restores the telescoping to first order.

J_k is known after call k (its output's rms); J_{k+1} needs rms(y_{k+1})
before call k+1 is reduced. This script measures how much the rescaled
feedback could give, by estimate of that rms:

* ``PN_RMS=oracle``: the exact sum of call k+1's partials (an upper bound;
  no real rank has it);
* ``PN_RMS=partials``: sqrt(sum_r ||x_r||^2) per token -- what a tiny extra
  all-reduce of P per-token scalars gives (exact if the partials were
  uncorrelated);
* ``PN_RMS=local``: each rank from its own partial, sqrt(P) * rms(x_r) (no
  communication; ranks rescale their own carried errors differently);
* ``PN_RMS=off``: no rescaling (plain Echo feedback: the divergent case).

With Hadamard on, the carried error is stored rotated per group: it is
rotated back to channels, rescaled and rotated again.

    PN_RMS=oracle python scripts/experiments/postnorm_feedback.py --model gemma3-270m --tp 4 \\
        --texts hamlet --postnorm feedback --variants exact echo+last echo+last:feedback=false \\
        --out /tmp/pn --stem pn_oracle
"""

from __future__ import annotations

import os
import sys

import torch

from echo_vllm.eval import hf_emulation
from echo_vllm.rotation import fwht

MODE = os.environ.get("PN_RMS", "oracle")
_reduce = hf_emulation.HFEmulation._reduce
_install = hf_emulation.HFEmulation.install


def _gain(self, site: str) -> torch.Tensor | float:
    """Per-channel gain of the norm applied to ``site``'s output (the scale of
    Gemma's embedding for the first call)."""
    if site == "embed":
        scale = getattr(self.backbone.embed_tokens, "embed_scale", None)
        return float(scale) if scale is not None else 1.0
    layer, name = site.split(".")
    block = self.layers[int(layer)]
    norm = block.post_attention_layernorm if name == "o_proj" else block.post_feedforward_layernorm
    return 1.0 + norm.weight.float()


def _rms(y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return y.float().pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def _reduce_rescaled(self, site: str, partials: torch.Tensor) -> torch.Tensor:
    tp = self.tp
    chain = tp.comm.chain
    if MODE != "off" and self.effective_mode == "echo" and self.effective_config.feedback:
        if site == "embed":
            self._pn_prev = None
        if MODE == "oracle":
            rms_next = _rms(partials.float().sum(0))
        elif MODE == "partials":
            rms_next = partials.float().pow(2).sum(0).mean(-1, keepdim=True).add(1e-6).sqrt()
        elif MODE == "local":  # per rank, from its own partial only: sqrt(P) * rms(x_r)
            rms_next = (partials.shape[0] * partials.float().pow(2).mean(-1, keepdim=True)).add(1e-6).sqrt()
        else:
            raise SystemExit(f"PN_RMS={MODE!r}: oracle, partials, local or off")
        # the embedding reaches the residual scaled, not normalised
        j_next = _gain(self, site) if site == "embed" else _gain(self, site) / rms_next
        prev = getattr(self, "_pn_prev", None)
        numel = partials[0].numel()
        if prev is not None and chain._buffer is not None and chain._pending_key is not None:
            buf = chain._buffer[:, :numel].view(partials.shape[0], *partials.shape[1:])
            # a channel the next norm nearly zeroes cannot take the carried
            # error back: cap the rescaling (PN_CAP), the excess stays uncancelled
            cap = float(os.environ.get("PN_CAP", "4"))
            ratio = torch.nan_to_num(prev / j_next, nan=0.0, posinf=cap, neginf=-cap).clamp(-cap, cap)
            if os.environ.get("PN_DEBUG"):
                print(f"[pn] {site}: ratio {ratio.min().item():.3g}..{ratio.max().item():.3g} "
                      f"|E| {buf.float().abs().max().item():.3g} "
                      f"|x| {partials.float().abs().max().item():.3g}", file=sys.stderr)
            if self.effective_config.hadamard:
                # the error is stored rotated (u = W x per group, W W = g I):
                # back to channels, rescale, rotate again
                g = self.effective_config.group_size
                e = fwht(buf.float().reshape(*buf.shape[:-1], -1, g)).reshape(buf.shape) / g
                e = fwht((e * ratio).reshape(*buf.shape[:-1], -1, g)).reshape(buf.shape)
            else:
                e = buf.float() * ratio
            buf.copy_(e.to(buf.dtype))
        y = _reduce(self, site, partials)
        # J of this call, from its actual output
        self._pn_prev = _gain(self, site) if site == "embed" else _gain(self, site) / _rms(y)
        return y
    return _reduce(self, site, partials)


if __name__ == "__main__":
    hf_emulation.HFEmulation._reduce = _reduce_rescaled
    from echo_vllm.eval import perplexity

    sys.exit(perplexity.main(sys.argv[1:]))
