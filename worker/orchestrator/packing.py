"""Sample lengths and packing of samples into micro-batches of at most ``seq_len`` tokens.

- ``completion_length`` counts the tokens the policy sampled in a rollout: the sum of its loss mask.
  In a multi-turn rollout the mask has gaps (user and tool turns), so the span from the first to the
  last sampled token overstates it (case C11: mask ``[0,0,0,1,1,1,1,0,0,0,1,1,1,1,1]`` -> 9, not 12).
  Length penalties, overlong checks and length metrics all use this count.
- ``pack`` places samples (prompt + completion tokens each) into bins of at most ``seq_len`` tokens
  with first-fit decreasing: longest first, each into the first bin with room, ties in index order.
  It is deterministic, keeps every sample exactly once, and uses at most 11/9 OPT + 6/9 bins
  (Dósa 2007); the trainer concatenates each bin into one packed sequence.
- ``pack_shared_prompt`` packs the samples of a GRPO group that have the same prompt ids (``prompt_keys``; a
  self-play group's proposer and solvers do not) so that their common prompt is in the row once: a chunk
  is ``prompt, completion_1, ..., completion_k`` (each completion attends to the prompt and to itself; ``worker.trainer.packed.micro_batch_tensors`` builds that mask), costing
  ``prompt + sum(completion)`` tokens instead of ``k * prompt + sum(completion)``. The logits and the
  gradients are the same as with every sample laid out in full (tested); on reverse-text (a
  ~38-token prompt, ~15-token completions, group 8) the trainer computes ~2.6x fewer tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any


def completion_length(loss_mask: Sequence[int | bool]) -> int:
    """Number of policy-sampled tokens of a rollout: the sum of its 0/1 loss mask.

    Args:
        loss_mask: one 0/1 (or bool) entry per token of the rollout, 1 where the policy sampled it.

    Returns:
        The count of 1 entries.
    """
    return sum(1 for m in loss_mask if m)


def check_lengths(lengths: Sequence[int], seq_len: int) -> None:
    """The input checks of ``pack`` and ``pack_shared_prompt``.

    Raises:
        ValueError: ``seq_len`` < 1, a negative length, or a sample longer than ``seq_len``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len: expected a token count >= 1, got {seq_len}")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"pack: sample {i} has a negative length {n}")
        if n > seq_len:
            raise ValueError(
                f"seq_len: sample {i} has {n} tokens, more than seq_len = {seq_len}; raise seq_len or lower max_tokens"
            )


def pack(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Bins of sample indices whose lengths sum to at most ``seq_len`` each (first-fit decreasing).

    Args:
        lengths: token count of each sample (prompt + completion), each >= 0.
        seq_len: capacity of one packed sequence in tokens (> 0).

    Returns:
        Bins in creation order; each bin lists its sample indices in placement order (longest first).
        Every index of ``lengths`` appears in exactly one bin; ``[]`` for no samples.

    Raises:
        ValueError: ``seq_len`` < 1, a negative length, or a sample longer than ``seq_len``.
    """
    check_lengths(lengths, seq_len)
    # first fit in O(log bins) a sample: a max-tree over the room of `leaves` bins (bin b at leaf `leaves + b`; a bin
    # not yet opened has room seq_len, so the leftmost bin with room is an open one or the next to open; the tree
    # doubles when every bin is open), not a scan of every open bin (2,048 samples into ~700 bins: 25 -> 5 ms,
    # benchmarks/README.md section 11)
    bins: list[list[int]] = []
    leaves, room = 4, [seq_len] * 8
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):  # stable: ties keep index order
        need = lengths[i]
        if len(bins) == leaves and room[1] < need:  # every bin open and full for it: twice the leaves, rooms kept
            room = [0] * (2 * leaves) + room[leaves:] + [seq_len] * (2 * leaves - len(bins))
            leaves *= 2
            for node in range(leaves - 1, 0, -1):
                room[node] = max(room[2 * node], room[2 * node + 1])
        node = 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        if node - leaves == len(bins):
            bins.append([])
        bins[node - leaves].append(i)
        room[node] -= need
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return bins


def prompt_keys(samples: Sequence[Mapping[str, Any]]) -> list[Hashable]:
    """The sharing key of each sample (``TrainSample`` dicts) for ``pack_shared_prompt``: its ``group`` and the exact
    ids of its first ``prefix_len`` tokens, so only samples whose prompts are identical share one (the proposer and
    the solvers of a self-play group have different prompts, maybe of equal length). A sample without a ``group``
    is a group of its own.
    """
    return [
        (s.get("group", ("own", i)), tuple(s["input_ids"][: s.get("prefix_len", 0)])) for i, s in enumerate(samples)
    ]


def pack_shared_prompt(
    lengths: list[int], prefix_lens: list[int], keys: Sequence[Hashable], seq_len: int
) -> list[list[int]]:
    """Micro-batches of sample indices in which consecutive samples with one prompt share it.

    Samples share a prompt when they have the same ``keys`` entry and the same ``prefix_lens``; they are placed
    longest first into chunks ``prefix + suffixes`` of at most ``seq_len`` tokens (first fit); the chunks of all
    keys are then packed first-fit decreasing by their cost (``pack``). A chunk's samples stay consecutive in its
    micro-batch, the first one laid out in full (the "leader").

    Args:
        lengths: token count of each sample (prompt + completion).
        prefix_lens: tokens at the start of each sample it may share (its prompt), 0..length.
        keys: the sharing key of each sample; samples with equal keys (and prefix_lens) must have identical first
            ``prefix_len`` ids: ``prompt_keys`` (group and prompt ids) gives such keys.
        seq_len: capacity of one packed sequence in tokens.

    Returns:
        Micro-batches of sample indices; every index appears exactly once.

    Raises:
        ValueError: as ``pack``: ``seq_len`` < 1, or a sample longer than ``seq_len``.
    """
    check_lengths(lengths, seq_len)
    by_prompt: dict[tuple[Hashable, int], list[int]] = {}
    for i, key in enumerate(zip(keys, prefix_lens, strict=True)):
        by_prompt.setdefault(key, []).append(i)
    chunks: list[list[int]] = []
    costs: list[int] = []
    for (_, prefix), members in by_prompt.items():
        first = len(chunks)
        for i in sorted(members, key=lambda j: -lengths[j]):
            suffix = lengths[i] - prefix
            for c in range(first, len(chunks)):
                if costs[c] + suffix <= seq_len:
                    chunks[c].append(i)
                    costs[c] += suffix
                    break
            else:
                chunks.append([i])
                costs.append(lengths[i])
    return [[i for c in bin_ for i in chunks[c]] for bin_ in pack(costs, seq_len)]
