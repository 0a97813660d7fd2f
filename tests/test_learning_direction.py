"""The direction of learning through the real parts: two samples of one task drawn from the
tiny model on vLLM, one rewarded and one not, go through the buffer (PostgreSQL); one trainer
step raises the rewarded sample's sequence log-probability and lowers the other's, and the
vLLM server, reloaded with the published weights, computes the same log-probabilities as the
trainer."""

from __future__ import annotations

import contextlib

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import torch

from tests.conftest import require_torchtitan

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_torchtitan()

PROMPT = list(range(300, 340))
# vLLM and the trainer compute the same float32 model with other kernels: per-token logprobs
# agree to what test_trainer_e2e and test_inference_vllm hold them to.
PER_TOKEN = 1e-3


def server_logprobs(url: str, prompt: list[int], output: list[int]) -> list[float]:
    """The server's log-probability of each token of `output` after `prompt` (prompt_logprobs)."""
    body = {"model": "tiny", "prompt": prompt + output, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status().json()["choices"][0]
    scored = choice["prompt_logprobs"][len(prompt):]
    return [float(entry[str(tok)]["logprob"]) for entry, tok in zip(scored, output)]


def trainer_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    from trainer.loss import token_logprobs
    from trainer.model import forward_logits

    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        logits = forward_logits(model, ids[:-1], torch.arange(len(ids) - 1), torch.zeros(len(ids) - 1, dtype=torch.long))
        lp, _ = token_logprobs(logits, ids[1:])
    return lp[len(prompt) - 1:].tolist()


@contextlib.asynccontextmanager
async def fresh_engine(vllm_fleet, pg_url: str):
    """An engine on the emptied test database, the fleet's dense model and its server; the
    server is put back to version 0 afterwards (the session shares it)."""
    from service.fleet.client import FleetConfig, VLLMClient
    from service.store import db
    from tests.conftest import _truncate_pg

    model_dir, url = vllm_fleet.models["dense"], vllm_fleet.url("dense-a")
    _truncate_pg(pg_url)
    engine = db.make_async_engine(pg_url)
    try:
        yield engine, model_dir, url
    finally:
        await engine.dispose()
        async with VLLMClient(FleetConfig(endpoints=[url])) as fleet:
            assert await fleet.reload(str(model_dir), version=0) == [url]


async def two_samples_stored(engine, url: str, seeds: tuple[int, int], rewards: tuple[float, float],
                             calls: tuple[dict | None, dict | None] = (None, None)):
    """Two samples of PROMPT drawn from the server at `url`, stored through the buffer as the two
    episodes of one group of a new run (one turn each, with `calls` as their tool calls) and
    finished with `rewards`. Returns the run's id and the samples."""
    from service.fleet.client import FleetConfig, SamplingParams, VLLMClient
    from service.store.buffer import Buffer
    from service.store.records import TurnRecord
    from service.store.tables import Episode, Group
    from tests.test_orchestrator import make_run

    async with VLLMClient(FleetConfig(endpoints=[url])) as fleet:
        samples = [await fleet.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=s)) for s in seeds]
    run_id = await make_run(engine, sampler="oracle", samples_per_task=2)
    buffer = Buffer(engine)
    async with engine.connect() as conn:
        group_id = await conn.scalar(sa.select(Group.id).where(Group.run_id == run_id).order_by(Group.id).limit(1))
        episodes = (await conn.execute(sa.select(Episode.id).where(Episode.group_id == group_id)
                                       .order_by(Episode.sample_index))).scalars().all()
    for episode_id, gen, reward, call in zip(episodes, samples, rewards, calls):
        await buffer.append_turn(episode_id, TurnRecord(
            idx=0, segment=0, input_ids=np.array(PROMPT), output_ids=np.array(gen.output_ids),
            output_logprobs=np.array(gen.output_logprobs, dtype=np.float32), policy_version=0,
            policy_version_end=0, finish_reason=gen.finish_reason, text="", tool_call=call, observation="",
            generation_s=0.0, tool_s=0.0))
        await buffer.finish_episode(episode_id, status="submitted", reward=reward, n_turns=1,
                                    policy_version_min=0, policy_version_max=0)
    return run_id, samples


async def test_one_step_raises_the_rewarded_sample_and_lowers_the_other(vllm_fleet, migrated_pg_url, tmp_path):
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    async with fresh_engine(vllm_fleet, migrated_pg_url) as (engine, model_dir, url):
        run_id, samples = await two_samples_stored(engine, url, (11, 12), (1.0, 0.0))
        assert samples[0].output_ids != samples[1].output_ids

        cfg = TrainerConfig(name="direction", model=model_dir, out_dir=tmp_path, endpoints=[url], served_model="tiny",
                            run_id=run_id, steps=1, groups_per_step=1, optim={"lr": 1e-3, "grad_clip": None},
                            data={"seq_len": 128}, wait_s=30)
        trainer = Trainer(cfg, engine)
        outputs = [s.output_ids for s in samples]
        before = [sum(trainer_logprobs(trainer.model, PROMPT, o)) for o in outputs]
        # the trainer's weights are the server's before the step: both score the samples alike
        for o, total in zip(outputs, before):
            assert abs(sum(server_logprobs(url, PROMPT, o)) - total) < PER_TOKEN * len(o)
        history = await trainer.run()
        assert [m["step"] for m in history] == [1] and history[0]["reloaded"] == [url]
        assert history[0]["advantage_mean"] == pytest.approx(0.0) and history[0]["episodes"] == 2
        after = [sum(trainer_logprobs(trainer.model, PROMPT, o)) for o in outputs]
        assert after[0] > before[0], (before, after)  # the rewarded sample became more likely
        assert after[1] < before[1], (before, after)  # the unrewarded one less
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "1"
        for o in outputs:  # and the reloaded server says the same, token by token
            served, trained = server_logprobs(url, PROMPT, o), trainer_logprobs(trainer.model, PROMPT, o)
            assert max(abs(a - b) for a, b in zip(served, trained)) < PER_TOKEN


async def test_a_malformed_turn_is_pushed_down_beside_a_rewarded_sample(vllm_fleet, migrated_pg_url, tmp_path):
    """A rewarded sample with a well-formed tool call and an unrewarded one without: with
    positive-advantage updates and skip_zero the unrewarded sample has nothing to teach, but with
    malformed_advantage its malformed turn trains, pushed down, while the rewarded one rises."""
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    async with fresh_engine(vllm_fleet, migrated_pg_url) as (engine, model_dir, url):  # the second sample: no call
        run_id, samples = await two_samples_stored(engine, url, (21, 22), (1.0, 0.0),
                                                   ({"name": "submit", "arguments": {}}, None))

        cfg = TrainerConfig(name="malformed", model=model_dir, out_dir=tmp_path, endpoints=[url], served_model="tiny",
                            run_id=run_id, steps=1, groups_per_step=1, optim={"lr": 1e-3, "grad_clip": None},
                            data={"seq_len": 128, "negative_scale": 0.0, "skip_zero": True,
                                  "malformed_advantage": 0.5}, wait_s=30)
        trainer = Trainer(cfg, engine)
        outputs = [s.output_ids for s in samples]
        before = [sum(trainer_logprobs(trainer.model, PROMPT, o)) for o in outputs]
        history = await trainer.run()
        assert (history[0]["episodes"], history[0]["skipped_episodes"], history[0]["malformed_turns"]) == (2, 0, 1)
        assert history[0]["sampled_tokens"] == sum(len(o) for o in outputs)
        after = [sum(trainer_logprobs(trainer.model, PROMPT, o)) for o in outputs]
        assert after[0] > before[0], (before, after)  # the rewarded sample rose
        assert after[1] < before[1], (before, after)  # the malformed one, of advantage 0 otherwise, fell
