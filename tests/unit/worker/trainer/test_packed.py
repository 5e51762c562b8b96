"""Packed micro-batches (``worker/trainer/packed.py``): attention masks, fields, logits equal to single samples."""

from __future__ import annotations

import torch

from tests.support.models import tiny_qwen3
from worker.trainer.packed import micro_batch_tensors, packed_attention_mask

# ----------------------------------------------------------------------------- packing


def test_packed_attention_mask_two_samples() -> None:
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    got = packed_attention_mask([2, 3])
    assert got.shape == (1, 1, 5, 5)
    assert got.dtype == torch.bool
    assert torch.equal(got[0, 0], expected)
    assert torch.equal(packed_attention_mask([1, 1])[0, 0], torch.eye(2, dtype=torch.bool))


def test_micro_batch_tensors_fields() -> None:
    t = micro_batch_tensors(
        [
            {"input_ids": [5, 6], "loss_mask": [0, 1], "sampling_logprobs": [0.0, -0.5]},
            {"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
        ]
    )
    assert t.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert t.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert t.loss_mask.tolist() == [False, True, False, True, True]
    assert t.sampling_logprobs.tolist() == [0.0, -0.5, 0.0, 0.0, 0.0]
    assert t.spans == [(0, 2), (2, 3)]
    assert torch.equal(t.attention_mask, packed_attention_mask([2, 3]))


@torch.no_grad()
def test_packed_logits_equal_single_samples() -> None:
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 300, (7,), generator=gen).tolist()
    b = torch.randint(0, 300, (5,), generator=gen).tolist()
    t = micro_batch_tensors([{"input_ids": a, "loss_mask": [1] * 7}, {"input_ids": b, "loss_mask": [1] * 5}])
    packed = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=t.attention_mask).logits[0]
    alone_a = model(input_ids=torch.tensor([a])).logits[0]
    alone_b = model(input_ids=torch.tensor([b])).logits[0]
    assert packed.shape == (12, 300)
    torch.testing.assert_close(packed[:7], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[7:], alone_b, atol=1e-5, rtol=0)
    # and the mask matters: without it, b's logits see a's tokens
    unmasked = model(input_ids=t.input_ids, position_ids=t.position_ids).logits[0]
    assert (unmasked[7:] - alone_b).abs().max() > 1e-3


@torch.no_grad()
def test_shared_prompt_row_gives_each_sample_its_own_logits() -> None:
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (6,), generator=gen).tolist()
    completions = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (4, 2, 5)]
    other = torch.randint(0, 300, (7,), generator=gen).tolist()  # another group, laid out in full
    samples = [
        {"input_ids": prompt + c, "loss_mask": [0] * 6 + [1] * len(c), "group": 0, "prefix_len": 6} for c in completions
    ]
    samples.append({"input_ids": other, "loss_mask": [0] * 3 + [1] * 4, "group": 1, "prefix_len": 3})
    t = micro_batch_tensors(samples)
    assert t.input_ids.shape == (1, 6 + 4 + 2 + 5 + 7)  # the prompt once
    assert t.position_ids[0].tolist() == [*range(10), 6, 7, 6, 7, 8, 9, 10, *range(7)]
    assert t.spans == [(0, 10), (10, 2), (12, 5), (17, 7)]
    assert t.rows[1].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        10,
    ]  # tokens 1..7 of sample 1: prompt rows of sample 0, then its own
    packed = model(input_ids=t.input_ids, position_ids=t.position_ids, attention_mask=t.attention_mask).logits[0]
    for s, rows in zip(samples, t.rows, strict=True):
        alone = model(input_ids=torch.tensor([s["input_ids"]])).logits[0]
        torch.testing.assert_close(packed[rows], alone[:-1], atol=1e-5, rtol=0)


def test_shared_prompt_needs_the_same_prompt_tokens() -> None:
    a = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "group": 0, "prefix_len": 2}
    b = {"input_ids": [1, 9, 5, 6], "loss_mask": [0, 0, 1, 1], "group": 0, "prefix_len": 2}  # different prompt
    t = micro_batch_tensors([a, b])
    assert t.input_ids[0].tolist() == [1, 2, 3, 4, 1, 9, 5, 6]
    assert torch.equal(t.attention_mask, packed_attention_mask([4, 4]))
