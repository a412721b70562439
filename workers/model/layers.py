"""Small building blocks shared by the three families: norms, MLPs, rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.fast_path import REFERENCE, FastPath
from workers.model.config import MlpKind


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fast: FastPath = REFERENCE  # fast.decode: the fused CPU kernels (fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast.decode is not None and x.dtype == torch.float32:
            return self.fast.decode.rms_norm(x, self.weight, None, x.shape[-1], self.eps)
        # One fused op in fp32, then the weight (as the reference: normalise, cast, scale).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def residual(self, h: torch.Tensor, delta: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `h + alpha * delta` and this norm of it. The fused kernel adds in
        place (the forward owns `h`: the embedding's output or an earlier sum) and normalises
        in the same pass over the row."""
        if self.fast.decode is not None and h.dtype == delta.dtype == torch.float32 and h.dim() == 2:
            return h, self.fast.decode.add_rms_norm(h, delta, alpha, self.weight, self.eps)
        h = h + delta if alpha == 1.0 else torch.add(h, delta, alpha=alpha)  # h + alpha * delta in one op
        return h, self(h)


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm over groups of channels of `x * silu(gate)` (Mamba2's output norm)."""

    def __init__(self, size: int, n_groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = size // n_groups
        self.eps = eps
        self.fast: FastPath = REFERENCE  # fast.scan / fast.decode: the fused CPU kernels (fp32)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fast.scan is not None and x.dtype == gate.dtype == torch.float32:  # gate read in place
            return self.fast.scan.gated_rms_norm(x, gate, self.weight.detach(), self.group_size, self.eps)
        if self.fast.decode is not None and x.dtype == gate.dtype == torch.float32:
            return self.fast.decode.rms_norm(x, self.weight, gate, self.group_size, self.eps)
        x32 = x.float() * F.silu(gate.float())
        grouped = F.rms_norm(x32.view(*x32.shape[:-1], -1, self.group_size), (self.group_size,), eps=self.eps)
        return self.weight * grouped.view(x32.shape).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU (Bamba, Granite) or squared-ReLU (Nemotron-H) feed-forward.

    SwiGLU keeps gate and up in one matrix so a single matmul serves both; on the fast path either
    activation is one C++ pass over that matmul's rows (`mlp_activation` in csrc/decode_kernels.cpp,
    at every row count).
    """

    def __init__(self, kind: MlpKind, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.kind = kind
        self.intermediate = intermediate
        up_rows = 2 * intermediate if kind is MlpKind.SWIGLU else intermediate
        self.up = nn.Linear(hidden, up_rows, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)
        self.fast: FastPath = REFERENCE  # fast.decode: the activation in one kernel (fp32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast.decode is not None and x.dtype == torch.float32:
            # silu(gate) * up, or relu(x)^2 in place on the up projection's fresh output
            return self.down(self.fast.decode.mlp_activation(self.up(x), self.kind is MlpKind.SWIGLU))
        if self.kind is MlpKind.SWIGLU:
            gate, up = self.up(x).split(self.intermediate, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(torch.square(F.relu(self.up(x))))


class RotaryEmbedding:
    """cos/sin tables for (partial) RoPE, computed once per forward for all layers."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        # Built on the CPU explicitly: the model may be constructed under the meta device.
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of x [tokens, heads, head_dim]; the rest pass."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
