"""Continuous admission (``worker/orchestrator/admission.py``): which finished group lands in which batch, stale drops,
slot refills, request seeds and environment draws by position, the checkpoint's data cursor, the spec's option; and
the orchestrator's producer driving it with groups whose finish order the test sets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.simulated_server import sim_app
from worker.orchestrator.admission import (
    CONTINUOUS_SEED,
    AdmissionQueue,
    Finished,
    Start,
    group_start_version,
)
from worker.orchestrator.batcher import Rollout
from worker.orchestrator.data import TaskSampler, request_seed
from worker.orchestrator.mixture import EnvMixture, MixtureEnv, choose_env
from worker.orchestrator.orchestrator import Orchestrator
from worker.run.rundir import RunDir
from worker.spec import EnvConfig, SpecError, validate_spec


def _queue(slots: int, tasks: list[str]) -> AdmissionQueue[str, str]:
    q: AdmissionQueue[str, str] = AdmissionQueue(slots, next_step=1)
    q.add_chunk(0, tasks)
    return q


def _names(taken: list[Finished[str, str]]) -> list[str]:
    return [f.group for f in taken]


# ----------------------------------------------------------------------------- the queue


def test_a_batch_takes_the_first_groups_to_finish_in_finish_order() -> None:
    q = _queue(4, ["a", "b", "c", "d"])
    starts = [q.start() for _ in range(4)]
    assert [s.task for s in starts if s] == ["a", "b", "c", "d"] and q.start() is None
    by_task = {s.task: s for s in starts if s}
    q.finish(by_task["c"], "c", v_start=0)
    assert q.take(1, 2, max_off_policy_steps=8) is None  # one ready, two wanted: nothing taken, c stays queued
    q.finish(by_task["a"], "a", v_start=0)
    q.finish(by_task["d"], "d", v_start=0)
    first = q.take(1, 2, max_off_policy_steps=8)
    assert first is not None and _names(first.groups) == ["c", "a"] and first.dropped_stale == 0
    assert q.next_step == 2 and _names(list(q.ready)) == ["d"]  # d waits for step 2
    q.finish(by_task["b"], "b", v_start=0)
    second = q.take(2, 2, max_off_policy_steps=8)
    assert second is not None and _names(second.groups) == ["d", "b"]


def test_batches_are_taken_in_step_order() -> None:
    q = _queue(1, ["a"])
    with pytest.raises(ValueError, match="batch of step 2 asked, step 1 fills next"):
        q.take(2, 1, 8)


def test_a_freed_slot_starts_the_next_task() -> None:
    q = _queue(2, ["a", "b", "c", "d"])
    a, b = q.start(), q.start()
    assert (a, b) == (Start(0, "a"), Start(1, "b")) and q.free() == 0 and q.start() is None
    q.finish(b, "b", v_start=0)
    assert q.free() == 1 and q.start() == Start(2, "c") and q.free() == 0
    q.slots = 3  # a live batch_size raised the slots
    assert q.start() == Start(3, "d") and q.needs_chunk() and q.start() is None  # the chunk is used up
    q.slots = 1  # lowered below the groups running: no slot until two finish
    assert q.free() == 0
    q.finish(a, "a", v_start=0)
    assert q.free() == 0


def test_stale_groups_are_dropped_and_counted_with_the_step_that_filled() -> None:
    """Step 4 trains v3; with max_off_policy_steps 1 a group started under v < 2 is stale (lag = 3 - v_start)."""
    q: AdmissionQueue[int, str] = AdmissionQueue(8, next_step=4)
    q.add_chunk(0, list(range(6)))
    starts = [q.start() for _ in range(6)]
    for s, v in zip(starts, [0, 2, 1, 0, 3, 2], strict=True):  # lags 3, 1, 2, 3, 0, 1
        assert s is not None
        q.finish(s, f"g{s.task}", v_start=v)
    taken = q.take(4, 2, max_off_policy_steps=1)
    assert taken is not None and _names(taken.groups) == ["g1", "g4"] and taken.dropped_stale == 3
    assert _names(taken.stale) == ["g0", "g2", "g3"]  # the groups themselves: finished, in the bias metrics (C26)
    assert _names(list(q.ready)) == ["g5"]  # fresh, for step 5 (lag 2 there: dropped then)
    assert q.take(5, 1, max_off_policy_steps=1) is None  # counted for step 5, which is not complete yet
    q.add_chunk(6, [6])
    s6 = q.start()
    assert s6 is not None
    q.finish(s6, "g6", v_start=4)
    fifth = q.take(5, 1, max_off_policy_steps=1)
    assert fifth is not None and _names(fifth.groups) == ["g6"] and fifth.dropped_stale == 1  # g5, counted once
    assert _names(fifth.stale) == ["g5"]


def test_a_groups_start_version_is_its_oldest_rollouts() -> None:
    assert group_start_version([(3, 4), (2, 4), (3, 3)], started_at=3) == 2  # a multi-turn rollout reached by v3
    assert group_start_version([], started_at=5) == 5


# ----------------------------------------------------------------------------- positions, seeds, cursor


def test_chunks_draw_environments_by_position() -> None:
    configs = [EnvConfig(name="a", weight=3.0), EnvConfig(name="b", weight=1.0)]
    samplers = [TaskSampler(None, seed=0) for _ in configs]
    envs = [MixtureEnv(c, None, None, s) for c, s in zip(configs, samplers, strict=True)]  # type: ignore[arg-type]
    mix = EnvMixture(envs, seed=0)
    first = mix.take(1, 4, places=(CONTINUOUS_SEED, 0))
    assert mix.position == 4
    second = mix.take(1, 4, places=(CONTINUOUS_SEED, mix.position))
    chosen = [choose_env([3.0, 1.0], 0, CONTINUOUS_SEED, p) for p in range(8)]
    assert [env for env, _ in first + second] == chosen
    # each env hands out its own tasks in order: the k-th group of env e gets task k
    assert [task for env, task in first + second if env == 0] == list(range(chosen.count(0)))


def test_seeds_are_a_function_of_the_position_alone() -> None:
    seeds = [request_seed(7, CONTINUOUS_SEED, p) for p in range(64)]
    assert seeds == [request_seed(7, CONTINUOUS_SEED, p) for p in range(64)]
    assert len(set(seeds)) == 64
    step_seeds = {request_seed(7, step, slot) for step in range(1, 9) for slot in range(8)}
    assert not set(seeds) & step_seeds


def test_the_checkpoint_keeps_the_cursor_after_the_last_chunk_taken_before_its_step_was_complete(
    tmp_path: Path,
) -> None:
    """Chunks of 2 keyed by the step filling when taken: 1, 1, 1, 2, 3 (cursors 2, 4, 6, 8, 10)."""
    sampler = TaskSampler(16, seed=0)
    for key in (1, 1, 1, 2, 3):
        sampler.take(key, 2)
    for step, cursor in ((1, 6), (1, 6), (2, 8), (4, 10), (4, 10)):  # a step without a chunk: the last before it
        sampler.write_state(tmp_path, step)
        assert json.loads((tmp_path / "state.json").read_text())["data_cursor"] == cursor
    resumed = TaskSampler.resume(tmp_path, step=4, num_tasks=16, seed=0, batch_size=2)
    assert resumed.cursor == 10


# ----------------------------------------------------------------------------- the spec option


def test_the_spec_option_and_its_one_line_errors() -> None:
    model = {"model": {"name": "m"}}
    default = validate_spec("rl", model).orchestrator
    assert default.admission == "step" and default.inflight_groups is None
    cont = validate_spec(
        "rl", {**model, "orchestrator": {"admission": "continuous", "batch_size": 4, "max_async_level": 2}}
    ).orchestrator
    assert cont.groups_in_flight() == 12
    explicit = validate_spec("rl", {**model, "orchestrator": {"admission": "continuous", "inflight_groups": 5}})
    assert explicit.orchestrator.groups_in_flight() == 5
    bad = {
        "orchestrator.inflight_groups: only with orchestrator.admission = \"continuous\", got admission 'step'": {
            "inflight_groups": 5
        },
        'orchestrator.admission: expected "step" with orchestrator.gates (continuous admission re-samples no group), '
        'got "continuous"': {"admission": "continuous", "gates": [{"type": "advantage_range", "reject_max": 0}]},
        "orchestrator.admission: expected \"step\" with orchestrator.curriculum.type 'difficulty_pool' (continuous "
        'admission draws no tasks per step), got "continuous"': {
            "admission": "continuous",
            "curriculum": {"type": "difficulty_pool"},
        },
        "orchestrator.admission: Input should be 'step' or 'continuous', got 'steps'": {"admission": "steps"},
    }
    for message, orch in bad.items():
        with pytest.raises(SpecError) as err:
            validate_spec("rl", {**model, "orchestrator": orch})
        assert str(err.value) == message


# ----------------------------------------------------------------------------- the producer


class _Groups:
    """Stand-in for ``Orchestrator.rollout_group``: each group waits until the test finishes it."""

    def __init__(self, orch: Any) -> None:
        self.orch, self.calls, self.pending = orch, [], {}

    async def __call__(self, index: int, seed: int | None, env: int = 0) -> list[Rollout]:
        v_start = self.orch.policy_version
        self.calls.append((index, seed, v_start))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending[index] = done
        await done
        return [Rollout(str(index), [1], [2], [-0.5], "x", "stop", 1.0, None, (v_start, self.orch.policy_version), 1.0)]

    def finish(self, *indices: int) -> None:
        for i in indices:
            self.pending.pop(i).set_result(None)


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def _orchestrator(tmp_path: Path) -> Any:
    """An Orchestrator with the parts ``produce`` uses (no server, no tokenizer): batch_size 2 (a group: one rollout),
    max_async_level 1 (4 slots), max_off_policy_steps 1, 3 steps, an endless taskset (task = position)."""
    spec = validate_spec(
        "rl",
        {
            "model": {"name": "m"},
            "max_steps": 3,
            "seed": 7,
            "orchestrator": {
                "admission": "continuous",
                "batch_size": 2,
                "group_size": 2,
                "max_async_level": 1,
                "max_off_policy_steps": 1,
            },
        },
    )
    run = RunDir(tmp_path / "run")
    run.create()
    orch: Any = Orchestrator.__new__(Orchestrator)
    orch.spec, orch.run, orch.start_step, orch.end = spec, run, 0, 3
    orch.seeded_requests = True
    orch.sampler = EnvMixture([MixtureEnv(EnvConfig(), None, None, TaskSampler(None, seed=7))], seed=7)  # type: ignore[arg-type]
    orch.policy_version, orch._version_changed = 0, asyncio.Condition()
    orch.live = orch_live(run)
    orch._steps, orch._step_specs, orch._gated = {}, {}, {}
    orch.admission = AdmissionQueue(spec.orchestrator.groups_in_flight(), next_step=1)
    orch._admission_changed, orch._admission_wait = asyncio.Event(), 0.0
    orch._admission_error, orch._admission_dropped = None, {}
    orch.rollout_group = _Groups(orch)
    return orch


def orch_live(run: RunDir) -> Any:
    from worker.live_config import LiveConfig

    return LiveConfig(run.root, "orchestrator")


def test_the_producer_fills_slots_and_batches_by_finish_order(tmp_path: Path) -> None:
    async def scenario() -> None:
        orch = _orchestrator(tmp_path)
        groups: _Groups = orch.rollout_group
        producer = asyncio.create_task(orch.produce())
        await _settle()
        assert [c[0] for c in groups.calls] == [0, 1, 2, 3]  # 4 slots: two chunks of batch_size 2
        groups.finish(2, 0)
        await _settle()
        assert [c[0] for c in groups.calls] == [0, 1, 2, 3, 4, 5]  # each finish refilled a slot
        one, _, _ = await orch._steps.pop(1)
        assert [g[0].task_key for g in one] == ["2", "0"]
        assert orch.observe_step(1, orch.spec.orchestrator) == {"admission_dropped_stale_groups": 0}
        orch.sampler.write_state(tmp_path, 1)  # chunks (0, 1), (2, 3), (4, 5) were taken while step 1 filled
        assert json.loads((tmp_path / "state.json").read_text())["data_cursor"] == 6
        async with orch._version_changed:  # the trainer published v1 from batch 1
            orch.policy_version = 1
            orch._version_changed.notify_all()
        groups.finish(1, 3)
        await _settle()
        two, _, _ = await orch._steps.pop(2)
        assert [g[0].task_key for g in two] == ["1", "3"]  # lag (2 - 1) - 0 = 1: trained
        assert orch.observe_step(2, orch.spec.orchestrator) == {"admission_dropped_stale_groups": 0}
        orch.sampler.write_state(tmp_path, 2)
        assert json.loads((tmp_path / "state.json").read_text())["data_cursor"] == 8  # chunk (6, 7) while 2 filled
        assert [(c[0], c[2]) for c in groups.calls[4:8]] == [(4, 0), (5, 0), (6, 1), (7, 1)]
        groups.finish(4, 5)  # started under v0: lag (3 - 1) - 0 = 2 at step 3, stale
        await _settle()
        assert 3 in orch._steps and not orch._steps[3].done()
        groups.finish(6, 7)
        await _settle()
        three, _, _ = await orch._steps.pop(3)
        assert [g[0].task_key for g in three] == ["6", "7"]
        assert [g[0].task_key for g in orch._admission_dropped[3]] == ["4", "5"]  # finished, never trained (C26)
        assert orch.observe_step(3, orch.spec.orchestrator) == {"admission_dropped_stale_groups": 2}
        # every group's seed is its position's
        assert all(seed == request_seed(7, CONTINUOUS_SEED, index) for index, seed, _ in groups.calls)
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await _settle()
        assert all(f.cancelled() for f in groups.pending.values())  # groups no batch needs are cancelled

    asyncio.run(scenario())


def test_a_failed_group_fails_the_step_it_would_fill(tmp_path: Path) -> None:
    async def scenario() -> None:
        orch = _orchestrator(tmp_path)
        groups: _Groups = orch.rollout_group
        producer = asyncio.create_task(orch.produce())
        await _settle()
        groups.pending.pop(1).set_exception(RuntimeError("inference gone"))
        await _settle()
        with pytest.raises(RuntimeError, match="inference gone"):
            await orch._steps.pop(1)
        await _settle()
        assert producer.done() and isinstance(producer.exception(), RuntimeError)  # it asks for no step 2
        assert orch._steps == {} and all(f.cancelled() for f in groups.pending.values())

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- the real loop, simulated server


def test_the_orchestrator_loop_runs_continuous_admission_against_the_simulated_server(tmp_path: Path) -> None:
    """``Orchestrator.main_loop`` (warm-up, evals, weight watcher, batcher, checkpoint) on reverse_text with the tiny
    model's tokenizer, against ``benchmarks/sim_inference.py`` in a thread and a stand-in trainer that publishes each
    version as soon as its batch is written: 4 steps of 4 groups of 2, 8 groups (16 completions) in flight."""
    import httpx

    from tests.support.uvicorn_thread import serve
    from worker.policy.models import init_model
    from worker.run.rundir import STABLE_MARKER, read_jsonl

    model = init_model(tmp_path / "tiny", size="tiny", seed=0)
    spec = validate_spec(
        "rl",
        {
            "name": "continuous",
            "output_dir": str(tmp_path / "runs"),
            "max_steps": 4,
            "model": {"name": str(model)},
            "env": {"id": "reverse_text", "args": {"system_message": False}},
            "inference": {"max_model_len": 256},
            "orchestrator": {
                "admission": "continuous",
                "batch_size": 4,
                "group_size": 2,
                "max_tokens": 16,
                "seq_len": 256,
                "max_async_level": 1,
                "eval": {"num_examples": 2},
            },
            "ckpt": {"interval": 2},
        },
    )
    run = RunDir(tmp_path / "run")
    run.create()
    run.config.write_text(spec.model_dump_json())
    app = sim_app(ttft_ms=50.0, per_token_ms=1.0, len_mean=8.0, load_ms=1.0)

    async def trainer(url: str) -> dict[str, Any]:
        """Publishes each version once its batch is written; returns the server's stats read before the last one, whose
        eval (2 more requests) may start while the groups of the next step are still in flight."""
        async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
            while not any(r["source"] == "eval" for r in read_jsonl(run.metrics)):  # warm-up and eval done
                await asyncio.sleep(0.005)
            await http.post("/sim/stats/reset")  # the maximum from the groups in flight now on
            for step in range(1, 5):
                while not run.batch(step).exists():
                    await asyncio.sleep(0.01)
                if step == 4:
                    stats = dict((await http.get("/sim/stats")).json())
                run.weight_dir(step).mkdir(parents=True, exist_ok=True)
                (run.weight_dir(step) / STABLE_MARKER).write_text("")
        return stats

    async def scenario(url: str) -> dict[str, Any]:
        stand_in = asyncio.create_task(trainer(url))
        await Orchestrator(spec, run, url, 0).main_loop()
        return await stand_in

    with serve(app) as url:
        stats = asyncio.run(scenario(url))
    assert stats["inflight_max"] == 16  # 8 groups of n = 2 at once, never more (a fresh-clone CI read 18 when the
    # stats were read after the run: the final eval's 2 requests had overlapped the groups still in flight)
    rows = [r for r in read_jsonl(run.metrics) if r["source"] == "orchestrator"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["admission_dropped_stale_groups"] for r in rows] == [0, 0, 0, 0]
    tasks = []
    for step in range(1, 5):
        records = read_jsonl(run.rollout_file(step))
        assert len(records) == 8 and {r["group"] for r in records} == {0, 1, 2, 3}
        # started under the gate (at most 1 behind the step filling then), they may land in a later step: trained
        # while they lag at most max_off_policy_steps (8)
        assert all(0 <= (step - 1) - r["policy_span"][0] <= 8 for r in records)
        tasks += [r["task"] for r in records if r["completion"] is not None][::2]
    assert len(set(tasks)) == 16  # 16 groups of 16 distinct positions of the data order
    state = json.loads((run.checkpoint_dir(2) / "orchestrator" / "state.json").read_text())
    assert state["data_cursor"] % 4 == 0 and 8 < state["data_cursor"] <= 8 + 8 + 4  # chunks of 4 past the 8 trained
