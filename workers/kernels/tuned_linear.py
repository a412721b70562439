"""The model's linears on the plan's backends: `TunedLinear`, an nn.Linear (the same weight and
bias parameters) that dispatches each call on its number of rows, installed and removed here.

    install_tuned_linears(model, plan)     # nn.Linear -> TunedLinear (same parameters)
    remove_tuned_linears(model)            # back to plain nn.Linear: the reference everywhere

A packed weight is a copy: install after the weights are loaded (the runner does). Installing
puts the CPU weights and their packed copies on huge pages (`huge_pages`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.huge_pages import on_huge_pages
from workers.kernels.linear_backends import BoundLinear, LinearBackend, Packed, bind, pack_for
from workers.kernels.linear_plan import LinearKey, LinearPlan, LinearTuning


class TunedLinear(nn.Linear):
    """An nn.Linear (the same weight and bias parameters) that runs each call on its plan's
    backend for that many rows."""

    def __init__(self, linear: nn.Linear, choices: tuple[LinearBackend, ...], tuning: LinearTuning):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.tuning, self.choices = tuning, choices
        packed = [b for b in dict.fromkeys(choices) if b.packed]
        self.packs: dict[LinearBackend, Packed] = {b: pack_for(b, self.weight) for b in packed}
        self.bound = self._bind()

    def _bind(self) -> tuple[BoundLinear, ...]:
        """Per bucket, the backend's function and its arguments after x (`linear_backends.bind`)."""
        return tuple(bind(b, self.weight, self.packs.get(b), self.bias, self.out_features) for b in self.choices)

    def streamed(self) -> list[torch.Tensor]:
        """The dense tensors a call may stream: the weight and the packed copies (oneDNN's
        opaque ones excepted), in the order `adopt` takes their replacements."""
        found = [self.weight.data]

        def collect(t: torch.Tensor) -> torch.Tensor:
            found.append(t)
            return t

        for pack in self.packs.values():
            _map_dense(pack, collect)
        return found

    def adopt(self, copies: Iterator[torch.Tensor]) -> None:
        """Use `copies` (equal values, `streamed` order) in place of the streamed tensors."""
        self.weight.data = next(copies)  # the same Parameter: the reference path shares it
        self.packs = {b: _map_dense(pack, lambda _: next(copies)) for b, pack in self.packs.items()}
        self.bound = self._bind()

    def backend_for(self, rows: int) -> LinearBackend:
        return self.choices[self.tuning.bucket_index(rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not rows:
            return F.linear(x, self.weight, self.bias)
        fn, args = self.bound[self.tuning.bucket_index(rows)]
        return fn(x, *args)


def _map_dense(pack: Packed, fn: Callable[[torch.Tensor], torch.Tensor]) -> Packed:
    """`pack` with each dense tensor t, in order, replaced by fn(t); oneDNN's opaque ones kept.
    The one walk `TunedLinear.streamed` and `adopt` share, so their orders cannot drift apart."""
    if isinstance(pack, tuple):
        return tuple(_map_dense(t, fn) for t in pack)
    return fn(pack) if pack.layout == torch.strided else pack


def install_tuned_linears(model: nn.Module, plan: LinearPlan) -> None:
    """Replace every linear of the model by a TunedLinear following the plan (weights shared),
    and put the CPU ones' weights and packed copies on huge pages (`huge_pages`)."""
    tuned = []
    for parent, name, linear in _linear_children(model):
        choices = plan.choices.get(LinearKey.of(linear), (LinearBackend.TORCH,) * len(plan.tuning.buckets))
        tuned.append(TunedLinear(linear, choices, plan.tuning))
        setattr(parent, name, tuned[-1])
    on_cpu = [t for t in tuned if t.weight.device.type == "cpu"]
    copies = iter(on_huge_pages([tensor for t in on_cpu for tensor in t.streamed()]))
    for t in on_cpu:
        t.adopt(copies)


def remove_tuned_linears(model: nn.Module) -> None:
    """Put plain nn.Linear modules back (the same parameters): the reference path."""
    for parent, name, linear in _linear_children(model):
        if isinstance(linear, TunedLinear):
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = linear.in_features, linear.out_features
            plain.weight, plain.bias = linear.weight, linear.bias
            setattr(parent, name, plain)


def _linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
