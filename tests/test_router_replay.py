"""Router replay (R3) on the tiny Qwen3-MoE in torchtitan (vLLM on CPU cannot return routed
experts, so the ids are recorded from the model itself)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import require_torchtitan  # noqa: E402

require_torchtitan()

from service.fleet.tiny_model import TinyModelSpec, init_tiny
from trainer.model import build_model
from trainer.replay import recording, replaying


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("moe") / "moe", TinyModelSpec(moe=True))


def tokens(n: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2000, (1, n), generator=torch.Generator().manual_seed(seed))


def test_replaying_its_own_choices_reproduces_the_logits_exactly(moe_dir):
    model, _, _ = build_model(moe_dir)
    ids = tokens()
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad(), recording(model) as rec:
        free = model(ids, pos)
    (chosen,) = rec
    assert chosen.shape == (256, 2, 2)
    with torch.no_grad(), replaying(model, chosen):
        replayed = model(ids, pos)
    assert torch.equal(free, replayed)


def test_replaying_other_ids_sends_tokens_where_told_and_trains_the_router(moe_dir):
    model, _, _ = build_model(moe_dir)
    model.train()
    ids = tokens(64)
    pos = torch.arange(64)[None]
    # layer 0: token e to experts (e, e+3) mod 8; layer 1: everything to experts 6 and 7
    forced = torch.stack([torch.tensor([[e % 8, (e + 3) % 8], [6, 7]]) for e in range(64)])
    for layer in model.layers.values():
        layer.moe.tokens_per_expert_E.zero_()
    with replaying(model, forced):
        out = model(ids, pos)
    loads = [model.layers[str(i)].moe.tokens_per_expert_E.tolist() for i in range(2)]
    assert loads[0] == [16] * 8 and loads[1] == [0] * 6 + [64, 64]  # the load is what was given
    out.float().logsumexp(-1).mean().backward()
    for layer in model.layers.values():  # the gate weights come from the router's own scores
        assert layer.moe.router.gate.weight.grad is not None and layer.moe.router.gate.weight.grad.abs().sum() > 0
    with torch.no_grad(), recording(model) as free:
        model(ids, pos)
    assert not torch.equal(free[0], forced)  # left to itself the router chooses otherwise


def test_bad_replay_shape_is_named(moe_dir):
    model, _, _ = build_model(moe_dir)
    with pytest.raises(ValueError, match="layers"):
        with replaying(model, torch.zeros(4, 5, 2, dtype=torch.long)):
            pass


def test_replay_lowers_the_mismatch_between_bf16_trainer_and_fp32_sampler(moe_dir):
    """The sampler (fp32) records its routing and logprobs; a trainer whose weights are the same
    rounded to bf16 routes some tokens differently; replaying the sampler's choices brings its
    logprobs closer (lower KL(sampler || trainer))."""
    sampler, _, _ = build_model(moe_dir)
    trainer, _, _ = build_model(moe_dir)
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    ids = tokens(1024, seed=3)
    pos = torch.arange(1024)[None]
    target = ids[0, 1:]

    def logp(logits):
        return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, target[:, None])[:, 0]

    with torch.no_grad():
        with recording(sampler) as rec:
            lp_sampler = logp(sampler(ids, pos))
        with recording(trainer) as trainer_rec:
            lp_free = logp(trainer(ids, pos))
        with replaying(trainer, rec[0]):
            lp_replay = logp(trainer(ids, pos))

    def kl(lp):  # k3 estimator on the sampler's tokens
        r = torch.exp(lp - lp_sampler)
        return float((r - 1 - (lp - lp_sampler)).mean())

    flipped = (trainer_rec[0].sort(-1).values != rec[0].sort(-1).values).any(-1).any(-1).sum()
    assert flipped > 0, "bf16 rounding changed no routing decision: the comparison would be empty"
    assert kl(lp_replay) < kl(lp_free)
