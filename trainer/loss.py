"""Token-level importance-sampled policy gradient against the inference logprobs.

For every sampled token t (loss mask), with the trainer's log-probability `logp` (with
gradient), the sampler's `logp_inf` and the sequence's advantage A:

    r = exp(logp - logp_inf)                      importance ratio, trainer over sampler
    kept = low <= r <= high                       tokens outside the trust region are masked
    w = min(r, clamp) (no gradient)               truncated importance weight (clamp optional)
    loss_t = -w * A * s + kl_coef * (logp - logp_inf)^2

where s = logp - stopgrad(logp) + 1 is 1 in value and d logp in gradient, so loss_t's value is
the weighted advantage and its gradient is the IS policy gradient. Normalisation: "token" sums
over kept tokens and divides by all sampled tokens of the batch; "sequence" does that per
sequence, then averages sequences; "batch" divides the sum by every token the step's groups
sampled, the samples left out of the batch included (the trainer passes that count as
total_tokens). Masked tokens count in the denominator (they are dropped,
not re-weighted), so masking shrinks the step instead of amplifying the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ratio_low: float = Field(0.5, ge=0)
    """Tokens with r below this are masked (trust region)."""
    ratio_high: float = Field(2.0, gt=0)
    """Tokens with r above this are masked (trust region)."""
    clamp: float | None = Field(None, gt=0)
    """Truncate the importance weight at this value (None: no truncation)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the log(r)^2 penalty."""
    normalize: Literal["token", "sequence", "batch"] = "token"
    """"token": the mean over the batch's sampled tokens; "sequence": over its sequences' means;
    "batch": the sum over the batch's tokens divided by all the tokens its groups sampled,
    those of samples not trained on included (zero advantage under DataConfig.skip_zero, groups
    without a reward spread): a step whose groups teach little moves the policy little, where
    "token" scales one useful group's gradient as large as sixteen's (Dr. GRPO's fixed
    normaliser, in the step's own tokens)."""

    @model_validator(mode="after")
    def _region(self) -> LossConfig:
        if self.ratio_low >= self.ratio_high:
            raise ValueError(f"ratio_low ({self.ratio_low}) must be below ratio_high ({self.ratio_high})")
        return self


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def policy_loss(logp: torch.Tensor, logp_inf: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: LossConfig, seq_ids: torch.Tensor | None = None, *, total_tokens: int | None = None,
                total_sequences: int | None = None) -> LossOutput:  # fmt: skip
    """All inputs are per token with the same shape (any); `mask` marks sampled tokens;
    `seq_ids` (same shape, int) says which sequence each token belongs to (needed for
    normalize="sequence"; -1 for tokens of none). When a batch is split into several calls
    (micro-batches whose gradients accumulate), give the whole batch's sampled tokens and
    sequences as total_tokens / total_sequences so the sum of the calls is the batch's loss."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logp - logp_inf, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    kept = mask & (ratio >= cfg.ratio_low) & (ratio <= cfg.ratio_high)
    weight = ratio.detach()
    if cfg.clamp is not None:
        weight = weight.clamp(max=cfg.clamp)
    surrogate = logp - logp.detach() + 1.0
    per_token = -weight * advantages * surrogate + cfg.kl_coef * log_ratio**2
    per_token = torch.where(kept, per_token, torch.zeros_like(per_token))
    n_sampled = mask.sum()
    if cfg.normalize in ("token", "batch"):
        loss = per_token.sum() / (total_tokens if total_tokens else n_sampled.clamp(min=1))
    else:
        if seq_ids is None:
            raise ValueError("normalize='sequence' needs seq_ids")
        ids = torch.where(mask, seq_ids, torch.full_like(seq_ids, -1)).flatten()
        valid = ids >= 0
        uniq, inverse = torch.unique(ids[valid], return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=per_token.dtype).index_add(0, inverse, per_token.flatten()[valid])
        counts = torch.zeros(len(uniq), dtype=per_token.dtype).index_add(
            0, inverse, torch.ones_like(per_token.flatten()[valid]))
        n_seqs = total_sequences if total_sequences else max(len(uniq), 1)
        loss = (sums / counts.clamp(min=1)).sum() / n_seqs
    with torch.no_grad():
        n = max(int(n_sampled), 1)
        k3 = torch.where(mask, ratio - 1 - log_ratio, torch.zeros_like(ratio))  # KL(sampler || trainer)
        metrics = {
            "mismatch_kl": float(k3.sum() / n),
            "masked_fraction": float(1 - kept.sum() / n) if int(n_sampled) else 0.0,
            "ratio_mean": float(torch.where(mask, ratio, torch.zeros_like(ratio)).sum() / n),
            "ratio_max": float(ratio[mask].max()) if int(n_sampled) else 1.0,
            "sampled_tokens": int(n_sampled),
        }
    return LossOutput(loss, metrics)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   entropy_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of each position's distribution, in float32. The entropy is
    a metric (no gradient), taken only where `entropy_at` (bool, the shape of targets) is true,
    0 elsewhere (None: everywhere), a few rows at a time: over [L, vocab] at once it cost as
    much as the log-softmax."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        flat = logprobs.detach().reshape(-1, logprobs.shape[-1])
        entropy = torch.zeros(flat.shape[0], dtype=flat.dtype, device=flat.device)
        rows = (torch.arange(flat.shape[0], device=flat.device) if entropy_at is None
                else entropy_at.reshape(-1).nonzero().flatten())
        step = max(1, ENTROPY_CHUNK // max(flat.shape[1], 1))
        for s in range(0, len(rows), step):
            at = rows[s:s + step]
            lp = flat.index_select(0, at)
            entropy[at] = -(lp.exp() * lp).sum(-1)
    return picked, entropy.reshape(picked.shape)


ENTROPY_CHUNK = 1 << 18
"""Elements of [rows, vocab] log-probabilities the entropy reads at a time (1 MB in float32)."""
