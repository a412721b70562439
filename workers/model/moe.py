"""Mixture of experts: a router picks top_k experts per token; their outputs, weighted by the
routing weights, are added to a shared expert's output (computed on every token).

    Granite 4.0-H (SOFTMAX_TOPK):        logits = x W_r^T;  top_k of logits;  w = softmax(those k)
    Nemotron-H (SIGMOID_GROUPED):        s = sigmoid(x W_r^T);  choice = s + bias
                                         groups ranked by the sum of their top-2 choices, topk_group kept,
                                         top_k experts of choice among them;  w = s[chosen]
                                         [/ sum(w)] * scaling

An expert is an MLP of the model's kind (SwiGLU for Granite, squared ReLU for Nemotron-H),
its weights stacked over experts as in transformers ([E, up_rows, hidden], [E, hidden, I]).
Each expert runs on the tokens routed to it (a loop over the experts hit); the router runs
in fp32, as transformers' does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import MlpKind, MoeShape, RouterKind
from workers.model.layers import MLP


class MoE(nn.Module):
    def __init__(self, kind: MlpKind, hidden: int, shape: MoeShape, bias: bool):
        super().__init__()
        self.kind, self.shape = kind, shape
        e, i = shape.n_experts, shape.intermediate
        # Plain parameters, not nn.Linear: the router stays exact fp32 (never tuned or int8), and
        # the experts are 3-D stacks.
        self.router = nn.Parameter(torch.empty(e, hidden))
        grouped = shape.router is RouterKind.SIGMOID_GROUPED
        self.score_bias = nn.Parameter(torch.zeros(e)) if grouped else None  # e_score_correction_bias
        self.experts_up = nn.Parameter(torch.empty(e, 2 * i if kind is MlpKind.SWIGLU else i, hidden))
        self.experts_down = nn.Parameter(torch.empty(e, hidden, i))
        self.shared = MLP(kind, hidden, shape.shared_intermediate, bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert index [T, top_k]) of the tokens x [T, hidden]."""
        s = self.shape
        logits = F.linear(x.float(), self.router.float())
        if s.router is RouterKind.SOFTMAX_TOPK:
            top, index = logits.topk(s.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), index
        scores = logits.sigmoid()
        choice = scores + self.score_bias.float()
        if s.n_group > 1:
            per_group = choice.view(-1, s.n_group, s.n_experts // s.n_group)
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            groups = group_scores.topk(s.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            choice = per_group.masked_fill(~keep[:, :, None], float("-inf")).view(-1, s.n_experts)
        index = choice.topk(s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.scaling, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.route(x)
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
        for expert in index.unique().tolist():
            token, slot = torch.where(index == expert)
            y = self.expert(x[token], expert) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.to(x.dtype) + self.shared(x)

    def expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        up = F.linear(x, self.experts_up[expert])
        if self.kind is MlpKind.SWIGLU:
            gate, up = up.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.experts_down[expert])
        return F.linear(torch.square(F.relu(up)), self.experts_down[expert])
