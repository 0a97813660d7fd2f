"""Advantages, sequences built from stored turns, and packing."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from service.store.buffer import EpisodeData, GroupData
from service.store.records import TurnRecord
from trainer.data import DataConfig, episode_sequences, group_advantages, pack, packing_efficiency, sequences_from_groups


def turn(idx, n_in, n_out, start=0, segment=0, experts=False):
    ids = np.arange(start, start + n_in + n_out)
    return TurnRecord(idx=idx, segment=segment, input_ids=ids[:n_in], output_ids=ids[n_in:],
                      output_logprobs=-np.arange(1, n_out + 1, dtype=np.float32) / 10, policy_version=3,
                      routed_experts=np.full((n_in + n_out, 2, 2), idx, dtype=np.uint8) if experts else None)


def called_episode(i, reward, called):
    """An episode of len(called) turns, each with TurnRecord.called as given."""
    turns = [turn(k, 3, 2, 10 * k) for k in range(len(called))]
    for t, c in zip(turns, called):
        t.called = c
    return EpisodeData(uuid.uuid4(), i, "max_turns", reward, 0, turns)


def called_group(*episodes):
    return GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), list(episodes))


def test_advantages():
    cfg = DataConfig()
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1], cfg), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1], DataConfig(std_normalize=True)), [1, -1, -1, 1], rtol=1e-5)


def test_sequence_is_the_turns_concatenated_with_loss_on_sampled_tokens():
    turns = [turn(0, 5, 3, 0), turn(1, 2, 4, 8, experts=False)]
    (seq,) = episode_sequences(turns, 0.5)
    assert seq.tokens.tolist() == list(range(14))
    assert seq.sampled.tolist() == [False] * 5 + [True] * 3 + [False] * 2 + [True] * 4
    np.testing.assert_allclose(seq.inf_logprobs[5:8], [-0.1, -0.2, -0.3])
    assert seq.inf_logprobs[:5].tolist() == [0] * 5 and seq.policy_version == 3 and seq.routed_experts is None


def test_segments_become_separate_sequences_and_experts_follow_tokens():
    turns = [turn(0, 4, 2, 0, experts=True), turn(1, 6, 2, 100, segment=1, experts=True)]
    a, b = episode_sequences(turns, 1.0)
    assert len(a.tokens) == 6 and len(b.tokens) == 8
    assert a.routed_experts.shape == (6, 2, 2) and int(b.routed_experts[0, 0, 0]) == 1


def test_turns_without_a_well_formed_call_get_no_positive_credit_when_asked():
    """A rewarded episode whose last turn was malformed (graded once out of turns): with
    credit_malformed off, that turn's tokens are not reinforced; the others are, and a negative
    advantage still reaches every turn."""
    good, bad, unknown = turn(0, 3, 2, 0), turn(1, 2, 3, 5), turn(2, 1, 2, 10)
    good.called, bad.called = True, False
    (seq,) = episode_sequences([good, bad, unknown], 1.0, credit_malformed=False)
    assert seq.sampled.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [False] * 3 + [False] + [True] * 2
    (seq,) = episode_sequences([good, bad, unknown], -0.5, credit_malformed=False)
    assert seq.sampled[7:10].all()
    (seq,) = episode_sequences([good, bad, unknown], 1.0)
    assert seq.sampled[7:10].all()  # the default credits every turn, as before
    group = GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), [
        EpisodeData(uuid.uuid4(), 0, "max_turns", 1.0, 0, [good, bad]),
        EpisodeData(uuid.uuid4(), 1, "submitted", 0.0, 0, [turn(0, 3, 2, 0)])])
    seqs, _ = sequences_from_groups([group], DataConfig(credit_malformed=False))
    assert seqs[0].sampled.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [False] * 3


def test_missing_logprobs_are_refused():
    t = turn(0, 3, 2)
    t.output_logprobs = None
    with pytest.raises(ValueError, match="logprobs"):
        episode_sequences([t], 1.0)


def test_groups_filter_zero_advantage_and_unrewarded_episodes():
    def group(rewards):
        return GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), [
            EpisodeData(uuid.uuid4(), i, "submitted", r, 0, [turn(0, 3, 2)]) for i, r in enumerate(rewards)])

    seqs, stats = sequences_from_groups([group([1, 0]), group([1, 1]), group([None, None]), group([0, None, 1])],
                                        DataConfig())
    assert (stats.groups, stats.zero_advantage_groups, stats.excluded_episodes, stats.episodes) == (4, 2, 3, 4)
    assert sorted(s.advantage for s in seqs) == [-0.5, -0.5, 0.5, 0.5]
    sft, sft_stats = sequences_from_groups([group([1, 1])], DataConfig(advantage_one=True))
    assert [s.advantage for s in sft] == [1.0, 1.0] and sft_stats.zero_advantage_groups == 0


def test_negative_scale_shrinks_only_the_failures_push():
    def group(rewards):
        return GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), [
            EpisodeData(uuid.uuid4(), i, "submitted", r, 0, [turn(0, 3, 2)]) for i, r in enumerate(rewards)])

    seqs, _ = sequences_from_groups([group([1, 0, 0, 0])], DataConfig(negative_scale=0.0))
    assert [s.advantage for s in seqs] == [0.75, 0.0, 0.0, 0.0]  # positive-advantage updates only
    seqs, _ = sequences_from_groups([group([1, 0])], DataConfig(negative_scale=0.5))
    assert [s.advantage for s in seqs] == [0.5, -0.25]
    seqs, stats = sequences_from_groups([group([0, 0])], DataConfig(negative_scale=0.0))
    assert seqs == [] and stats.zero_advantage_groups == 1


def test_skip_zero_trains_only_the_samples_that_teach():
    """With positive-advantage updates, samples at or below their group's mean have advantage 0:
    skip_zero leaves them out of the step (counted as skipped), keeps every sample with an
    advantage either way, and leaves the batch's reward and advantage statistics as they were."""
    def group(rewards):
        return GroupData(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), [
            EpisodeData(uuid.uuid4(), i, "submitted", r, 0, [turn(0, 3, 2)]) for i, r in enumerate(rewards)])

    groups = [group([1, 0, 0, 0]), group([1, 1, 0, 1]), group([0, 0])]
    kept, stats = sequences_from_groups(groups, DataConfig(negative_scale=0.0, skip_zero=True))
    every, every_stats = sequences_from_groups(groups, DataConfig(negative_scale=0.0))
    assert [s.advantage for s in kept] == [0.75, 0.25, 0.25, 0.25]
    assert [s.advantage for s in every] == [0.75, 0.0, 0.0, 0.0, 0.25, 0.25, 0.0, 0.25]
    assert [s.episode_id for s in kept] == [s.episode_id for s in every if s.advantage != 0]
    assert (stats.episodes, stats.skipped_episodes, stats.zero_advantage_groups) == (4, 4, 1)
    assert (every_stats.episodes, every_stats.skipped_episodes) == (8, 0)
    assert stats.rewards == every_stats.rewards and stats.advantages == every_stats.advantages
    # every sampled token of the rewarded episodes, taught or not, groups without a spread too
    assert stats.sampled_tokens == every_stats.sampled_tokens == 2 * 10
    both, _ = sequences_from_groups([group([1, 0])], DataConfig(negative_scale=0.5, skip_zero=True))
    assert [s.advantage for s in both] == [0.5, -0.25]  # a scaled-down failure still teaches


def test_format_weight_ranks_a_groups_failures_by_their_well_formed_turns():
    """Every sample failed: with format_weight the well-formed one rises against the malformed
    ones; the recorded rewards (the batch's statistics) stay the grade's, and without the weight
    the group teaches nothing, as before."""
    failed = called_group(called_episode(0, 0.0, [True, True, True]), called_episode(1, 0.0, [True, False, False]),
                   called_episode(2, 0.0, [True, None, False]), called_episode(3, 0.0, [False, False, False]))
    seqs, stats = sequences_from_groups([failed], DataConfig(format_weight=0.3, negative_scale=0.0))
    # shares 1, 1/3, 2/3, 0 (unknown counts as well formed): mean 0.5, times 0.3
    np.testing.assert_allclose([s.advantage for s in seqs], [0.15, 0.0, 0.05, 0.0], atol=1e-12)
    assert stats.rewards == [0.0] * 4 and stats.zero_advantage_groups == 0
    seqs, stats = sequences_from_groups([failed], DataConfig(negative_scale=0.0))
    assert seqs == [] and stats.zero_advantage_groups == 1
    mixed = called_group(called_episode(0, 1.0, [True, True, True]), called_episode(1, 0.0, [True, False, False]))
    seqs, _ = sequences_from_groups([mixed], DataConfig(format_weight=0.3))
    np.testing.assert_allclose([s.advantage for s in seqs], [0.6, -0.6], atol=1e-12)  # 1.3 against 0.1
    with pytest.raises(ValueError, match="format_weight"):
        DataConfig(format_weight=2.0)


def test_packing_respects_boundaries_and_shifts_targets():
    seqs = episode_sequences([turn(0, 5, 3, 0)], 1.0) + episode_sequences([turn(0, 4, 4, 50)], -1.0) \
        + episode_sequences([turn(0, 10, 7, 200)], 0.5)
    rows, truncated = pack(seqs, seq_len=16)
    assert truncated == 0 and sum(r.used for r in rows) == 7 + 7 + 16
    for row in rows:
        for sid in set(row.seq_ids[row.seq_ids >= 0].tolist()):
            at = np.flatnonzero(row.seq_ids == sid)
            s = seqs[sid]
            assert row.positions[at].tolist() == list(range(len(at)))
            assert row.inputs[at].tolist() == s.tokens[:-1].tolist()
            assert row.targets[at].tolist() == s.tokens[1:].tolist()
            assert row.loss_mask[at].tolist() == s.sampled[1:].tolist()
            assert np.all(row.advantages[at] == s.advantage)
            np.testing.assert_allclose(row.inf_logprobs[at], s.inf_logprobs[1:])
        assert not row.loss_mask[row.seq_ids < 0].any()
    assert packing_efficiency(rows) == pytest.approx(30 / 32)


def test_packing_truncates_what_does_not_fit_and_reports_it():
    rows, truncated = pack(episode_sequences([turn(0, 20, 10, 0)], 1.0), seq_len=16)
    assert truncated == 30 - 17 and len(rows) == 1 and rows[0].used == 16


def test_packing_is_efficient_on_many_sequences():
    rng = np.random.default_rng(0)
    seqs = [s for n in rng.integers(50, 2000, 300) for s in episode_sequences([turn(0, int(n) // 2, int(n) - int(n) // 2)], 1.0)]
    rows, _ = pack(seqs, seq_len=8192)
    assert packing_efficiency(rows) > 0.98


def test_malformed_advantage_pushes_down_only_the_broken_turns_of_groups_that_teach():
    """With malformed_advantage, in a group with a reward spread a turn without a well-formed
    call gets -malformed_advantage on its sampled tokens whatever its episode's advantage, and
    the episode's other turns keep theirs; a sample with nothing else to teach (advantage zero
    under skip_zero) trains its first malformed turn alone and is cut after it. A group where
    every sample failed still teaches nothing, and at 0 nothing changes."""
    cfg = DataConfig(negative_scale=0.0, skip_zero=True, credit_malformed=False, malformed_advantage=0.25)
    failed = called_group(called_episode(0, 0.0, [True, False, True, False]), called_episode(1, 0.0, [True, True]))
    seqs, stats = sequences_from_groups([failed], cfg)
    assert seqs == [] and stats.zero_advantage_groups == 1 and stats.malformed_turns == 0

    cut = called_group(called_episode(0, 1.0, [True]), called_episode(1, 0.0, [True, False, True, False]))
    seqs, stats = sequences_from_groups([cut], cfg)
    assert (stats.episodes, stats.skipped_episodes, stats.malformed_turns) == (2, 0, 1)
    seq = seqs[1]
    assert len(seq.tokens) == 10  # cut after the first malformed turn
    assert seq.sampled.tolist() == [False] * 3 + [False] * 2 + [False] * 3 + [True] * 2
    (row,), _ = pack([seq], 16)
    np.testing.assert_allclose(row.advantages[row.loss_mask], [-0.25, -0.25])
    assert seq.advantage == 0.0

    mixed = called_group(called_episode(0, 1.0, [True, False, True]), called_episode(1, 0.0, [False]),
                         called_episode(2, 0.0, [True]))
    seqs, stats = sequences_from_groups([mixed], cfg)
    assert (stats.episodes, stats.skipped_episodes, stats.malformed_turns) == (2, 1, 2)
    solved, broken = seqs
    (row,), _ = pack([solved], 32)
    # the solved sample: its well-formed turns up by 2/3, its malformed one down
    np.testing.assert_allclose(row.advantages[row.loss_mask], [2 / 3] * 2 + [-0.25] * 2 + [2 / 3] * 2, rtol=1e-6)
    (row,), _ = pack([broken], 32)
    np.testing.assert_allclose(row.advantages[row.loss_mask], [-0.25, -0.25])

    every, _ = sequences_from_groups([mixed], cfg.model_copy(update={"skip_zero": False}))
    assert len(every) == 3 and every[2].advantages is None and every[2].sampled.sum() == 2  # a zero-advantage sample trains as before

    broke = called_group(called_episode(0, 1.0, [True]), called_episode(1, 0.0, [True, False, True]))
    broke.episodes[1].turns[1].malformed_at = 1  # its second sampled token is where the call broke
    broke.episodes[0].turns[0].malformed_at = 0  # a well-formed turn's is never read
    seqs, stats = sequences_from_groups([broke], cfg)
    assert stats.malformed_turns == 1 and seqs[0].advantages is None
    assert seqs[1].sampled.tolist() == [False] * 5 + [False] * 3 + [False, True]
    (row,), _ = pack([seqs[1]], 16)
    np.testing.assert_allclose(row.advantages[row.loss_mask], [-0.25])
    seqs, _ = sequences_from_groups([broke], cfg.model_copy(update={"skip_zero": False}))
    # trained as the episode: its well-formed start at the episode's advantage (0 here), pushed down from the break
    assert seqs[1].sampled.tolist() == [False] * 3 + [True] * 2 + [False] * 3 + [True, True] + [False] * 3 + [True] * 2
    np.testing.assert_allclose(seqs[1].advantages[seqs[1].sampled], [0, 0, 0, -0.25, 0, 0])
    broke.episodes[1].turns[1].malformed_at = 2  # out of the turn's range: the whole turn
    seqs, _ = sequences_from_groups([broke], cfg)
    assert seqs[1].sampled.tolist() == [False] * 8 + [True] * 2

    off, off_stats = sequences_from_groups([failed, mixed], cfg.model_copy(update={"malformed_advantage": 0.0}))
    assert off_stats.zero_advantage_groups == 1 and off_stats.malformed_turns == 0
    assert [s.advantages for s in off] == [None] and off[0].sampled.tolist() == (
        [False] * 3 + [True] * 2 + [False] * 3 + [False] * 2 + [False] * 3 + [True] * 2)
