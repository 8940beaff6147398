"""Wording of the demo corpus, in two families that share no sentence.

Family ``A`` writes the eval documents, family ``B`` the calibration documents; the training pool
uses both. Because no template sentence, tool schema or JSON key set is common to the two
families, the calibration pool shares no template text with any eval document by construction
(the builder still checks 16-grams of tokens). Each entry is a ``str.format`` template; the slots
are filled by :mod:`healsweep.demo.corpus_documents`.
"""

from __future__ import annotations

PHRASES: dict[str, dict[str, tuple[str, ...]]] = {
    "A": {
        "code_ask": (
            "Show me how `{q}` is implemented.",
            "Can you walk me through the source code of `{q}`?",
            "How does `{q}` work internally? Please include the code.",
            "I'd like to read the implementation of `{q}` from the `{m}` module.",
        ),
        "code_think": (
            "The user wants to see the code of `{q}`. It is a {kind} in `{m}`.",
            "This is a question about the implementation of the {kind} `{q}` from `{m}`.",
        ),
        "code_plan": (
            "I'll show the source first and then explain what each part does.",
            "Showing the code and then summarizing it step by step should answer this.",
        ),
        "code_intro": (
            "Here is the implementation of `{q}` from `{m}`:",
            "This is the source of `{q}` as it appears in the `{m}` module:",
        ),
        "code_more": (
            "Now show me `{q}` too.",
            "What about `{q}`? Show its code as well.",
        ),
        "code_calls_ask": (
            "Which other functions does it call?",
            "What does it call internally?",
        ),
        "code_raises_ask": (
            "Can it raise exceptions?",
            "Which errors can come out of it?",
        ),
        "docs_ask": (
            "What does `{q}` do?",
            "Explain `{q}` in plain words.",
            "I keep seeing `{q}` in code. What is it for?",
        ),
        "docs_think": (
            'The question is about `{q}` from the `{m}` module. Its docstring opens with: "{s}"',
            'The user asks what `{q}` is for. The documentation in `{m}` starts: "{s}"',
        ),
        "docs_plan": (
            "I should restate the documentation clearly and mention how to call it.",
            "A short explanation followed by the call signature will do.",
        ),
        "docs_usage": (
            "You call it as `{call}`.",
            "Its call signature is `{call}`.",
        ),
        "docs_more": (
            "Does it take any optional arguments?",
            "Which arguments have default values?",
        ),
        "docs_next": (
            "And what does `{q}` do?",
            "Now explain `{q}`, please.",
        ),
        "topic_ask": (
            'Explain the Python language topic "{t}".',
            "What does the language reference say about {t}?",
        ),
        "topic_think": (
            'This asks about the reference section "{t}". It begins: "{s}"',
            'The relevant part of the language reference is "{t}", which opens with: "{s}"',
        ),
        "topic_plan": (
            "I will summarize the section and keep its main rules.",
            "Quoting the key rules of that section is the clearest answer.",
        ),
        "topic_more": (
            "Please continue with the rest of that section.",
            "Tell me more about this.",
        ),
        "json_ask": (
            "Extract these fields as JSON: name, module, kind, params, summary.\n\n{block}",
            "From the documentation below, return a JSON object with the keys name, module, "
            "kind, params and summary.\n\n{block}",
        ),
        "json_think": (
            "I need to pull the name, module, kind, parameters and first sentence out of the "
            "text. The object is `{q}`, a {kind} in `{m}`.",
            "The documentation describes the {kind} `{q}` from `{m}`; I will fill the five "
            "requested fields.",
        ),
        "json_params": (
            "Its parameters are {params}.",
            "The signature lists {params}.",
        ),
        "json_next": (
            "Now the same for this one:\n\n{block}",
            "Do the same extraction here:\n\n{block}",
        ),
        "tool_system": (
            "You are a helpful assistant for questions about the Python standard library.\n\n"
            "# Tools\n\nYou can call the functions described inside <tools></tools> to look "
            "things up.\n<tools>\n{tools}\n</tools>\n\nTo call one, write a JSON object with the "
            "function name and its arguments between <tool_call></tool_call> tags:\n"
            '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
            "</tool_call>",
        ),
        "tool_ask_sig": (
            "What arguments does `{q}` take?",
            "How do I call `{q}`?",
        ),
        "tool_ask_doc": (
            "What is `{q}` used for, and how is it called?",
            "Tell me what `{q}` does and what its parameters are.",
        ),
        "tool_ask_members": (
            "Which documented names does the `{m}` module provide?",
            "List what `{m}` offers.",
        ),
        "tool_think_call": (
            "I should look this up with `{tool}` instead of guessing.",
            "The `{tool}` tool gives exactly this, so I will call it.",
        ),
        "tool_think_next": (
            "The signature came back. Now I need the documentation, so I call `{tool}`.",
            "I have the signature; `{tool}` will give me the docstring.",
        ),
        "tool_think_done": (
            "The tool results are enough to answer.",
            "I now have what I need from the tools.",
        ),
    },
    "B": {
        "code_ask": (
            "Please print the code behind `{q}`.",
            "Where is `{q}` defined, and what does its body look like?",
            "Give me the listing of `{q}` with a commentary.",
        ),
        "code_think": (
            "Request: the body of `{q}` ({kind}, module `{m}`).",
            "Looking for the definition of `{q}`; `{m}` holds it as a {kind}.",
        ),
        "code_plan": (
            "Plan: listing first, commentary after.",
            "Print the definition, then comment on it.",
        ),
        "code_intro": (
            "`{m}` defines `{q}` like this:",
            "Listing of `{q}`:",
        ),
        "code_more": (
            "And the listing of `{q}`?",
            "Next, print `{q}`.",
        ),
        "code_calls_ask": (
            "Name the helpers it relies on.",
            "List its callees.",
        ),
        "code_raises_ask": (
            "Any raise statements in there?",
            "Does that body throw anywhere?",
        ),
        "docs_ask": (
            "Describe `{q}` for me.",
            "In a few sentences: purpose of `{q}`?",
        ),
        "docs_think": (
            'Topic: `{q}` ({m}). Docstring summary line: "{s}"',
            '`{q}` lives in {m}; first docstring line reads "{s}"',
        ),
        "docs_plan": (
            "Paraphrase the docstring, then give the calling form.",
            "Answer from the docstring and end with the call form.",
        ),
        "docs_usage": (
            "Calling form: `{call}`.",
            "Usage: `{call}`.",
        ),
        "docs_more": (
            "Which parameters are optional?",
            "Any defaults I can leave out?",
        ),
        "docs_next": (
            "Same for `{q}`?",
            "Next: `{q}`.",
        ),
        "topic_ask": (
            "Summarize the reference entry on {t}.",
            "Teach me about {t} in Python.",
        ),
        "topic_think": (
            'Reference entry: "{t}". Opening line: "{s}"',
            'Entry "{t}" applies here; it says first: "{s}"',
        ),
        "topic_plan": (
            "Condense it and keep the rules intact.",
            "Walk through it rule by rule.",
        ),
        "topic_more": (
            "Continue, please.",
            "Keep going with that entry.",
        ),
        "json_ask": (
            "Turn this into JSON with qualified_name, defined_in, category, arguments and "
            "first_sentence.\n\n{block}",
            "Produce a JSON record (qualified_name, defined_in, category, arguments, "
            "first_sentence) for:\n\n{block}",
        ),
        "json_think": (
            "Record needed for `{q}`: category {kind}, defined in {m}.",
            "Fields to fill: qualified_name `{q}`, defined_in {m}, category {kind}.",
        ),
        "json_params": (
            "Arguments: {params}.",
            "Argument list is {params}.",
        ),
        "json_next": (
            "Another record, please:\n\n{block}",
            "Next one:\n\n{block}",
        ),
        "tool_system": (
            "Answer questions on Python's bundled modules. Lookup helpers are declared between "
            "<tools> and </tools>, one per line.\n<tools>\n{tools}\n</tools>\nInvoke a helper by "
            'emitting <tool_call>, a line of JSON {{"name": ..., "arguments": {{...}}}}, '
            "then </tool_call>. Results arrive in tool messages.",
        ),
        "tool_ask_sig": (
            "Parameters of `{q}`?",
            "I need the call form of `{q}`.",
        ),
        "tool_ask_doc": (
            "Purpose and call form of `{q}`, please.",
            "Summarize `{q}`: what it is for and its arguments.",
        ),
        "tool_ask_members": (
            "Inventory of `{m}`, please.",
            "What is in `{m}`?",
        ),
        "tool_think_call": (
            "Helper `{tool}` answers this directly.",
            "Use `{tool}` here.",
        ),
        "tool_think_next": (
            "Call form known; docstring still missing, so `{tool}` next.",
            "Next step: `{tool}` for the docstring.",
        ),
        "tool_think_done": (
            "Enough data now.",
            "Lookups done; composing the reply.",
        ),
    },
}

# Tool catalogues: (name, argument, description) per family; schemas are written per family.
TOOLS: dict[str, dict[str, tuple[str, str, str]]] = {
    "A": {
        "signature": (
            "get_signature",
            "qualname",
            "Return the call signature of a standard library function or class.",
        ),
        "doc": ("get_docstring", "qualname", "Return the docstring of a standard library object."),
        "members": ("list_members", "module", "List the documented public names of a module."),
        "source": ("get_source", "qualname", "Return the Python source of a function."),
    },
    "B": {
        "signature": ("describe_callable", "target", "call form of a dotted stdlib name"),
        "doc": ("read_doc", "target", "docstring text for a dotted stdlib name"),
        "members": ("module_contents", "module_name", "public documented names in a module"),
        "source": ("source_lines", "target", "source listing of a stdlib function"),
    },
}
