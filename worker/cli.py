"""``asyncrl`` command line.

    asyncrl rl   @ configs/reverse_text/rl.toml [@ more.toml] [--trainer.optim.lr 1e-5] [--dry-run] [--resume]
    asyncrl sft  @ configs/reverse_text/sft.toml [--max_steps 100] [--dry-run]
    asyncrl eval --model PATH | --url URL [--env reverse_text] [--num-examples 64]
    asyncrl eval --model PATH --spec RL.toml [--env NAME]   (one environment of the spec's [[env]] mixture)
    asyncrl model init --out DIR [--arch llama|qwen2|qwen3|qwen3_moe|gemma3|mistral|phi3|olmo2] [--size tiny|small]
    asyncrl demo [--local] [--summary PATH]
    asyncrl export RUN_DIR [--step N] --out DIR [--adapter-only]   (Hugging Face model directory)
    asyncrl config set RUN_DIR trainer.optim.lr=5e-5 [orchestrator.temperature=1.2 ...]   (live config)
    asyncrl slurm render SPEC [@ more.toml] [--launcher.slurm.nodes 4]   (print the Slurm job script)
    asyncrl server | worker | token create --name N | submit SPEC   (control plane)
    asyncrl runs ls | show|stop|resume|delete ID | fork ID --set K=V | logs ID   (runs through the server)
    asyncrl sweep SWEEP.toml | sweep show ID | sweep stop ID   (a sweep of runs through the server)
    asyncrl pipeline PIPELINE.toml | pipeline show|stop|resume ID   (stages sft -> rl -> eval through the server)

Spec files are TOML (or JSON), later ones win; ``--dotted.key value`` overrides win over files.
Bad input exits with code 2 and one line naming the field.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.cli_parser import ArgParser
from worker.spec import RLSpec, SFTSpec, SpecError, load_spec_data, validate_spec

FLAGS = {"--dry-run", "--resume", "--overwrite", "--quiet"}


def split_spec_args(argv: list[str]) -> tuple[list[str | Path], list[tuple[str, str]], set[str]]:
    """Split ``@ file`` / ``@file`` arguments, ``--dotted.key value`` overrides and flags.

    Raises:
        SpecError: an override without a value (none left, or the next argument is a ``--`` option), an ``@``
            without a file, or a stray argument.
    """
    files: list[str | Path] = []
    overrides: list[tuple[str, str]] = []
    flags: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                got = f", got {argv[i + 1]!r}" if i + 1 < len(argv) else ""
                raise SpecError(f"'@' must be followed by a config file{got}")
            files.append(argv[i + 1])
            i += 2
        elif arg.startswith("@"):
            files.append(arg[1:])
            i += 1
        elif arg in FLAGS:
            flags.add(arg)
            i += 1
        elif arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise SpecError(f"--{key}: missing value")
                if argv[i + 1].startswith("--"):  # `--trainer.optim.lr --dry-run` must not eat the flag
                    raise SpecError(
                        f"--{key}: missing value (next is {argv[i + 1]!r}; write --{key}=VALUE for a value "
                        "starting with '--')"
                    )
                value = argv[i + 1]
                i += 1
            overrides.append((key.replace("-", "_"), value))
            i += 1
        else:
            raise SpecError(f"unexpected argument {arg!r} (config files go after '@', overrides as --key value)")
    return files, overrides, flags


SPEC_USAGE = """usage: asyncrl {kind} @ SPEC.toml [@ MORE.toml ...] [--dotted.key VALUE ...] [flags]

  @ FILE          spec files (TOML or JSON); later files win
  --a.b VALUE     override one key (VALUE is a TOML literal: 1e-5, true, [0.5, 5], or text; a table or list
                  may be JSON: --launcher.slurm.env '{{"A": "1"}}')
  --dry-run       run the launch's cheap checks (model dir, tokenizer, env, lengths, run dir), print the
                  resolved spec as JSON and exit; starts and writes nothing (an unset
                  orchestrator.inflight_groups under continuous admission shows the number the run uses)
  --resume        continue the run from its newest complete checkpoint
  --overwrite     replace an existing run directory
  --quiet         (rl) no step lines on the console
"""


def _shown_spec(spec: RLSpec | SFTSpec) -> dict[str, Any]:
    """The spec as ``--dry-run`` prints it: its JSON, with the defaults resolved at use filled in.

    ``orchestrator.inflight_groups`` left unset under ``admission = "continuous"`` shows the number of groups the run
    keeps in flight (``OrchestratorConfig.groups_in_flight``, the one home of that default); the spec itself keeps
    None, so a live ``batch_size`` / ``max_async_level`` change still moves it.
    """
    data: dict[str, Any] = json.loads(spec.model_dump_json())
    if isinstance(spec, RLSpec) and spec.orchestrator.admission == "continuous":
        data["orchestrator"]["inflight_groups"] = spec.orchestrator.groups_in_flight()
    return data


def _spec_command(kind: str, argv: list[str]) -> int:
    if any(a in {"-h", "--help"} for a in argv):
        print(SPEC_USAGE.format(kind=kind))  # noqa: T201
        return 0
    files, overrides, flags = split_spec_args(argv)
    if not files and not overrides:
        raise SpecError(f"no spec given: asyncrl {kind} @ SPEC.toml [--key value ...] (-h for help)")
    spec = validate_spec(kind, load_spec_data(files, overrides))
    assert isinstance(spec, RLSpec | SFTSpec)  # kind is "rl" or "sft" (an eval job runs through the service)
    if "--dry-run" in flags:  # the same cheap checks as the launch, in the same order; nothing is created
        from worker.run.checkpoint import check_run_dir

        check_run_dir(spec, resume="--resume" in flags, overwrite="--overwrite" in flags)
        if isinstance(spec, RLSpec):
            from worker.launchers.local import preflight

            preflight(spec)
        else:
            from worker.trainer.sft import sft_preflight

            sft_preflight(spec)
        print(json.dumps(_shown_spec(spec), indent=2, ensure_ascii=False))  # noqa: T201
        return 0
    if isinstance(spec, RLSpec):
        from worker.launchers.local import launch_rl

        summary = launch_rl(
            spec, resume="--resume" in flags, overwrite="--overwrite" in flags, quiet="--quiet" in flags
        )
        return 0 if summary["status"] == "completed" else 1
    from worker.trainer.sft import run_sft

    run_sft(spec, overwrite="--overwrite" in flags, resume="--resume" in flags)
    return 0


def _eval_command(argv: list[str]) -> int:
    p = ArgParser(prog="asyncrl eval", description="Held-out reward and pass@k of a model.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model path or HF name (starts a vLLM server for the eval)")
    src.add_argument("--url", help="base URL of a running vLLM server")
    p.add_argument("--tokenizer", help="tokenizer path or name (default: --model, or the server's model)")
    p.add_argument(
        "--adapter", type=Path, help="a PEFT LoRA adapter folder to serve on top of --model (its base model)"
    )
    p.add_argument(
        "--env", default=None, help="environment id (default reverse_text); with --spec: the name of one of its envs"
    )
    p.add_argument("--env-args", default="{}", help="JSON object of environment arguments (with --spec: merged in)")
    p.add_argument("--spec", type=Path, help="an RL spec file: evaluate its environment --env (id and args)")
    p.add_argument("--num-examples", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pass-k", type=int, default=1)
    p.add_argument("--num-samples", type=int, help="samples per task (default --pass-k); pass@k unbiased from them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the result JSON here")
    args = p.parse_args(argv)
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as err:
        raise SpecError(f"--env-args: expected a JSON object, got {args.env_args!r} ({err.msg})") from None
    if not isinstance(env_args, dict):
        raise SpecError(f"--env-args: expected a JSON object, got {args.env_args!r}")
    for name in ("num_examples", "max_tokens", "pass_k"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.num_samples is not None and args.num_samples < args.pass_k:
        raise SpecError(f"--num-samples: expected at least --pass-k = {args.pass_k}, got {args.num_samples}")
    if args.temperature < 0:
        raise SpecError(f"--temperature: expected >= 0 (0 = greedy), got {args.temperature}")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise SpecError(f"--url: expected http://HOST:PORT, got {args.url!r}")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        what = "is a directory" if args.out.is_dir() else f"is in a folder that does not exist ({args.out.parent})"
        raise SpecError(f"--out: expected a file path for the result JSON; {args.out} {what}")
    from worker.evaluation import EvalSettings, env_of_spec, run_eval

    env_id = args.env or "reverse_text"
    if args.spec is not None:
        spec = validate_spec("rl", load_spec_data([args.spec], []))
        assert isinstance(spec, RLSpec)
        env = env_of_spec(spec.envs, args.env, str(args.spec))
        env_id, env_args = env.id, {**env.args, **env_args}
    result = run_eval(
        model=args.model,
        url=args.url,
        tokenizer=args.tokenizer,
        env_id=env_id,
        env_args=env_args,
        settings=EvalSettings(
            args.num_examples, args.temperature, args.max_tokens, args.pass_k, num_samples=args.num_samples
        ),
        seed=args.seed,
        adapter=args.adapter,
    )
    text = json.dumps(result, indent=2)
    print(text)  # noqa: T201
    if args.out:
        args.out.write_text(text)
    return 0


def _model_command(argv: list[str]) -> int:
    from worker.policy.architectures import ARCHITECTURES, DEFAULT_ARCH
    from worker.policy.models import SIZES

    p = ArgParser(prog="asyncrl model")
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="build a tiny random-init model of one architecture and a byte-level tokenizer")
    init.add_argument("--out", required=True, type=Path)
    init.add_argument(
        "--arch",
        default=DEFAULT_ARCH,
        help=f"architecture: {', '.join(ARCHITECTURES)} (default {DEFAULT_ARCH})",
    )
    init.add_argument(
        "--size", choices=list(SIZES), default="tiny", help="tiny (3M), small, qwen3-0.6b (596M: its shape)"
    )
    tie = init.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="tie the output projection")
    tie.add_argument("--untied", dest="tied", action="store_false", help="a separate output projection")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--overwrite", action="store_true", help="replace an existing model directory at --out")
    args = p.parse_args(argv)
    from worker.policy.models import init_model

    if args.arch not in ARCHITECTURES:
        raise SpecError(f"--arch: expected one of {', '.join(ARCHITECTURES)}, got {args.arch!r}")
    try:
        path = init_model(
            args.out, size=args.size, seed=args.seed, overwrite=args.overwrite, arch=args.arch, tied=args.tied
        )
    except FileExistsError as err:
        hint = "; pass --overwrite to replace it" if str(err).endswith("not empty") else ""
        raise SpecError(f"--out: {err}{hint}") from None
    except NotADirectoryError as err:
        raise SpecError(f"--out: {err}") from None
    except OSError as err:  # no permission, disk full: nothing is left at --out
        raise SpecError(f"--out: cannot write {args.out} ({err.strerror or type(err).__name__})") from None
    except ValueError as err:  # a size of another architecture
        raise SpecError(f"--{err}") from None
    print(f"model written to {path}")  # noqa: T201
    return 0


def _demo_command(argv: list[str]) -> int:
    p = ArgParser(
        prog="asyncrl demo",
        description="tiny model -> SFT warm-up -> RL -> greedy eval on reverse-text, submitted as one pipeline to "
        "the service (server + worker started here, embedded mode)",
    )
    p.add_argument("--local", action="store_true", help="run SFT and RL here, without the service (no eval stage)")
    p.add_argument("--summary", type=Path, default=Path("outputs/demo/summary.json"))
    p.add_argument(
        "--output-dir",
        default="outputs/demo",
        help="where model, SFT, service state and run go (default: outputs/demo)",
    )
    p.add_argument("--rl-steps", type=int, default=None, help="override the RL step count")
    p.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count")
    p.add_argument(
        "--serve",
        action="store_true",
        help="open the dashboard again on an earlier demo's state (--output-dir), until Ctrl-C",
    )
    p.add_argument("--port", type=int, default=8000, help="the dashboard's port with --serve (default: 8000)")
    args = p.parse_args(argv)
    if not 1 <= args.port <= 65535:
        raise SpecError(f"--port: expected a port 1-65535, got {args.port}")
    for name in ("rl_steps", "sft_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.summary.is_dir() or args.summary.suffix != ".json":
        raise SpecError(f"--summary: expected a .json file path such as outputs/demo/summary.json, got {args.summary}")
    from worker.demo import DemoError, run_demo, run_service_demo, serve_demo

    output_dir = args.output_dir
    try:
        if args.serve:
            try:
                serve_demo(output_dir, port=args.port)
            except KeyboardInterrupt:
                return 0
            return 0
        summary = (run_demo if args.local else run_service_demo)(
            output_dir, args.summary, rl_steps=args.rl_steps, sft_steps=args.sft_steps
        )
    except DemoError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (the run, server and worker were stopped)", file=sys.stderr)  # noqa: T201
        return 130
    print(json.dumps(summary, indent=2))  # noqa: T201
    return 0


def _export_command(argv: list[str]) -> int:
    """``asyncrl export RUN_DIR [--step N] --out DIR [--adapter-only]`` (``worker/policy/export.py``)."""
    p = ArgParser(
        prog="asyncrl export",
        description="Write a Hugging Face model directory (weights, config, tokenizer, chat template) from a "
        "complete checkpoint, or without --step from final/ (else the newest complete checkpoint).",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--step", type=int, help="checkpoint step (default: final/, else the newest complete checkpoint)")
    p.add_argument("--out", required=True, help="new (or empty) folder to write")
    p.add_argument("--adapter-only", action="store_true", help="LoRA runs: write the PEFT adapter, not merged weights")
    args = p.parse_args(argv)
    if not args.out.strip():  # Path("") is "."
        raise SpecError("--out: expected a folder path, got an empty string")
    args.out = Path(args.out)
    if args.step is not None and args.step < 0:
        raise SpecError(f"--step: expected an integer >= 0, got {args.step}")
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from worker.policy.export import ExportError, check_adapter_only, check_out, find_source, write_export

    try:
        source = find_source(args.run_dir, args.step)
        check_out(args.out)
        check_adapter_only(source, args.adapter_only)
        hf_logging.disable_progress_bar()  # one display: the stages below
        console = Console(stderr=True)
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        # no terminal (a log, a pipe): no spinner, whose teardown left a blank line before an error
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task(f"exporting {source.label}", total=None)
            out = write_export(
                source,
                args.out,
                adapter_only=args.adapter_only,
                stage=lambda text: progress.update(task, description=text),
            )
    except ExportError as err:
        raise SpecError(str(err)) from None
    except FileNotFoundError as err:  # the base model is gone
        raise SpecError(f"model.name: {err}") from None
    what = "adapter" if args.adapter_only else "merged model" if source.kind == "lora" else "model"
    print(f"exported {what} of {source.label} of {source.run_dir} to {out}")  # noqa: T201
    return 0


def _config_command(argv: list[str]) -> int:
    p = ArgParser(prog="asyncrl config", description="Live config of a running run (keys: worker/live_config.py).")
    sub = p.add_subparsers(dest="action", required=True)
    set_ = sub.add_parser("set", help="append a config revision to RUN_DIR/live_config.jsonl (local runs)")
    set_.add_argument("run_dir", type=Path)
    set_.add_argument("assignments", nargs="+", metavar="key=value", help="e.g. trainer.optim.lr=5e-5")
    args = p.parse_args(argv)
    from worker.live_config import set_local

    print(json.dumps(set_local(args.run_dir, args.assignments)))  # noqa: T201
    return 0


SLURM_USAGE = """usage: asyncrl slurm render SPEC.toml [@ MORE.toml ...] [--dotted.key VALUE ...] [--resume]

Print the Slurm job script (sbatch) of a spec (RL, SFT or eval) without submitting it; the spec is validated first.
  SPEC.toml       the run spec ('@' before it is optional); later '@ FILE's win
  --dotted.key    an override, e.g. --launcher.slurm.nodes 3 --launcher.slurm.inference_nodes 1
  --resume        the script of a resume from the run's last complete checkpoint"""


def _slurm_command(argv: list[str]) -> int:
    """``asyncrl slurm render SPEC [@ more.toml] [--key value]``: print the Slurm job script of a spec (RL, SFT or eval)."""
    if argv[:1] in (["-h"], ["--help"]) or argv[:2] in (["render", "-h"], ["render", "--help"]):
        print(SLURM_USAGE)  # noqa: T201
        return 0
    if not argv or argv[0] != "render":
        got = f", got {argv[0]!r}" if argv else ""
        raise SpecError(f"asyncrl slurm: expected 'render SPEC' (prints the job script without submitting){got}")
    rest = argv[1:]
    if rest and not rest[0].startswith(("@", "--")):
        rest = ["@", *rest]  # the spec file may be given without '@'
    files, overrides, flags = split_spec_args(rest)
    if not files:
        raise SpecError("asyncrl slurm render: expected a spec file, e.g. asyncrl slurm render configs/x.toml")
    data = load_spec_data(files, overrides)
    spec = validate_spec(str(data.get("kind", "rl")), data)  # any kind: an SFT run or an eval job too
    from worker.launchers.slurm import render

    home = Path(spec.output_dir).resolve()
    print(render(spec, home=home, name=f"asyncrl-{spec.name}", resume="--resume" in flags), end="")  # noqa: T201
    return 0


COMMANDS: dict[str, Any] = {
    "rl": lambda argv: _spec_command("rl", argv),
    "sft": lambda argv: _spec_command("sft", argv),
    "eval": _eval_command,
    "model": _model_command,
    "demo": _demo_command,
    "export": _export_command,
    "config": _config_command,
    "slurm": _slurm_command,
}
CONTROL_PLANE_COMMANDS = ("server", "worker", "token", "submit", "runs", "sweep", "pipeline")
"""Commands of ``server/cli.py``: imported only when used (the engine's commands need no server packages), and
``server.cli`` never imports this module."""


def _control_plane(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from server.cli import COMMANDS as SERVER_COMMANDS

        return int(SERVER_COMMANDS[name](argv))

    return run


COMMANDS.update({name: _control_plane(name) for name in CONTROL_PLANE_COMMANDS})


SIGPIPE_EXIT = 128 + 13
"""Exit status of a command whose reader closed its output (``asyncrl runs ls | head -1``): a shell's for SIGPIPE."""


def _closed_stdout(err: BrokenPipeError) -> int:
    """Quiet end of a command whose stdout reader went away (Python's SIGPIPE note): the rest of the output goes
    to ``/dev/null`` so the interpreter's flush at exit raises nothing, and no traceback is printed. A broken pipe
    that is not stdout's (``err`` from a socket: stdout's pipe still has a reader) is raised again.

    Returns:
        :data:`SIGPIPE_EXIT`.
    """
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poller.poll(0))  # a pipe without a reader
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured output)
        closed = False
    if not closed:
        raise err
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    """``asyncrl``: run a command, its bad input as one line and exit status 2; a closed stdout ends it quietly
    (:data:`SIGPIPE_EXIT`)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError as err:
        return _closed_stdout(err)


def _main(argv: list[str] | None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)  # noqa: T201
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"error: unknown command {argv[0]!r} (expected one of {', '.join(COMMANDS)}; -h for help)", file=sys.stderr
        )  # noqa: T201
        return 2
    try:
        return int(COMMANDS[argv[0]](argv[1:]))
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    except Exception as err:  # an InferenceError and the like: one line, not a traceback
        from worker.inference.client import InferenceError

        if not isinstance(err, InferenceError):
            raise
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 1


if __name__ == "__main__":
    sys.exit(main())
