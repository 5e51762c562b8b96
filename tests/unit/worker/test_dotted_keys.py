import pytest

from worker.dotted_keys import DottedKeyError, flatten, get_key, replay, with_keys


def test_with_keys_sets_creates_and_leaves_the_input():
    spec = {"trainer": {"optim": {"lr": 1e-4}}, "max_steps": 8}
    out = with_keys(spec, {"trainer.optim.lr": 5e-5, "orchestrator.eval.interval": 2})
    assert out == {"trainer": {"optim": {"lr": 5e-5}}, "max_steps": 8, "orchestrator": {"eval": {"interval": 2}}}
    assert spec == {"trainer": {"optim": {"lr": 1e-4}}, "max_steps": 8}
    assert get_key(out, "orchestrator.eval.interval") == 2


@pytest.mark.parametrize(
    ("key", "reason"),
    [("a..b", "expected a dotted key such as trainer.optim.lr"), ("max_steps.x", "max_steps is not a table")],
)
def test_with_keys_names_the_bad_key(key, reason):
    with pytest.raises(DottedKeyError) as err:
        with_keys({"max_steps": 8}, {"ok": 1, key: 2})
    assert (err.value.key, str(err.value)) == (key, reason)


def test_replay_applies_revisions_in_order_and_flatten_inverts():
    spec = {"trainer": {"optim": {"lr": 1e-4}}}
    live = replay(spec, [{"trainer.optim.lr": 5e-5}, {"trainer.optim.lr": 2e-5, "orchestrator.temperature": 0.7}])
    assert flatten(live) == {"trainer.optim.lr": 2e-5, "orchestrator.temperature": 0.7}
    assert flatten({"a": {}, "b": {"c": 1}}) == {"a": {}, "b.c": 1}


def test_closest_is_the_one_matcher_of_every_hint():
    """Spec keys (one part, cutoff 0.5), live keys and metric names (0.85) share ``closest``: no other module matches
    names with difflib's ``get_close_matches``."""
    from pathlib import Path

    from worker.dotted_keys import closest, did_you_mean

    assert closest("lrr", ["lr", "betas"], cutoff=0.5) == "lr"
    assert closest("lrr", ["lr", "betas"]) is None  # 0.8 < 0.85
    assert did_you_mean("trainer.optim.lrr", ["trainer.optim.lr"]) == " (did you mean 'trainer.optim.lr'?)"
    repo = Path(__file__).resolve().parents[3]
    users = sorted(
        str(p.relative_to(repo))
        for package in ("server", "worker", "webui")
        for p in (repo / package).rglob("*.py")
        if "get_close_matches(" in p.read_text()
    )
    assert users == ["worker/dotted_keys.py"]
