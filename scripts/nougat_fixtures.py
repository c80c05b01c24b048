#!/usr/bin/env python3
"""Writes tests/fixtures/nougat_post/cases.json: crafted Nougat generations
and what transformers' `NougatTokenizer.post_process_generation` returns for
each, with `fix_markdown=True` (`fix_markdown`) and `fix_markdown=False`
(`no_fix_markdown`), for a Rust port of the post-processing.

    /work/venv/bin/python scripts/nougat_fixtures.py

The post-processing never reads the vocabulary: it is called on
`NougatTokenizer()` (the constructor's five-token default vocab), so no
checkpoint is needed. It needs `nltk` and `Levenshtein` installed, but NOT
nltk's `words` corpus: without it `nltk.corpus.words.words()` raises
`LookupError` and transformers' fallback branch appends a space to any
generation that reaches the last-word check. That fallback is the behaviour
recorded here (as in an ordinary install); the script refuses to run if the
corpus is present. Inputs are fixed or drawn from a seeded `random.Random`,
so the output is deterministic.
"""

import json
import random
from pathlib import Path

import Levenshtein
import nltk
import transformers
from transformers import NougatTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/nougat_post/cases.json"

LONG_TITLE = (
    "A very long heading that is certainly not a section title because it goes on and on "
    "about the method"
)
assert len(LONG_TITLE) >= 100


def refs(n, fmt, start=1, sep="\n"):
    return sep.join(fmt.format(i=i, j=i + start, y=1990 + i) for i in range(n))


REF = "* [{j}] A. Author and B. Writer. On the theory of things. J. Stuff, {i}:{y}, {y}."
REF_UNI = "* [{j}] M. Müller and 李 小龍. Über die Théorie der Dinge 🚀. Zeitschrift, {i}({y}), {y}."


def distinct_refs(rng, n):
    """Reference lines different enough from each other (ratio < 0.9)."""
    words = ["graph", "neural", "theory", "quantum", "sparse", "optical", "protein", "market",
             "lattice", "entropy", "fluid", "kernel", "galaxy", "enzyme", "tensor", "voting"]
    lines = []
    for i in range(n):
        w = rng.sample(words, 4)
        first = "".join(rng.choice("ABCDEFGHIJKLMNOPRSTW") for _ in range(2))
        lines.append(f"* [{i + 1}] {first[0]}. {first[1]}{w[0]}. {w[1].title()} {w[2]} of {w[3]}. "
                     f"Proc. {rng.randint(1, 99)}, {rng.randint(1950, 2023)}.")
    return "\n".join(lines)


def near_refs(n):
    """Lines that are not equal after number removal but have ratio > 0.9."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "\n".join(
        f"* [{i + 1}] C. Ng and D. Roe. Learning the structure of model {letters[i % 26]}. Conf. Learn., {2000 + i}."
        for i in range(n)
    )


def cases(rng):
    c = []

    def add(name, text):
        c.append((name, text))

    # --- section titles and headings ---------------------------------------
    add("title_too_long_at_start", "# 1. " + LONG_TITLE + "\nBody text follows here")
    add("title_too_long_middle", "Intro text.\n## 2 " + LONG_TITLE + " é 中文\nMore text")
    add("title_too_long_99_chars_kept", "Intro text.\n## 3 " + LONG_TITLE[:99] + "\nMore text")
    add("title_too_long_W_is_newline", "# \n" + LONG_TITLE + "\nafter")
    add("heading_numeral_only", "# 1.\nText after a numeral heading\n## 2.3\n\n  Next paragraph")
    add("heading_roman_only", "Start\n## iv.\n\nRoman heading above\n### xii\nend")
    add("heading_numeral_with_text_kept", "# 1. Introduction\nText of the introduction")
    add("heading_empty", "Start\n# \n\nafter empty heading")
    add("hallucinated_title_at_end", "Some body text.\n## Conclusion")
    add("hash_without_space_at_end", "Some body text\n#hashtag")
    add("single_line_heading", "# Only A Title")
    add("leftmargin", "Items:\n* [leftmargin=*]\n* one thing\n* two things")
    add("incomplete_headers", "Text\n## B\nMore text\n### [\nEven more\n##\nend")

    # --- truncate_repetitions -----------------------------------------------
    add("repeat_tail_with_punctuation",
        "An introduction sentence. " + "The cat sat on the mat once again. " * 6)
    add("repeat_tail_case_differs",
        "Preface here! " + "The Cat Sat On The Mat Yet Again; " + "the cat sat on the mat yet again; " * 2
        + "THE CAT SAT ON THE MAT YET AGAIN; " * 2)
    add("repeat_tail_no_punctuation",
        "begin " + "abcdefghij klmnopqrst uvwxyz 0123 " * 5)
    add("repeat_tail_unicode",
        "Résumé: " + "crème brûlée 🍮 et café au lait, très bon " * 4)
    add("repeat_tail_dotted_i_lower_changes_length",
        "İstanbul İzmir. " + "Ankara İstanbul and back once more. " * 4)
    add("repeat_identical_lines", "Header line\n" + "\n".join(["the same line repeated, forever and ever"] * 8))
    add("short_text_under_60", "abcabcabcabcabcabcabcabcabcabcabc")

    # --- hallucinated references ----------------------------------------------
    add("refs_no_header_text_after",
        "Some concluding text here.\n" + refs(20, REF) + "\nText after the references is different.")
    add("refs_with_header_at_end", "Body of the paper.\n\n## References\n\n" + refs(18, REF))
    add("refs_blank_lines_between", "Paper.\n## References\n" + refs(17, REF, sep="\n\n") + "\n\nFin.")
    add("refs_unicode", "Einleitung ü.\n" + refs(19, REF_UNI) + "\nSchluss")
    add("refs_near_identical_ratio_over_0_9", "Start.\n" + near_refs(18) + "\nEnd")
    add("refs_distinct_ratio_under_0_9", "## References\n" + distinct_refs(rng, 20))
    add("refs_no_header_at_end", "Closing words of the text\n" + refs(16, REF, start=101))
    add("refs_header_then_missing_page", "Text.\n## References\n\n[MISSING_PAGE_POST:12]\nmore text")
    # get_slices skips lines starting "[MISSING_PAGE", but it tests the
    # cleaned lines, whose underscores remove_numbers has dropped: removed.
    add("missing_page_lines_underscores_cleaned",
        "Start\n" + "\n".join(f"[MISSING_PAGE_EMPTY:{i}] page is empty here" for i in range(18)) + "\nEnd")
    add("refs_only_ten_kept", "Start.\n" + refs(10, REF) + "\nEnd")
    add("refs_two_blocks",
        "A.\n" + refs(16, REF) + "\nMiddle text that is not a reference at all.\n" + refs(17, REF_UNI, start=40)
        + "\nZ end")

    # --- reference regexes, single characters, pmc, footnotes ------------------
    add("ref_empty_brackets", "Refs:\n* [12][]ABC and more\n* [3][] x\n* [4] [] y")
    add("ref_too_many_initials",
        "Refs:\n* [3] A. B. C. D. E. F. G. H. I. J. K. Smith\n* [4] A. B. C. X. Jones\nend")
    add("single_char_start", "a\n\nText body of the page")
    add("single_char_end", "Text body of the page\n\nZ")
    add("single_char_unicode", "é\n\nText body\n\n中")
    add("single_char_dollar_before_final_newline",
        "Body\n\nZ\n* [3] A. B. C. D. E. F. G. H. I. J. K. Smith")
    add("single_char_superscript_and_combining", "²\n\nBody text\n\n\u0301")
    add("pmc_subscript", "where _a__b_ is and (_x__yz_) and _q__rst_: done")
    add("pmc_italic", "let _x_ and 3_y_4 be _z_; also _u_ _v_ here")
    add("footnote_fix",
        "Text\nFootnote 1: footnotetext: The first note.\n\nMore text\nFootnote 2: thanks:  -- Grant 7.")
    add("footnote_block", "Before [FOOTNOTE:1]note text[ENDFOOTNOTE] after [FOOTNOTE:]x[ENDFOOTNOTE] end")

    # --- list-like lines --------------------------------------------------------
    add("list_dash_items", "- first item here - second item here - third one")
    add("list_short_items_dropped", "- a. - b")
    add("list_roman", "* i. item one - ii. item two - iii. item three")
    add("list_nested_numbers",
        "Intro line\n- 1 Intro part - 1.1 Sub part - 1.1.1 Deep part - 1.10 Not nested\nlast line")
    add("list_star_not_first_line", "Intro line\n* 日本 語 * 中文 字 * café au lait\nend.")

    # --- endings ------------------------------------------------------------------
    add("ending_period", "A sentence that ends.")
    add("ending_brace", "We have $x^{2}$ and \\textbf{y}")
    add("ending_figure", "Some text\nFigure 3: A caption")
    add("ending_table", "Some text\nTable 2 shows")
    add("ending_plain_word", "words at the end")
    add("ending_single_capital", "A")
    add("ending_single_hash", "#")
    add("start_hash_and_period", "#Heading\n\nText.")
    add("start_bold", "**Bold** text")
    add("start_begin", "\\begin{equation}x=1\\end{equation}")
    add("empty", "")
    add("whitespace_python_strip", "\x1f\xa0\u3000 text \x85\x1c")

    # --- tables -------------------------------------------------------------------------
    add("table_whitespace",
        "\\begin{table} \\begin{tabular}{l l} a & b \\\\ \\end{tabular} \\end{table} Table 1: x")
    add("table_begin_after_text",
        "Text \\begin{tabular}{c} a \\end{tabular} then \\begin{tabular}{c} b \\end{tabular}")
    add("table_too_many_tabulars",
        "keep\n" + "\\begin{tabular}{c}x\\end{tabular}" * 16 + "\nalso keep")
    add("table_empty_tabulars",
        "A\n\\begin{tabular}{l l}  & \\\\ \\end{tabular}\nB\n\\begin{tabular}{}\n\n\\end{tabular}\n"
        "C\n\\begin{tabular}{c c r} & & \\\\ \\end{tabular}\nD\n\\begin{tabular}{cc}  \\end{tabular}\nE")
    add("array_brackets", "\\[\\begin{array}[]{cc} 1 & 2 \\end{array}\\]")
    add("sab_repeats", "Text\n**S. A. B.**\n**S. A. B.**\n\n**S. A. B.**\nMore text")
    add("lone_periods", "Text\n.\nMore\n.  \n\n\n\nEnd")
    add("many_newlines", "alpha\n\n\n\nbeta\n\n\ngamma")
    add("many_newlines_single_chars", "a\n\n\n\nb\n\n\nc")

    # --- markdown_compatible ---------------------------------------------------------------
    # The tag rules are anchored at line ends; the last line has gained a
    # trailing space (or "\n\n") by then, so it is never tagged.
    add("eq_tag_before", "(1) \\[x+y\\]\n(2.1b) \\[z\\]\nwhere x is real.")
    add("eq_tag_before_lazy_spans", "(1) \\[a\\] and \\[b\\]\ndone.")
    add("eq_tag_after", "\\[E=mc^2\\] (2a)\nSo.")
    add("eq_tag_between", "\\[a\\] (3) \\[b\\]\nok.")
    add("eq_tag_unicode_digit", "(١) \\[α\\]\nok.")
    add("eq_tag_last_line_not_tagged", "\\[E=mc^2\\] (2a)")
    add("escaped_period", "end\\. Next\\.")
    add("bold_math", "\\bm{x} and {\\\\bm y} and \\mbox{\\boldmath$z$} and \\mbox{ \\boldmath$w$}")
    add("urls", "see https://example.com/path?q=1. and http://例え.jp/パス, ftp://files.example.org/a.txt")
    add("code_fences", "Algorithm:\n```  python\nx = 1\n  ```\nand ```y``` done")

    # --- mixed unicode -------------------------------------------------------------------------
    add("unicode_paragraph", "Ça va? 日本語のテキスト 😀 naïve façade")
    add("unicode_list", "- 甲 乙丙 - 丁 戊己 😀\n- ü ö")
    return c


def main() -> None:
    try:
        nltk.corpus.words.words()
    except LookupError:
        pass
    else:
        raise SystemExit("nltk's words corpus is installed: the fixtures record the fallback "
                         "branch taken without it; remove the corpus and rerun")

    tok = NougatTokenizer()
    rng = random.Random(20240611)
    out_cases = []
    for name, text in cases(rng):
        out_cases.append({
            "name": name,
            "input": text,
            "fix_markdown": tok.post_process_generation(text, fix_markdown=True),
            "no_fix_markdown": tok.post_process_generation(text, fix_markdown=False),
        })
    names = [c["name"] for c in out_cases]
    assert len(names) == len(set(names)), "duplicate case names"

    out = {
        "transformers": transformers.__version__,
        "levenshtein": Levenshtein.__version__,
        "nltk_words_corpus": False,
        "cases": out_cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(out, indent=1, ensure_ascii=False) + "\n"
    assert len(data.encode()) < 200_000, "fixture file too large"
    OUT.write_text(data)
    # Which outputs differ from the input beyond the whitespace added or
    # stripped at the ends.
    for c in out_cases:
        changed = [k for k in ("no_fix_markdown", "fix_markdown") if c[k].strip() != c["input"].strip()]
        print(f"{c['name']:45} changed: {', '.join(changed) or '- (ends only)'}")
    print(f"wrote {OUT} ({len(out_cases)} cases)")


if __name__ == "__main__":
    main()
