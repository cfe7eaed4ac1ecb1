"""The checks of the mixture-of-experts keys (model.experts ...) and of expert parallelism (parallel.ep).

Part of `Config.validate`; each mistake names the key and the fix. Expert parallelism is
carved out of dp (ep divides dp) and composes today with dp and tp; the combinations not
built yet are refused here rather than run wrongly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config


def validate_experts(c: "Config", dp: int) -> None:
    m, p = c.model, c.parallel
    for key, value in [("model.experts", m.experts), ("model.shared_experts", m.shared_experts),
                       ("model.expert_ffn_hidden", m.expert_ffn_hidden), ("model.moe_start", m.moe_start),
                       ("model.expert_capacity", m.expert_capacity), ("model.head_size", m.head_size),
                       ("model.router_aux_weight", m.router_aux_weight),
                       ("model.router_z_weight", m.router_z_weight)]:
        if value < 0:
            raise ConfigError(key, f"must be at least 0, got {value}")
    if m.moe_every < 1:
        raise ConfigError("model.moe_every", f"must be at least 1, got {m.moe_every}")
    if m.experts and not 1 <= m.experts_top_k <= m.experts:
        raise ConfigError("model.experts_top_k", f"must be between 1 and model.experts={m.experts}, "
                          f"got {m.experts_top_k}")
    if p.ep < 1:
        raise ConfigError("parallel.ep", f"must be at least 1, got {p.ep}")
    if m.experts:
        if p.pp > 1:
            raise ConfigError("parallel.pp", "a mixture of experts does not run under pipeline parallelism yet "
                              "(the routers' auxiliary losses of earlier stages do not reach the loss); use pp=1")
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", "a mixture of experts does not run under sequence "
                              "parallelism yet; set parallel.sequence_parallel=false")
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
    if p.zero == 3:
        raise ConfigError("parallel.zero", f"ZeRO-3 does not run with ep={p.ep} yet; use --zero 0, 1 or 2, "
                          "or --ep 1")
    if c.train.periodic:
        raise ConfigError("train.sync_every", f"periodic synchronisation (local SGD) does not run with ep={p.ep} "
                          "yet; synchronise every step or use --ep 1")
    if c.compress.method != "none":
        raise ConfigError("compress.method", f"gradient compression does not run with ep={p.ep} yet; "
                          "use compress.method=none or --ep 1")
