"""Completion length from the loss mask (case C11) and first-fit-decreasing packing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.orchestrator.packing import completion_length, pack, pack_shared_prompt, prompt_keys


def test_c11_completion_length_counts_sampled_tokens_not_the_span():
    mask = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    # sampled tokens: 4 (turn 1) + 5 (turn 2) = 9; the first-to-last span would be 15 - 3 = 12
    assert completion_length(mask) == 9
    assert completion_length([bool(m) for m in mask]) == 9
    assert completion_length([]) == 0


def test_pack_first_fit_decreasing_by_hand():
    # lengths by index: 0:5 1:7 2:3 3:2 4:4 ; capacity 10 ; order by length: 1(7) 0(5) 4(4) 2(3) 3(2)
    # 1 -> new bin A [7, 3 free]; 0 -> new bin B [5, 5 free]; 4 -> B (1 free);
    # 2 -> A (0 free); 3 -> no room in A or B -> new bin C
    assert pack([5, 7, 3, 2, 4], 10) == [[1, 2], [0, 4], [3]]


def test_pack_ties_keep_index_order_and_edge_cases():
    assert pack([4, 4, 4], 8) == [[0, 1], [2]]
    assert pack([], 8) == []
    assert pack([8], 8) == [[0]]
    assert pack([0, 3], 3) == [[1, 0]]


def test_pack_rejects_a_sample_longer_than_seq_len():
    with pytest.raises(ValueError, match=r"^seq_len: sample 1 has 9 tokens, more than seq_len = 8"):
        pack([3, 9], 8)
    with pytest.raises(ValueError, match=r"^seq_len: expected a token count >= 1, got 0"):
        pack([1], 0)
    with pytest.raises(ValueError, match="negative length"):
        pack([-1], 4)


@given(st.integers(1, 64).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(0, cap), max_size=40))))
def test_pack_keeps_every_index_once_and_respects_capacity(case):
    seq_len, lengths = case
    bins = pack(lengths, seq_len)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= seq_len for b in bins)
    assert pack(list(lengths), seq_len) == bins  # deterministic
    # first fit never leaves two bins at most half full: the later one's first sample would have
    # fitted into the earlier one
    half_or_less = [b for b in bins if 2 * sum(lengths[i] for i in b) <= seq_len]
    assert len(half_or_less) <= 1


# ----------------------------------------------------------------------------- shared-prompt packing


def _first_fit_by_scan(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing as its definition reads: each sample into the first open bin with room, by a scan."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(seq_len - lengths[i])
    return bins


@given(st.integers(1, 60).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(0, cap), max_size=120))))
def test_pack_places_each_sample_where_a_scan_of_every_bin_would(case):
    seq_len, lengths = case
    assert pack(lengths, seq_len) == _first_fit_by_scan(lengths, seq_len)


def test_pack_of_a_step_with_hundreds_of_bins_matches_the_scan():
    # 2,048 samples of 40-140 tokens into 256-token bins: ~740 bins, the tree doubles from 4 leaves to 1,024
    lengths = [40 + (i * 37) % 101 for i in range(2048)]
    bins = pack(lengths, 256)
    assert bins == _first_fit_by_scan(lengths, 256)
    assert 700 < len(bins) < 800


def test_pack_shared_prompt_by_hand():
    # group 0: prompt 4, completions 3, 2, 5 -> one chunk 4+5+3+2 = 14 <= 16; group 1: prompt 6, completions 4, 4 -> 14
    lengths = [7, 6, 9, 10, 10]
    bins = pack_shared_prompt(lengths, [4, 4, 4, 6, 6], [0, 0, 0, 1, 1], seq_len=16)
    assert bins == [[2, 0, 1], [3, 4]]
    # seq_len 12: group 0 splits into chunks [2 (9), 0 (+3) = 12] and [1 (6)]; group 1 into [3 (10)] and [4 (10)]
    assert pack_shared_prompt(lengths, [4, 4, 4, 6, 6], [0, 0, 0, 1, 1], seq_len=12) == [[2, 0], [3], [4], [1]]


def test_samples_of_one_group_share_a_prompt_only_when_its_ids_are_equal():
    # a self-play group: a proposer and a solver whose prompts are both 6 tokens long but different ids, and a
    # second solver with the first solver's prompt; 10 tokens each, seq_len 14
    samples = [
        {"input_ids": [1, 2, 3, 4, 5, 6, 70, 71, 72, 73], "group": 0, "prefix_len": 6},  # proposer
        {"input_ids": [1, 2, 3, 9, 9, 9, 80, 81, 82, 83], "group": 0, "prefix_len": 6},  # solver
        {"input_ids": [1, 2, 3, 9, 9, 9, 90, 91, 92, 93], "group": 0, "prefix_len": 6},  # solver, same prompt
        {"input_ids": [1, 2, 3, 4, 5, 6, 74, 75, 76, 77], "group": 1, "prefix_len": 6},  # the proposer's ids, group 1
    ]
    keys = prompt_keys(samples)
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[0] != keys[3]
    # the two solvers: one chunk of 10 + 4 = 14 tokens; the proposers (other group, other prompt) alone: 10 each
    assert pack_shared_prompt([10] * 4, [6] * 4, keys, seq_len=14) == [[1, 2], [0], [3]]
    # keyed by group alone (the old key) the proposer would have joined a solver's chunk with a prompt it lacks
    assert pack_shared_prompt([10] * 4, [6] * 4, [0, 0, 0, 1], seq_len=14) == [[0, 1], [2], [3]]


def test_pack_shared_prompt_rejects_what_pack_rejects():
    with pytest.raises(ValueError, match="seq_len"):
        pack_shared_prompt([20], [4], [0], seq_len=16)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30)), min_size=1, max_size=40), st.integers(1, 12))
def test_pack_shared_prompt_keeps_every_index_once_and_fits(samples, prompt):
    groups = [g for g, _ in samples]
    prefix = [prompt + g for g in groups]  # one prompt length per group
    lengths = [p + c for p, c in zip(prefix, (c for _, c in samples), strict=True)]
    seq_len = max(lengths) + 5
    bins = pack_shared_prompt(lengths, prefix, groups, seq_len)
    assert sorted(i for b in bins for i in b) == list(range(len(samples)))
    for b in bins:  # the row cost: a sample following one of its group adds only its completion
        cost = sum(
            lengths[i] if k == 0 or groups[b[k - 1]] != groups[i] else lengths[i] - prefix[i] for k, i in enumerate(b)
        )
        assert cost <= seq_len
