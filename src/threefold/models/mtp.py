"""Multi-token prediction (`model.mtp_depth`, `model.mtp_weight`): DeepSeek-V3's MTP modules.

DeepSeek-V3 (arXiv 2412.19437, section 2.2) trains D sequential extra depths after the main
model. Depth k (1 .. D) takes the previous depth's hidden state h^{k-1}_i (h^0: the last block's
output, before the final norm) and the embedding of token t_{i+k}, normalises both, concatenates
them, projects 2h -> h, runs one transformer block and, through its own final norm and the
model's shared output head, predicts token t_{i+k+1}:

    h'^k_i = proj_k([norm(h^{k-1}_i); norm(Emb(t_{i+k}))])      h^k = Block_k(h'^k)
    L_k    = sum_i CE(head(norm_k(h^k_i)), t_{i+k+1})             L = L_main + mtp_weight / D * sum_k L_k

The embedding and the head are the main model's (shared, as DeepSeek-V3 shares them); every
summed loss is divided by the same token count as the main loss (the trainer's `global_tokens`),
which is the paper's 1/T. The norms are the model's kind (`model.norm`: RMSNorm in the Llama
variant, as DeepSeek-V3; LayerNorm in the GPT one); the block is a dense block of the model.

Targets. Inputs are t_0 .. t_{s-1} and the main targets t_1 .. t_s, so the token depth k embeds
at position i is the main target i + k - 1 and its target the main target i + k: the last k
positions of a row have none. A target counts only if every main target from i to i + k counts:
in packed rows (`data.pack`) a main target that does not count marks a document boundary or
padding, so a depth-k target across a boundary is ignored (IGNORE_INDEX) with no other input
than the main targets. Embedded tokens that do not count become id 0: they only reach
positions whose targets are ignored (the attention is causal and masked by document).

At evaluation (`val_loss`) and without targets (logits, generation, export) the depths do not
run. The head and the loss skip the last k positions of each row (the whole sequence is there, except
under sequence parallelism, which config/mtp_checks.py refuses: a vocabulary-parallel loss does not skip ignored
targets). `mtp_tally` and `mtp_figures` report the weighted loss they added to the logged `loss` (`mtp_loss`) and
each depth's mean cross-entropy over its counted targets.
"""

from __future__ import annotations

import torch
from torch import nn

from .cross_entropy import IGNORE_INDEX
from .forwards import is_evaluating, is_recomputing
from .loss import Head, Loss, head_loss

__all__ = ["MTPDepth", "depth_targets", "mtp_figures", "mtp_loss", "mtp_tally"]


class MTPDepth(nn.Module):
    """One extra depth: norms of the hidden state and of the embedding, the 2h -> h projection, one
    block, and the depth's own final norm before the shared head."""

    def __init__(self, hidden: int, hidden_norm: nn.Module, embed_norm: nn.Module, block: nn.Module,
                 norm: nn.Module):
        super().__init__()
        self.hidden_norm = hidden_norm
        self.embed_norm = embed_norm
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = norm
        # this step's summed losses (weighted, as added to the loss; and the plain sum), counted targets
        self.tally: torch.Tensor | None = None

    def forward(self, h_bsh: torch.Tensor, e_bsh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k, norm(h^k): the head's input) from h^{k-1} and the embedding of the tokens k positions ahead.
        One call runs every parameter of the depth (ZeRO-3 gathers them around it)."""
        h = self.block(self.proj(torch.cat([self.hidden_norm(h_bsh), self.embed_norm(e_bsh)], dim=-1)))
        return h, self.norm(h)

    def add_tally(self, weighted: torch.Tensor, plain: torch.Tensor, counted: torch.Tensor) -> None:
        row = torch.stack([weighted.detach().double(), plain.detach().double(), counted.double()])
        self.tally = row if self.tally is None else self.tally + row

    def take_tally(self, device) -> torch.Tensor:
        row = self.tally if self.tally is not None else torch.zeros(3, dtype=torch.float64, device=device)
        self.tally = None
        return row.to(device)


def depth_targets(targets_bs: torch.Tensor, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For k = 1 .. `depth`: (token ids depth k embeds, its targets), both (b, s), from the main targets
    (module text): targets across a document boundary, past the row's end or of padding are IGNORE_INDEX."""
    rows = targets_bs.shape[0]
    counted = targets_bs != IGNORE_INDEX
    out = []
    for k in range(1, depth + 1):
        pad = targets_bs.new_full((rows, k), IGNORE_INDEX)
        embedded = torch.cat([targets_bs[:, k - 1:], pad[:, :k - 1]], dim=1)
        ahead = torch.cat([targets_bs[:, k:], pad], dim=1)
        counted = counted & (ahead != IGNORE_INDEX)
        out.append((embedded.masked_fill(embedded == IGNORE_INDEX, 0), ahead.masked_fill(~counted, IGNORE_INDEX)))
    return out


def mtp_loss(depths: nn.ModuleList, embed: nn.Module, head: Head, loss: Loss, x_bsh: torch.Tensor,
             targets_bs: torch.Tensor, weight: float, chunk: int = 0) -> torch.Tensor | None:
    """weight / D * sum_k L_k (summed over tokens, fp32, 0-dim) of the depths on the last block's output
    `x_bsh`; `embed(tokens, positions=False)` is the shared token embedding. None where the depths do not
    run (no depths, evaluation, no gradient wanted)."""
    if not len(depths) or not torch.is_grad_enabled() or is_evaluating():
        return None
    total, h = None, x_bsh
    scale = weight / len(depths)
    seq = targets_bs.shape[1]
    for k, (depth, (tokens, targets)) in enumerate(zip(depths, depth_targets(targets_bs, len(depths))), start=1):
        h, normed = depth(h, embed(tokens, positions=False))
        if normed.shape[1] == seq:  # the last k positions have no target: head and loss skip them
            normed, targets = normed[:, :seq - k], targets[:, :seq - k]
        plain = head_loss(head, loss, normed, targets, chunk)
        weighted = scale * plain
        if not is_recomputing():
            depth.add_tally(weighted, plain, (targets != IGNORE_INDEX).sum())
        total = weighted if total is None else total + weighted
    return total


def mtp_tally(module: nn.Module, device, depth: int = 0) -> torch.Tensor | None:
    """This rank's multi-token prediction figures since the last call, (D, 3) float64 per depth: the
    weighted summed loss (as added to the loss), the plain summed cross-entropy, the counted targets;
    zeros on a pipeline rank without the depths (they live on the last stage) of a model of `depth`
    depths; None for a model without depths. The caller sums the table over the pipeline, batch and
    sequence axes (pp, dp, cp; every tp rank holds the whole loss) and reads it with `mtp_figures`."""
    depths = [m for m in module.modules() if isinstance(m, MTPDepth)]
    if depths:
        return torch.stack([d.take_tally(device) for d in depths])
    return torch.zeros(depth, 3, dtype=torch.float64, device=device) if depth else None


def mtp_figures(table: torch.Tensor, tokens: float | torch.Tensor) -> dict:
    """The metrics of a global `mtp_tally` table: `mtp_loss`, the weighted losses the logged loss
    includes, per token of the main loss's count `tokens`; `mtp_ce`, each depth's mean cross-entropy
    over its own counted targets."""
    weighted, plain, counted = table.double().cpu().unbind(1)
    return {"mtp_loss": float(weighted.sum()) / max(float(tokens), 1.0),
            "mtp_ce": [float(p) / max(float(c), 1.0) for p, c in zip(plain, counted)]}
