"""`healsweep bench night`: a real `sweep run` measured end to end, on this host or a local pool.

The sweep is a grid in the proportions of an ablation: a few quantization settings (``gain_d``,
which the down projection's quantization reads; ``gain_gu``, gate's and up's; or ``type_d``, down's
storage type, which ggml's own quantizer writes: the costliest re-quantization) x several ``rho`` x
several ``eta``, listed so that the quantization varies fastest: the first trials each build a new
quantization (the very first is cold: it also traces the calibration set), the later ones change
only ``rho`` or ``eta`` of a quantization built before (the follow-ups). With ``nodes`` it first
starts a local pool (:mod:`healsweep.bench.localpool`) of that many Ray nodes on this host, each
with its own stage cache (or, ``shared``, one cache root every node uses: the spec's
``cache_root``), runs the sweep there with ``healsweep sweep run --address``, and stops the pool
afterwards. Each placement asked for (``cache``: by the holders of each trial's quantization;
``ray``: by Ray alone) runs on a fresh pool with fresh caches, one after the other, so their
figures compare.

The figures come from the run's wall time and its ``trials.parquet`` rows (their placement
columns): :func:`night_figures`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from healsweep.bench.localpool import NodeSpec, local_pool
from healsweep.bench.trial import phase_table
from healsweep.cache import disk_entries as cache_entries
from healsweep.errors import HealsweepError
from healsweep.heal.knobs import Knobs
from healsweep.profile import phase_totals
from healsweep.results.placement import pool_summary
from healsweep.results.schema import KNOB_PREFIX, row_role
from healsweep.results.store import read_trials

NIGHT_HOURS = 8.0
# Values of each varied knob, the shipped healer's first (the baseline is one grid point).
GRID_VALUES = {
    "gain_d": [0.3, 0.0, 0.6, 0.15, 0.45],
    "gain_gu": [0.3, 0.0, 0.6, 0.15, 0.45],
    "type_d": ["q2_0", "iq2_xs", "iq2_xxs", "q2_k"],
    "rho": [6.0, 24.0, 2.0, 60.0],
    "eta": [0.15, 0.5, 0.0, 1.0],
}
KINDS = ("cold", "quant-change", "rho-only", "eta-only")
QUANT_KNOBS = ("gain_d", "gain_gu", "type_d")  # the quantization knob a night's grid varies


class NightError(HealsweepError):
    """The night's sweep could not be run or measured."""


def parse_grid(grid: str, quant_knob: str = "gain_d") -> dict[str, int]:
    """``"QxRxE"`` (quantization settings x rho values x eta values) as ``{knob: count}``, the
    quantization settings being values of ``quant_knob`` (one of :data:`QUANT_KNOBS`)."""
    if quant_knob not in QUANT_KNOBS:
        raise NightError(f"--quant-knob {quant_knob!r}: expected one of {', '.join(QUANT_KNOBS)}")
    knobs = (quant_knob, "rho", "eta")
    try:
        counts = [int(part) for part in grid.lower().split("x")]
    except ValueError:
        counts = []
    limits = [len(GRID_VALUES[knob]) for knob in knobs]
    if len(counts) != 3 or not all(1 <= n <= top for n, top in zip(counts, limits, strict=True)):
        raise NightError(
            f"--grid {grid!r}: expected QxRxE, e.g. 3x2x2, with at most "
            f"{'x'.join(map(str, limits))} (quantization settings x rho x eta values)"
        )
    return dict(zip(knobs, counts, strict=True))


def night_spec(
    model: str,
    *,
    grid: Mapping[str, int],
    windows: int,
    placement: str,
    resources: Mapping[str, float],
    max_concurrent: int,
    cache_root: str | None = None,
    calib_tokens: int | None = None,
    knobs: Knobs | None = None,
    name: str = "night",
    cache_max_gb: float | None = None,
) -> dict[str, Any]:
    """The sweep spec of a night (a dict, as a spec YAML holds): eta, then rho, then the
    quantization knob, so that grid order (the product, last knob fastest) varies the
    quantization first. ``knobs``: what every config shares (the spec's baseline and fixed
    knobs, less the grid's), e.g. ``quantizer: gptq`` for a quantization as costly as a real
    one."""
    quant = next(knob for knob in grid if knob in QUANT_KNOBS)
    space = {knob: GRID_VALUES[knob][: grid[knob]] for knob in ("eta", "rho", quant)}
    given = knobs.model_dump(include=knobs.model_fields_set) if knobs is not None else {}
    shared = {knob: value for knob, value in given.items() if knob not in space}
    calibration: dict[str, Any] = {"corpus": "demo"}
    if calib_tokens:
        calibration["max_tokens"] = calib_tokens
    spec: dict[str, Any] = {
        "name": name,
        "model": model,
        "corpus": "demo",
        "calibration": calibration,
        "baseline": dict(shared),
        "fixed": dict(shared),
        "references": False,
        "search_space": space,
        "sampler": "grid",
        "pruner": "none",
        "resources": dict(resources),
        "max_concurrent": max_concurrent,
        "max_failures": 2,  # a trial lost with its worker (e.g. memory) is retried, as at night
        "scoring": {"max_windows": windows, "batch": 8},
        "seed": 0,
        "placement": placement,
    }
    if cache_root:
        spec["cache_root"] = cache_root
    if cache_max_gb is not None:
        spec["cache_max_gb"] = cache_max_gb
    return spec


def trial_kinds(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{trial_id: kind}`` of tuned rows by what an earlier trial of the sweep built: the
    first trial is ``cold``; one whose quantization no earlier trial had is ``quant-change``;
    one whose quantization and rho an earlier trial had is ``eta-only``, else ``rho-only``."""
    tuned = sorted((r for r in rows if row_role(r).tuned and r.get("started_at")),
                   key=lambda r: r["started_at"])  # fmt: skip
    seen_q: set[Any] = set()
    seen_qr: set[Any] = set()
    kinds = {}
    for i, row in enumerate(tuned):
        q, rho = row.get("quantization"), row.get(KNOB_PREFIX + "rho")
        if i == 0:
            kinds[row["trial_id"]] = "cold"
        elif q not in seen_q:
            kinds[row["trial_id"]] = "quant-change"
        elif (q, rho) in seen_qr:
            kinds[row["trial_id"]] = "eta-only"
        else:
            kinds[row["trial_id"]] = "rho-only"
        seen_q.add(q)
        seen_qr.add((q, rho))
    return kinds


def entries_on_disk(root: Path) -> dict[str, int]:
    """``{stage: entries}`` of a stage-cache folder (the compilation cache left out)."""
    out: dict[str, int] = {}
    if root.is_dir():
        for stage in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "jax"):
            count = sum(1 for _ in stage.rglob("*.hsc"))
            if count:
                out[stage.name] = count
    return out


def cache_on_disk(roots: Sequence[Path]) -> dict[str, Any]:
    """The stage caches' size at the end of a night: bytes of their entries per stage and in
    all, and the bytes of JAX's compilation cache beside them (``jax/``, not an entry)."""
    per_stage: dict[str, int] = defaultdict(int)
    compiled = 0
    for root in roots:
        for entry in cache_entries(root):
            per_stage[entry.stage] += entry.size
        jax_dir = root / "jax"
        if jax_dir.is_dir():
            compiled += sum(p.stat().st_size for p in jax_dir.rglob("*") if p.is_file())
    return {
        "entry_bytes": sum(per_stage.values()),
        "entry_bytes_by_stage": dict(sorted(per_stage.items())),
        "jax_compilation_cache_bytes": compiled,
    }


def night_figures(
    sweep_dir: Path,
    wall_s: float,
    pool_cpus: float,
    gpu_util: float | None = None,
    shared_root: Path | None = None,
) -> dict[str, Any]:
    """The figures of one night's sweep (see the module docstring)."""
    rows = [r for r in read_trials(sweep_dir).to_pylist() if row_role(r).tuned]
    done = [r for r in rows if r["status"] == "completed"]
    pool = pool_summary(rows) or {}
    kinds = trial_kinds(rows)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for row in done:
        if row.get("work_s") is not None:
            by_kind[kinds.get(row["trial_id"], "?")].append(float(row["work_s"]))
    cpu_s = sum(float(r.get("work_cpu_s") or 0.0) for r in rows)
    rss: dict[str, float] = {}
    for row in rows:
        if row.get("placed_node") and row.get("peak_rss_mb") is not None:
            node = row["placed_node"][:8]
            rss[node] = max(rss.get(node, 0.0), float(row["peak_rss_mb"]))
    per_hour = len(done) / wall_s * 3600 if wall_s > 0 else 0.0
    out: dict[str, Any] = {
        "trials": len(done),
        "trials_failed": len(rows) - len(done),
        "wall_s": round(wall_s, 1),
        "configs_per_hour": round(per_hour, 1),
        "configs_per_night": round(per_hour * NIGHT_HOURS),
        "cache_hit_rate": pool.get("cache_hit_rate"),
        "follow_up_on_holder": pool.get("follow_up_on_holder"),
        "follow_ups": pool.get("follow_ups", 0),
        "cache_hits": pool.get("cache_hits", 0),
        "cache_computed": pool.get("cache_computed", 0),
        "cache_waited": pool.get("cache_waited", 0),
        "seconds_per_trial": {
            kind: {
                "n": len(by_kind[kind]),
                "mean_s": round(sum(by_kind[kind]) / len(by_kind[kind]), 2),
            }
            for kind in KINDS
            if by_kind[kind]
        },
        "kinds": {kind: sum(k == kind for k in kinds.values()) for kind in KINDS},
        "trials_per_node": {node[:8]: n for node, n in pool.get("nodes", {}).items()},
        "gpus_seen": pool.get("gpus", {}),
        "cpu_utilization": round(cpu_s / (wall_s * pool_cpus), 3) if wall_s and pool_cpus else None,
        "gpu_utilization": gpu_util,
        "peak_rss_mb_per_node": {node: round(mb) for node, mb in rss.items()},
    }
    computed: dict[str, int] = defaultdict(int)
    for row in rows:
        for stage, n in json.loads(row.get("cache_detail") or "{}").get("computed", {}).items():
            computed[stage] += n
    out["computed_by_stage"] = dict(computed)  # a quantization built on two nodes counts twice
    out.update(cache_bytes(rows))
    out["threads"] = sorted({int(r["threads"]) for r in rows if r.get("threads") is not None})
    out["phases_by_kind"] = phases_by_kind(done, kinds)
    cold = [r for r in done if kinds.get(r["trial_id"]) == "cold" and r.get("phase_profile")]
    out["cold_phase_rows"] = json.loads(cold[0]["phase_profile"]) if cold else []
    out["work_cpu_s"] = round(
        cpu_s, 1
    )  # CPU seconds of the work: steadier than wall on a busy host
    # Where the wall time went: the trials' works ran for busy_s slot-seconds of the pool's
    # wall x slots; queued_s is what trials spent placed but not yet running (waiting for a
    # node: a busy holder, or a pool with no free slot).
    busy_s = sum(float(r.get("work_s") or 0.0) for r in done)
    out["busy_s"] = round(busy_s, 1)
    out["busy_share"] = round(busy_s / (wall_s * pool_cpus), 3) if wall_s and pool_cpus else None
    out["queued_s"] = round(sum(_queued_s(r) for r in done), 1)
    if shared_root is not None:
        on_disk = entries_on_disk(shared_root)
        out["shared_cache"] = {"computed": dict(computed), "entries": on_disk}
        out["entries_computed_twice"] = sum(
            max(0, n - on_disk.get(stage, 0)) for stage, n in computed.items()
        )
    return out


def cache_bytes(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the rows' works wrote into the stage caches, per stage and in all, and what their
    evictions deleted (bytes, from each row's ``cache_detail``)."""
    written: dict[str, int] = defaultdict(int)
    evicted = 0
    for row in rows:
        detail = json.loads(row.get("cache_detail") or "{}")
        for stage, n in detail.get("bytes_written", {}).items():
            written[stage] += n
        evicted += sum(detail.get("bytes_evicted", {}).values())
    return {
        "cache_bytes_written_by_stage": dict(sorted(written.items())),
        "cache_bytes_written": sum(written.values()),
        "cache_bytes_evicted": evicted,
    }


def phases_by_kind(
    rows: Sequence[Mapping[str, Any]], kinds: Mapping[str, str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per trial kind, the mean over its trials of each phase's totals
    (:func:`~healsweep.profile.phase_totals` of the rows' ``phase_profile``)."""
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("phase_profile"):
            grouped[kinds.get(row["trial_id"], "?")].append(json.loads(row["phase_profile"]))
    out = {}
    for kind in (*KINDS, "?"):
        if not grouped.get(kind):
            continue
        n = len(grouped[kind])
        totals = phase_totals([r for trial in grouped[kind] for r in trial])
        for total in totals.values():
            for key in ("wall_s", "cpu_s", "device_s", "cache_bytes", "calls", "compile_s"):
                if total[key] is not None:
                    total[key] = round(total[key] / n, 3)
            total["trials"] = n
        out[kind] = totals
    return out


def _queued_s(row: Mapping[str, Any]) -> float:
    """Seconds a finished trial spent between its start and its work's (its coordinator's
    time less its task's)."""
    start, end, work = row.get("started_at"), row.get("ended_at"), row.get("work_s")
    if start is None or end is None or work is None:
        return 0.0
    return max(0.0, (end - start).total_seconds() - float(work))


class _GpuSampler:
    """Mean GPU utilization (``nvidia-smi``, every 2 s, all GPUs) while it runs; None without
    ``nvidia-smi``."""

    def __init__(self) -> None:
        self.tool = shutil.which("nvidia-smi")
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = [self.tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(2.0):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
                values = [float(v) for v in out.split()]
            except (OSError, ValueError, subprocess.TimeoutExpired):
                continue
            if values:
                self.samples.append(sum(values) / len(values) / 100)

    def __enter__(self) -> _GpuSampler:
        if self.tool:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.tool:
            self._thread.join(timeout=15)

    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 3) if self.samples else None


def _sweep_run(spec_path: Path, results: Path, env: Mapping[str, str], address: str | None,
               num_cpus: int | None) -> float:  # fmt: skip
    """Run ``healsweep sweep run`` in a child process; its wall seconds."""
    args = [sys.executable, "-m", "healsweep", "sweep", "run", str(spec_path),
            "--results", str(results)]  # fmt: skip
    if address:
        args += ["--address", address]
    elif num_cpus:
        args += ["--num-cpus", str(num_cpus)]
    started = time.perf_counter()
    done = subprocess.run(args, env=dict(env), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise NightError(f"the night's `sweep run` of {spec_path} failed (exit "
                         f"{done.returncode}):\n{tail}")  # fmt: skip
    return wall


def run_night(
    model: str,
    work_dir: Path,
    *,
    nodes: int = 0,
    placements: Sequence[str] = ("cache",),
    grid: Mapping[str, int],
    windows: int = 96,
    cpus_per_node: int = 1,
    gpus_per_node: int = 0,
    gpu: bool = False,
    max_concurrent: int | None = None,
    shared: bool = False,
    calib_tokens: int | None = None,
    knobs: Knobs | None = None,
    cache_max_gb: float | None = None,
) -> dict[str, Any]:
    """Run the night once per placement; ``{"placements": {placement: figures}, ...}``.
    ``cache_max_gb``: the spec's size limit of each stage cache (None: none)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    # no cpu: a trial takes its node's share of the cores (cores ÷ the trials there at once)
    resources = {"gpu": 1} if gpu else {}
    if nodes:
        slots = nodes * (gpus_per_node if gpu else cpus_per_node)
    else:
        slots = max(1, (os.cpu_count() or 1) if not gpu else 1)
    concurrent = max_concurrent or slots
    out: dict[str, Any] = {"model": model, "nodes": nodes or 1, "grid": dict(grid),
                           "windows": windows, "max_concurrent": concurrent,
                           "shared_cache": shared, "cache_max_gb": cache_max_gb,
                           "placements": {}}  # fmt: skip
    for placement in placements:
        run_dir = work_dir / placement
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        shared_root = run_dir / "shared-cache" if shared else None
        spec = night_spec(model, grid=grid, windows=windows, placement=placement,
                          resources=resources, max_concurrent=concurrent,
                          cache_root=str(shared_root) if shared_root else None,
                          calib_tokens=calib_tokens, knobs=knobs,
                          name=f"night-{placement}", cache_max_gb=cache_max_gb)  # fmt: skip
        spec_path = run_dir / "spec.yaml"
        spec_path.write_text(json.dumps(spec, indent=2))  # JSON is YAML
        results = run_dir / "results"
        env = {**os.environ, "HEALSWEEP_CACHE": str(run_dir / "cache")}
        with _GpuSampler() as sampler:
            if nodes:
                specs = [
                    NodeSpec(cpus=cpus_per_node, gpus=gpus_per_node,
                             env={"HEALSWEEP_CACHE": str(run_dir / f"cache-node{i}")})
                    for i in range(nodes)
                ]  # fmt: skip
                with local_pool(specs) as pool:
                    wall = _sweep_run(spec_path, results, pool.env, pool.address, None)
                pool_cpus = float(nodes * cpus_per_node)
            else:
                wall = _sweep_run(spec_path, results, env, None, None if gpu else slots)
                pool_cpus = float(slots)
        figures = night_figures(results / spec["name"], wall, pool_cpus, sampler.mean(),
                                shared_root)  # fmt: skip
        figures["sweep_dir"] = str(results / spec["name"])
        # each node's own root (its entries, or only its JAX cache with a shared root)
        roots = [run_dir / f"cache-node{i}" for i in range(nodes)] if nodes else [run_dir / "cache"]
        figures["cache_on_disk"] = cache_on_disk(roots + ([shared_root] if shared_root else []))
        out["placements"][placement] = figures
    first = out["placements"][placements[0]]
    for key in ("trials", "configs_per_hour", "configs_per_night", "cache_hit_rate",
                "follow_up_on_holder"):  # fmt: skip
        out[key] = first[key]  # the first placement's: the headline keys
    if "cache" in out["placements"] and "ray" in out["placements"]:
        cache, ray = out["placements"]["cache"], out["placements"]["ray"]
        out["wall_ratio_cache_vs_ray"] = round(cache["wall_s"] / ray["wall_s"], 3)
        out["cpu_ratio_cache_vs_ray"] = round(cache["work_cpu_s"] / max(ray["work_cpu_s"], 1e-9), 3)
    return out


def night_table(night: Mapping[str, Any]) -> str:
    """The Markdown table docs/sizing.md quotes: one row per placement."""
    head = ("| placement | nodes | trials | wall s | configs/h | configs/night | cache hit rate "
            "| follow-ups on holder | s/trial cold / quant / rho / eta | quantize entries computed "
            "| work CPU s | busy share | queued s | CPU util | GPU util "
            "| peak RSS MiB/node |")  # fmt: skip
    lines = [head, "|" + "---|" * 16]

    def share(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    for placement, f in night["placements"].items():
        per = "/".join(
            f"{f['seconds_per_trial'][k]['mean_s']:.1f}" if k in f["seconds_per_trial"] else "-"
            for k in KINDS
        )
        rss = ", ".join(str(v) for v in f["peak_rss_mb_per_node"].values()) or "-"
        lines.append(
            f"| {placement}{' (shared root)' if night['shared_cache'] else ''} | {night['nodes']} "
            f"| {f['trials']} | {f['wall_s']:.0f} | {f['configs_per_hour']:.1f} "
            f"| {f['configs_per_night']} | {share(f['cache_hit_rate'])} "
            f"| {share(f['follow_up_on_holder'])} ({f['follow_ups']}) | {per} "
            f"| {f['computed_by_stage'].get('quantize', 0)} | {f['work_cpu_s']:.0f} "
            f"| {share(f['busy_share'])} | {f['queued_s']:.0f} "
            f"| {share(f['cpu_utilization'])} | {share(f['gpu_utilization'])} | {rss} |"
        )
    for placement, f in night["placements"].items():
        for kind, phases in f.get("phases_by_kind", {}).items():
            n = next(iter(phases.values()))["trials"] if phases else 0
            lines += ["", f"{placement}, {kind} trial (mean of {n}), host threads "
                      f"{', '.join(map(str, f.get('threads', []))) or '-'}:", phase_table(phases)]
    return "\n".join(lines)


def cache_table(night: Mapping[str, Any]) -> str:
    """The stage caches of each placement's night: per stage, the MB its trials wrote and the
    MB on disk at the end (with the evictions and JAX's compilation cache under the table)."""
    lines = ["| placement | stage | MB written | MB on disk at the end |", "|---|---|---|---|"]
    notes = []
    for placement, f in night["placements"].items():
        disk, written = f["cache_on_disk"], f["cache_bytes_written_by_stage"]
        stages = sorted(set(written) | set(disk["entry_bytes_by_stage"]))
        for stage in stages:
            lines.append(f"| {placement} | {stage} | {written.get(stage, 0) / 1e6:.1f} "
                         f"| {disk['entry_bytes_by_stage'].get(stage, 0) / 1e6:.1f} |")  # fmt: skip
        lines.append(f"| {placement} | all | {f['cache_bytes_written'] / 1e6:.1f} "
                     f"| {disk['entry_bytes'] / 1e6:.1f} |")  # fmt: skip
        limit = night.get("cache_max_gb")
        notes.append(
            f"{placement}: limit {'none' if limit is None else f'{limit:g} GiB'}, "
            f"{f['cache_bytes_evicted'] / 1e6:.1f} MB evicted, JAX's compilation cache "
            f"{disk['jax_compilation_cache_bytes'] / 1e6:.1f} MB"
        )
    return "\n".join(lines + [""] + notes)
