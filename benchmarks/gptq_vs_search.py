"""``quantizer: search`` against ``quantizer: gptq`` on one layer of a model, in one process.

    python benchmarks/gptq_vs_search.py MODEL [--calib-tokens 1024,4096] [--layer 0]
        [--repeats 3] [--dense] [--shares 0.5,1] [--corpus demo] [--json OUT]
        [--write-if-missing]

For each calibration budget: the teacher's calibration trace (read from the stage cache at
``$HEALSWEEP_CACHE``, computed there if missing) and the layer's routed experts decoded once;
then ``repeats`` rounds, each running the quantize stage of both tensor groups (``heal.quantize.quantize_group``) with
the shipped knobs' ``search`` and with ``gptq`` (``gptq_damp`` 0.01) back to back, and with
``--dense`` also ``gptq`` with every expert on the dense path (``LOWRANK_SHARE = 0``: the
algorithm before the low-rank path), and with ``--shares`` also ``gptq`` at each of those
``LOWRANK_SHARE`` values (the threshold's measurement). Each run reports its wall seconds, the CPU seconds of the
whole process (every thread) and the 1-minute load average before it: on a shared machine the
CPU seconds are the steadier figure. Round 0 includes the compilations; the summary is the
median of the later rounds (of all, with one round).

Last, the codes' quality: ``Σ_e tr((W_e − Q_e)·H_e·(W_e − Q_e)ᵀ)`` with ``H_e = X_eᵀX_e`` (no
damping: the routed output's squared error on the calibration rows), in float64, summed over the
experts GPTQ quantized, for each quantizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from healsweep.cache import StageCache, default_cache_dir
from healsweep.heal import stages
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.quantize import quantize_group
from healsweep.heal.trace import calibration_trace
from healsweep.kernels.q2_0 import Q2Packed
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model
from healsweep.quant import gptq
from healsweep.quant.values import GROUPS, Q2_0

TENSORS = ("gate", "up", "down")
A27B_LAYER = "one layer of the Qwen1.5-MoE-A2.7B shape, random, Q8_0 experts (docs/sizing.md)"
A27B = dict(
    n_layer=1, n_embd=2048, n_head=16, n_head_kv=16, n_expert=60, n_expert_used=4,
    n_ff_exp=1408, n_ff_shexp=5632, context_length=4096,
    types={f"ffn_{n}_exps.weight": "Q8_0" for n in TENSORS},
)  # fmt: skip


def _quantize_layer(weights, knobs, trace_layer, calibration) -> dict:
    """The quantize stage of both tensor groups of one layer in Q2_0: ``{"gate.d": ...,
    "gate.codes": ..., ...}`` (fp16 scales and packed codes of each routed stack)."""
    arrays = {}
    for group in GROUPS:
        found = quantize_group(weights, knobs, trace_layer, calibration, group, Q2_0)
        for name, stack in zip(group.tensors, found.stacks, strict=True):
            arrays[f"{name}.d"], arrays[f"{name}.codes"] = np.asarray(stack.d), stack.codes
    return arrays


def _quantize(weights, knobs, trace_layer, calibration, share: float | None):
    """The layer's quantize stage (:func:`_quantize_layer`) timed, with ``gptq.LOWRANK_SHARE``
    set to ``share`` (None: as shipped): ``(arrays, wall s, CPU s, load before)``."""
    shipped = gptq.LOWRANK_SHARE
    gptq.LOWRANK_SHARE = shipped if share is None else share
    try:
        load = os.getloadavg()[0]
        wall, cpu = time.perf_counter(), time.process_time()
        arrays = _quantize_layer(weights, knobs, trace_layer, calibration)
        return arrays, time.perf_counter() - wall, time.process_time() - cpu, load
    finally:
        gptq.LOWRANK_SHARE = shipped


def h_weighted_errors(weights, trace_layer, experts, runs: dict) -> dict:
    """Per run and tensor, ``Σ_e ‖(W_e − Q_e)·X_eᵀ‖²`` in float64 over ``experts`` (``X_e``:
    the expert's routed rows; for down, its teacher hidden ``h``)."""
    x = np.asarray(trace_layer["x"], np.float64)
    ids = np.asarray(trace_layer["ids"])
    w = {n: np.asarray(weights[f"ffn_{n}_exps.weight"]) for n in TENSORS}
    totals = {label: dict.fromkeys(TENSORS, 0.0) for label in runs}
    for e in experts:
        rows = x[np.any(ids == e, axis=1)]
        gate = rows @ w["gate"][e].T.astype(np.float64)
        hidden = gate / (1 + np.exp(-gate)) * (rows @ w["up"][e].T.astype(np.float64))
        for label, arrays in runs.items():
            for n in TENSORS:
                d, codes = arrays[f"{n}.d"][e : e + 1], arrays[f"{n}.codes"][e : e + 1]
                values = np.asarray(Q2Packed(d, codes).dequantize(), np.float64)[0]
                error = (w[n][e].astype(np.float64) - values) @ (hidden if n == "down" else rows).T
                totals[label][n] += float(np.sum(error * error))
    return totals


def compare(
    model, corpus: str, tokens: int, layer: int, repeats: int, dense: bool, shares=()
) -> dict:
    """One budget's rounds, medians, ratios and errors (see the module docstring)."""
    calibration = CalibrationConfig(corpus=corpus, max_tokens=tokens, chunk_length=512)
    cache = StageCache(default_cache_dir())
    trace_layer = calibration_trace(model, calibration, cache).layer(layer)
    weights = stages.expert_weights(model, layer)
    counts = np.asarray(trace_layer["counts"])
    experts = np.nonzero(counts >= calibration.min_tokens_per_expert)[0]
    n_in = {n: weights[f"ffn_{n}_exps.weight"].shape[2] for n in TENSORS}
    low_rank = {n: int(np.sum(counts[experts] <= gptq.LOWRANK_SHARE * n_in[n])) for n in TENSORS}
    contenders = [("search", Knobs(), None), ("gptq", Knobs(quantizer="gptq"), None)]
    contenders += [(f"gptq, share {s:g}", Knobs(quantizer="gptq"), s) for s in shares]
    if dense:
        contenders.append(("gptq, dense path", Knobs(quantizer="gptq"), 0.0))
    rounds, last = [], {}
    for r in range(repeats):
        for label, knobs, share in contenders:
            arrays, wall, cpu, load = _quantize(weights, knobs, trace_layer, calibration, share)
            rounds.append({"round": r, "quantizer": label, "wall_s": wall, "cpu_s": cpu,
                           "load_1m": load})  # fmt: skip
            print(f"  {tokens} tokens, round {r}, {label}: {wall:.2f} s wall, {cpu:.2f} CPU s, "
                  f"load {load:.2f}", flush=True)  # fmt: skip
            last[label] = arrays
    later = [row for row in rounds if row["round"] > 0] or rounds
    median = {
        label: {k: statistics.median(row[k] for row in later if row["quantizer"] == label)
                for k in ("wall_s", "cpu_s")}
        for label, _, _ in contenders
    }  # fmt: skip
    ratio = {
        label: {k: median[label][k] / median["search"][k] for k in ("wall_s", "cpu_s")}
        for label in median
        if label != "search"
    }
    return {
        "calib_tokens": tokens,
        "layer": layer,
        "gptq_experts": len(experts),
        "experts": len(counts),
        "routed_rows": [int(counts[experts].min()), int(counts[experts].max())],
        "low_rank_experts": low_rank,
        "rounds": rounds,
        "median": median,
        "ratio_to_search": ratio,
        "h_weighted_error": h_weighted_errors(weights, trace_layer, experts, last),
        "load_after_1m": os.getloadavg()[0],
    }


def format_result(res: dict) -> str:
    lo, hi = res["routed_rows"]
    lines = [
        f"{res['calib_tokens']} calibration tokens, layer {res['layer']}: {res['gptq_experts']} "
        f"of {res['experts']} experts by GPTQ ({lo}-{hi} routed rows; low-rank path: "
        + ", ".join(f"{n} {k}" for n, k in res["low_rank_experts"].items())
        + ")",
        f"{'round':>5}  {'quantizer':<18}{'wall s':>9}{'CPU s':>9}{'load 1m':>9}",
    ]
    for row in res["rounds"]:
        lines.append(
            f"{row['round']:>5}  {row['quantizer']:<18}{row['wall_s']:9.2f}{row['cpu_s']:9.2f}"
            f"{row['load_1m']:9.2f}"
        )
    lines.append("median of the rounds after the first (compiles in round 0):")
    for label, m in res["median"].items():
        ratio = res["ratio_to_search"].get(label)
        vs = f"  = {ratio['wall_s']:.2f}x / {ratio['cpu_s']:.2f}x search" if ratio else ""
        lines.append(f"  {label:<18} wall {m['wall_s']:7.2f} s  CPU {m['cpu_s']:7.2f} s{vs}")
    lines.append("H-weighted error, sum over the GPTQ experts of ||(W - Q) X^T||^2 (float64):")
    for label, per in res["h_weighted_error"].items():
        parts = "  ".join(f"{n} {v:.6e}" for n, v in per.items())
        lines.append(f"  {label:<18} total {sum(per.values()):.6e}  ({parts})")
    lines.append(f"load average (1 min) at the end: {res['load_after_1m']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calib-tokens", default="1024")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--shares", default="", help="further LOWRANK_SHARE values to time")
    parser.add_argument("--corpus", default="demo")
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-if-missing", action="store_true",
                        help="write MODEL first if it does not exist: " + A27B_LAYER)  # fmt: skip
    args = parser.parse_args(argv)
    if args.write_if_missing and not os.path.exists(args.model):
        wall = time.perf_counter()
        write_random_model(args.model, **A27B)
        print(f"wrote {args.model} in {time.perf_counter() - wall:.1f} s", flush=True)
    model = open_model(args.model)
    shares = [float(s) for s in args.shares.split(",") if s]
    results = []
    for tokens in (int(t) for t in args.calib_tokens.split(",")):
        res = compare(model, args.corpus, tokens, args.layer, args.repeats, args.dense, shares)
        print(format_result(res), flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
