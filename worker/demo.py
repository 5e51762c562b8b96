"""``asyncrl demo --local``: tiny model -> SFT warm-up -> async RL on reverse-text, with a summary.

The summary's ``reward_after_sft`` and ``reward_after_rl`` are the RL run's own online evals at
policy version 0 (the SFT model) and at the last version, on the same held-out tasks with the same
sampling (``orchestrator.eval``), so the difference is what RL added.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from worker.rundir import atomic_write_json
from worker.spec import load_spec_data, validate_spec

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "reverse_text"


def run_demo(
    output_dir: str, summary_path: Path, *, rl_steps: int | None = None, sft_steps: int | None = None
) -> dict[str, Any]:
    """Run the three stages below ``output_dir`` (replacing an earlier demo there); returns the summary."""
    from worker.launchers.local import launch_rl
    from worker.models import init_model
    from worker.trainer.sft import run_sft

    t0 = time.time()
    out = Path(output_dir)
    model_dir = init_model(out / "model", size="tiny", seed=0)
    print(f"[demo] tiny model: {model_dir}", flush=True)  # noqa: T201

    sft_overrides = [("model.name", str(model_dir)), ("output_dir", str(out)), ("name", "sft")]
    if sft_steps:
        sft_overrides.append(("max_steps", str(sft_steps)))
    sft_spec = validate_spec("sft", load_spec_data([CONFIGS / "sft.toml"], sft_overrides))
    sft = run_sft(sft_spec, overwrite=True)  # type: ignore[arg-type]
    print(f"[demo] SFT done in {sft['wall_s']}s: greedy eval reward {sft['eval_reward_greedy']:.3f}", flush=True)  # noqa: T201

    rl_overrides = [("model.name", sft["final"]), ("output_dir", str(out)), ("name", "rl")]
    if rl_steps:
        rl_overrides.append(("max_steps", str(rl_steps)))
    rl_spec = validate_spec("rl", load_spec_data([CONFIGS / "rl.toml"], rl_overrides))
    rl = launch_rl(rl_spec, overwrite=True)  # type: ignore[arg-type]
    summary = {
        "status": rl["status"],
        "reward_after_sft": rl["eval_reward_first"],
        "reward_after_rl": rl["eval_reward_last"],
        "reward_gain": (rl["eval_reward_last"] - rl["eval_reward_first"])
        if rl["eval_reward_first"] is not None and rl["eval_reward_last"] is not None
        else None,
        "sft_greedy_eval_reward": sft["eval_reward_greedy"],
        "mismatch_kl": rl["mismatch_kl"],
        "mismatch_kl_on_policy": rl["mismatch_kl_on_policy"],
        "steps": rl["steps"],
        "sft_steps": sft_spec.max_steps,
        "wall_s": round(time.time() - t0, 1),
        "rl_wall_s": rl["wall_s"],
        "sft_wall_s": sft["wall_s"],
        "run_dir": str(rl_spec.run_dir),
    }
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(summary_path, summary)
    return summary
