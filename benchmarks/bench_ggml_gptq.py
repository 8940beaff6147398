"""H-weighted output error of ggml's types: plain ggml + imatrix against GPTQ error feedback.

    python benchmarks/bench_ggml_gptq.py MODEL [--layers 0,1] [--calib-tokens 16384]
        [--heldout-tokens 8192] [--types iq1_m,iq2_xxs,...] [--damp 0.01] [--json OUT]
    python benchmarks/bench_ggml_gptq.py random [--embd 1024 --ff 512 --experts 8]

For each MoE layer of MODEL (``random``: a random qwen2moe written by
``model.synthetic.write_random_model``, rows as wide as ``--embd`` / ``--ff``), the teacher's
routed inputs come from the calibration trace (``heal.trace.calibration_trace``, the corpus's
calibration pool, ``--calib-tokens``) and, held out, from the same teacher forward over dev-split
documents (``configs/splits/demo.yaml``: odd-index eval documents; never test). Per expert
``e`` and projection, ``H_e`` is the undamped second moment of its input (gate/up: x; down: the
teacher's h) over that token set; the figure is ``Σ_e tr((W_e − Q_e) H_e (W_e − Q_e)ᵀ) / T``
summed over gate, up and down (``T`` the tokens of the set, so the two sets are comparable).
``Q_e`` is the decode of the stored bytes of:

- ``plain``: ggml with the calibration importance row per expert (``baseline llama
  --imatrix-from-calibration``);
- ``block/<importance>``: :func:`healsweep.quant.ggml_gptq.quantize_experts_ef`, ``method="block"``
  with that chunk importance (conditional, hessian, imatrix);
- ``block/conditional+N``: the same with ``rounds=N`` of in-chunk refinement;
- ``column``: ``method="column"`` (the grids of ``ggml_gptq.COLUMN_GRIDS``: Q2_K-Q5_K, IQ1_S,
  IQ1_M, IQ2_XXS, IQ2_XS), conditional importance.

Error feedback is fitted on the calibration tokens only. Seconds are wall time per layer (all
three projections) on this machine, second moments and factorizations included; CPU seconds
the process's (all threads: ggml, BLAS, JAX), so they do not depend on how busy the machine is.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from healsweep.cache import StageCache
from healsweep.gguf_io._ggml_lib import dequantize_rows
from healsweep.heal.knobs import CalibrationConfig
from healsweep.kernels.ggml_types import ggml_type
from healsweep.quant import ggml_gptq
from healsweep.quant.gptq import second_moments
from healsweep.quant.imatrix import expert_importance, quantize_expert_stack

TYPES = "iq1_m,iq2_xxs,iq2_xs,iq2_s,q2_k,iq3_xxs,q3_k"
METHODS = (
    "plain",
    "block/conditional",
    "block/hessian",
    "block/imatrix",
    "block/conditional+4",
    "block/conditional+8",
    "column",
)
PROJECTIONS = (("gate", "up"), ("down",))


def heldout_layers(model, tokens: int) -> dict[int, dict[str, np.ndarray]]:
    """x and ids of every MoE layer over the first ``tokens`` tokens of the dev documents."""
    from healsweep.data.chat_template import model_chat_format
    from healsweep.data.corpus import load_corpus
    from healsweep.data.split import load_split, resolve_split
    from healsweep.heal.trace import make_chunks, run_trace

    corpus = load_corpus("demo")
    split = resolve_split(
        load_split(Path(__file__).parents[1] / "configs/splits/demo.yaml"), corpus
    )
    dev = set(split.doc_ids("dev"))
    docs = [d for d in corpus.documents if d.doc_id in dev]
    chunks, _ = make_chunks(
        docs, model.tokenizer(), CalibrationConfig(max_tokens=tokens), model_chat_format(model)
    )
    found: dict[int, dict[str, np.ndarray]] = {}
    run_trace(model, chunks, lambda i, a: found.setdefault(i, {"x": a["x"], "ids": a["ids"]}))
    return found


def errors(stacks, raws, kind, hs, tokens) -> float:
    """Σ over stacks and experts of tr(ΔW H ΔWᵀ) / tokens."""
    total = 0.0
    for w, raw in zip(stacks, raws, strict=True):
        q = dequantize_rows(raw, kind.ggml_id, w.shape[2])
        total += float(ggml_gptq.h_weighted_error(w, q, hs).sum())
    return total / tokens


def layer_table(model, layer, cal, held, types, methods, damp, min_tokens, chunk):
    """{type: {method: (calibration error, held-out error, seconds, CPU seconds)}} of one
    layer."""
    from healsweep.heal.stages import expert_weights

    weights = {k: np.asarray(v) for k, v in expert_weights(model, layer).items() if "exps" in k}
    gate, up = weights["ffn_gate_exps.weight"], weights["ffn_up_exps.weight"]
    n_expert = gate.shape[0]
    everyone = np.arange(n_expert)
    importance = expert_importance(cal, min_tokens)
    enough = np.nonzero(cal["counts"] >= min_tokens)[0]
    groups = []
    for names in PROJECTIONS:
        gate_up = (gate, up) if names == ("down",) else None
        stacks = [weights[f"ffn_{n}_exps.weight"] for n in names]
        h_cal = second_moments(cal["x"].astype(np.float32), cal["ids"], everyone, gate_up)
        h_held = second_moments(held["x"].astype(np.float32), held["ids"], everyone, gate_up)
        imp = importance[f"ffn_{names[0]}_exps.weight"]
        groups.append((names, stacks, gate_up, h_cal, h_held, imp))
    table = {}
    for name in types:
        kind = ggml_type(name)
        row = {}
        for method in methods:
            if method == "column" and kind.ggml_id not in ggml_gptq.COLUMN_GRIDS:
                continue
            cal_err = held_err = seconds = cpu = 0.0
            for _names, stacks, gate_up, h_cal, h_held, imp in groups:
                start, start_cpu = time.perf_counter(), time.process_time()
                if method == "plain":
                    raws = [quantize_expert_stack(w, kind.ggml_id, imp) for w in stacks]
                else:
                    how, _, mode = method.partition("/")
                    mode, _, rounds = mode.partition("+")
                    raws, _ = ggml_gptq.quantize_experts_ef(
                        stacks,
                        name,
                        cal["x"].astype(np.float32),
                        cal["ids"],
                        enough,
                        damp,
                        imp,
                        gate_up,
                        method=how,
                        chunk_importance=mode or "conditional",
                        rounds=int(rounds or 0),
                        chunk=chunk,
                    )
                seconds += time.perf_counter() - start
                cpu += time.process_time() - start_cpu
                cal_err += errors(stacks, raws, kind, h_cal, len(cal["x"]))
                held_err += errors(stacks, raws, kind, h_held, len(held["x"]))
            row[method] = (cal_err, held_err, seconds, cpu)
        table[name] = row
    return table


def open_or_write(args) -> object:
    from healsweep.model import open_model

    if args.model != "random":
        return open_model(args.model)
    from healsweep.model.synthetic import write_random_model

    path = Path(tempfile.mkdtemp(prefix="bench-ef-")) / "random.gguf"
    write_random_model(
        path,
        n_layer=2,
        n_embd=args.embd,
        n_head=4,
        n_head_kv=2,
        n_expert=args.experts,
        n_expert_used=2,
        n_ff_exp=args.ff,
        n_ff_shexp=args.ff,
        seed=0,
    )
    return open_model(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--layers", default=None, help="comma-separated MoE layers (default all)")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--heldout-tokens", type=int, default=8192)
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--damp", type=float, default=0.01)
    parser.add_argument("--chunk", type=int, default=256, help="columns per ggml call")
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--ff", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from healsweep.heal.trace import calibration_trace

    model = open_or_write(args)
    calibration = CalibrationConfig(
        max_tokens=args.calib_tokens, min_tokens_per_expert=args.min_tokens
    )
    trace = calibration_trace(model, calibration, StageCache())
    held = heldout_layers(model, args.heldout_tokens)
    layers = model.hparams.moe_layers
    if args.layers:
        layers = [int(i) for i in args.layers.split(",")]
    types = args.types.split(",")
    methods = ["plain"] + [m for m in args.methods.split(",") if m != "plain"]
    results = {}
    for layer in layers:
        results[layer] = layer_table(
            model,
            layer,
            trace.layer(layer),
            held[layer],
            types,
            methods,
            args.damp,
            args.min_tokens,
            args.chunk,
        )
    hp = model.hparams
    print(
        f"{args.model}: layers {layers}, {hp.n_expert} experts, D {hp.n_embd}, F {hp.n_ff_exp}; "
        f"calibration {trace.report['tokens_used']} tokens, held-out "
        f"{len(held[layers[0]]['x'])} dev tokens; damp {args.damp}, chunk {args.chunk}"
    )
    print(
        "| type | method | calibration error | vs plain | held-out error | vs plain | s/layer "
        "| CPU s/layer |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in types:
        for method in methods:
            if method not in results[layers[0]][name]:
                continue
            cal, held_err, sec, cpu = (
                sum(results[i][name][method][k] for i in layers) for k in range(4)
            )
            plain = [sum(results[i][name]["plain"][k] for i in layers) for k in range(2)]
            print(
                f"| {name} | {method} | {cal:.5g} | {cal / plain[0]:.3f} | {held_err:.5g} | "
                f"{held_err / plain[1]:.3f} | {sec / len(layers):.2f} | {cpu / len(layers):.2f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
