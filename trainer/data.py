"""From claimed groups to packed training rows, without re-tokenizing.

A group's episodes get group-relative advantages (reward minus the group mean, optionally
divided by the group's standard deviation); groups whose advantages are all zero teach nothing
and are filtered (and counted). Each episode segment becomes one sequence: its turns'
`input_ids + output_ids` concatenated, exactly the tokens the sampler saw, with the loss only
on sampled tokens and the sampler's logprobs beside them. Sequences are packed first-fit
decreasing into rows of `seq_len`; positions restart at every sequence so attention and RoPE
can respect document boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from service.store.records import TurnRecord


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    std_normalize: bool = False
    """Divide advantages by the group's standard deviation (GRPO) instead of only centring (Dr. GRPO)."""
    eps: float = Field(1e-6, gt=0)
    seq_len: int = Field(8192, ge=16)
    """Tokens per packed row."""
    advantage_one: bool = False
    """SFT: every sampled token gets advantage 1 (no group statistics, no filtering)."""
    negative_scale: float = Field(1.0, ge=0, le=1)
    """Scales negative advantages: 1 is the plain group baseline, 0 learns only from samples
    better than their group (positive-advantage updates, which keep a small warm-started
    policy's tool-call format stable where pushing failures down breaks it)."""
    credit_malformed: bool = True
    """False: a turn without a well-formed tool call gets no positive advantage. An episode
    graded after it ran out of turns is rewarded for its fix even when its last turns were
    garbage; with credit, those turns are reinforced with the fix and the format erodes."""
    format_weight: float = Field(0.0, ge=0, le=1)
    """Added to an episode's reward, times the share of its turns with a well-formed tool call,
    for its advantage only (the recorded reward, and the batch's reward statistics, stay the
    grade's). A group every sample of which failed then still teaches: its well-formed samples
    rise against its malformed ones (R1's format reward, here a fraction of the task's). Turns
    whose form is unknown (TurnRecord.called None) count as well formed."""
    skip_zero: bool = False
    """Episodes of a useful group whose advantage is zero are not trained on. With negative_scale 0
    those are every sample at or below its group's mean, about half of a step's: their only loss
    is the log-ratio penalty, near zero on the policy that sampled them, and their forward and
    backward passes cost as much as a taught sample's. With "token" normalisation the step's
    loss is then the mean over the taught samples' tokens."""
    malformed_advantage: float = Field(0.0, ge=0, le=1)
    """In a group with a reward spread, the sampled tokens of a turn known to lack a well-formed
    tool call (TurnRecord.called False) get the advantage -malformed_advantage in place of their
    episode's (an unlikelihood term on the broken turns only, as format penalties are in
    R1-style rewards, but on the turn rather than the episode): from the token where the turn
    broke (TurnRecord.malformed_at: the call's first bad character, or where a loop cut at
    max_tokens began repeating) to its end, its well-formed start trained as its episode's; the
    whole turn when that is not known. Positive-advantage updates never
    push a repetition loop or garbled arguments down; they shrink only as the solved samples'
    calls take probability from them. An episode trained only for its malformed turns (advantage
    zero under skip_zero) trains its first one and is cut after it: the turns after a broken call
    follow from a context the policy stops producing once it stops breaking calls, and they are
    what would cost the step most. The penalised tokens count in the step's token normalisation
    like any others. 0: off.

    Groups without a reward spread are left out as before: applied in every group (the groups
    that never solve their task then teach through their malformed turns alone), 0.2 from the
    demo's SFT checkpoint (0.322) collapsed the policy, held-out pass@1 0.064 after 21 steps
    against 0.379 without, format errors 0.192 against 0.183 (bench/RESULTS.md, 2026-12-05
    evening): with nothing solved to anchor them, the failing groups moved the policy to calls
    that stop submitting. In the groups that teach, 0.2 on the whole turn gave 0.342 and format
    errors 0.157; from the break, from seed 1's checkpoint, 0.375 and 0.096 against 0.369 and
    0.123 without (2026-12-05 night)."""


@dataclass
class Sequence:
    tokens: np.ndarray  # int64 [n]
    sampled: np.ndarray  # bool [n]: token i was sampled by the policy
    inf_logprobs: np.ndarray  # float32 [n]: the sampler's logprob of token i (0 where not sampled)
    advantage: float
    episode_id: object = None
    policy_version: int | None = None
    routed_experts: np.ndarray | None = None  # [n, layers, top_k] when every turn carries them
    advantages: np.ndarray | None = None  # float32 [n]: token i's advantage, where it is not `advantage` everywhere


@dataclass
class BatchStats:
    groups: int = 0
    zero_advantage_groups: int = 0
    episodes: int = 0
    excluded_episodes: int = 0
    skipped_episodes: int = 0  # zero advantage, not trained on (DataConfig.skip_zero)
    malformed_turns: int = 0  # turns pushed down by DataConfig.malformed_advantage
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    truncated_tokens: int = 0
    sampled_tokens: int = 0  # every sampled token of the groups' rewarded episodes, trained or not


def group_advantages(rewards: list[float], cfg: DataConfig) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if cfg.std_normalize:
        adv = adv / (r.std() + cfg.eps)
    return adv


def episode_sequences(turns: list[TurnRecord], advantage: float, episode_id=None, credit_malformed: bool = True,
                      malformed_advantage: float = 0.0, only_malformed: bool = False) -> list[Sequence]:  # fmt: skip
    """One sequence per segment (a template that rewrites history starts a new one). With
    `credit_malformed` False and a positive advantage, the sampled tokens of turns known to
    lack a well-formed tool call (TurnRecord.called False) are not trained on. With
    `malformed_advantage` above 0 those tokens, from where the turn broke (TurnRecord.malformed_at),
    are trained with advantage -malformed_advantage (DataConfig.malformed_advantage);
    `only_malformed` trains nothing else, and a segment is cut
    after its first malformed turn (one without any is left out)."""
    by_segment: dict[int, list[TurnRecord]] = {}
    for t in sorted(turns, key=lambda t: t.idx):
        by_segment.setdefault(t.segment, []).append(t)
    out = []
    for seg_turns in by_segment.values():
        penalised = [malformed_advantage > 0 and t.called is False for t in seg_turns]
        if only_malformed:
            if not any(penalised):
                continue
            seg_turns = seg_turns[:penalised.index(True) + 1]
        tokens, sampled, logprobs, experts, advantages = [], [], [], [], []
        for t, bad in zip(seg_turns, penalised):
            n_in, n_out = len(t.input_ids), len(t.output_ids)
            tokens += [np.asarray(t.input_ids, dtype=np.int64), np.asarray(t.output_ids, dtype=np.int64)]
            trained = not only_malformed and (credit_malformed or advantage <= 0 or t.called is not False)
            # a penalised turn: pushed down from where it broke (all of it when that is not known), its
            # well-formed start trained as an unpenalised malformed turn's tokens would be
            broke = (t.malformed_at if t.malformed_at is not None and 0 <= t.malformed_at < n_out else 0) if bad else n_out
            turn_sampled = np.full(n_out, trained, dtype=bool)
            turn_sampled[broke:] = True
            turn_advantages = np.full(n_out, advantage, dtype=np.float32)
            turn_advantages[broke:] = -malformed_advantage
            sampled += [np.zeros(n_in, dtype=bool), turn_sampled]
            advantages += [np.zeros(n_in, dtype=np.float32), turn_advantages]
            lp = t.output_logprobs
            if lp is None or len(lp) != n_out:
                raise ValueError(f"episode {episode_id} turn {t.idx}: {n_out} sampled tokens but "
                                 f"{0 if lp is None else len(lp)} logprobs; not trainable")
            logprobs += [np.zeros(n_in, dtype=np.float32), np.asarray(lp, dtype=np.float32)]
            experts.append(t.routed_experts)
        seq = Sequence(np.concatenate(tokens), np.concatenate(sampled), np.concatenate(logprobs), advantage,
                       episode_id, min((t.policy_version or 0) for t in seg_turns))
        if any(penalised):
            seq.advantages = np.concatenate(advantages)
        if all(e is not None for e in experts):
            seq.routed_experts = np.concatenate(experts)
            if len(seq.routed_experts) != len(seq.tokens):
                seq.routed_experts = None  # recorded for a different span: not replayable
        out.append(seq)
    return out


def well_formed_share(turns: list[TurnRecord]) -> float:
    """The share of `turns` not known to lack a well-formed tool call."""
    return sum(t.called is not False for t in turns) / len(turns) if turns else 1.0


def group_advantages_of(group, cfg: DataConfig) -> tuple[list, np.ndarray] | None:
    """The group's trainable episodes (rewarded, with turns) and their advantages; None when the
    group teaches nothing (no such episode, or every advantage zero)."""
    episodes = [e for e in group.episodes if e.reward is not None and e.turns]
    if not episodes:
        return None
    if cfg.advantage_one:
        return episodes, np.ones(len(episodes))
    rewards = [float(e.reward) + cfg.format_weight * well_formed_share(e.turns) for e in episodes]
    adv = group_advantages(rewards, cfg)
    adv = np.where(adv < 0, adv * cfg.negative_scale, adv)
    return None if np.all(np.abs(adv) < cfg.eps) else (episodes, adv)


def sequences_from_groups(groups, cfg: DataConfig) -> tuple[list[Sequence], BatchStats]:
    """`groups`: buffer.GroupData. Episodes without a reward (harness failures) are excluded."""
    stats = BatchStats()
    out: list[Sequence] = []
    for group in groups:
        stats.groups += 1
        rewarded = [e for e in group.episodes if e.reward is not None and e.turns]
        stats.excluded_episodes += len(group.episodes) - len(rewarded)
        stats.rewards += [float(e.reward) for e in rewarded]
        stats.sampled_tokens += sum(len(t.output_ids) for e in rewarded for t in e.turns)
        useful = group_advantages_of(group, cfg)
        if useful is None:
            stats.zero_advantage_groups += 1
            continue
        episodes, adv = useful
        stats.advantages += adv.tolist()
        for e, a in zip(episodes, adv):
            bad = [t for t in e.turns if t.called is False] if cfg.malformed_advantage > 0 else []
            only = abs(a) < cfg.eps and cfg.skip_zero  # nothing to learn but its malformed turns
            if only and not bad:
                stats.skipped_episodes += 1
                continue
            stats.episodes += 1
            # every malformed turn, or the first of each segment when only those train
            stats.malformed_turns += len({t.segment for t in bad}) if only else len(bad)
            out += episode_sequences(e.turns, float(a), e.id, cfg.credit_malformed, cfg.malformed_advantage, only)
    return out, stats


@dataclass
class Row:
    """One packed row, shifted for next-token prediction: position i predicts targets[i]."""

    inputs: np.ndarray  # int64 [L]
    targets: np.ndarray  # int64 [L]
    positions: np.ndarray  # int64 [L], restarting at 0 for every sequence
    loss_mask: np.ndarray  # bool [L]: targets[i] was sampled
    inf_logprobs: np.ndarray  # float32 [L]
    advantages: np.ndarray  # float32 [L]
    seq_ids: np.ndarray  # int64 [L], -1 on padding
    routed_experts: np.ndarray | None = None  # [L, layers, top_k] for inputs, when all sequences have them
    used: int = 0  # non-padding tokens


def pack(sequences: list[Sequence], seq_len: int, pad_id: int = 0) -> tuple[list[Row], int]:
    """First-fit decreasing into rows of seq_len tokens (each sequence contributes len-1
    prediction positions). Returns the rows and the number of tokens truncated from sequences
    longer than a row."""
    truncated = 0
    items = []
    for i, s in enumerate(sequences):
        if len(s.tokens) < 2:
            continue
        n = min(len(s.tokens), seq_len + 1)
        truncated += len(s.tokens) - n
        items.append((n - 1, i))
    items.sort(key=lambda x: -x[0])
    bins: list[list[int]] = []
    room: list[int] = []
    for n, i in items:
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(seq_len - n)
    rows = []
    with_experts = all(sequences[i].routed_experts is not None for _, i in items) and items
    for members in bins:
        inputs = np.full(seq_len, pad_id, dtype=np.int64)
        targets = np.full(seq_len, pad_id, dtype=np.int64)
        positions = np.zeros(seq_len, dtype=np.int64)
        loss_mask = np.zeros(seq_len, dtype=bool)
        inf = np.zeros(seq_len, dtype=np.float32)
        adv = np.zeros(seq_len, dtype=np.float32)
        seq_ids = np.full(seq_len, -1, dtype=np.int64)
        experts = None
        at = 0
        for i in members:
            s = sequences[i]
            n = min(len(s.tokens), seq_len + 1) - 1
            inputs[at:at + n] = s.tokens[:n]
            targets[at:at + n] = s.tokens[1:n + 1]
            positions[at:at + n] = np.arange(n)
            loss_mask[at:at + n] = s.sampled[1:n + 1]
            inf[at:at + n] = s.inf_logprobs[1:n + 1]
            adv[at:at + n] = s.advantage if s.advantages is None else s.advantages[1:n + 1]
            seq_ids[at:at + n] = i
            if with_experts:
                if experts is None:
                    experts = np.zeros((seq_len, *s.routed_experts.shape[1:]), dtype=s.routed_experts.dtype)
                experts[at:at + n] = s.routed_experts[:n]
            at += n
        # padding continues the positions so every row stays a valid causal sequence
        positions[at:] = np.arange(seq_len - at)
        rows.append(Row(inputs, targets, positions, loss_mask, inf, adv, seq_ids, experts, used=at))
    return rows, truncated


def packing_efficiency(rows: list[Row]) -> float:
    total = sum(len(r.inputs) for r in rows)
    return sum(r.used for r in rows) / total if total else 1.0
