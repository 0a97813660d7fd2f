"""The golden trainer batch: a fixed hand-made group whose one-step loss and gradient norm on the
seed-0 tiny dense model are recorded (tests/test_trainer.py on CPU, bench/trainer_gpu.py on a
GPU). Imports only what the trainer needs, so the GPU machine can load it."""

from __future__ import annotations

import uuid

import numpy as np

from service.store.buffer import EpisodeData, GroupData
from service.store.records import TurnRecord

# CPU, float32, torch 2.13, SDPA
GOLDEN = {"loss": 1.5285574197769165, "grad_norm": 3.958608865737915, "sampled_tokens": 45}
GOLDEN_CONFIG = {"data": {"seq_len": 40}, "seed": 0,
                 "loss": {"kl_coef": 0.1, "clamp": 3.0, "ratio_low": 0.0, "ratio_high": 1e9}}


def golden_group() -> GroupData:
    rng = np.random.default_rng(1234)
    episodes = []
    for i, reward in enumerate([1.0, 0.0, 0.5]):
        turns = [TurnRecord(idx=k, segment=0, input_ids=rng.integers(0, 2000, 7), output_ids=rng.integers(0, 2000, 5),
                            output_logprobs=-rng.uniform(0.5, 9.0, 5).astype(np.float32), policy_version=0)
                 for k in range(3)]
        episodes.append(EpisodeData(uuid.UUID(int=i), i, "submitted", reward, 0, turns))
    return GroupData(uuid.UUID(int=10), uuid.UUID(int=11), uuid.UUID(int=12), episodes)
