"""The Slurm backend: `perseusrun python train.py` inside an allocation (an sbatch script, an
salloc shell) runs on the allocation's nodes and task slots, with no -H, as mpirun and
horovodrun do there.

Over MPI it is mpirun with the allocation's hosts (Open MPI starts its daemons through srun).
With --tcp it is one `srun` step with no MPI: each task forms the TCP controller from the
step's own variables (perseus_shared.slurm.slurm_tcp_settings) and the job secret perseusrun
exports.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping

from perseus_shared import slurm
from perseusrun import mpi_run, supervise, tcp_run
from perseusrun.job import UsageError, check_job_args, rank_environment


def in_allocation(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """Whether this is a Slurm allocation's shell or batch script (not a job step) and the
    command line names no hosts of its own."""
    if args.hosts or args.hostfile or args.emulate_hosts:
        return False
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST")
                and not env.get("SLURM_STEP_ID"))


def allocation_hosts(env: Mapping[str, str]) -> list[tuple[str, int]]:
    """(node, task slots) of the allocation: SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE."""
    try:
        nodes = slurm.expand_hostlist(env["SLURM_JOB_NODELIST"])
        slots = slurm.expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
    except slurm.SlurmEnvironmentError as exc:
        raise UsageError(f"Slurm job {env.get('SLURM_JOB_ID')}: {exc}") from None
    if len(slots) != len(nodes):
        raise UsageError(
            f"Slurm job {env.get('SLURM_JOB_ID')}: SLURM_TASKS_PER_NODE="
            f"{env.get('SLURM_TASKS_PER_NODE', '')!r} gives {len(slots)} node(s) but "
            f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} names {len(nodes)}")
    return list(zip(nodes, slots))


def srun_command(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """One srun step of args.np tasks without MPI (block placement, all of the environment)."""
    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        raise UsageError("perseusrun --tcp in a Slurm allocation starts its ranks with `srun`, "
                         "which is not on PATH")
    label = ["--label"] if args.tag_output else []
    return [srun, f"--ntasks={args.np}", "--distribution=block", "--mpi=none",
            "--kill-on-bad-exit=1", *label, *args.program]


def prepare(args: argparse.Namespace, env: dict) -> Callable[[], int]:
    """Backend interface (see perseusrun.job): the job on the allocation's nodes."""
    hosts = allocation_hosts(env)
    if args.np is None:
        args.np = sum(slots for _, slots in hosts)
    check_job_args(args)
    if args.restarts:
        raise UsageError("--restarts does not apply in a Slurm allocation: requeue the job "
                         "(sbatch --requeue), and it resumes from the survivors' checkpoint")
    where = ",".join(f"{name}:{slots}" for name, slots in hosts)
    if args.tcp:
        tcp_run.check_tcp_args(args)
        if args.np > sum(slots for _, slots in hosts):
            raise UsageError(f"-np {args.np} needs {args.np} task slots but Slurm job "
                             f"{env['SLURM_JOB_ID']} has {where}")
        cmd = srun_command(args, env)
        step_env = rank_environment(args, env)

        def run_step() -> int:
            if args.verbose:
                print(f"perseusrun: Slurm job {env['SLURM_JOB_ID']} ({where}):",
                      shlex.join(cmd), file=sys.stderr, flush=True)
            return supervise.supervise([(cmd, step_env)], timeout=args.timeout)

        return run_step
    args.hosts = where
    cmd = mpi_run.build_mpirun_command(args, env)
    return lambda: mpi_run.run_mpirun(cmd, env, args)
