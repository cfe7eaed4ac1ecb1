"""1-bit Adam (Tang et al. 2021): Adam whose momentum, not gradient, crosses dp in 1 bit.

Sign compression with error feedback works for SGD-like updates, but not through Adam's
non-linear variance. 1-bit Adam therefore runs in two stages:

    warm-up (`warmup_steps` steps)  gradients summed uncompressed (dense all-reduce);
                                    exact AdamW, which estimates the variance v
    compression                     v is frozen; the gradient hook sends nothing; each rank forms
                                    c_i = beta1 m / n + (1 - beta1) g_i from its *local* gradient, and
                                    m = sum_i c_i is summed by the compressed all-reduce
                                    (onebit.OneBitAllReduce, error feedback on both sides);
                                    p -= lr (m / bc1) / (sqrt(v / bc2_frozen) + eps)

How it plugs in: the data-parallel reducer gets `OneBitAdamHook` (from make_comm_hook for
compress.method=onebit with onebit_adam=true), and the optimizer is built through the hook's
`optimizer_for` (CommHook), which returns a `OneBitAdam` in place of the AdamW over the fp32
masters, with the same parameter groups and hyper-parameters, sharing that hook. During
warm-up OneBitAdam computes exactly what AdamW (foreach=False) computes. After warm-up the gradient left in the buckets is this rank's
local one, so the gradient norm the trainer reports and clips with is rank 0's local norm
(the same factor on every rank, so replicas stay identical).

State: the optimizer's own state_dict (exp_avg, exp_avg_sq, step per parameter); the hook's
`state_dict()` holds the warm-up position and the two error buffers of the momentum exchange.
"""

from __future__ import annotations

import torch

from ..collectives import Comm
from ..hierarchical import dense_all_reduce
from .onebit import OneBitAllReduce


class _Nothing:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class OneBitAdamHook:
    """Dense gradient sums during warm-up, no gradient traffic afterwards."""

    applies_momentum = False
    replicated = False  # after warm-up each rank keeps its local gradient

    def __init__(self, warmup_steps: int, error_feedback: bool = True):
        self.warmup_steps = warmup_steps
        self.error_feedback = error_feedback
        self.steps = torch.zeros((), dtype=torch.int64)  # optimizer steps done (advanced by OneBitAdam)
        self.momentum_state: dict = {}  # worker_error / server_error of the momentum exchange

    @property
    def compressing(self) -> bool:
        return int(self.steps) >= self.warmup_steps

    def launch(self, bucket, comm: Comm, axis: str):
        if self.compressing:
            return _Nothing()
        return dense_all_reduce(comm, bucket.buffer, axis, async_op=True)

    def complete(self, bucket) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"steps": self.steps}
        out.update({f"momentum.{k}": v for k, v in self.momentum_state.items() if not k.startswith("_")})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.steps = state["steps"].clone().to(torch.int64)
        self.momentum_state = {k.removeprefix("momentum."): v.clone() for k, v in state.items()
                               if k.startswith("momentum.")}

    def optimizer_for(self, optimizer: torch.optim.Optimizer, comm: Comm, axis: str) -> torch.optim.Optimizer:
        """1-bit Adam in place of the AdamW `optimizer`: the same parameter groups and hyper-parameters,
        its moments carried over (both keep step, exp_avg, exp_avg_sq per tensor), this hook shared."""
        d = optimizer.defaults
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        one_bit = OneBitAdam(groups, self, comm, axis, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                             weight_decay=d["weight_decay"])
        one_bit.state.update(optimizer.state)
        return one_bit


class OneBitAdam(torch.optim.Optimizer):
    def __init__(self, params, hook: OneBitAdamHook, comm: Comm, axis: str = "dp", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.hook, self.comm, self.axis = hook, comm, axis

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield group, p

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def _exchange_momentum(self) -> None:
        """m = sum over ranks of (beta1 m / n + (1 - beta1) g_local), compressed."""
        n = self.comm.mesh.size(self.axis)
        entries = [(group, p, self._state(p)) for group, p in self._params()]
        flat = torch.cat([(s["exp_avg"] * (g["betas"][0] / n)).add_(p.grad, alpha=1 - g["betas"][0]).flatten()
                          for g, p, s in entries])
        OneBitAllReduce(flat.numel(), n, self.hook.error_feedback).all_reduce(
            flat, self.hook.momentum_state, self.comm, self.axis)
        offset = 0
        for _, p, s in entries:
            s["exp_avg"].copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        compressing = self.hook.compressing
        if compressing:
            self._exchange_momentum()
        for group, p in self._params():
            state = self._state(p)
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            state["step"] += 1
            step = state["step"].item()
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            if compressing:
                variance_steps = max(1, min(step, self.hook.warmup_steps))  # v stopped changing there
            else:  # the same operations as torch's AdamW (foreach=False)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                variance_steps = step
            bias_correction1 = 1 - beta1 ** step
            bias_correction2_sqrt = (1 - beta2 ** variance_steps) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        self.hook.steps += 1
        return loss

