"""Hostile models and ledgers (issue 47, items 3, 4, 7, 9): chat templates that build at compile
time or through a filter, tokenizer metadata and GGUF headers that contradict themselves, ledger
lines of the wrong types or depth. Each class goes through the real CLI as a child process (the
wrapper of ``test_hostile_files``: one ``error:`` line, exit 1, peak RSS under 1 GB); its
instances are checked in-process where the CLI adds nothing but start-up time.
"""

from __future__ import annotations

import time

import pytest
from test_hostile_files import refused, run_cli

from healsweep.model.synthetic import write_random_model

# --- templates: constant folding, builders estimated before they build, the time limit -------

FOLDED = "{{ 'x'|center(1500000000)|length }}"  # Jinja's optimizer folded this at compile time
BUILDERS = {
    # name: (template, what the refusal names)
    "constant folding": (FOLDED, "'center' would bring"),
    "an autoescape value": ("{% autoescape ('x'|center(1500000000)|length) > 0 %}x"
                            "{% endautoescape %}", "'center' would bring"),
    "batch padding": ("{{ [1]|batch(300000000, 'x')|list|length }}", "'batch' would bring"),
    "slice padding": ("{{ [1]|slice(30000000, 'x')|list|length }}", "'slice' would bring"),
    "a % star width": ("{{ '%*s' % (1500000000, 'x') }}", "'%' would bring"),
    "a format star width": ("{{ '%*s'|format(1500000000, 'x') }}", "'format' would bring"),
    "a nested format width": ("{{ '{:>{}}'.format('x', '1500000000') }}", "'format' would bring"),
    "a width inside a list": ("{{ '{0[0]:>{0[1]}}'.format(['x', 1500000000]) }}",
                              "'format' would bring"),
    "lipsum paragraphs": ("{{ lipsum(1000000) }}", "'generate_lorem_ipsum' would bring"),
    "lipsum words": ("{{ lipsum(3, max=100000000) }}", "'generate_lorem_ipsum' would bring"),
    "indent": ("{{ ('x\n' * 1000000)|indent(1000) }}", "'indent' would bring"),
    "title of many words": ("{{ ('x ' * 10000000)|title|length }}", "'title' would bring"),
    "split into many pieces": ("{{ ('ab ' * 10000000).split()|length }}", "'split' would bring"),
    "a list doubled by +": ("{% set ns = namespace(s=['x']) %}{% for i in range(40) %}"
                            "{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+' would bring"),
    "pprint": ("{{ (range(100000)|list)|pprint }}", "'pprint' would bring"),
}  # fmt: skip
SLOW = {  # Python-level filters whose loops pass none of the template's own checks
    "wordwrap of a long word": "{{ ('x' * 300000)|wordwrap(1) }}",
    "join of many pieces": "{{ (range(100000)|map('string')|list)|join('y' * 1000) }}",
}


def _render(template: str, seconds: float = 1.0) -> str:
    from healsweep.data.chat_template import ChatFormat, RenderLimits
    from healsweep.data.corpus import Message
    from healsweep.errors import ChatTemplateError

    chat = ChatFormat(template, source="T", limits=RenderLimits(seconds=seconds))
    with pytest.raises(ChatTemplateError) as refusal:
        chat.render([Message("user", "hi")])
    return str(refusal.value)


@pytest.mark.parametrize("case", list(BUILDERS))
def test_a_template_builder_is_refused_before_it_builds(case):
    import resource

    template, expected = BUILDERS[case]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    message = _render(template, seconds=30)  # memory, not time, must stop it
    assert expected in message and "over 33,554,432 (32 MiB)" in message, message
    assert time.monotonic() - start < 5
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert grown < 200 * 1024, f"the peak grew by {grown >> 10} MiB"


@pytest.mark.parametrize("case", list(SLOW))
def test_the_time_limit_holds_inside_a_python_filter(case):
    start = time.monotonic()
    message = _render(SLOW[case], seconds=1)
    assert "it ran past 1 s of wall time" in message, message
    assert time.monotonic() - start < 2  # within 2x of the setting


def test_a_benign_template_keeps_its_constants():
    """Without folding, constant expressions still render (they run in the render instead)."""
    from healsweep.data.chat_template import ChatFormat

    chat = ChatFormat("{{ 'ab'|center(6) ~ '%03d' % 7 ~ '{:>4}'.format('x') ~ [1, 2]|join('-') }}"
                      "{% autoescape false %}{{ lipsum(1, false, 2, 3)|length > 0 }}"
                      "{% endautoescape %}", source="T")  # fmt: skip
    assert chat.render([]) == "  ab  007   x1-2True"


def test_a_constant_folding_template_is_one_line_through_the_cli(tmp_path, tiny_tokenizer,
                                                                  record_property):  # fmt: skip
    path = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              chat_template=FOLDED)  # fmt: skip
    run = run_cli("score", "--model", path, "--ref", path, "--max-scored", "16",
                  "--max-context", "16", tmp_path=tmp_path)  # fmt: skip
    message = refused(run, record_property)
    assert message.startswith(f"{path}: tokenizer.chat_template was stopped on document ")
    assert "'center' would bring what it built to 1,500,000,001 characters" in message
