"""The one-click eval job of a checkpoint (``server.services.evals.checkpoint_spec``) and the chart of eval reward over
checkpoints (``webui.figures.checkpoint_evals_figure``), without a database."""

from __future__ import annotations

from server.models import Run
from server.services.evals import EvalPoint, checkpoint_spec
from webui.figures import NO_DATA, checkpoint_evals_figure
from worker.spec import validate_spec


def test_an_sft_runs_checkpoint_is_evaluated_greedy_on_its_environment() -> None:
    spec = validate_spec(
        "sft", {"name": "warm", "model": {"name": "m"}, "env": {"args": {"system_message": False}}, "eval_examples": 9}
    ).model_dump(mode="json")
    run = Run(id=12, name="warm", kind="sft", spec=spec, spec_hash="", owner="a", run_dir="")
    job = validate_spec("eval", checkpoint_spec(run, 40))
    assert job.name == "warm-eval-40" and (job.model.run, job.model.step, job.model.name) == (12, 40, "")
    assert [(e.id, e.args) for e in job.envs] == [("reverse_text", {"system_message": False})]
    assert job.eval.model_dump() == {
        "num_examples": 9,
        "temperature": 0.0,
        "max_tokens": 64,
        "pass_k": 1,
        "pass_threshold": 1.0,
        "num_samples": None,
    }
    assert job.seed == spec["seed"] == 0


def test_an_rl_runs_checkpoint_takes_its_eval_settings_and_mixture() -> None:
    data = {
        "name": "r" * 100,
        "seed": 3,
        "model": {"name": "m"},
        "env": [{"id": "reverse_text", "name": "a"}, {"id": "arithmetic", "name": "b", "weight": 0}],
        "orchestrator": {
            "max_tokens": 40,
            "eval": {"num_examples": 7, "temperature": 0.5, "pass_k": 4, "num_samples": 12},
        },
    }
    stored = validate_spec("rl", data).model_dump(mode="json")
    run = Run(id=3, name="r" * 100, kind="rl", spec=stored, spec_hash="", owner="a", run_dir="")
    job = validate_spec("eval", checkpoint_spec(run, 1000))
    assert job.name == "r" * 80 + "-eval-1000" and job.seed == 3
    assert [(e.name, e.weight) for e in job.envs] == [("a", 1.0), ("b", 0.0)]
    assert (job.eval.num_examples, job.eval.temperature, job.eval.pass_k, job.eval.max_tokens) == (7, 0.5, 4, 40)
    assert job.eval.num_samples == 12  # the run's own online evals' samples per task


def test_the_chart_draws_finished_evals_by_step_with_each_environment() -> None:
    points = [
        EvalPoint(8, 20, 20, "completed", {"reward_mean": 0.4, "pass_at_k": 0.1, "reward_mean/a": 0.5}),
        EvalPoint(9, 40, 40, "running", {}),
        EvalPoint(10, None, 60, "completed", {"reward_mean": 0.6, "pass_at_k": 0.2}),
    ]
    fig = checkpoint_evals_figure(points)
    lines = [(t["name"], t["x"], t["y"], t["text"]) for t in fig["data"]]
    assert lines == [
        ("reward_mean", [20, 60], [0.4, 0.6], ["eval run #8", "eval run #10"]),
        ("pass_at_k", [20, 60], [0.1, 0.2], ["eval run #8", "eval run #10"]),
        ("reward_mean/a", [20], [0.5], ["eval run #8"]),
    ]
    empty = checkpoint_evals_figure([points[1]])
    assert empty["data"] == [] and any(a.get("text") == NO_DATA for a in empty["layout"]["annotations"])
