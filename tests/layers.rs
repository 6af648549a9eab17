//! The crate's layering, checked from the source: every top-level module
//! names only the modules docs/ARCHITECTURE.md allows it (the block between
//! `<!-- layers:begin -->` and `<!-- layers:end -->`), and that block lists
//! exactly the edges the code has, so the document cannot drift.
//!
//! An edge is any `crate::NAME` path (in `use` lines, inside `{...}`
//! groups, or written in place) or a `super::` chain that climbs to the
//! crate root, outside comments, in any file under `src/`.
//!
//! And in the layers the project's size rule is for (`runtime/`,
//! `server/`, `cluster/`): no file over 600 lines before its tests, and
//! each opening with two `//!` lines that say what it is for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Edges = BTreeMap<String, BTreeSet<String>>;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("list src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's module path under the crate root: `src/runtime/worker/mod.rs`
/// is `[runtime, worker]`, `src/kv/pool.rs` is `[kv, pool]`, `src/lib.rs`
/// is `[]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The source without `//` comments (line, doc and inner doc) and without
/// the contents of string literals, so neither can make an edge.
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    in_string = false;
                    out.push('"');
                }
                '\n' => out.push('\n'),
                _ => {}
            }
            continue;
        }
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            // A char literal holding a quote must not open a string.
            '\'' if chars.peek() == Some(&'"') => {
                chars.next();
                out.push_str("'\"");
            }
            '"' => {
                in_string = true;
                out.push('"');
            }
            _ => out.push(c),
        }
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of each path in a `{...}` group starting at `s[0]`.
fn group_heads(s: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut start = 1;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' | ',' if depth == 1 => {
                let head = ident_at(s[start..i].trim_start());
                if !head.is_empty() && head != "self" {
                    heads.push(head.to_string());
                }
                start = i + 1;
                if c == '}' {
                    break;
                }
            }
            '}' => depth -= 1,
            _ => {}
        }
    }
    heads
}

/// The top-level modules `code` (of the file at `module`) names.
fn named_modules(code: &str, module: &[String]) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    let bytes = code.as_bytes();
    let boundary = |at: usize| {
        at == 0
            || !(bytes[at - 1].is_ascii_alphanumeric()
                || bytes[at - 1] == b'_'
                || bytes[at - 1] == b':')
    };
    let mut heads = |rest: &str| {
        if rest.starts_with('{') {
            named.extend(group_heads(rest));
        } else {
            let head = ident_at(rest);
            if !head.is_empty() {
                named.insert(head.to_string());
            }
        }
    };
    for (at, _) in code.match_indices("crate::") {
        if boundary(at) {
            heads(&code[at + "crate::".len()..]);
        }
    }
    for (at, _) in code.match_indices("super::") {
        if !boundary(at) {
            continue;
        }
        let mut rest = &code[at..];
        let mut climbs = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            climbs += 1;
            rest = r;
        }
        // `super` from a file's own module climbs one level per step; at
        // the crate root the next segment is a top-level module.
        if climbs == module.len() {
            heads(rest);
        }
    }
    named
}

fn edges_in_code() -> Edges {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let module = module_path(&src, &file);
        let Some(top) = module.first().cloned() else {
            continue; // lib.rs and main.rs tie the modules together
        };
        let text = std::fs::read_to_string(&file).expect("read source");
        for named in named_modules(&code_of(&text), &module) {
            if named != top && top_level_modules().contains(&named) {
                edges.entry(top.clone()).or_default().insert(named);
            }
        }
    }
    edges
}

/// Every module `src/lib.rs` declares.
fn top_level_modules() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).expect("lib.rs");
    code_of(&lib)
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').trim().to_string())
        })
        .collect()
}

fn edges_in_document() -> Edges {
    let doc = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("ARCHITECTURE");
    let begin = doc
        .find("<!-- layers:begin -->")
        .expect("a layers:begin marker");
    let end = doc
        .find("<!-- layers:end -->")
        .expect("a layers:end marker");
    let mut edges = Edges::new();
    for line in doc[begin..end].lines().skip(1) {
        let Some((from, to)) = line.split_once("->") else {
            continue;
        };
        let from = from.trim().to_string();
        for name in to.split_whitespace() {
            edges
                .entry(from.clone())
                .or_default()
                .insert(name.to_string());
        }
    }
    edges
}

fn render(edges: &Edges) -> String {
    edges
        .iter()
        .map(|(from, to)| {
            format!(
                "{from} -> {}\n",
                to.iter().cloned().collect::<Vec<_>>().join(" ")
            )
        })
        .collect()
}

#[test]
fn no_module_names_a_module_the_document_does_not_allow_it() {
    let allowed = edges_in_document();
    let actual = edges_in_code();
    let mut wrong = Vec::new();
    for (from, to) in &actual {
        for name in to {
            if !allowed.get(from).is_some_and(|a| a.contains(name)) {
                wrong.push(format!("{from} -> {name}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "edges the layering does not allow: {wrong:?}\n(the code's edges are:\n{})",
        render(&actual)
    );
}

#[test]
fn the_document_lists_exactly_the_edges_the_code_has() {
    let allowed = edges_in_document();
    let actual = edges_in_code();
    assert_eq!(
        render(&allowed),
        render(&actual),
        "docs/ARCHITECTURE.md's layers block differs from the code: replace it with the right side"
    );
}

#[test]
fn the_layers_have_no_cycle() {
    let edges = edges_in_document();
    // Depth-first from every module; a module met again on its own path
    // closes a cycle.
    fn visit(at: &str, edges: &Edges, path: &mut Vec<String>, done: &mut BTreeSet<String>) {
        if let Some(i) = path.iter().position(|m| m == at) {
            panic!("a cycle: {} -> {at}", path[i..].join(" -> "));
        }
        if done.contains(at) {
            return;
        }
        path.push(at.to_string());
        for next in edges.get(at).into_iter().flatten() {
            visit(next, edges, path, done);
        }
        path.pop();
        done.insert(at.to_string());
    }
    let mut done = BTreeSet::new();
    for from in edges.keys() {
        visit(from, &edges, &mut Vec::new(), &mut done);
    }
}

#[test]
fn the_edge_finder_sees_groups_super_chains_and_ignores_comments() {
    let module = vec!["runtime".to_string(), "worker".to_string()];
    let code = code_of(
        "use crate::{kv::{A, B}, model::M};\n\
         // crate::server is only a comment\n\
         let s = \"crate::cli in a string\";\n\
         let x = crate::sampler::f();\n\
         use super::super::durable::Store;\n\
         use super::batch::Plan;\n",
    );
    let named = named_modules(&code, &module);
    let expected: BTreeSet<String> = ["kv", "model", "sampler", "durable"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(named, expected);
}

/// Lines of `text` before its inline tests (`#[cfg(test)]` followed by a
/// `mod`), the whole file where it has none.
fn code_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
        .unwrap_or(lines.len())
}

/// The files of the layers the 600-line rule is for, test files apart.
fn ruled_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["runtime", "server", "cluster"] {
        rust_files(&root().join("src").join(dir), &mut files);
    }
    files.retain(|f| f.file_name().is_none_or(|n| n != "tests.rs"));
    files.sort();
    files
}

#[test]
fn no_file_in_runtime_server_or_cluster_is_over_600_lines_before_its_tests() {
    let over: Vec<String> = ruled_files()
        .iter()
        .filter_map(|f| {
            let n = code_lines(&std::fs::read_to_string(f).expect("read"));
            (n > 600).then(|| format!("{} ({n})", f.display()))
        })
        .collect();
    assert!(over.is_empty(), "split these by job: {over:?}");
}

#[test]
fn every_file_in_runtime_server_and_cluster_opens_by_saying_what_it_is_for() {
    let bare: Vec<String> = ruled_files()
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            text.lines()
                .take(2)
                .filter(|l| l.starts_with("//!"))
                .count()
                < 2
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        bare.is_empty(),
        "no two-line `//!` doc at the top: {bare:?}"
    );
}
