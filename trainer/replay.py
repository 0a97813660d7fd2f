"""Router replay (R3): the trainer's MoE layers route each token to the experts the sampler
chose for it (recorded per token and layer by vLLM), and compute the gate weights from the
trainer's own router scores at those experts, so the router still gets gradients.

torchtitan has no replay: `enable(model)` turns every `TokenChoiceTopKRouter` of a model into a
`ReplayRouter` (same parameters, same forward when nothing is set to replay); `replaying(model,
ids)` is a context manager that routes a forward pass by `ids` [tokens, layers, top_k].
`recording(model)` captures the routing a forward pass chose, in the same layout.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def _routers(model) -> list:
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    out = []
    for layer in model.layers.values():
        moe = getattr(layer, "moe", None)
        if moe is not None and isinstance(moe.router, TokenChoiceTopKRouter):
            out.append(moe.router)
    return out


class ReplayRouterMixin:
    replay_ids: torch.Tensor | None = None  # [B, L, K]
    recorded: torch.Tensor | None = None

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        if self.replay_ids is None:
            scores, ids, full = super().forward(x_BLD, expert_bias_E)
            if self.record:
                self.recorded = ids.detach().clone()
            return scores, ids, full
        with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
            scores_BLE = self.gate(x_BLD)
        scores_BLE = torch.sigmoid(scores_BLE) if self.score_func == "sigmoid" else F.softmax(scores_BLE, dim=-1)
        ids = self.replay_ids.to(device=scores_BLE.device, dtype=torch.int64).contiguous()
        if ids.shape[:2] != scores_BLE.shape[:2] or ids.shape[-1] != self.top_k:
            raise ValueError(f"replayed expert ids {tuple(ids.shape)} do not fit the router: "
                             f"tokens {tuple(scores_BLE.shape[:2])}, top_k {self.top_k}")
        if self.record:
            self.recorded = ids.detach().clone()
        topk = scores_BLE.gather(dim=-1, index=ids)  # the trainer's own scores: gradients reach the gate
        if self.route_norm:
            topk = topk / (topk.sum(dim=-1, keepdim=True) + 1e-20)
        return topk * self.route_scale, ids, scores_BLE

    record: bool = False


def enable(model) -> int:
    """Make the model's routers replay-capable; returns how many MoE layers there are."""
    routers = _routers(model)
    for router in routers:
        if not isinstance(router, ReplayRouterMixin):
            router.__class__ = type(f"Replay{type(router).__name__}", (ReplayRouterMixin, type(router)), {})
    return len(routers)


@contextmanager
def replaying(model, ids):
    """Route this forward pass by ids [tokens, layers, top_k] (numpy or torch, batch of one), or
    [batch, tokens, layers, top_k] for a batch."""
    routers = _routers(model)
    ids = torch.as_tensor(ids)
    if ids.ndim == 3:
        ids = ids.unsqueeze(0)
    if ids.ndim != 4 or ids.shape[2] != len(routers):
        raise ValueError(f"routed experts {tuple(ids.shape)}: expected [tokens, {len(routers)} layers, top_k] "
                         f"or [batch, tokens, {len(routers)} layers, top_k]")
    enable(model)
    try:
        for i, router in enumerate(routers):
            router.replay_ids = ids[:, :, i, :].contiguous()
        yield
    finally:
        for router in routers:
            router.replay_ids = None


@contextmanager
def recording(model):
    """Capture the expert ids a forward pass chooses: yields a list that holds, after the pass,
    one [tokens, layers, top_k] tensor (batch of one)."""
    routers = _routers(model)
    enable(model)
    out: list[torch.Tensor] = []
    for router in routers:
        router.record, router.recorded = True, None
    try:
        yield out
        out.append(torch.stack([r.recorded[0] for r in routers], dim=1))
    finally:
        for router in routers:
            router.record, router.recorded = False, None
