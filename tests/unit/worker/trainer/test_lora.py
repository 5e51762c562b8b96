"""LoRA RL on the trainer side (``worker/trainer/lora.py``): the spec table, the launch check of ``target_modules``,
which parameters train, the adapter's arithmetic, checkpoint round trip and the published version folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.models import tiny_qwen3
from worker.policy.lora_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from worker.policy.models import init_model
from worker.run.checkpoint import write_part
from worker.run.rundir import STABLE_MARKER, RunDir
from worker.spec import LoraConfig, OptimConfig, SchedulerConfig, SpecError, validate_spec
from worker.trainer.checkpointer import BackgroundCheckpointer, load_trainer_state
from worker.trainer.lora import adapter_state, check_targets, wrap
from worker.trainer.optim import build_optimizer, build_scheduler
from worker.weight_sync.publish import publish_adapter

pytestmark = pytest.mark.serial  # gloo process groups: not beside the parallel pass (a peer closed under load)

MODEL = {"model": {"name": "some/model"}}


@pytest.mark.parametrize(
    ("lora", "error"),
    [
        ({"rank": 0}, "trainer.lora.rank: Input should be greater than or equal to 1, got 0"),
        ({"rank": 1024}, "trainer.lora.rank: Input should be less than or equal to 512, got 1024"),
        ({"alpha": 0}, "trainer.lora.alpha: Input should be greater than 0, got 0"),
        ({"dropout": 1}, "trainer.lora.dropout: Input should be less than 1, got 1"),
        ({"dropout": -0.1}, "trainer.lora.dropout: Input should be greater than or equal to 0, got -0.1"),
        (
            {"target_modules": []},
            "trainer.lora.target_modules: expected a non-empty list of module names, e.g. ['q_proj', 'v_proj'], got []",
        ),
        (
            {"target_modules": ["q_proj", " "]},
            "trainer.lora.target_modules: expected a non-empty list of module names, e.g. ['q_proj', 'v_proj'], "
            "got ['q_proj', ' ']",
        ),
        ({"ranks": 4}, "unknown key 'trainer.lora.ranks' (did you mean 'trainer.lora.rank'?)"),
    ],
    ids=[
        "rank-0",
        "rank-too-large",
        "alpha-0",
        "dropout-1",
        "dropout-negative",
        "targets-empty",
        "target-blank",
        "typo",
    ],
)
def test_lora_spec_bad_values_one_line(lora: dict[str, object], error: str) -> None:
    with pytest.raises(SpecError) as e:
        validate_spec("rl", {**MODEL, "trainer": {"lora": lora}})
    assert str(e.value) == error


def test_lora_spec_defaults_and_absence() -> None:
    assert validate_spec("rl", MODEL).trainer.lora is None  # absent: full fine-tune
    lora = validate_spec("rl", {**MODEL, "trainer": {"lora": {}}}).trainer.lora
    assert lora is not None and (lora.rank, lora.alpha, lora.dropout) == (8, 16.0, 0.0)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(SpecError) as e:
        validate_spec("rl", {**MODEL, "trainer": {"lora": {}, "weight_sync": {"kind": "process_group"}}})
    assert str(e.value) == (
        "trainer.lora: a LoRA run publishes its adapter through trainer.weight_sync.kind = 'filesystem'"
    )


def test_target_modules_matching_nothing_is_named(tmp_path: Path) -> None:
    model_dir = init_model(tmp_path / "m")
    check_targets(model_dir, ["q_proj", "self_attn.v_proj", "mlp.down_proj"])  # suffixes of real linears: fine
    with pytest.raises(ValueError) as e:
        check_targets(model_dir, ["q_proj", "query", "embed_tokens"])  # embed_tokens: an Embedding, not a Linear
    assert str(e.value) == (
        "trainer.lora.target_modules: ['query', 'embed_tokens'] match no linear layer of qwen3 (its linear layers: "
        "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'])"
    )


def test_targets_with_tied_weights_are_refused(tmp_path: Path) -> None:
    """The tiny model ties ``lm_head`` to ``embed_tokens`` (``tie_word_embeddings``): an adapter on ``lm_head`` would
    merge into the shared tensor and change the embedding too. Refused at launch and by ``wrap``; the same model
    untied takes it."""
    tied = "['lm_head'] target layers whose weights qwen3 ties (lm_head, model.embed_tokens: tie_word_embeddings)"
    with pytest.raises(ValueError) as e:
        check_targets(init_model(tmp_path / "m"), ["q_proj", "lm_head"])
    assert str(e.value) == f"trainer.lora.target_modules: {tied}, which LoRA cannot merge; leave them out"
    model = tiny_qwen3(seed=0)  # tied too
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"^trainer\.lora\.target_modules: \['lm_head'\] target layers whose"):
        wrap(model, LoraConfig(target_modules=["lm_head"]))
    untied = tiny_qwen3(seed=0, tie=False)
    wrap(untied, LoraConfig(target_modules=["lm_head"]))
    assert untied.lm_head.lora_B["default"].weight.requires_grad


def test_only_adapters_train_and_version_0_is_the_base() -> None:
    model = tiny_qwen3(seed=0)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits.clone()
    adapter = wrap(model, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = model.config.num_hidden_layers
    assert len(trainable) == layers * 2 * 2  # per layer: q_proj and v_proj, each A and B
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n for n in trainable if "layers.0.self_attn.q_proj" in n} == {
        "model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.layers.0.self_attn.q_proj.lora_B.default.weight",
    }
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base_logits)  # B = 0 at init
    opt = build_optimizer(model, OptimConfig())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    assert set(adapter_state(adapter)) == {
        n.replace(".default", "").replace("model.", "base_model.model.model.", 1) for n in trainable
    }


def test_adapter_arithmetic_by_hand() -> None:
    """q_proj(x) = W x + (alpha / r) * B (A x): r = 2, alpha = 3, so a scale of 1.5, on a hand-made A and B."""
    model = tiny_qwen3(seed=0)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.zeros(1, q.in_features)
    x[0, 0], x[0, 1] = 1.0, 2.0
    with torch.no_grad():
        base = q(x).clone()
    wrap(model, LoraConfig(rank=2, alpha=3, target_modules=["q_proj"]))
    lq = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        lq.lora_A["default"].weight.zero_()
        lq.lora_A["default"].weight[0, 0] = 1.0  # A x = [x0, x1] = [1, 2]
        lq.lora_A["default"].weight[1, 1] = 1.0
        lq.lora_B["default"].weight.zero_()
        lq.lora_B["default"].weight[0, 0] = 1.0  # B (A x): out[0] = 1 * 1, out[1] = 2 * 2 + 1 * (-1)
        lq.lora_B["default"].weight[1, 0] = -1.0
        lq.lora_B["default"].weight[1, 1] = 2.0
        delta = lq(x) - base
    assert delta[0, 0].item() == pytest.approx(1.5 * 1.0, abs=1e-6)
    assert delta[0, 1].item() == pytest.approx(1.5 * 3.0, abs=1e-6)
    assert delta[0, 2:].abs().max().item() == 0.0


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_lora_checkpoint_round_trip_exact(run: RunDir) -> None:
    cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = tiny_qwen3(seed=0)
    adapter = wrap(model, cfg)
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    sched = build_scheduler(opt, SchedulerConfig(type="cosine", warmup_steps=2), max_steps=10)
    for _ in range(2):  # two steps: B and A both moved off their init
        _step(model, opt, sched)
    torch.manual_seed(5)
    random.seed(6)
    ckpt = BackgroundCheckpointer(run, keep=2)
    ckpt.save(2, model, opt, sched, adapter=adapter)
    expected_rand, expected_py = torch.rand(3), random.random()
    expected = adapter_state(adapter)
    expected_opt = opt.state_dict()
    ckpt.wait()
    write_part(run, 2, "orchestrator", lambda folder: (folder / "state.json").write_text("{}"))
    folder = run.checkpoint_dir(2) / "trainer"
    assert sorted(p.name for p in folder.iterdir()) == [".complete", "adapter", "meta.json", "state.pt"]  # no weights
    assert sorted(p.name for p in (folder / "adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    written = load_file(folder / "adapter" / ADAPTER_WEIGHTS)
    assert set(written) == set(expected) and all(torch.equal(written[k], v) for k, v in expected.items())
    assert all(v.abs().sum() > 0 for k, v in expected.items() if "lora_B" in k)
    config = json.loads((folder / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        8,
        ["down_proj", "q_proj", "v_proj"],
    )

    model2 = tiny_qwen3(seed=0)  # same base, fresh adapter (other random A), fresh optimizer and RNG
    torch.manual_seed(77)
    adapter2 = wrap(model2, cfg)
    opt2 = build_optimizer(model2, OptimConfig(lr=1e-2))
    sched2 = build_scheduler(opt2, SchedulerConfig(type="cosine", warmup_steps=2), max_steps=10)
    assert not all(torch.equal(adapter_state(adapter2)[k], v) for k, v in expected.items())
    assert load_trainer_state(folder, model2, opt2, sched2, adapter=adapter2) == 2
    got = adapter_state(adapter2)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    got_opt = opt2.state_dict()
    assert len(got_opt["state"]) == len(expected_opt["state"]) == 3 * 2 * model.config.num_hidden_layers
    for idx, s in expected_opt["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got_opt["state"][idx][name], s[name]), (idx, name)
    assert sched2.last_epoch == 2
    assert torch.equal(torch.rand(3), expected_rand) and random.random() == expected_py
    # the resumed trainer continues exactly as the first one would
    _step(model, opt, sched)
    _step(model2, opt2, sched2)
    after, after2 = adapter_state(adapter), adapter_state(adapter2)
    assert all(torch.equal(after2[k], v) for k, v in after.items())


def test_publish_adapter_writes_the_two_files_then_stable(run: RunDir) -> None:
    model = tiny_qwen3(seed=0)
    adapter = wrap(model, LoraConfig(rank=8, target_modules=["q_proj"]))
    for v in (1, 2, 3):
        publish_adapter(adapter, run, v, keep_versions=2)
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_2", "step_3"]
    folder = run.weight_dir(3)
    assert sorted(p.name for p in folder.iterdir()) == [STABLE_MARKER, ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert (folder / STABLE_MARKER).read_text() == "3"
    state = load_file(folder / ADAPTER_WEIGHTS)
    assert len(state) == 2 * model.config.num_hidden_layers
    assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 8)


def test_adapter_of_an_fsdp2_model_saves_as_plain_tensors(tmp_path: Path) -> None:
    """On a GPU the trainer wraps even one rank in FSDP2, whose parameters are DTensors: saving the adapter then
    died in safetensors ("invalid python storage", seen on the H200). ``adapter_state`` gathers them into plain
    tensors, equal to the unsharded values. Run in a child process: a one-rank gloo group on CPU."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from pathlib import Path
        from safetensors.torch import load_file
        from torch.distributed.fsdp import fully_shard
        from worker.policy.models import init_model, load_model
        from worker.spec import LoraConfig
        from worker.trainer.dist import decoder_blocks
        from worker.trainer.lora import adapter_state, save_adapter, wrap

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = load_model(init_model({str(tmp_path / "m")!r}, size="tiny", seed=0))
        peft = wrap(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p)  # lora_B starts at 0: make every value tell
        plain = adapter_state(peft)
        for block in decoder_blocks(model):
            fully_shard(block)
        fully_shard(model)
        assert any(type(p).__name__ == "DTensor" for p in model.parameters())
        save_adapter(peft, Path({str(tmp_path / "adapter")!r}))
        saved = load_file({str(tmp_path / "adapter" / ADAPTER_WEIGHTS)!r})
        assert saved.keys() == plain.keys() and all(torch.equal(saved[k], plain[k]) for k in plain), "differ"
        print("ok", len(saved))
        dist.destroy_process_group()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok 16"), out.stderr[-2000:]


def test_lora_checkpoint_resumes_into_an_fsdp2_model_exactly(tmp_path: Path) -> None:
    """A LoRA checkpoint (adapter + optimizer state) of an FSDP2-wrapped PEFT model loads back into a fresh FSDP2 model
    (other random A, fresh optimizer) and its next step equals the uninterrupted run's, bit for bit. Run in two child
    processes: a two-rank gloo group on CPU (each rank holds half of every tensor), the trainer's ``prepare_model``."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys, torch, torch.distributed as dist
        from pathlib import Path
        from safetensors.torch import load_file
        from worker.policy.models import init_model, load_model
        from worker.run.rundir import RunDir
        from worker.spec import LoraConfig, OptimConfig, SchedulerConfig
        from worker.trainer.checkpointer import BackgroundCheckpointer, load_trainer_state
        from worker.trainer.dist import DistInfo, prepare_model
        from worker.trainer.lora import adapter_state, wrap
        from worker.trainer.optim import build_optimizer, build_scheduler

        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=rank, world_size=2)
        if rank == 0:
            init_model({str(tmp_path / "m")!r}, size="tiny", seed=0)
        dist.barrier()
        path = {str(tmp_path / "m")!r}
        cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])

        def build(seed):
            torch.manual_seed(seed)
            model = load_model(path, dtype="float32")
            adapter = wrap(model, cfg)
            model.train()
            info = DistInfo(rank=rank, world_size=2, sharded=True)
            prepare_model(model, info, bf16=False, activation_checkpointing=False)
            opt = build_optimizer(model, OptimConfig(lr=1e-2))
            return model, adapter, opt, build_scheduler(opt, SchedulerConfig(type="cosine", warmup_steps=2), 10)

        def step(model, opt, sched):
            ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()

        model, adapter, opt, sched = build(0)
        lora = [p for n, p in model.named_parameters() if "lora_A" in n]
        assert all(type(p).__name__ == "DTensor" and p.to_local().shape[0] * 2 == p.shape[0] for p in lora)
        for _ in range(2):
            step(model, opt, sched)
        run = RunDir(Path({str(tmp_path / "run")!r}))
        ckpt = BackgroundCheckpointer(run, keep=2)
        ckpt.save(2, model, opt, sched, adapter=adapter)
        ckpt.wait()
        dist.barrier()  # rank 0 wrote the files
        saved = adapter_state(adapter)
        step(model, opt, sched)
        expected = adapter_state(adapter)

        model2, adapter2, opt2, sched2 = build(77)  # other random A, fresh optimizer
        assert not all(torch.equal(adapter_state(adapter2)[k], v) for k, v in saved.items())
        assert load_trainer_state(run.checkpoint_dir(2) / "trainer", model2, opt2, sched2, adapter=adapter2) == 2
        loaded = adapter_state(adapter2)
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items()), "load"
        assert sched2.last_epoch == 2
        step(model2, opt2, sched2)
        got = adapter_state(adapter2)
        moved = sum(not torch.equal(expected[k], saved[k]) for k in saved)
        assert all(torch.equal(got[k], v) for k, v in expected.items()), "next step differs"
        print("ok", rank, len(got), moved)
        dist.destroy_process_group()
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    # 4 layers x 3 targets x (A, B) = 24 tensors, every one moved by the step after the resume
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and out.startswith(f"ok {rank} 24 24"), err[-3000:]
