#!/usr/bin/env python3
"""Writes tests/fixtures/donut/token2json.json: crafted Donut outputs and
what transformers' `DonutProcessor.token2json` makes of them (key order
kept), for `tests/donut_token2json.rs`.

    .venv/bin/python scripts/donut_fixtures.py

The method reads its processor only to recurse and, when `added_vocab`
is not given, for the tokenizer's added tokens; it is called here on a
bare instance with `added_vocab` given, so no checkpoint is needed.
"""

import json
from pathlib import Path

from transformers import DonutProcessor

ROOT = Path(__file__).resolve().parent.parent
ADDED = ["<s_menu>", "</s_menu>", "<s_nm>", "</s_nm>", "<sep/>", "<yes/>", "<no/>", "<s_class>",
         "</s_class>", "<receipt/>", "<s_docvqa>", "<s_question>", "</s_question>", "<s_answer>",
         "</s_answer>"]

CASES = [
    # CORD-like: nested objects, a list of items.
    "<s_menu><s_nm>Latte</s_nm><s_cnt>2</s_cnt><s_price>9,000</s_price><sep/>"
    "<s_nm>Tea</s_nm><s_cnt>1</s_cnt><s_price>4,500</s_price></s_menu>"
    "<s_total><s_total_price>13,500</s_total_price></s_total>",
    # One item: the list collapses to the object.
    "<s_menu><s_nm>Latte</s_nm><s_price>9,000</s_price></s_menu>",
    # Leaves split at <sep/>, stripped; categorical tokens lose their brackets.
    "<s_tags> a <sep/> b<sep/><yes/> <sep/><maybe/></s_tags>",
    "<s_class><receipt/></s_class>",
    # A key opened and never closed is dropped; the rest is parsed.
    "<s_nm>Latte<s_price>9,000</s_price>",
    # Case-insensitive tags.
    "<S_Nm>Mocha</s_nm><s_x>1</S_X>",
    # No field: the text.
    "just some words",
    "",
    "<s_open only",
    # DocVQA.
    "<s_docvqa><s_question>what is the total?</s_question><s_answer>13,500</s_answer>",
    # A repeated key: the later value, at the first one's place.
    "<s_a>1</s_a><s_b>2</s_b><s_a>3</s_a>",
    # An empty object field is left out; an empty leaf is kept.
    "<s_empty><s_inner></s_x></s_empty><s_blank></s_blank>",
    # Deeper nesting, lists of lists.
    "<s_menu><s_sub><s_nm>a</s_nm><sep/><s_nm>b</s_nm></s_sub><sep/><s_sub><s_nm>c</s_nm></s_sub></s_menu>",
    # A list of objects at the top.
    "<s_nm>x</s_nm><sep/><s_nm>y</s_nm>",
    # Text around and between fields, unicode, newlines.
    "prefix <s_name>Café\nnoir</s_name> middle <s_note> ünïcödé </s_note> suffix",
    # A closing tag before its opening one.
    "</s_k>junk<s_k>v</s_k>",
    # Tags with regex metacharacters in the key.
    "<s_a.b>1</s_a.b><s_(c)>2</s_(c)>",
    # Whitespace controls Python strips.
    "<s_k>\x1c v \x1f</s_k>",
]


def main() -> None:
    p = object.__new__(DonutProcessor)
    added = {t: i for i, t in enumerate(ADDED + ["<maybe/>"])}
    out = {
        "added_vocab": list(added),
        # `text`: the compact JSON with transformers' key order, compared
        # as text (a parsed JSON value would lose the order).
        "cases": [
            {
                "tokens": t,
                "text": json.dumps(
                    p.token2json(t, added_vocab=added), ensure_ascii=False, separators=(",", ":")
                ),
            }
            for t in CASES
        ],
    }
    path = ROOT / "tests/fixtures/donut/token2json.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {path} ({len(CASES)} cases)")


if __name__ == "__main__":
    main()
