"""The devices and compiled code of a trial's process: its GPU, JAX's memory on it, and the
compilation cache the trials of a host share.

A trial's work runs as a Ray task (:mod:`healsweep.sweep.placed`) with the spec's resources. A
task that asks for GPUs gets a worker process of its own (Ray's default ``max_calls=1`` for GPU
tasks: a reused process would keep the GPU its JAX backend opened for an earlier task) whose
``CUDA_VISIBLE_DEVICES`` Ray sets to the GPUs it was given before the task's code runs. JAX reads
it when its backend starts, at the first computation, so :func:`prepare_trial_process` runs before
the work and refuses a process whose backend has already started. On a GPU, JAX preallocates a
fraction of the device per process (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default): one
trial per GPU keeps that; a trial holding a share of a GPU (``gpu: 0.5``) gets that share of it,
and so does its resident-layer budget (:mod:`healsweep.model.resident`). Settings the worker's
environment already has are left as they are.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from healsweep.cache import default_cache_dir
from healsweep.errors import HealsweepError
from healsweep.model.resident import SHARE_ENV
from healsweep.runtime import current
from healsweep.sweep.spec import RAY_RESOURCE_NAMES
from healsweep.threads import cores, use_threads

PREALLOCATED = 0.75  # the fraction of a GPU JAX's allocator takes per process by default


class DeviceSetupError(HealsweepError):
    """A trial process cannot be given its own GPU."""


def trial_device_env(resources: Mapping[str, float]) -> dict[str, str]:
    """The environment a trial process with ``resources`` (the spec's, per trial) runs with:
    its share of its GPU and, below one GPU, JAX's allocator limited to that share. Empty for
    a trial without GPUs."""
    gpus = float(resources.get("gpu", 0.0))
    if gpus <= 0:
        return {}
    share = min(gpus, 1.0)  # a trial of several GPUs keeps its layers on the first, whole
    env = {SHARE_ENV: f"{share:g}"}
    if share < 1.0:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{PREALLOCATED * share:.4g}"
    return env


def cpu_share(
    resources: Mapping[str, float], max_concurrent: int, nodes: Sequence[Mapping[str, float]]
) -> int:
    """The CPUs a trial takes when its spec names none: on the node that can run it and gives it
    the fewest, the node's cores ÷ the trials that run there at once. A node runs as many as its
    other resources allow (a GPU each: cores ÷ GPUs), at most its share of ``max_concurrent``
    over the nodes that can run trials; so a trial alone on its node takes every core.
    ``nodes``: each alive node's Ray resources (``{"CPU": 16, "GPU": 1, ...}``); at least 1."""

    wanted = {RAY_RESOURCE_NAMES.get(k, k): v for k, v in resources.items() if k != "cpu"}
    able = [  # a node of no CPUs (a pool's head, say) runs no trial
        n for n in nodes
        if n.get("CPU", 0) >= 1 and all(n.get(k, 0) >= v for k, v in wanted.items() if v > 0)
    ]  # fmt: skip
    if not able:
        return 1
    per_node = math.ceil(max_concurrent / len(able))
    shares = []
    for node in able:
        slots = min([per_node] + [int(node[k] // v) for k, v in wanted.items() if v > 0])
        shares.append(node.get("CPU", 1) / max(1, slots))
    return max(1, int(min(shares)))


def prepare_trial_process(
    resources: Mapping[str, float], *, own_process: bool = True
) -> dict[str, Any]:
    """Set up this process for a trial's work, before any JAX computation: the host threads of
    its CPUs (:func:`healsweep.threads.use_threads`: BLAS, XLA's CPU client, ggml's quantizer),
    the environment of :func:`trial_device_env` (what the worker's environment sets already
    wins), the host's compilation cache; what it was given, for the trial's row (``gpus``: the
    ``CUDA_VISIBLE_DEVICES`` JAX will see, None without GPUs; ``threads``: its host threads).
    ``own_process=False``: a process that runs one trial after another on the same GPUs (a Tune
    actor), whose backend may be up."""
    wants_gpu = float(resources.get("gpu", 0.0)) > 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # The process's first trial records the GPUs it started with (JAX has no public "backend
    # started" query): a task with GPUs gets a fresh worker process on a host of several GPUs
    # (sweep.placed: max_calls=1), so nothing has started JAX there before this call; a process
    # reused on a one-GPU node sees that one GPU whatever started JAX. The record is the
    # process's runtime's, which a worker keeps for its life (healsweep.runtime.current).
    started_with = current().memo("CUDA_VISIBLE_DEVICES at the first trial", lambda: visible)
    if own_process and wants_gpu and started_with != visible:
        # (a process reused on a one-GPU node is given the GPU its backend started with)
        raise DeviceSetupError(
            f"trial process {os.getpid()}: JAX's backend started before the trial's GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}) was set, so it "
            "may use another trial's GPU; run trials with GPUs as Ray tasks with num_gpus set "
            "where they are declared (a fresh process per trial)"
        )
    for name, value in trial_device_env(resources).items():
        os.environ.setdefault(name, value)
    threads = use_threads(min(cores(), max(1, int(resources.get("cpu", 1)))))
    enable_compilation_cache()
    return {"gpus": visible if wants_gpu else None, "threads": threads}


def enable_compilation_cache() -> None:
    """Keep JAX's compiled code on disk in one folder of the host (``$HEALSWEEP_CACHE/jax`` of
    the worker's environment, host-local even when the stage cache is shared storage), so the
    trial processes of a host, and those of a re-run or resumed sweep, compile each shape once.
    A folder the user configured (``JAX_COMPILATION_CACHE_DIR``) is left alone. Takes effect
    only before the process's first compilation."""


    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
