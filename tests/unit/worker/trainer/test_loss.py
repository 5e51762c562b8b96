"""Per-sample RL losses: hand-computed 4-token cases, gradient directions, case C1, invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.spec import SpecError, validate_spec
from worker.trainer.logprobs import entropy_from_logits, selective_log_softmax
from worker.trainer.loss import LOSSES, LossInputs, LossOutputs, compute_sample_loss
from worker.trainer.loss.conventions import mismatch_kl_k3

NAN = float("nan")
LN = math.log


def make(trainer_probs, sampling_probs, advantages, mask=None, dtype=torch.float64) -> LossInputs:
    """Inputs from probabilities (logs taken here); a NaN sampling prob stays NaN."""
    n = len(trainer_probs)
    mask = [True] * n if mask is None else [bool(m) for m in mask]
    return LossInputs(
        trainer_logprobs=torch.tensor([LN(p) for p in trainer_probs], dtype=dtype).requires_grad_(),
        sampling_logprobs=torch.tensor([LN(q) if q == q else NAN for q in sampling_probs], dtype=dtype),
        advantages=torch.tensor(advantages, dtype=dtype),
        loss_mask=torch.tensor(mask),
    )


def run(name: str, inputs: LossInputs, **params) -> tuple[LossOutputs, torch.Tensor]:
    out = compute_sample_loss(name, inputs, **params)
    out.loss.backward()
    return out, inputs.trainer_logprobs.grad.clone()


def metric(out: LossOutputs, key: str) -> float:
    return out.metrics[key].item()


# ----------------------------------------------------------------------------- dppo_kl


def test_dppo_kl_four_tokens_by_hand():
    # token  p_train p_infer  A    d = p_train - p_infer  r = p/q   decision
    #   1     0.5     0.25   +1       +0.25 > 0.2          2.0      masked high (A > 0 pushes further up)
    #   2     0.2     0.5    -1       -0.30 < -0.2         0.4      masked low  (A < 0 pushes further down)
    #   3     0.4     0.5    +1       -0.10                0.8      kept (A > 0 only checks the high side)
    #   4     0.6     0.5    -1       +0.10                1.2      kept
    # pg  = -(0.8 * 1 + 1.2 * -1) = 0.4
    # kl  = ln2^2 + ln0.4^2 + ln0.8^2 + ln1.2^2 = 0.480453 + 0.839589 + 0.049793 + 0.033241 = 1.403076
    # loss = pg + 0.01 * kl = 0.4140308
    # d loss / d log pi_t = -r_t A_t [kept] + 2 tau log r_t:
    #   [0.0138629, -0.0183258, -0.8 - 0.0044629, 1.2 + 0.0036464]
    # mismatch_kl = sum(r - ln r - 1) = 0.306853 + 0.316291 + 0.023144 + 0.017678 = 0.663966
    inputs = make([0.5, 0.2, 0.4, 0.6], [0.25, 0.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0])
    out, grad = run("dppo_kl", inputs, kl_tau=0.01)

    kl = LN(2) ** 2 + LN(0.4) ** 2 + LN(0.8) ** 2 + LN(1.2) ** 2
    assert kl == pytest.approx(1.403076, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.4 + 0.01 * kl, abs=1e-9)
    assert out.loss.item() == pytest.approx(0.4140308, abs=1e-7)
    expected = [0.02 * LN(2), 0.02 * LN(0.4), -0.8 + 0.02 * LN(0.8), 1.2 + 0.02 * LN(1.2)]
    assert grad.tolist() == pytest.approx(expected, abs=1e-9)
    assert grad.tolist() == pytest.approx([0.0138629, -0.0183258, -0.8044629, 1.2036464], abs=1e-6)
    assert metric(out, "masked") == 2
    assert metric(out, "masked_high") == 1
    assert metric(out, "masked_low") == 1
    assert metric(out, "loss_tokens") == 4
    assert metric(out, "is_ratio") == pytest.approx(2.0 + 0.4 + 0.8 + 1.2)
    assert metric(out, "mismatch_kl") == pytest.approx(0.663966, abs=1e-6)
    assert metric(out, "kl") == pytest.approx(kl)


def test_dppo_kl_default_params_match_prime_rl():
    # A token with d = +0.19 and A > 0 is inside the default 0.2 band; with d = +0.21 it is masked.
    inside = make([0.69], [0.5], [1.0])
    outside = make([0.71], [0.5], [1.0])
    assert metric(compute_sample_loss("dppo_kl", inside), "masked") == 0
    assert metric(compute_sample_loss("dppo_kl", outside), "masked") == 1
    # default kl_tau = 1e-3: the masked token's loss is only the KL term 1e-3 * ln(0.71/0.5)^2
    assert compute_sample_loss("dppo_kl", outside).loss.item() == pytest.approx(1e-3 * LN(0.71 / 0.5) ** 2)


def test_dppo_kl_zero_advantage_is_never_masked():
    out = compute_sample_loss("dppo_kl", make([0.9, 0.05], [0.1, 0.9], [0.0, 0.0]), kl_tau=0.0)
    assert metric(out, "masked") == 0
    assert out.loss.item() == 0


def test_dppo_kl_sequence_ratio():
    # geometric mean over loss tokens: s = (2 * 0.4 * 0.8 * 1.2) ** (1/4) = 0.768 ** 0.25 = 0.936138
    # A = +1 on every token, so only the high side is checked: token 1 (d = +0.25) is masked,
    # tokens 2..4 (d = -0.3, -0.1, +0.1) are kept. kl_tau = 0:
    # loss = -3 * s = -2.808415 ; GSPO-token gradient -s on each kept token, 0 on token 1
    inputs = make([0.5, 0.2, 0.4, 0.6], [0.25, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0])
    out, grad = run("dppo_kl", inputs, kl_tau=0.0, ratio_level="sequence")
    s = 0.768**0.25
    assert s == pytest.approx(0.936138, abs=1e-6)
    assert out.loss.item() == pytest.approx(-3 * s)
    assert grad.tolist() == pytest.approx([0.0, -s, -s, -s])
    assert metric(out, "is_ratio") == pytest.approx(4 * s)
    assert metric(out, "masked_high") == 1


# ----------------------------------------------------------------------------- ipo


def test_ipo_four_tokens_by_hand_masks_both_sides_regardless_of_sign():
    # token  p_train p_infer  A    d       |d| > 0.2 ?  r
    #   1     0.5     0.25   -1   +0.25    masked       2.0   (dppo_kl would keep it: A < 0 checks only d < -0.2)
    #   2     0.2     0.5    +1   -0.30    masked       0.4   (dppo_kl would keep it: A > 0 checks only d > 0.2)
    #   3     0.4     0.5    +1   -0.10    kept         0.8
    #   4     0.6     0.5    -1   +0.10    kept         1.2
    # loss = -(0.8 * 1 + 1.2 * -1) = 0.4 ; grad = [0, 0, -0.8, +1.2]
    inputs = make([0.5, 0.2, 0.4, 0.6], [0.25, 0.5, 0.5, 0.5], [-1.0, 1.0, 1.0, -1.0])
    out, grad = run("ipo", inputs)
    assert out.loss.item() == pytest.approx(0.4)
    assert grad.tolist() == pytest.approx([0.0, 0.0, -0.8, 1.2])
    assert (metric(out, "masked"), metric(out, "masked_high"), metric(out, "masked_low")) == (2, 1, 1)

    # the same inputs under dppo_kl (no KL): nothing masked, loss = -(2*-1 + 0.4*1 + 0.8*1 + 1.2*-1) = 2.0
    same = make([0.5, 0.2, 0.4, 0.6], [0.25, 0.5, 0.5, 0.5], [-1.0, 1.0, 1.0, -1.0])
    dppo = compute_sample_loss("dppo_kl", same, kl_tau=0.0)
    assert dppo.loss.item() == pytest.approx(2.0)
    assert metric(dppo, "masked") == 0


def test_ipo_epsilon_sets_the_band():
    inputs = make([0.5, 0.2, 0.4, 0.6], [0.25, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0])
    assert metric(compute_sample_loss("ipo", inputs, epsilon=0.35), "masked") == 0
    assert metric(compute_sample_loss("ipo", inputs, epsilon=0.05), "masked") == 4


# ----------------------------------------------------------------------------- icepop


def test_icepop_four_tokens_by_hand():
    # token  p_train p_infer  r     band [0.5, 5]     loss_mask
    #   1     0.5     0.25   2.0    kept              1
    #   2     0.2     0.5    0.4    masked low        1
    #   3     0.6     0.1    6.0    masked high       1
    #   4     0.3     NaN    -      (not a loss token) 0
    # A = 1 on every token; loss = -(2 * 1) = -2 ; grad = [-2, 0, 0, 0]
    # is_ratio = 2 + 0.4 + 6 = 8.4
    # mismatch_kl = (2 - ln2 - 1) + (0.4 - ln0.4 - 1) + (6 - ln6 - 1) = 0.306853 + 0.316291 + 3.208241 = 3.831385
    inputs = make([0.5, 0.2, 0.6, 0.3], [0.25, 0.5, 0.1, NAN], [1.0, 1.0, 1.0, 1.0], mask=[1, 1, 1, 0])
    out, grad = run("icepop", inputs)
    assert out.loss.item() == pytest.approx(-2.0)
    assert grad.tolist() == pytest.approx([-2.0, 0.0, 0.0, 0.0])
    assert (metric(out, "masked"), metric(out, "masked_low"), metric(out, "masked_high")) == (2, 1, 1)
    assert metric(out, "loss_tokens") == 3
    assert metric(out, "is_ratio") == pytest.approx(8.4)
    assert metric(out, "mismatch_kl") == pytest.approx(3.831385, abs=1e-6)


def test_icepop_sequence_ratio_keeps_or_masks_the_whole_sample():
    # s = (2 * 0.4 * 6) ** (1/3) = 4.8 ** (1/3) = 1.686865, inside [0.5, 5] -> all three tokens kept
    # loss = -3 * s * A with A = 1 -> -5.060596 ; GSPO-token gradient = -s * A on every loss token
    inputs = make([0.5, 0.2, 0.6, 0.3], [0.25, 0.5, 0.1, NAN], [1.0, 1.0, 1.0, 1.0], mask=[1, 1, 1, 0])
    out, grad = run("icepop", inputs, ratio_level="sequence")
    s = 4.8 ** (1 / 3)
    assert out.loss.item() == pytest.approx(-3 * s)
    assert out.loss.item() == pytest.approx(-5.060596, abs=1e-6)
    assert grad.tolist() == pytest.approx([-s, -s, -s, 0.0])
    assert metric(out, "masked") == 0
    # s = 6 ** (1/2) = 2.449 is outside a band of (0.5, 2): every token masked, loss 0
    far = make([0.6, 0.6], [0.1, 0.6], [1.0, 1.0])
    out = compute_sample_loss("icepop", far, band=(0.5, 2.0), ratio_level="sequence")
    assert out.loss.item() == 0
    assert metric(out, "masked") == 2


# ----------------------------------------------------------------------------- aipo


def test_aipo_four_tokens_by_hand():
    # token  p_train p_infer  r     w = min(r, 2)  loss_mask
    #   1     0.6     0.2    3.0    2.0 (truncated)   1
    #   2     0.2     0.5    0.4    0.4               1
    #   3     0.6     0.5    1.2    1.2               1
    #   4     0.9     NaN    -      -                 0
    # A = 0.5; loss = -(2 + 0.4 + 1.2) * 0.5 = -1.8 ; grad = -w * A = [-1.0, -0.2, -0.6, 0]
    inputs = make([0.6, 0.2, 0.6, 0.9], [0.2, 0.5, 0.5, NAN], [0.5, 0.5, 0.5, 0.5], mask=[1, 1, 1, 0])
    out, grad = run("aipo", inputs)
    assert out.loss.item() == pytest.approx(-1.8)
    assert grad.tolist() == pytest.approx([-1.0, -0.2, -0.6, 0.0])
    assert metric(out, "truncated") == 1
    assert metric(out, "masked") == 0
    assert metric(out, "is_ratio") == pytest.approx(3.0 + 0.4 + 1.2)


def test_aipo_sequence_ratio_truncates_the_sample_weight():
    # s = (3 * 3) ** (1/2) = 3 > max_ratio 2 -> w = 2 on both tokens; A = -1 -> loss = +4, grad = [2, 2]
    out, grad = run("aipo", make([0.6, 0.3], [0.2, 0.1], [-1.0, -1.0]), ratio_level="sequence")
    assert out.loss.item() == pytest.approx(4.0)
    assert grad.tolist() == pytest.approx([2.0, 2.0])
    assert metric(out, "truncated") == 2


# ----------------------------------------------------------------------------- all losses

ALL = sorted(LOSSES)
LEVELS = ["token", "sequence"]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gradient_direction_follows_the_advantage(name, level, advantage):
    # an in-band token (r = 1): a descent step must raise log pi for A > 0 and lower it for A < 0
    out, grad = run(name, make([0.3], [0.3], [advantage]), ratio_level=level)
    assert grad.item() == pytest.approx(-advantage)
    assert out.loss.item() == pytest.approx(-advantage)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ALL)
def test_c1_masked_nan_token_does_not_poison_the_loss(name, level):
    # Case C1: trainer [0, 0], sampling [0, NaN], advantages [1, 1], mask [1, 0] must equal the 1-token case.
    two = LossInputs(
        trainer_logprobs=torch.tensor([0.0, 0.0], requires_grad=True),
        sampling_logprobs=torch.tensor([0.0, NAN]),
        advantages=torch.tensor([1.0, 1.0]),
        loss_mask=torch.tensor([True, False]),
    )
    one = LossInputs(
        trainer_logprobs=torch.tensor([0.0], requires_grad=True),
        sampling_logprobs=torch.tensor([0.0]),
        advantages=torch.tensor([1.0]),
        loss_mask=torch.tensor([True]),
    )
    out2, grad2 = run(name, two, ratio_level=level)
    out1, grad1 = run(name, one, ratio_level=level)
    assert torch.isfinite(out2.loss)
    assert out2.loss.item() == out1.loss.item() == -1.0
    assert out2.metrics.keys() == out1.metrics.keys()
    for key, value in out2.metrics.items():
        assert torch.isfinite(value), key
        assert value.item() == out1.metrics[key].item(), key
    assert torch.isfinite(grad2).all()
    assert grad2.tolist() == [grad1.item(), 0.0]


@pytest.mark.parametrize("name", ALL)
def test_extreme_ratio_on_a_dropped_or_masked_token_gives_finite_gradients(name):
    # token 2 has r = e^200 (overflows float32 exp); only aipo keeps it, with a truncated weight
    inputs = LossInputs(
        trainer_logprobs=torch.tensor([-1.0, -0.5, -2.0], requires_grad=True),
        sampling_logprobs=torch.tensor([-1.0, -200.5, float("inf")]),
        advantages=torch.tensor([1.0, 1.0, 1.0]),
        loss_mask=torch.tensor([True, True, False]),
    )
    out, grad = run(name, inputs, **({"kl_tau": 0.0} if name == "dppo_kl" else {}))
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad).all()
    assert grad[2].item() == 0.0


@st.composite
def masked_samples(draw):
    n = draw(st.integers(1, 12))
    logp = st.floats(-6.0, -0.01)
    trainer = draw(st.lists(logp, min_size=n, max_size=n))
    sampling = draw(st.lists(logp, min_size=n, max_size=n))
    adv = draw(st.floats(-2.0, 2.0))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    garbage = draw(st.sampled_from([NAN, float("inf"), -float("inf"), 1e30]))
    return trainer, sampling, adv, mask, garbage


@settings(max_examples=60, deadline=None)
@given(sample=masked_samples(), name=st.sampled_from(ALL), level=st.sampled_from(LEVELS))
def test_masked_positions_never_matter(sample, name, level):
    """Loss, metrics and gradient equal those of the sample with its masked tokens removed."""
    trainer, sampling, adv, mask, garbage = sample
    dirty = [q if m else garbage for q, m in zip(sampling, mask, strict=True)]
    full = LossInputs(
        trainer_logprobs=torch.tensor(trainer, dtype=torch.float64, requires_grad=True),
        sampling_logprobs=torch.tensor(dirty, dtype=torch.float64),
        advantages=torch.full((len(trainer),), adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask),
    )
    kept = [i for i, m in enumerate(mask) if m]
    compact = LossInputs(
        trainer_logprobs=torch.tensor([trainer[i] for i in kept], dtype=torch.float64, requires_grad=True),
        sampling_logprobs=torch.tensor([sampling[i] for i in kept], dtype=torch.float64),
        advantages=torch.full((len(kept),), adv, dtype=torch.float64),
        loss_mask=torch.ones(len(kept), dtype=torch.bool),
    )
    out_full, grad_full = run(name, full, ratio_level=level)
    out_compact, grad_compact = run(name, compact, ratio_level=level)
    assert torch.isfinite(out_full.loss)
    assert out_full.loss.item() == pytest.approx(out_compact.loss.item(), rel=1e-9, abs=1e-12)
    for key, value in out_full.metrics.items():
        assert value.item() == pytest.approx(out_compact.metrics[key].item(), rel=1e-9, abs=1e-12), key
    assert grad_full[kept].tolist() == pytest.approx(grad_compact.tolist(), rel=1e-9, abs=1e-12)
    assert all(grad_full[i].item() == 0.0 for i, m in enumerate(mask) if not m)
    assert out_full.metrics["mismatch_kl"].item() >= 0
    assert out_full.metrics["masked"].item() <= len(kept)


# ----------------------------------------------------------------------------- parameters and registry


BAND = "trainer.loss.band: expected [low, high] with 0 < low < 1 < high"


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("icepop", {"band": [1.5, 5]}, f"{BAND}, got [1.5, 5]"),
        ("icepop", {"band": [0.5, 0.9]}, f"{BAND}, got [0.5, 0.9]"),
        ("icepop", {"band": [0.5]}, "trainer.loss.band.1: Field required"),
        ("icepop", {"band": [0.5, math.inf]}, "trainer.loss.band.1: Input should be a finite number, got inf"),
        ("dppo_kl", {"mask_low": 0.0}, "trainer.loss.mask_low: Input should be greater than 0, got 0.0"),
        ("dppo_kl", {"mask_high": -1}, "trainer.loss.mask_high: Input should be greater than 0, got -1"),
        ("dppo_kl", {"kl_tau": -1e-3}, "trainer.loss.kl_tau: Input should be greater than or equal to 0, got -0.001"),
        ("dppo_kl", {"kl_tau": math.nan}, "trainer.loss.kl_tau: Input should be a finite number, got nan"),
        ("ipo", {"epsilon": 0}, "trainer.loss.epsilon: Input should be greater than 0, got 0"),
        ("aipo", {"max_ratio": 1.0}, "trainer.loss.max_ratio: Input should be greater than 1, got 1.0"),
        ("aipo", {"ratio_level": "seq"}, "trainer.loss.ratio_level: Input should be 'token' or 'sequence', got 'seq'"),
    ],
)
def test_bad_parameters_are_refused_by_the_spec(name, params, message):
    """Loss parameters are validated once, by the spec (the losses do arithmetic only)."""
    with pytest.raises(SpecError) as err:
        validate_spec("rl", {"model": {"name": "some/model"}, "trainer": {"loss": {"type": name, **params}}})
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("ipo", {"band": (0.5, 5)}, "trainer.loss.band: not a parameter of loss 'ipo'"),
        ("ppo", {}, "trainer.loss.type: expected one of ['aipo', 'custom', 'dppo_kl', 'icepop', 'ipo'], got 'ppo'"),
    ],
)
def test_registry_names_the_spec_field(name, params, message):
    with pytest.raises(ValueError) as err:
        compute_sample_loss(name, make([0.5], [0.5], [1.0]), **params)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_registry_matches_the_spec_names_and_defaults():
    assert set(LOSSES) == {"dppo_kl", "ipo", "icepop", "aipo"}
    dppo_defaults = {"mask_low": 0.2, "mask_high": 0.2, "kl_tau": 1e-3, "ratio_level": "token"}
    assert LOSSES["dppo_kl"].__kwdefaults__ == dppo_defaults
    assert LOSSES["ipo"].__kwdefaults__ == {"epsilon": 0.2, "ratio_level": "token"}
    assert LOSSES["icepop"].__kwdefaults__ == {"band": (0.5, 5.0), "ratio_level": "token"}
    assert LOSSES["aipo"].__kwdefaults__ == {"max_ratio": 2.0, "ratio_level": "token"}


# ----------------------------------------------------------------------------- logits helpers


def test_selective_log_softmax_matches_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(37, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (37,))
    got = selective_log_softmax(logits, targets, chunk_size=8)
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want)
    (g1,) = torch.autograd.grad(got.sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(g1, g2)


def test_selective_log_softmax_by_hand_and_bf16():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; targets [1, 0] on two rows -> [ln 0.75, ln 0.25]
    logits = torch.tensor([[0.0, LN(3)], [0.0, LN(3)]])
    got = selective_log_softmax(logits, torch.tensor([1, 0]))
    assert got.tolist() == pytest.approx([LN(0.75), LN(0.25)], abs=1e-6)
    got_bf16 = selective_log_softmax(logits.bfloat16(), torch.tensor([1, 0]))
    assert got_bf16.dtype == torch.float32
    assert got_bf16.tolist() == pytest.approx([LN(0.75), LN(0.25)], abs=1e-2)


def test_entropy_from_logits():
    # uniform over 8 -> ln 8 ; [0, ln 3] -> -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335 ; near one-hot -> ~0
    logits = torch.tensor([[0.0] * 8, [0.0, LN(3)] + [-1e4] * 6, [50.0] + [0.0] * 7])
    got = entropy_from_logits(logits, chunk_size=2)
    assert got.tolist() == pytest.approx([LN(8), 0.562335, 0.0], abs=1e-5)
    assert not got.requires_grad


def test_mismatch_kl_k3():
    # r - ln r - 1 at r = 1, 2, 0.5: 0, 1 - ln 2 = 0.306853, ln 2 - 0.5 = 0.193147
    got = mismatch_kl_k3(torch.tensor([0.0, LN(2), LN(0.5)], dtype=torch.float64))
    assert got.tolist() == pytest.approx([0.0, 0.306853, 0.193147], abs=1e-6)
