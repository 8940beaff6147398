"""`healsweep cluster status` and `healsweep doctor`."""

from __future__ import annotations

import typer

from healsweep import cluster, ray_orphans
from healsweep.cli._apps import app, cluster_app

_ADDRESS = typer.Option(
    None, "--address", help="Ray cluster HOST:PORT (default: a local cluster, if any)."
)


_STOP_ORPHANS = typer.Option(
    False, "--stop-orphans",
    help="Stop the Ray processes that drivers killed on this machine left running.",
)  # fmt: skip


@cluster_app.command("status")
def cluster_status(address: str | None = _ADDRESS, stop_orphans: bool = _STOP_ORPHANS) -> None:
    """List the cluster's nodes, their resources, JAX backends and GPUs; first, the Ray
    processes a killed driver left on this machine (stopped with --stop-orphans)."""
    orphans = ray_orphans.find()
    if stop_orphans:
        ray_orphans.stop(orphans)
    for group in orphans:
        if stop_orphans:
            typer.echo(f"stopped {group.describe()}")
        else:
            pids = " ".join(str(pid) for pid, _ in group.processes)
            typer.echo(f"left running: {group.describe()}; stop them with `healsweep cluster "
                       f"status --stop-orphans` (or `kill -9 {pids}`)")  # fmt: skip
    if not cluster.connect(address):
        if stop_orphans:
            typer.echo("no Ray cluster is running here")
            return
        raise cluster.ClusterError(
            "no Ray cluster is running here; start one with metal/head.sh or pass "
            "--address HOST:PORT"
        )
    found = cluster.nodes(census=True)
    for line in node_lines(found):
        typer.echo(line)
    alive = sum(node.alive for node in found)
    typer.echo(f"{len(found)} node(s), {alive} alive")


_BYTE_RESOURCES = ("memory", "object_store_memory")


def format_resources(resources: dict[str, float]) -> str:
    """``CPU=1, memory=21.5GiB, metal=1`` (byte-valued resources in GiB)."""
    parts = []
    for name, value in sorted(resources.items()):
        shown = f"{value / 2**30:.1f}GiB" if name in _BYTE_RESOURCES else f"{value:g}"
        parts.append(f"{name}={shown}")
    return ", ".join(parts)


def gpu_cell(node) -> str:
    """The node's GPUs: those JAX sees there, and Ray's count when it differs; '' for none."""
    if not node.gpus and not node.declared_gpus:
        return ""
    seen = ", ".join(node.gpus) if node.gpus else "none seen by JAX"
    if node.declared_gpus != len(node.gpus):
        seen += f" ({node.declared_gpus} declared to Ray)"
    return f"; gpus: {seen}"


def node_lines(nodes) -> list[str]:
    """A table of nodes: short id, address, alive, JAX backend (version), resources, GPUs."""
    lines = [f"{'node':<10} {'address':<16} {'alive':<6} {'jax backend':<22} resources"]
    for node in nodes:
        resources = format_resources(node.resources)
        backend = node.jax_backend
        if node.jax_version != "?":
            backend = f"{backend} (jax {node.jax_version})"
        lines.append(
            f"{node.node_id[:8]:<10} {node.address:<16} {str(node.alive):<6} {backend:<22} "
            f"{resources}{gpu_cell(node)}"
        )
    return lines


def _cluster_line(address: str | None) -> str:
    if not cluster.connect(address):
        return "ray cluster: none running here (sweeps start an embedded local Ray)"
    found = cluster.nodes(census=False)
    totals: dict[str, float] = {}
    for node in found:
        if node.alive:
            for name, value in node.resources.items():
                totals[name] = totals.get(name, 0.0) + value
    offered = format_resources(totals)
    alive = sum(node.alive for node in found)
    return f"ray cluster: {alive} alive node(s) of {len(found)}, offers {offered}"


@app.command("doctor")
def doctor(
    address: str | None = _ADDRESS,
    no_ray: bool = typer.Option(False, "--no-ray", help="Skip the Ray cluster check."),
) -> None:
    """JAX backend and devices, the Ray cluster, and the conformance suite: every kernel, GGUF
    decoder and a model layer against float64 references (and the device against the CPU)."""
    # lazy: heavy (gguf, jax): the conformance suite runs every kernel
    from healsweep.conformance import run_conformance
    from healsweep.gguf_io._ggml_lib import status_line

    info = cluster.jax_info()
    typer.echo(
        f"jax {info.jax_version} (jaxlib {info.jaxlib_version}), default backend: {info.backend}"
    )
    for device in info.devices:
        typer.echo(f"  device {device}")
    if not no_ray:
        typer.echo(_cluster_line(address))
    typer.echo(status_line())
    accelerator = info.backend != "cpu"
    where = f"{info.devices[0]}" if accelerator and info.devices else info.backend
    if accelerator:
        typer.echo(f"kernel conformance: {where} against float64 references, and against the CPU:")
    else:
        typer.echo(
            "kernel conformance: CPU only, checked against float64 references "
            "(decoders: gguf-py's and ggml's):"
        )
    results = run_conformance()
    _print_rows(results, accelerator)
    # lazy: heavy (jax, the heal stages)
    from healsweep.heal.device_phases import RIDGE_RTOL, phase_cases

    typer.echo(
        "device phases (the CUDA device's work: teacher record, routed_q, ridge basis), each "
        f"against float64 and its host path (ridge tolerance {RIDGE_RTOL:.0e}):"
    )
    phases = run_conformance(phase_cases())
    _print_rows(phases, accelerator)
    results = [*results, *phases]
    bad = [_failure(r) for r in results if not r.ok]
    if bad:
        typer.echo(
            f"doctor: {len(bad)} of {len(results)} kernel(s) failing: {'; '.join(bad)}", err=True
        )
        raise typer.Exit(1)
    if accelerator:
        compared = sum(r.device_err == r.device_err for r in results)
        typer.echo(
            f"doctor: all {len(results)} kernels agree with their float64 references on "
            f"{info.backend} and on the CPU ({compared} also {info.backend} vs CPU)"
        )
    else:
        typer.echo(
            f"doctor: all {len(results)} kernels agree with their float64 references "
            "(CPU only: no device was compared)"
        )


def _print_rows(results: list, accelerator: bool) -> None:
    """One line per case: its backend, errors, verdict, production path and note."""
    for r in results:
        status = "ok" if r.ok else ("WRONG" if r.lowered else "FAILS")
        figures = f"vs reference {r.err:.1e}"
        if accelerator and r.device_err == r.device_err:  # not NaN: compared with the CPU
            figures += f"  vs cpu {r.device_err:.1e}"
        path = f" [{r.path}]" if r.path else ""
        note = f"  {r.note}" + (f": {r.error}" if r.error else "") if r.note else ""
        typer.echo(f"  {r.name:<32} {r.backend:<5} {figures}  {status}{path}{note}")


def _failure(result) -> str:
    """One kernel's failure in a few words, for doctor's closing line."""
    return f"{result.name} ({result.note})"
