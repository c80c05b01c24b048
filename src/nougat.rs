//! Nougat's output as Markdown: transformers'
//! `NougatTokenizer.post_process_generation` (read in
//! `models/nougat/tokenization_nougat.py`, transformers 5.x) ported rule by
//! rule — too long or empty headings dropped, repeated tails cut,
//! hallucinated reference lists replaced by `[MISSING_PAGE_POST]`, pmc math
//! artifacts, footnotes, list-like lines, tables, and with `fix_markdown`
//! the Markdown fixes (equation tags, bold math, links, code fences).
//!
//! Two backends of the Python code are reproduced:
//!
//! - python-Levenshtein's `ratio` (the normalised InDel similarity,
//!   `2 · LCS / (|a| + |b|)`, over code points);
//! - the `nltk` words corpus is a data download that transformers does not
//!   make: without it, its check of the last word raises `LookupError` and
//!   transformers appends a space. vl takes that branch, always.
//!
//! Python's regular expressions are translated for `fancy_regex`: `$`
//! without `re.MULTILINE` (end of text, or before a final newline) as
//! `(?=\n?\z)`, `re.match` anchored with `\A`, literal braces escaped.
//! Tested against transformers' own outputs on crafted pages
//! (`tests/nougat_post.rs`, fixtures written by `scripts/nougat_fixtures.py`).

use fancy_regex::Regex;

/// Python's `str.strip()` whitespace.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

/// `pattern` with Python's classes: `\w` is `str.isalnum()` or `_`
/// (letters and every numeric character, `²` included; not combining
/// marks, which Rust's `\w` takes), `\s` adds the separators
/// U+001C–U+001F.
fn python_classes(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut in_class = false;
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match (chars.next(), in_class) {
                (Some('w'), false) => out.push_str(r"[\p{L}\p{N}_]"),
                (Some('w'), true) => out.push_str(r"\p{L}\p{N}_"),
                (Some('W'), false) => out.push_str(r"[^\p{L}\p{N}_]"),
                (Some('s'), false) => out.push_str(r"[\s\x1c-\x1f]"),
                (Some('s'), true) => out.push_str(r"\s\x1c-\x1f"),
                (Some(x), _) => {
                    out.push('\\');
                    out.push(x);
                }
                (None, _) => out.push('\\'),
            }
            continue;
        }
        match c {
            '[' if !in_class => in_class = true,
            ']' if in_class => in_class = false,
            _ => {}
        }
        out.push(c);
    }
    out
}

/// The compiled `pattern` (one of this module's constants, compiled once
/// per thread; each is compiled by the tests).
fn compile(pattern: &'static str) -> Regex {
    thread_local! {
        static CACHE: std::cell::RefCell<std::collections::HashMap<&'static str, Regex>> =
            Default::default();
    }
    CACHE.with(|cache| {
        cache
            .borrow_mut()
            .entry(pattern)
            .or_insert_with(|| {
                let translated = python_classes(pattern);
                Regex::new(&translated).unwrap_or_else(|e| panic!("pattern {pattern:?}: {e}"))
            })
            .clone()
    })
}

/// `re.sub(pattern, replacement, text)`: every match replaced, `$1`-style
/// groups in `replacement`. A pattern the engine gives up on (its
/// backtracking limit) leaves `text` as it is.
fn sub(pattern: &'static str, replacement: &str, text: &str) -> String {
    let re = compile(pattern);
    match re.try_replacen(text, 0, replacement) {
        Ok(out) => out.into_owned(),
        Err(_) => text.to_string(),
    }
}

/// `re.search(pattern, text)` is not `None`.
fn is_match(pattern: &'static str, text: &str) -> bool {
    let re = compile(pattern);
    re.is_match(text).unwrap_or(false)
}

/// python-Levenshtein's `ratio(a, b)`: `1 − InDel(a, b) / (|a| + |b|)`,
/// i.e. `2 · LCS / (|a| + |b|)`, over code points; 1 for two empty
/// strings.
pub fn ratio(a: &str, b: &str) -> f64 {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let total = a.len() + b.len();
    if total == 0 {
        return 1.0;
    }
    // The longest common subsequence, one row at a time.
    let mut row = vec![0usize; b.len() + 1];
    for &ca in &a {
        let mut diag = 0;
        for (j, &cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if ca == cb { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    2.0 * row[b.len()] as f64 / total as f64
}

/// `markdown_compatible`: equation tags, `\bm` and `\boldmath` as
/// `\mathbf`, links made clickable, code fences on their own lines.
pub fn markdown_compatible(text: &str) -> String {
    let mut text = sub(
        r"(?m)^\(([\d.]+[a-zA-Z]?)\) \\\[(.+?)\\\]$",
        r"\[${2} \tag{${1}}\]",
        text,
    );
    text = sub(
        r"(?m)^\\\[(.+?)\\\] \(([\d.]+[a-zA-Z]?)\)$",
        r"\[${1} \tag{${2}}\]",
        &text,
    );
    text = sub(
        r"(?m)^\\\[(.+?)\\\] \(([\d.]+[a-zA-Z]?)\) (\\\[.+?\\\])$",
        r"\[${1} \tag{${2}}\] ${3}",
        &text,
    );
    text = text.replace(r"\. ", ". ");
    text = text
        .replace(r"\bm{", r"\mathbf{")
        .replace(r"{\\bm ", r"\mathbf{");
    text = sub(r"\\mbox\{ ?\\boldmath\$(.*?)\$\}", r"\mathbf{${1}}", &text);
    text = sub(
        r"((?:http|ftp|https)://(?:[\w_-]+(?:(?:\.[\w_-]+)+))(?:[\w.,@?^=%&:/~+#-]*[\w@?^=%&/~+#-]))",
        "[${1}](${1})",
        &text,
    );
    sub(r"(?s)```\s*(.+?)\s*```", "```\n${1}\n```", &text)
}

/// `normalize_list_like_lines`: a line that starts with `-` or `*` and
/// holds more items after `. - ` (or `. * `) split into one line per item,
/// nested by the dots of its numbering.
pub fn normalize_list_like_lines(generation: &str) -> String {
    let item_re = compile(r". ([-*]) ");
    let lines: Vec<&str> = generation.split('\n').collect();
    let mut out = Vec::with_capacity(lines.len());
    for (line_no, line) in lines.iter().enumerate() {
        let found = item_re
            .captures(line)
            .ok()
            .flatten()
            .and_then(|c| c.get(1).map(|m| m.as_str().to_string()));
        let (Some(bullet), Some(first)) = (found, line.chars().next()) else {
            out.push(line.to_string());
            continue;
        };
        if first != '-' && first != '*' {
            out.push(line.to_string());
            continue;
        }
        let delim = format!("{bullet} ");
        let delim1 = format!("{first} ");
        let mut replacement = String::new();
        for (i, item) in line.split(delim.as_str()).skip(1).enumerate() {
            let item = strip(item);
            let Some((numeral, rest)) = item.split_once(' ') else {
                continue;
            };
            if rest.is_empty() {
                continue;
            }
            let level = if is_match(r"(?im)^[\dixv]+((?:\.[\dixv])?)+$", numeral) {
                numeral.matches('.').count()
            } else {
                0
            };
            if i > 0 {
                replacement.push('\n');
            }
            replacement.push_str(&"\t".repeat(level));
            replacement.push_str(if i > 0 || line_no == 0 {
                &delim
            } else {
                &delim1
            });
            replacement.push_str(item);
        }
        if line_no == lines.len() - 1 {
            replacement.push('\n');
        }
        out.push(replacement);
    }
    out.join("\n")
}

/// `find_next_punctuation`: the index of the first `.`, `?`, `!` or
/// newline at or after `start`.
fn find_next_punctuation(text: &[char], start: usize) -> Option<usize> {
    (start..text.len()).find(|&i| matches!(text[i], '.' | '?' | '!' | '\n'))
}

/// `truncate_repetitions`: a tail of at least `min_len` characters
/// repeated to the end is kept once, extended to the next sentence end.
pub fn truncate_repetitions(text: &str, min_len: usize) -> String {
    let lower: Vec<char> = text.to_lowercase().chars().collect();
    let chars: Vec<char> = text.chars().collect();
    let n = lower.len();
    if n < 2 * min_len {
        return text.to_string();
    }
    let mut longest = None;
    for len in min_len..n / 2 {
        if (0..len).all(|i| lower[n - len - i - 1] == lower[n - i - 1]) {
            longest = Some(len);
        }
    }
    let Some(len) = longest else {
        return text.to_string();
    };
    let lcs = &lower[n - len..];
    let mut kept = n;
    while lower[..kept].ends_with(lcs) {
        kept -= len;
    }
    let repeating_tail: String = lower[kept..].iter().collect();
    let reversed: Vec<char> = lower.iter().rev().copied().collect();
    let mut out_len = kept;
    loop {
        let end = find_next_punctuation(&lower, out_len);
        let start = find_next_punctuation(&reversed, out_len);
        // Python's truthiness: an index of 0 counts as none.
        match (end, start) {
            (Some(end), Some(start)) if end != 0 && start != 0 => {
                let sentence: String = if start < end {
                    lower[start..end].iter().collect()
                } else {
                    String::new()
                };
                out_len = (end + 1).min(n);
                if repeating_tail.contains(&sentence) {
                    break;
                }
            }
            _ => break,
        }
    }
    chars[..out_len.min(chars.len())].iter().collect()
}

/// `remove_numbers`: digits, underscores and `**` removed, stripped.
fn remove_numbers(s: &str) -> String {
    strip(&sub(r"(?:[\d_]|\*\*)", "", s)).to_string()
}

/// `get_slices`: runs of (near-)identical short lines, as `(start, end)`
/// line ranges longer than 15.
fn get_slices(lines: &[&str], clean: &[String]) -> Vec<(usize, usize)> {
    let n = lines.len();
    let mut marked = vec![false; n];
    for i in 0..n.saturating_sub(1) {
        let mut j = i + 1;
        while clean[j].is_empty() && j < n - 1 {
            j += 1;
        }
        let (a, b) = (&clean[i], &clean[j]);
        let (la, lb) = (a.chars().count(), b.chars().count());
        if la < 200
            && la > 3
            && lb < 200
            && lb > 3
            && !a.starts_with("[MISSING_PAGE")
            && (a == b || ratio(a, b) > 0.9)
        {
            marked[i..j].iter_mut().for_each(|m| *m = true);
        }
    }
    let ids: Vec<usize> = (0..n).filter(|&i| marked[i]).collect();
    let mut slices = Vec::new();
    let Some(&last) = ids.last() else {
        return slices;
    };
    let mut j0 = 0;
    for j in 0..ids.len() - 1 {
        if ids[j + 1] - ids[j] > 3 {
            slices.push((ids[j0], ids[j] + 2));
            j0 = j + 1;
        }
    }
    slices.push((ids[j0], last + 2));
    slices.retain(|(a, b)| b - a > 15);
    slices
}

/// Python's `str.isnumeric()` of one character: Unicode's numeric
/// categories, and the CJK ideographs with a numeric value (Unihan's
/// primary and accounting numerals) that are letters to Rust.
fn is_numeric(c: char) -> bool {
    c.is_numeric()
        || "零一二三四五六七八九十百千万萬億亿兆壹贰貳叁參肆伍陆陸柒捌玖拾佰仟廿卅".contains(c)
}

/// `remove_slice_from_lines`: the text of a slice of repeated lines,
/// widened to its heading or its differing neighbours, cut where the next
/// page's content starts.
fn remove_slice_from_lines(lines: &[&str], clean: &[String], slice: (usize, usize)) -> String {
    let base = &clean[slice.0];
    let mut section = [slice.0, slice.1];
    let mut check_start = false;
    // Backwards, at most 4 lines: range(max(0, s - 1), max(0, s - 5), -1).
    let (from, to) = (slice.0.saturating_sub(1), slice.0.saturating_sub(5));
    let mut idx = from;
    while idx > to {
        let line = lines[idx];
        if !line.is_empty() {
            if line == "## References" {
                section[0] = idx;
                break;
            } else if ratio(base, &remove_numbers(line)) < 0.9 {
                section[0] = idx + 1;
                let before = lines[idx.saturating_sub(1)];
                let after_bracket = before.split_once("* [").map_or("", |(_, r)| r);
                let potential = remove_numbers(after_bracket);
                if potential.chars().count() as f64 >= 0.75 * base.chars().count() as f64
                    && ratio(base, &potential) < 0.9
                {
                    section[0] = idx;
                }
                check_start = true;
                break;
            }
        }
        idx -= 1;
    }
    // Forwards, at most 5 lines.
    let n = lines.len();
    for (idx, line) in lines
        .iter()
        .enumerate()
        .take(n.min(slice.1 + 5))
        .skip(n.min(slice.1))
    {
        if ratio(base, &remove_numbers(line)) < 0.9 {
            section[1] = idx;
            break;
        }
    }
    if n <= section[1] {
        section[1] = n - 1;
    }
    let mut to_delete = lines[section[0]..=section[1]].join("\n");
    // Where the last line stops agreeing with the one before it, digits
    // skipped on both sides; `ib` the index of the last character read
    // from the last line (Python's loop variable, unset if none was).
    let cur: Vec<char> = lines[section[1]].chars().collect();
    let mut ita = lines[section[1] - 1].chars();
    let mut itb = cur.iter().copied().enumerate();
    let mut last_b: Option<usize> = None;
    'scan: while let Some(mut a) = ita.next() {
        while is_numeric(a) {
            match ita.next() {
                Some(x) => a = x,
                None => break 'scan,
            }
        }
        let Some((i, mut b)) = itb.next() else { break };
        last_b = Some(i);
        while is_numeric(b) {
            match itb.next() {
                Some((i, x)) => {
                    last_b = Some(i);
                    b = x;
                }
                None => break 'scan,
            }
        }
        if a != b {
            break;
        }
    }
    if check_start && to_delete.contains("* [") {
        let rest = to_delete.split_once("* [").map_or("", |(_, r)| r);
        to_delete = format!("* [{rest}");
    }
    if let Some(ib) = last_b {
        let delta = cur.len() as isize - ib as isize - 1;
        if delta > 0 {
            let keep = to_delete.chars().count().saturating_sub(delta as usize);
            to_delete = to_delete.chars().take(keep).collect();
        }
    }
    strip(&to_delete).to_string()
}

/// `remove_hallucinated_references`: runs of near-identical reference
/// lines replaced by `[MISSING_PAGE_POST]`.
pub fn remove_hallucinated_references(text: &str) -> String {
    let lines: Vec<&str> = text.split('\n').collect();
    let clean: Vec<String> = lines.iter().map(|l| remove_numbers(l)).collect();
    let slices = get_slices(&lines, &clean);
    let deletes: Vec<String> = slices
        .into_iter()
        .map(|s| remove_slice_from_lines(&lines, &clean, s))
        .collect();
    let mut text = text.to_string();
    for d in deletes.iter().rev() {
        text = text.replace(d.as_str(), "\n\n[MISSING_PAGE_POST]\n\n");
    }
    sub(
        r"## References\n+\[MISSING_PAGE_POST(:\d+)?\]",
        "\n\n[MISSING_PAGE_POST${1}]",
        &text,
    )
}

/// `correct_tables`: impossible tables removed, `table`/`tabular` starts
/// and ends on their own lines, empty tabulars removed.
pub fn correct_tables(generation: &str) -> String {
    let mut g = generation.to_string();
    for l in generation.split('\n') {
        if l.matches("\\begin{tabular}").count() > 15
            || l.matches("\\multicolumn").count() > 60
            || l.matches('&').count() > 400
        {
            g = g.replace(l, "");
        }
    }
    g = g.replace(
        "\\begin{table} \\begin{tabular}",
        "\\begin{table}\n\\begin{tabular}",
    );
    g = g.replace(
        "\\end{tabular} \\end{table}",
        "\\end{tabular}\n\\end{table}",
    );
    g = g.replace("\\end{table} Tab", "\\end{table}\nTab");
    g = sub(r"(?m)(^.+)\\begin\{tab", "${1}\n\\begin{tab", &g);
    g = g.replace(r"\begin{tabular}{l l}  & \\ \end{tabular}", "");
    g.replace("\\begin{tabular}{}\n\n\\end{tabular}", "")
}

/// `NougatTokenizer.post_process_single` (and `post_process_generation` of
/// one text): `generation` is the decoded output (special tokens
/// skipped); `fix_markdown` adds [`markdown_compatible`].
pub fn post_process(generation: &str, fix_markdown: bool) -> String {
    let mut g = sub(r"(?:\n|^)#+ \d*\W? ?(.{100,})", "\n${1}", generation);
    g = strip(&g).to_string();
    g = g.replace("\n* [leftmargin=*]\n", "\n");
    g = sub(r"(?m)^#+ (?:[\d+\.]+|[ixv\.]+)?\s*(?:$|\n\s*)", "", &g);
    let lines: Vec<&str> = g.split('\n').collect();
    if let Some(last) = lines.last() {
        if last.starts_with('#') && last.trim_start_matches('#').starts_with(' ') && lines.len() > 1
        {
            g = lines[..lines.len() - 1].join("\n");
        }
    }
    g = truncate_repetitions(&g, 30);
    g = remove_hallucinated_references(&g);
    g = sub(r"(?m)^\* \[\d+\](\s?[A-W]\.+\s?){10,}.*$", "", &g);
    g = sub(r"(?m)^(\* \[\d+\])\[\](.*)$", "${1}${2}", &g);
    g = sub(r"(^\w\n\n|\n\n\w(?=\n?\z))", "", &g);
    g = sub(
        r"([\s.,()])_([a-zA-Z0-9])__([a-zA-Z0-9]){1,3}_([\s.,:()])",
        r"${1}\(${2}_{${3}}\)${4}",
        &g,
    );
    g = sub(
        r"([\s.,\d])_([a-zA-Z0-9])_([\s.,\d;])",
        r"${1}\(${2}\)${3}",
        &g,
    );
    g = sub(
        r"(\nFootnote .*?:) (?:footnotetext|thanks):\W*(.*(?:\n\n|(?=\n?\z)))",
        "${1} ${2}",
        &g,
    );
    g = sub(r"\[FOOTNOTE:.+?\](.*?)\[ENDFOOTNOTE\]", "", &g);
    g = normalize_list_like_lines(&g);

    if g.ends_with('.') || g.ends_with('}') {
        g.push_str("\n\n");
    }
    if is_match(r"\A[A-Z0-9,;:]\n?\z", &g) {
        g.push(' ');
    } else if g.starts_with('#') || g.starts_with("**") || g.starts_with("\\begin") {
        g = format!("\n\n{g}");
    } else if g
        .split('\n')
        .next_back()
        .is_some_and(|l| l.starts_with('#') || l.starts_with("Figure") || l.starts_with("Table"))
    {
        g.push_str("\n\n");
    } else {
        // transformers looks the last word up in nltk's words corpus; the
        // corpus is a separate download, and without it (LookupError) it
        // appends a space, as here.
        g.push(' ');
    }

    g = correct_tables(&g);
    g = g.replace("\\begin{array}[]{", "\\begin{array}{");
    g = sub(
        r"\\begin\{tabular\}\{([clr ]){2,}\}\s*[& ]*\s*(\\\\)? \\end\{tabular\}",
        "",
        &g,
    );
    g = sub(r"(\*\*S\. A\. B\.\*\*\n+){2,}", "", &g);
    g = sub(r"(?m)^#+( [\[\d\w])?$", "", &g);
    g = sub(r"(?m)^\.\s*$", "", &g);
    g = sub(r"\n{3,}", "\n\n", &g);
    if fix_markdown {
        markdown_compatible(&g)
    } else {
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_python_levenshteins() {
        assert!((ratio("abc", "abd") - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(ratio("", ""), 1.0);
        assert_eq!(ratio("a", ""), 0.0);
        assert!((ratio("kitten", "sitting") - 8.0 / 13.0).abs() < 1e-12);
    }

    #[test]
    fn every_pattern_compiles() {
        // post_process runs each of them; a page with a bit of everything.
        let out = post_process(
            "# 1 Intro\nText with http://example.org/a and ```x```.\n(1) \\[a\\]",
            true,
        );
        assert!(
            out.contains("[http://example.org/a](http://example.org/a)"),
            "{out}"
        );
        assert!(out.contains("\\[a \\tag{1}\\]"), "{out}");
    }
}
