"""The routed experts' storage types as knobs: values, per-layer forms, what each stage reads,
and the one-line refusal when ggml's quantizer is not installed.

Everything here runs without ggml (the default tier has no llama-cpp-python): a knob set that
names a ggml type is plain data until a knob file, a sweep spec or ``build_student`` takes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from healsweep.errors import KnobError, SettingError
from healsweep.heal.knobs import (
    ADDED_LATER,
    EXPERT_TYPES,
    Knobs,
    LayerTypes,
    load_knobs,
    require_ggml,
)
from healsweep.heal.quantize import reads_trace
from healsweep.heal.reads import stage_reads, student_key
from healsweep.kernels.ggml_types import ROUTED_TYPES, ggml_type, step_down, step_up
from healsweep.stage_names import STUDENT_STAGES
from healsweep.sweep.space import config_hash

TYPE_KNOBS = Knobs.TYPES


def test_type_knobs_at_their_defaults_leave_every_config_hash_unchanged():
    assert config_hash(Knobs()) == "46a7eedd3d4d3150"  # pinned in test_knobs.py as well
    assert all(k in ADDED_LATER and k not in Knobs().identity() for k in TYPE_KNOBS)
    assert Knobs(type_gu="q2_0", type_d="q2_0", up_first=0, layer_types="") == Knobs()
    assert config_hash(Knobs(type_d="iq2_xs")) != config_hash(Knobs())
    assert set(EXPERT_TYPES) == {t.name for t in ROUTED_TYPES} and "q2_0" in EXPERT_TYPES


def test_type_values_are_validated_with_what_is_allowed():
    with pytest.raises(KnobError, match=r"^knob 'type_gu' = 'q8_0' is not allowed: expected one "):
        Knobs(type_gu="q8_0")
    with pytest.raises(KnobError, match="'up_last' = -1 is not allowed"):
        Knobs(up_last=-1)
    with pytest.raises(KnobError, match="'up_first' = True"):
        Knobs(up_first=True)
    bad = {
        "1-iq2_xs": "not LAYER:GU/DOWN",
        "x:iq2_xs": "'x' is not a layer index",
        "0:iq2_xs/q2_k/q3_k": "not LAYER:GU/DOWN",
        "0:iq9": "'iq9' is not a routed-expert type",
        "1:iq2_xs,1:q2_k": "a layer is listed twice",
    }
    for value, why in bad.items():
        with pytest.raises(KnobError) as info:
            Knobs(layer_types=value)
        message = str(info.value)
        assert "\n" not in message and f"'layer_types' = {value!r}" in message, message
        assert why in message and "LAYER:GU/DOWN" in message, message


def test_layer_types_has_one_spelling_per_allocation():
    knobs = Knobs(layer_types=" 0 : IQ2_XS / iq3_xxs , -1:q2_k ")
    assert knobs.layer_types == "0:iq2_xs/iq3_xxs,-1:q2_k/q2_k"
    assert knobs == Knobs(layer_types="0:iq2_xs/iq3_xxs,-1:q2_k/q2_k")
    assert config_hash(knobs) == config_hash(Knobs(layer_types="0:iq2_xs/iq3_xxs,-1:q2_k"))


def test_the_ladder_steps_to_the_next_type_with_more_bits():
    for t in ROUTED_TYPES:
        up = ggml_type(step_up(t.name))
        later = ROUTED_TYPES[ROUTED_TYPES.index(t) + 1 :]
        bigger = [u for u in later if u.bits_per_weight > t.bits_per_weight]
        if bigger:
            assert up == bigger[0]  # the next one up, skipping a type of the same size
        else:
            assert up == t  # the top of the ladder stays
    assert [step_up(n) for n in ("iq2_xxs", "q2_0", "iq2_xs", "q3_k", "q4_k")] == [
        "q2_0", "iq2_xs", "iq2_s", "iq4_xs", "q5_k"
    ]  # fmt: skip
    # with a row width: the next one up whose blocks fill the rows (1408 = 44 * 32, not 256's)
    assert step_up("iq2_xs", 1536) == "iq2_s" and step_up("q2_0", 1408) == "iq4_nl"
    assert step_up("iq4_nl", 1408) == "iq4_nl"  # nothing bigger fits: stays


def test_the_ladder_steps_down_to_the_last_type_with_fewer_bits():
    for t in ROUTED_TYPES:
        down = ggml_type(step_down(t.name))
        earlier = ROUTED_TYPES[: ROUTED_TYPES.index(t)]
        smaller = [u for u in earlier if u.bits_per_weight < t.bits_per_weight]
        assert down == (smaller[-1] if smaller else t)  # the bottom of the ladder stays
        if down != t:  # a step down then up comes back (the types of one size aside)
            assert step_up(down.name) in {u.name for u in ROUTED_TYPES
                                          if u.bits_per_weight == t.bits_per_weight}  # fmt: skip
    assert [step_down(n) for n in ("iq2_xs", "q2_0", "iq2_xxs", "q3_k", "iq3_s", "iq1_s")] == [
        "q2_0", "iq2_xxs", "iq1_m", "iq3_xxs", "iq3_xxs", "iq1_s"
    ]  # fmt: skip
    # with a row width: the last one down whose blocks fill the rows (rows of 64: q2_0's)
    assert step_down("iq4_nl", 64) == "q2_0" and step_down("q2_0", 64) == "q2_0"


def test_each_layer_gets_its_types():
    moe, n_layer = range(1, 6), 6  # a dense first layer, then five MoE layers
    knobs = Knobs(type_gu="iq2_xxs", type_d="iq2_xs", up_first=1, up_last=2)
    base, up = LayerTypes("iq2_xxs", "iq2_xs"), LayerTypes("q2_0", "iq2_s")
    assert knobs.expert_types(moe, n_layer) == {1: up, 2: base, 3: base, 4: up, 5: up}
    # overlapping ends step once; layer_types wins over both, negative from the last layer
    both = knobs.replace(up_first=4, up_last=4, layer_types="3:q4_k/iq1_m,-1:q2_k")
    assert both.expert_types(moe, n_layer) == {
        1: up, 2: up, 3: LayerTypes("q4_k", "iq1_m"), 4: up, 5: LayerTypes("q2_k", "q2_k")
    }  # fmt: skip
    assert Knobs().expert_types(moe, n_layer) == dict.fromkeys(moe, LayerTypes("q2_0", "q2_0"))
    for text, why in (("0:iq2_xs", "layer 0 is not a MoE layer"),
                      ("6:iq2_xs", "layer 6 is not a MoE layer"),
                      ("5:iq2_xs,-1:q2_k", "entries 5 and -1 both name layer 5")):  # fmt: skip
        with pytest.raises(KnobError, match=why):
            Knobs(layer_types=text).expert_types(moe, n_layer)


def test_a_group_stored_in_a_ggml_type_reads_no_quantizer_knob():
    knobs = Knobs(quantizer="gptq", gptq_refine=2, importance="act", gain_gu=0.1)
    assert stage_reads(knobs, "quantize", group="gu", stored_as="iq2_s") == {"type": "iq2_s"}
    assert stage_reads(knobs, "quantize", group="gu", stored_as="q2_0") == {
        "importance": "act", "gain_gu": 0.1, "quantizer": "gptq", "gptq_damp": 0.01,
        "gptq_refine": 2,
    }  # fmt: skip
    assert set(stage_reads(knobs, "quantize", group="d", stored_as="q2_0")) == {
        "importance_down", "gain_d", "quantizer", "gptq_damp", "gptq_refine"
    }  # fmt: skip
    assert stage_reads(Knobs(quantizer="plain"), "quantize", group="d", stored_as="q2_0") == {
        "quantizer": "plain"
    }
    # the whole model: the default reads what it always read
    assert stage_reads(Knobs(), "quantize") == {
        "importance": "norm_proxy", "importance_down": "none", "gain_gu": 0.3, "gain_d": 0.3
    }  # fmt: skip
    ggml = Knobs(type_gu="iq2_s", type_d="iq4_nl")
    assert stage_reads(ggml, "quantize") == {"type_gu": "iq2_s", "type_d": "iq4_nl"}
    # the same student, whatever the quantizer knobs say (no grid for gptq to refine)...
    twin = ggml.replace(quantizer="gptq", gain_gu=1.5, importance_down="act")
    assert all(stage_reads(twin, s) == stage_reads(ggml, s) for s in STUDENT_STAGES)
    assert student_key(twin) == student_key(ggml)  # a sweep scores it once
    # ...unless some layer may be Q2_0: iq2_xxs steps up to q2_0
    stepped = Knobs(type_gu="iq2_xxs", type_d="q2_k", up_last=1)
    assert "gain_gu" in stage_reads(stepped, "quantize")
    assert "gain_d" not in stage_reads(stepped, "quantize")
    grid = Knobs(quantizer="gptq", gptq_damp=0.1, gain_d=0.2)  # gptq refines the K grids
    assert stage_reads(grid, "quantize", group="d", stored_as="q3_k") == {
        "type": "q3_k", "quantizer": "gptq", "gptq_damp": 0.1
    }  # fmt: skip
    assert stage_reads(grid, "quantize", group="d", stored_as="iq2_s") == {"type": "iq2_s"}
    # ...and the IQ grids (quant.ggml_gptq)
    for name in ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq3_s", "iq4_xs"):
        assert stage_reads(grid, "quantize", group="gu", stored_as=name) == {
            "type": name, "quantizer": "gptq", "gptq_damp": 0.1
        }  # fmt: skip
    assert stage_reads(grid.replace(type_gu="q2_k", type_d="q2_k"), "quantize") == {
        "type_gu": "q2_k", "type_d": "q2_k", "quantizer": "gptq", "gptq_damp": 0.1
    }  # fmt: skip
    named = Knobs(type_gu="iq2_xs", type_d="q2_k", layer_types="0:iq2_xs/q2_0")
    assert "gain_d" in stage_reads(named, "quantize")
    assert "gain_gu" not in stage_reads(named, "quantize")


def test_a_ggml_type_reads_the_trace_and_q2_0_only_for_act_or_gptq():
    assert not reads_trace(Knobs(), "gu", "q2_0")
    assert reads_trace(Knobs(importance="act"), "gu", "q2_0")
    assert not reads_trace(Knobs(importance="act"), "d", "q2_0")
    assert reads_trace(Knobs(quantizer="gptq"), "d", "q2_0")
    for group in ("gu", "d"):
        assert not reads_trace(Knobs(quantizer="plain", importance="act"), group, "q2_0")
        assert reads_trace(Knobs(quantizer="plain"), group, "iq2_xs")  # its importance rows


@pytest.fixture
def without_ggml(monkeypatch):
    """ggml's quantizer as on a machine without llama-cpp-python."""
    from healsweep.gguf_io import _ggml_lib

    _ggml_lib.libggml.cache_clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec answers None
    monkeypatch.delenv(_ggml_lib.ENV_VAR, raising=False)  # no llama.cpp build named either
    monkeypatch.setattr(_ggml_lib, "BUILT_DIR", Path("no-such-folder"))  # nor tools/build-ggml.sh's
    yield
    monkeypatch.undo()
    _ggml_lib.libggml.cache_clear()


def test_a_ggml_type_without_ggml_fails_in_one_line_at_load(without_ggml, tmp_path):
    from healsweep.gguf_io import _ggml_lib
    from healsweep.gguf_io._ggml_lib import status_line
    from healsweep.sweep.spec_files import spec_from_dict

    knobs = tmp_path / "k.yaml"
    knobs.write_text("type_d: iq2_xs\n")
    with pytest.raises(SettingError) as info:
        load_knobs(knobs)
    message = str(info.value)
    assert message == (
        f"{knobs}: knob type_d = 'iq2_xs' needs ggml's quantizer: ggml's quantizer "
        f"(libggml-base) was not found: {_ggml_lib.WAYS}"
    )
    assert "tools/build-ggml.sh" in message and "HEALSWEEP_GGML_LIB" in message
    with pytest.raises(SettingError, match=r"^knob layer_types = '2:q2_0/q3_k' needs ggml's"):
        require_ggml(Knobs(layer_types="2:q2_0/q3_k").model_dump())
    with pytest.raises(SettingError, match="^knob type_gu = 'q2_k' needs ggml's quantizer"):
        spec_from_dict({"name": "x", "search_space": {"type_gu": ["q2_0", "q2_k"]}})
    with pytest.raises(SettingError, match="^knob up_first = 2 needs ggml's"):
        require_ggml(Knobs(up_first=2).model_dump())  # q2_0 one step up is iq2_xs
    require_ggml(Knobs(layer_types="0:q2_0", quantizer="gptq").model_dump())  # all Q2_0: fine
    (tmp_path / "q2.yaml").write_text("type_d: q2_0\nlayer_types: '1:q2_0'\n")
    assert load_knobs(tmp_path / "q2.yaml").type_d == "q2_0"
    assert status_line().startswith("ggml quantizer: absent (ggml's quantizer (libggml-base) was")


def test_the_cli_refuses_a_ggml_type_in_one_line_in_a_process_that_cannot_find_ggml(tmp_path):
    # A real process whose import system has no llama_cpp (find_spec answers None there) and no
    # HEALSWEEP_GGML_LIB, so healsweep.gguf_io._ggml_lib finds no library: `healsweep heal` exits
    # 1 with one line, no traceback, once it has checked that the type fits the model's rows.
    knobs = tmp_path / "k.yaml"
    knobs.write_text("type_gu: iq2_xxs\n")
    hide = "import sys; sys.modules['llama_cpp'] = None; from healsweep.cli import main; main()"
    args = ["heal", "demo-medium-cpu", "--knobs", str(knobs), "--out", str(tmp_path / "o.gguf")]
    env = {k: v for k, v in os.environ.items() if k != "HEALSWEEP_GGML_LIB"}
    env["HEALSWEEP_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert done.returncode == 1, done.stderr
    if "tools/build-ggml.sh" in done.stderr and "built" in done.stderr:  # pragma: no cover
        pytest.fail("this venv has a built libggml-base; the test cannot hide it")
    assert done.stderr.startswith(
        f"error: {knobs}: knob type_gu = 'iq2_xxs' needs ggml's quantizer: ggml's quantizer "
        "(libggml-base) was not found: build it with tools/build-ggml.sh"
    ), done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.slow  # a spec that names a ggml type needs ggml's quantizer (the [bench] extra)
def test_the_grid_drops_points_whose_only_change_a_ggml_typed_group_does_not_read():
    from healsweep.sweep.space import grid_configs
    from healsweep.sweep.spec_files import spec_from_dict

    space = {"type_gu": ["q2_0", "iq2_xs"], "type_d": ["iq2_xs"], "gain_gu": [0.3, 1.0]}
    configs = grid_configs(spec_from_dict({"name": "x", "search_space": space}))
    assert [(c.type_gu, c.type_d, c.gain_gu) for c in configs] == [
        ("q2_0", "q2_0", 0.3),  # the baseline
        ("q2_0", "iq2_xs", 0.3),
        ("q2_0", "iq2_xs", 1.0),  # gain_gu acts on the Q2_0 gate and up experts
        ("iq2_xs", "iq2_xs", 0.3),  # (iq2_xs, 1.0) is this student again: dropped
    ]
    assert len({student_key(c) for c in configs}) == len(configs)


def test_the_headline_recipe_on_the_small_demo_names_the_model_it_fits(tmp_path):
    """``heal demo --knobs configs/knobs/budget-2.06.yaml``: the demo's rows of 128 do not hold
    IQ2_XXS blocks of 256. One line naming the packaged model where the recipe fits, with the
    command, and the smallest types that do fit the demo; said before any question of ggml's
    quantizer (which the recipe needs, and which HEALSWEEP_GGML_LIB hides here)."""
    root = Path(__file__).resolve().parents[1]
    knobs = "configs/knobs/budget-2.06.yaml"
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache"),
           "HEALSWEEP_GGML_LIB": str(tmp_path / "nowhere")}  # fmt: skip
    run = subprocess.run([sys.executable, str(root / "cli.py"), "heal", "demo", "--knobs", knobs,
                          "--out", str(tmp_path / "h.gguf")], capture_output=True, text=True,
                         cwd=root, env=env, timeout=300)  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "hold 128 values, not a multiple of the IQ2_XXS block of 256" in line
    assert "The types that fit this model, smallest first: q2_0 (2.25 bits), iq4_nl" in line
    assert f"`healsweep heal demo-medium-cpu --knobs {knobs} --out OUT.gguf`" in line
    assert not (tmp_path / "h.gguf").exists()
