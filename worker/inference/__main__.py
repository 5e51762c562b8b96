"""``python -m worker.inference --model PATH --port N``: run the vLLM inference server in the foreground.

Everything after ``--`` is passed to vLLM unchanged. The process execs vLLM, so signals sent to this
process reach the server directly.
"""

from __future__ import annotations

import argparse
import os

from worker.inference.server import server_command, server_env


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker.inference", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model name or local path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="OMP threads of the vLLM worker (see server_env)")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, do not start")
    args, extra = p.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    cmd = server_command(
        args.model,
        args.host,
        args.port,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        extra_args=extra,
    )
    env = server_env(threads=args.threads)
    if args.dry_run:
        print(" ".join(cmd))  # noqa: T201
        return
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
