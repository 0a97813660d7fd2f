"""Each term of the policy loss against a direct formula on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import LossConfig, policy_loss, token_logprobs


def make(seed: int = 0, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(2, n, generator=g) * 2).requires_grad_()
    logp_inf = logp.detach() + (torch.rand(2, n, generator=g) - 0.5) * 1.6  # ratios in about [0.45, 2.2]
    adv = torch.tensor([[0.7] * n, [-1.3] * n])
    mask = torch.rand(2, n, generator=g) > 0.3
    seq_ids = torch.tensor([[0] * n, [1] * n])
    return logp, logp_inf, adv, mask, seq_ids


def direct(logp, logp_inf, adv, mask, cfg: LossConfig, seq_ids):
    """The formula of trainer/loss.py's docstring, token by token in Python floats."""
    terms: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    grads = torch.zeros_like(logp)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            sid = int(seq_ids[b, t])
            counts[sid] = counts.get(sid, 0) + 1
            lr = float(logp[b, t] - logp_inf[b, t])
            r = math.exp(lr)
            if not (cfg.ratio_low <= r <= cfg.ratio_high):
                terms.setdefault(sid, [])
                continue
            w = min(r, cfg.clamp) if cfg.clamp is not None else r
            terms.setdefault(sid, []).append(-w * float(adv[b, t]) + cfg.kl_coef * lr * lr)
            grads[b, t] = -w * float(adv[b, t]) + 2 * cfg.kl_coef * lr
    n = sum(counts.values())
    if cfg.normalize == "token":
        loss = sum(sum(v) for v in terms.values()) / n
        grads = grads / n
    else:
        loss = sum(sum(terms.get(s, [])) / c for s, c in counts.items()) / len(counts)
        for b in range(logp.shape[0]):
            for t in range(logp.shape[1]):
                sid = int(seq_ids[b, t])
                if mask[b, t]:
                    grads[b, t] = grads[b, t] / counts[sid] / len(counts)
    return loss, grads


@pytest.mark.parametrize("cfg", [
    LossConfig(),  # trust-region mask only
    LossConfig(ratio_low=0.0, ratio_high=100.0),  # nothing masked: plain IS policy gradient
    LossConfig(clamp=1.2),  # truncated importance weights
    LossConfig(kl_coef=0.3),  # log(r)^2 penalty
    LossConfig(normalize="sequence", clamp=1.5, kl_coef=0.1),
], ids=["mask", "plain", "clamp", "kl", "per-sequence"])
def test_loss_and_gradient_match_the_formula(cfg):
    logp, logp_inf, adv, mask, seq_ids = make()
    out = policy_loss(logp, logp_inf, adv, mask, cfg, seq_ids)
    out.loss.backward()
    expected, grads = direct(logp.detach(), logp_inf, adv, mask, cfg, seq_ids)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logp.grad, grads.float(), rtol=1e-5, atol=1e-7)


def test_batch_normalisation_divides_by_every_token_the_groups_sampled():
    """"batch": the token sum over the step's whole sample count, untrained samples included, so
    half the samples teaching gives half the step "token" would; alone it is "token"."""
    logp, logp_inf, adv, mask, seq_ids = make(2)
    token = policy_loss(logp, logp_inf, adv, mask, LossConfig(), seq_ids)
    token.loss.backward()
    token_grad, logp.grad = logp.grad.clone(), None
    n = int(mask.sum())
    out = policy_loss(logp, logp_inf, adv, mask, LossConfig(normalize="batch"), seq_ids, total_tokens=2 * n)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(token.loss.item() / 2, rel=1e-6)
    torch.testing.assert_close(logp.grad, token_grad / 2)
    alone = policy_loss(logp, logp_inf, adv, mask, LossConfig(normalize="batch"), seq_ids)
    assert alone.loss.item() == pytest.approx(token.loss.item(), rel=1e-6)


def test_metrics():
    logp, logp_inf, adv, mask, seq_ids = make(1)
    out = policy_loss(logp, logp_inf, adv, mask, LossConfig(ratio_low=0.8, ratio_high=1.25), seq_ids)
    lr = (logp - logp_inf).detach()[mask]
    r = lr.exp()
    assert out.metrics["sampled_tokens"] == int(mask.sum())
    assert out.metrics["mismatch_kl"] == pytest.approx(float((r - 1 - lr).mean()), rel=1e-5)
    assert out.metrics["masked_fraction"] == pytest.approx(float(((r < 0.8) | (r > 1.25)).float().mean()), rel=1e-6)
    assert 0 < out.metrics["masked_fraction"] < 1


def test_on_policy_tokens_have_no_mismatch_and_the_vanilla_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]])).requires_grad_()
    out = policy_loss(logp, logp.detach(), torch.tensor([[2.0, 2.0, 2.0]]), torch.ones(1, 3, dtype=bool), LossConfig())
    out.loss.backward()
    assert out.metrics["mismatch_kl"] == 0 and out.metrics["masked_fraction"] == 0
    assert out.loss.item() == pytest.approx(-2.0)
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2.0 / 3))


def test_bad_region_is_refused():
    with pytest.raises(ValueError, match="ratio_low"):
        LossConfig(ratio_low=2.0, ratio_high=1.0)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    picked, entropy = token_logprobs(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(picked, torch.log(torch.tensor([[0.5, 0.75]])))
    torch.testing.assert_close(entropy[0, 0], torch.tensor(math.log(2.0)))
