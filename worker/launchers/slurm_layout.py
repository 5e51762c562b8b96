"""Inside a multi-node Slurm job: which node runs which process of the run, and the ``srun`` that puts it there.

The job script (``deploy/slurm/rl.sbatch.j2``) runs the run's supervisor on the job's first node whatever the node
count; the supervisor starts the run's processes through :func:`worker.launchers.local.launch_rl`, which, with
``launcher.slurm.nodes > 1``, asks :func:`from_job` for the layout and starts each process as a job step
(:meth:`Layout.srun`), so the supervisor follows every step as it follows a local process (an ``srun`` ends when its
step ends; SIGTERM to it ends the step) and ``scancel`` ends every step on every node.

- inference: the vLLM server on the first of the first ``inference_nodes`` nodes, listening on that node's
  ``NodeAddr`` only (never every interface: ``server/services/spec_policy.py`` allows loopback or a node of the run)
  on ``inference_port`` (key-protected: the key is made by the supervisor before the split and reaches every step
  through ``srun``'s environment, never a file); the other processes reach it at that address. With
  ``inference.replicas = r > 1``, replica ``i`` runs on inference node ``i mod k`` (``k = inference_nodes``) on port
  ``inference_port + i div k`` (:meth:`Layout.replicas`): one server a node when ``r = k`` (``inference.replicas``
  left unset: ``worker.spec.runs.RLSpec``);
- trainer: ``torchrun`` on each of the other nodes (``gpus_per_node`` ranks per node, one on CPU with gloo), joined
  by a c10d rendezvous on the first trainer node's ``NodeAddr``:``rdzv_port``;
- orchestrator: beside the first trainer rank (on the first trainer node).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from worker.inference.server import run_server_command
from worker.launchers.slurm import SlurmError, slurm_command
from worker.run.procs import run_as_argv
from worker.spec import RLSpec


@dataclass(frozen=True)
class Layout:
    """The nodes of one multi-node job, split as ``launcher.slurm`` says."""

    job_id: str
    inference: tuple[str, ...]
    """Node names (Slurm ``NodeName``) of the inference part, in the job's node order."""
    trainer: tuple[str, ...]
    """Node names of the trainer part; the first hosts the rendezvous and the orchestrator."""
    addresses: dict[str, str]
    """``NodeAddr`` of each node: the address its processes are reached at."""
    run_as: tuple[str, ...] = ()
    """The argv prefix that drops a step's command to the run's uid on its node (``worker.run.procs.run_as_argv``: a job
    of a root worker), or ``()``."""

    def srun(self, nodes: Sequence[str], name: str) -> list[str]:
        """The ``srun`` argv prefix that runs a command once on each of ``nodes`` as a step of this job named
        ``name`` (``--overlap``: the steps share the nodes' CPUs with each other and the supervisor's batch step;
        ``--kill-on-bad-exit``: one failed task ends the step), followed by :attr:`run_as`: the step runs as root
        (the job's user), its command as the run's uid."""
        return [
            "srun",
            f"--jobid={self.job_id}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}",
            "--overlap",
            "--kill-on-bad-exit=1",
            f"--job-name={name}",
            *self.run_as,
        ]

    def placement(self, replicas: int = 1) -> dict[str, list[str]]:
        """Process name -> the nodes it runs on (recorded in the run's ``running`` event); ``replicas`` vLLM servers
        (:meth:`replicas`)."""
        inference = list(dict.fromkeys(node for node, _, _ in self.replicas(replicas, 0, 0)))
        return {"inference": inference, "trainer": list(self.trainer), "orchestrator": [self.trainer[0]]}

    def replicas(self, count: int, port: int, gpus_per_node: int) -> list[tuple[str, int, list[int]]]:
        """``(node, port, gpus)`` of each of ``count`` vLLM servers: replica ``i`` on inference node ``i mod k`` (``k``
        inference nodes), port ``port + i div k``, and the ``(i div k)``-th of ``ceil(count / k)`` even slices of the
        node's ``gpus_per_node`` GPUs (empty: every GPU of the node, when the slices do not divide evenly or on CPU).
        E.g. 64 replicas on 16 nodes of 8 GPUs: 4 servers a node, ports 8000-8003, GPUs 0-1, 2-3, 4-5, 6-7."""
        k = len(self.inference)
        per_node = -(-count // k)
        share = gpus_per_node // per_node if gpus_per_node and gpus_per_node % per_node == 0 else 0
        return [
            (self.inference[i % k], port + i // k, list(range((i // k) * share, (i // k + 1) * share)))
            for i in range(count)
        ]

    @property
    def inference_host(self) -> str:
        """The address the vLLM server listens on and is reached at: the first inference node's ``NodeAddr``."""
        return self.addresses[self.inference[0]]

    def inference_url(self, port: int, node: str | None = None) -> str:
        """URL of the server on ``node`` (default the first inference node) at ``port``: the node's ``NodeAddr``."""
        return f"http://{self.addresses[node or self.inference[0]]}:{port}"

    def inference_command(
        self, spec: RLSpec, port: int, node: str | None = None, name: str = "inference", gpus: Sequence[int] = ()
    ) -> list[str]:
        """``srun`` (step ``name``) of a vLLM server of the run (:func:`worker.inference.server.run_server_command`,
        key required) on ``node`` (default the first inference node), listening on that node's address, ``port``
        only; on the node's GPUs ``gpus`` (``CUDA_VISIBLE_DEVICES`` set inside the step, after Slurm's; empty: all)."""
        node = node or self.inference[0]
        visible = ["env", f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))}"] if gpus else []
        return [
            *self.srun([node], name),
            *visible,
            *run_server_command(spec, self.addresses[node], port, require_key=True),
        ]

    def trainer_command(self, spec: RLSpec, trainer_args: list[str]) -> list[str]:
        """``srun`` of ``torchrun`` on every trainer node: ``max(gpus_per_node, 1)`` ranks a node, c10d rendezvous on
        the first trainer node (``rdzv_port``), run id = the job id; ``trainer_args`` follow ``-m worker.trainer``."""
        slurm = spec.launcher.slurm
        return [
            *self.srun(self.trainer, "trainer"),
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(self.trainer)}",
            f"--nproc-per-node={max(slurm.gpus_per_node, 1)}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.addresses[self.trainer[0]]}:{slurm.rdzv_port}",
            f"--rdzv-id={self.job_id}",
            "--max-restarts=0",
            "-m",
            "worker.trainer",
            *trainer_args,
        ]


def node_address(node: str) -> str:
    """``NodeAddr`` of ``node`` (``scontrol show node``); the node's name when Slurm has none.

    Raises:
        SlurmError: scontrol failed (unknown node, controller down).
    """
    for field in slurm_command(["scontrol", "show", "node", "-o", node]).split():
        key, _, value = field.partition("=")
        if key == "NodeAddr" and value:
            return value
    return node


def from_job(spec: RLSpec, environ: dict[str, str] | None = None) -> Layout | None:
    """The layout of this Slurm job (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` of ``environ``, default this
    process's) for ``spec``; None when ``spec`` runs on one node or this process is not in a Slurm job.

    Raises:
        SlurmError: scontrol failed, or the job has another node count than ``launcher.slurm.nodes``.
    """
    env = os.environ if environ is None else environ
    slurm = spec.launcher.slurm
    job = env.get("SLURM_JOB_ID")
    if spec.launcher.kind != "slurm" or slurm.nodes == 1 or job is None:
        return None
    nodes = slurm_command(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")]).split()
    if len(nodes) != slurm.nodes:
        raise SlurmError(f"job {job} has {len(nodes)} nodes ({','.join(nodes)}), launcher.slurm.nodes = {slurm.nodes}")
    return Layout(
        job_id=job,
        inference=tuple(nodes[: slurm.inference_nodes]),
        trainer=tuple(nodes[slurm.inference_nodes :]),
        addresses={node: node_address(node) for node in nodes},
        run_as=tuple(run_as_argv(env)),
    )
