"""Plugins (``type = "custom"``): the worked example of ``examples/plugins`` loads through the spec and computes
hand-computed values; a function that does not import, is not callable or has the wrong parameters is one line
naming the key; the service's rule for user code covers every ``import_path``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.orchestrator.advantages import compute_advantages
from worker.orchestrator.advantages.custom import load_custom_advantage
from worker.spec import CustomAdvantage, CustomGate, CustomLoss, SpecError, validate_spec
from worker.spec.user_code import CodeNotAllowed, check_spec_code, load_function
from worker.trainer.loss import LossInputs, compute_sample_loss, load_custom_loss

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "plugins"
RLOO = "asyncrl_example_plugins.advantages:leave_one_out"
REINFORCE = "asyncrl_example_plugins.losses:reinforce"


@pytest.fixture(autouse=True)
def example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example package importable in every test here, as after ``pip install examples/plugins``."""
    monkeypatch.syspath_prepend(str(EXAMPLE))


def rl_spec(**tables: object):
    return validate_spec("rl", {"model": {"name": "m"}, **tables})


def test_example_advantage_is_leave_one_out_from_the_spec() -> None:
    spec = rl_spec(orchestrator={"advantage": {"type": "custom", "import_path": RLOO, "kwargs": {"scale": 2.0}}})
    config = spec.orchestrator.advantage
    assert isinstance(config, CustomAdvantage)
    # present rewards [1, 0, 0.5] (the None is taken out before the call, case C8): sum 1.5, N = 3
    #   A_i = scale * (R_i - (1.5 - R_i) / 2):  1 - 0.25 = 0.75,  0 - 0.75 = -0.75,  0.5 - 0.5 = 0  -> x2
    result = compute_advantages(config, [1.0, 0.0, None, 0.5], [3, 4, 5, 6])
    assert result.advantages == [pytest.approx(1.5), pytest.approx(-1.5), None, pytest.approx(0.0)]
    assert (result.reward_mean, result.reward_missing, result.all_missing) == (pytest.approx(0.5), 1, False)
    assert compute_advantages(config, [0.7], [3]).advantages == [0.0]  # a group of one: no other rollout
    flagged = compute_advantages(config, [None, None], [3, 3])  # the function is not called for no reward
    assert flagged.all_missing and flagged.advantages == [None, None]


def test_example_loss_is_reinforce_with_the_standard_metrics_filled_in() -> None:
    spec = rl_spec(trainer={"loss": {"type": "custom", "import_path": REINFORCE, "kwargs": {"scale": 0.5}}})
    config = spec.trainer.loss
    assert isinstance(config, CustomLoss)
    # tokens: p_train [0.5, 0.25, 1.0], p_infer [0.25, 0.25, NaN], A = 2, mask [1, 1, 0]
    # loss = -0.5 * (2 ln 0.5 + 2 ln 0.25) = -(ln 0.5 + ln 0.25) = ln 8 = 2.0794415
    # d loss / d log pi_t = -scale * A_t = -1 on the loss tokens, 0 on the masked one
    # mismatch_kl (filled in) = k3(r = 2) + k3(r = 1) = (2 - ln 2 - 1) + 0 = 0.3068528
    trainer_lp = torch.tensor([math.log(0.5), math.log(0.25), 0.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        trainer_logprobs=trainer_lp,
        sampling_logprobs=torch.tensor([math.log(0.25), math.log(0.25), float("nan")], dtype=torch.float64),
        advantages=torch.full((3,), 2.0, dtype=torch.float64),
        loss_mask=torch.tensor([True, True, False]),
    )
    out = compute_sample_loss(config.type, inputs, **config.model_dump(exclude={"type"}))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(math.log(8))
    assert trainer_lp.grad is not None and trainer_lp.grad.tolist() == pytest.approx([-1.0, -1.0, 0.0])
    metrics = {k: v.item() for k, v in out.metrics.items()}
    assert metrics["loss_tokens"] == 2 and metrics["masked"] == 0
    assert metrics["mismatch_kl"] == pytest.approx(1 - math.log(2))
    assert metrics["is_ratio"] == pytest.approx(3.0)  # r = 2 and 1


def test_entry_point_name_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "asyncrl_example_plugins-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: asyncrl-example-plugins\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[asyncrl.plugins]\nleave_one_out = {RLOO}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = rl_spec(orchestrator={"advantage": {"type": "custom", "import_path": "leave_one_out"}})
    assert load_custom_advantage(config.orchestrator.advantage)([1.0, 0.0], [1, 1]) == [1.0, -1.0]  # 1-0, 0-1
    check_spec_code(config, allowed=())  # an installed package registered it: allowed at the service


SIGNATURE = "(rewards, completion_lengths, *, scale=1.0)"


@pytest.mark.parametrize(
    ("key", "value", "kwargs", "message"),
    [
        (
            "trainer.loss.import_path",
            "no_such_pkg.mod:fn",
            {},
            "trainer.loss.import_path: cannot import 'no_such_pkg.mod': ModuleNotFoundError: No module named "
            "'no_such_pkg'",
        ),
        (
            "trainer.loss.import_path",
            "asyncrl_example_plugins.losses:nope",
            {},
            "trainer.loss.import_path: module 'asyncrl_example_plugins.losses' has no attribute 'nope'",
        ),
        ("trainer.loss.import_path", "math:pi", {}, "trainer.loss.import_path: math:pi is a float, not a function"),
        (
            "trainer.loss.import_path",
            RLOO,
            {},
            f"trainer.loss.import_path: {RLOO}{SIGNATURE} cannot be called as leave_one_out(inputs): missing a "
            "required argument: 'completion_lengths'",
        ),
        (
            "orchestrator.advantage.import_path",
            RLOO,
            {"temperature": 1.0},
            f"orchestrator.advantage.import_path: {RLOO}{SIGNATURE} cannot be called as leave_one_out(rewards, "
            "completion_lengths, temperature=...): got an unexpected keyword argument 'temperature'",
        ),
    ],
)
def test_a_function_that_cannot_be_called_so_is_one_line_naming_the_key(
    key: str, value: str, kwargs: dict[str, object], message: str
) -> None:
    args = ("inputs",) if key.startswith("trainer") else ("rewards", "completion_lengths")
    with pytest.raises(SpecError) as err:
        load_function(key, value, args=args, kwargs=kwargs)
    assert str(err.value) == message


def test_launch_checks_load_through_the_registries() -> None:
    loss = rl_spec(trainer={"loss": {"type": "custom", "import_path": RLOO}}).trainer.loss
    assert isinstance(loss, CustomLoss)
    with pytest.raises(SpecError, match=r"^trainer\.loss\.import_path: .* cannot be called as leave_one_out\(inputs\)"):
        load_custom_loss(loss)
    adv = rl_spec(orchestrator={"advantage": {"type": "custom", "import_path": REINFORCE}}).orchestrator.advantage
    assert isinstance(adv, CustomAdvantage)
    with pytest.raises(SpecError, match=r"^orchestrator\.advantage\.import_path: .* cannot be called as reinforce\("):
        load_custom_advantage(adv)


@pytest.mark.parametrize(
    ("tables", "key"),
    [
        ({"trainer": {"loss": {"type": "custom", "import_path": "os:system"}}}, "trainer.loss.import_path"),
        (
            {"orchestrator": {"advantage": {"type": "custom", "import_path": RLOO}}},
            "orchestrator.advantage.import_path",
        ),
    ],
)
def test_the_service_allows_only_allowed_packages(tables: dict[str, object], key: str) -> None:
    spec = rl_spec(**tables)
    value = spec.model_dump()[key.split(".")[0]][key.split(".")[1]]["import_path"]
    with pytest.raises(CodeNotAllowed) as err:
        check_spec_code(spec, allowed=())
    assert str(err.value) == (
        f"{key}: {value!r} is not allowed in a run submitted to the service; allowed: package.module:attr from an "
        "allowed package (ALLOWED_CODE_PACKAGES: none)"
    )
    check_spec_code(rl_spec(**tables), allowed=(value.split(".")[0].split(":")[0],))  # its package allowed: passes


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"type": "custom"}, "trainer.loss.import_path: Field required"),
        (
            {"type": "custom", "import_path": "os.system"},
            "trainer.loss.import_path: expected package.module:function, got 'os.system'",
        ),
        (
            {"type": "custom", "import_path": "a:b", "scale": 1},
            "unknown key 'trainer.loss.scale' (valid keys here: import_path, kwargs, type)",
        ),
    ],
)
def test_spec_refuses_a_malformed_custom_table(table: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as err:
        rl_spec(trainer={"loss": table})
    assert str(err.value) == message


TOO_EASY = "asyncrl_example_plugins.gates:too_easy"


def test_example_gate_rejects_groups_the_policy_solves() -> None:
    from worker.orchestrator.gates import first_rejecting

    spec = rl_spec(
        orchestrator={"gates": [{"type": "custom", "import_path": TOO_EASY, "kwargs": {"max_pass_rate": 0.5}}]}
    )
    gates = spec.orchestrator.gates
    assert isinstance(gates[0], CustomGate)
    # present rewards (1, 1, 0): 2 of 3 pass, 2/3 > 0.5 -> rejected (gate 0); (1, 0, 0.5): 1/3 -> kept
    assert first_rejecting(gates, [1.0, 1.0, 0.0, None], [0.3, 0.3, -0.7, None]) == 0
    assert first_rejecting(gates, [1.0, 0.0, 0.5], [0.5, -0.5, 0.0]) is None
    # NaN is missing (one rule): the gate sees (1, None) -> 1/1 > 0.5; as a reward NaN would have made it 1/2
    assert first_rejecting(gates, [1.0, float("nan")], [0.0, None]) == 0
    assert first_rejecting(gates, [None, None], [None, None]) is None  # no reward: the example keeps it


def test_custom_gate_checks_its_signature_and_its_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.orchestrator.gates import first_rejecting, load_custom_gate

    wrong = rl_spec(orchestrator={"gates": [{"type": "custom", "import_path": TOO_EASY, "kwargs": {"scale": 1}}]})
    with pytest.raises(SpecError) as err:
        load_custom_gate(wrong.orchestrator.gates[0], "orchestrator.gates.0.import_path")
    assert str(err.value) == (
        f"orchestrator.gates.0.import_path: {TOO_EASY}(rewards, advantages, *, pass_threshold=1.0, max_pass_rate=0.75)"
        " cannot be called as too_easy(rewards, advantages, scale=...): got an unexpected keyword argument 'scale'"
    )
    (tmp_path / "gate_returns_a_number.py").write_text("def gate(rewards, advantages):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    odd = rl_spec(orchestrator={"gates": [{"type": "custom", "import_path": "gate_returns_a_number:gate"}]})
    with pytest.raises(ValueError) as bad:
        first_rejecting(odd.orchestrator.gates, [1.0], [0.0])
    assert str(bad.value) == (
        "orchestrator.gates.import_path: gate_returns_a_number:gate returned 1 (int); expected True (reject) or "
        "False (keep)"
    )


NUMPY_GATE = """import numpy as np
import torch

def gate(rewards, advantages, *, kind):
    mean = np.mean([r for r in rewards if r is not None])
    return {
        "numpy": mean > 0.5,
        "array": np.array(mean > 0.5),
        "torch": torch.tensor(mean > 0.5),
        "float": mean,
        "vector": np.array([True, False]),
        "none": None,
    }[kind]
"""


@pytest.mark.parametrize(
    ("kind", "refused"),
    [
        ("numpy", None),
        ("array", None),
        ("torch", None),
        ("float", "returned np.float64(0.75) (float64)"),
        ("vector", "returned array([ True, False]) (ndarray)"),
        ("none", "returned None (NoneType)"),
    ],
)
def test_custom_gate_takes_numpy_and_torch_bools_and_refuses_other_types(
    kind: str, refused: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.orchestrator.gates import first_rejecting

    (tmp_path / "numpy_gate.py").write_text(NUMPY_GATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    gates = rl_spec(
        orchestrator={"gates": [{"type": "custom", "import_path": "numpy_gate:gate", "kwargs": {"kind": kind}}]}
    ).orchestrator.gates
    if refused is None:
        assert first_rejecting(gates, [1.0, 1.0, 1.0, 0.0], [0.2, 0.2, 0.2, -0.6]) == 0  # mean 0.75 > 0.5: reject
        assert first_rejecting(gates, [1.0, 0.0, 0.0], [0.6, -0.3, -0.3]) is None  # mean 1/3: keep
        return
    with pytest.raises(ValueError) as bad:
        first_rejecting(gates, [1.0, 1.0, 1.0, 0.0], [0.2, 0.2, 0.2, -0.6])
    assert str(bad.value) == (
        f"orchestrator.gates.import_path: numpy_gate:gate {refused}; expected True (reject) or False (keep)"
    )


def test_the_service_refuses_a_custom_gate_of_a_package_not_allowed() -> None:
    spec = rl_spec(orchestrator={"gates": [{"type": "custom", "import_path": TOO_EASY}]})
    with pytest.raises(CodeNotAllowed) as err:
        check_spec_code(spec, allowed=())
    assert str(err.value) == (
        f"orchestrator.gates.0.import_path: {TOO_EASY!r} is not allowed in a run submitted to the service; allowed: "
        "package.module:attr from an allowed package (ALLOWED_CODE_PACKAGES: none)"
    )
    check_spec_code(spec, allowed=("asyncrl_example_plugins",))
