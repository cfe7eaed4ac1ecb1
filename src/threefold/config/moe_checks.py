"""The checks of the mixture-of-experts keys (model.experts ...) and of expert parallelism (parallel.ep).

Part of `Config.validate`; each mistake names the key and the fix. Expert parallelism is
carved out of dp (ep divides dp) and composes with tp (and sequence parallelism), pp and
ZeRO 1-3; local SGD and gradient compression are refused with ep > 1 (docs/moe.md says why).
"""

from __future__ import annotations

from .sections import ModelConfig, Sections
from ..errors import ConfigError


def validate_experts(c: Sections, dp: int) -> None:
    m, p = c.model, c.parallel  # each value's own range: domains.py
    if m.experts and not 1 <= m.experts_top_k <= m.experts:
        raise ConfigError("model.experts_top_k", f"must be between 1 and model.experts={m.experts}, "
                          f"got {m.experts_top_k}")
    if m.experts and m.preset.startswith("hf:") and p.pp > 1:  # the reference decoder's experts do run pipelined
        raise ConfigError("parallel.pp", "a Hugging Face mixture of experts does not run under pipeline parallelism "
                          "(its load-balancing loss is computed over the whole model, not per stage); use pp=1")
    validate_balance(m)
    if p.ep == 1:
        return
    if not m.experts:
        raise ConfigError("parallel.ep", f"ep={p.ep} needs a mixture of experts; set model.experts (a multiple "
                          "of ep) or use a preset such as tiny-moe, or set --ep 1")
    if dp % p.ep:
        raise ConfigError("parallel.ep", f"ep={p.ep} must divide dp={dp} (expert parallelism is carved out of "
                          "data parallelism)")
    if m.experts % p.ep:
        raise ConfigError("parallel.ep", f"model.experts={m.experts} is not divisible by ep={p.ep}")
    if c.train.periodic:
        raise ConfigError("train.sync_every", f"periodic synchronisation (local SGD) does not run with ep={p.ep}: "
                          "its replicas are whole models averaged over dp, but under ep a model spans the ep group "
                          "and only the edp groups hold the same experts; synchronise every step or use --ep 1")
    if c.compress.method != "none":
        raise ConfigError("compress.method", f"gradient compression does not run with ep={p.ep}: it compresses "
                          "the one gradient exchange over dp, and the experts' gradients are summed over edp apart "
                          "from it; use compress.method=none or --ep 1")
    if p.zero_hpz:
        raise ConfigError("parallel.zero_hpz", f"hpZ is not built for ep={p.ep}: the experts' ZeRO-3 shards live on "
                          "edp, apart from the dense parameters' node-local copy; drop parallel.zero_hpz or use --ep 1")


def validate_balance(m: ModelConfig) -> None:
    """`model.router_balance` and the keys that belong to one of its modes: a key set for the other mode
    would do nothing, so it is refused (its default is accepted)."""
    if m.router_balance == "aux":
        for key in ("router_bias_rate", "router_seq_aux_weight"):
            if getattr(m, key) != getattr(ModelConfig, key):
                raise ConfigError(f"model.{key}", "belongs to model.router_balance=bias (the bias rule); it does "
                                  "nothing under router_balance=aux: set router_balance=bias or drop it")
        return
    if not m.experts:
        raise ConfigError("model.router_balance", "router_balance=bias needs a mixture of experts: set "
                          "model.experts or use router_balance=aux")
    if m.preset.startswith("hf:"):
        raise ConfigError("model.router_balance", "router_balance=bias is the reference decoder's (models/moe.py); "
                          "a Hugging Face mixture of experts routes as its config says: use router_balance=aux")
    if m.router_aux_weight != ModelConfig.router_aux_weight:
        raise ConfigError("model.router_aux_weight", "does nothing under router_balance=bias, whose sequence-wise "
                          "balance loss is weighted by model.router_seq_aux_weight: set that one instead")
