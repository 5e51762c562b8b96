"""Write an environment's tasks with their reference answers as SFT chat rows (JSONL), in the order the
environment-data SFT takes them (``worker.orchestrator.data.data_order``):

    python scripts/sft_rows_from_env.py --env reverse_text --args '{"system_message": false}' \\
        --num-examples 8192 --seed 0 --out outputs/data/reverse_text_sft.jsonl

Each line is ``{"messages": [<the environment's prompt messages>..., {"role": "assistant", "content": answer}]}``;
``--split eval`` writes the eval tasks (the first ``--num-examples``) instead, e.g. for ``data.eval_path``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.envs import load_environment
from worker.orchestrator.data import data_order


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="reverse_text")
    p.add_argument("--args", default="{}", help="the environment loader's keyword arguments, as JSON")
    p.add_argument("--split", choices=("train", "eval"), default="train")
    p.add_argument("--num-examples", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    env = load_environment(a.env, split=a.split, seed=a.seed, **json.loads(a.args))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w", encoding="utf-8") as f:
        for i in range(a.num_examples):
            task = env.task(data_order(i, env.num_tasks, a.seed) if a.split == "train" else i)
            answer = {"role": "assistant", "content": str(task.data.answer)}
            f.write(json.dumps({"messages": [*env.prompt_messages(task), answer]}) + "\n")
    print(f"{a.num_examples} rows -> {a.out}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
