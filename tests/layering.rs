//! The module layering of `src/`, checked on every `cargo test` (issue 16).
//!
//! custody is one crate, so the compiler cannot keep a lower module from importing a higher one
//! as a crate boundary would. This test reads every `src/**/*.rs`, resolves each `crate::<m>`,
//! `super::<m>` (where `super` is the crate root) and `custody::<m>` path to the top-level
//! module it names, and fails with `file:line` for every reference that goes up or sideways in
//! [`LAYERS`], and for every use of an I/O crate in the pure core. A test double would not do:
//! the point is that the real sources obey the table.
//!
//! The reader is a small tokenizer rather than `syn` (not a dependency of custody): it drops
//! comments, string and char literals, and tracks inline `mod name { … }` blocks so that
//! `super::` is resolved from where it is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layers, bottom first. A module may import modules of lower layers only; modules of one
/// layer do not import each other.
const LAYERS: &[&[&str]] = &[
    // The pure core: handle records, verdicts, the action policy and recovery rules, the
    // verdict record, audit settlement, templates.
    &["domain"],
    // Adapters of the outside world, each owning its vocabulary.
    &["checkpoint", "mcp"],
    // custody's own tables; they commit in the writable pool's transactions (checkpoint's), so
    // that a ledger row and the checkpoint it settles commit together.
    &["ledger"],
    // The custom resources.
    &["crd"],
    // The one compile step: resources into validated plans.
    &["plan"],
    // The only module that sequences I/O.
    &["sweep"],
    // Local mode, the cluster glue and the reports.
    &["local", "cluster", "report"],
    &["controller"],
    // The binary and the crate root.
    &["main", "lib"],
];

/// Crates the core must not name: it talks to no database, server, cluster or runtime.
const IO_CRATES: &[&str] = &[
    "kube",
    "k8s_openapi",
    "sqlx",
    "rmcp",
    "tokio",
    "reqwest",
    "axum",
    "http",
    "fail",
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The top-level module a file belongs to, and the length of its module path (0 for
/// `src/lib.rs` and `src/main.rs`, 1 for `src/x.rs` and `src/x/mod.rs`, 2 for `src/x/y.rs`, …):
/// the number of `super::` that climb from it to the crate root.
fn module_of(src: &Path, file: &Path) -> (String, usize) {
    let rel = file.strip_prefix(src).expect("under src");
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let top = parts[0].trim_end_matches(".rs").to_owned();
    let depth = match parts.last().map(String::as_str) {
        Some("lib.rs" | "main.rs") if parts.len() == 1 => 0,
        Some("mod.rs") => parts.len() - 1,
        _ => parts.len(),
    };
    (top, depth)
}

/// Source text with comments and string/char literals blanked (newlines kept, so line numbers
/// stay right).
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            let mut j = 0;
            while j < rest.len() {
                if rest[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &rest[..j]);
            i += j;
        } else if let Some(len) = raw_string(rest) {
            blank(&mut out, &rest[..len]);
            i += len;
        } else if rest[0] == b'"' || rest.starts_with(b"b\"") {
            let mut j = if rest[0] == b'"' { 1 } else { 2 };
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' {
            // A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a): only the former closes.
            let len = if rest.get(1) == Some(&b'\\') {
                rest.get(3..)
                    .and_then(|r| r.iter().position(|&c| c == b'\''))
                    .map(|p| p + 4)
            } else {
                let ch = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                (rest.get(1 + ch) == Some(&b'\'')).then_some(ch + 2)
            };
            match len {
                Some(len) => {
                    blank(&mut out, &rest[..len]);
                    i += len;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = text[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The length of a raw string literal (`r"…"`, `r#"…"#`, `br#"…"#`) starting here.
fn raw_string(s: &[u8]) -> Option<usize> {
    let start = if s.starts_with(b"br") {
        2
    } else if s.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = s[start..].iter().take_while(|&&c| c == b'#').count();
    if s.get(start + hashes) != Some(&b'"') {
        return None;
    }
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    let body = start + hashes + 1;
    s[body..]
        .windows(close.len())
        .position(|w| w == close.as_slice())
        .map(|p| body + p + close.len())
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    PathSep,
}

fn tokens(text: &str) -> Vec<(usize, Tok)> {
    let mut out = Vec::new();
    let mut line = 1;
    let mut chars = text.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        if c == '\n' {
            line += 1;
        } else if c.is_alphabetic() || c == '_' {
            let mut ident = String::from(c);
            while let Some(&(_, n)) = chars.peek() {
                if n.is_alphanumeric() || n == '_' {
                    ident.push(n);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push((line, Tok::Ident(ident)));
        } else if c == ':' && chars.peek().map(|&(_, n)| n) == Some(':') {
            chars.next();
            out.push((line, Tok::PathSep));
        } else if !c.is_whitespace() {
            out.push((line, Tok::Punct(c)));
        }
    }
    out
}

/// Every top-level module a file names, with the line: `crate::m`, `custody::m`, `super::m`
/// resolving to the crate root, and the items of `use crate::{a, b::c}` groups.
fn references(file_depth: usize, text: &str) -> Vec<(usize, String)> {
    let toks = tokens(&strip(text));
    let mut out = Vec::new();
    // Depth of inline `mod x {` blocks around each token: (brace level at which it opened).
    let mut mods: Vec<usize> = Vec::new();
    let mut braces = 0usize;
    let mut i = 0;
    while i < toks.len() {
        match &toks[i].1 {
            Tok::Punct('{') => braces += 1,
            Tok::Punct('}') => {
                braces = braces.saturating_sub(1);
                if mods.last() == Some(&braces) {
                    mods.pop();
                }
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some((_, Tok::Ident(_))), Some((_, Tok::Punct('{')))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    mods.push(braces);
                }
            }
            Tok::Ident(root) if root == "crate" || root == "custody" || root == "super" => {
                let preceded_by_sep = i > 0 && toks[i - 1].1 == Tok::PathSep;
                if !preceded_by_sep {
                    let line = toks[i].0;
                    if root == "super" {
                        // Count `super::super::…`; the path names a top-level module only when
                        // it climbs exactly to the crate root.
                        let (mut ups, mut j) = (0, i);
                        while matches!(&toks.get(j), Some((_, Tok::Ident(s))) if s == "super")
                            && toks.get(j + 1).map(|t| &t.1) == Some(&Tok::PathSep)
                        {
                            ups += 1;
                            j += 2;
                        }
                        if ups > 0 && ups == file_depth + mods.len() {
                            collect_after(&toks, j, line, &mut out);
                        }
                    } else if toks.get(i + 1).map(|t| &t.1) == Some(&Tok::PathSep) {
                        collect_after(&toks, i + 2, line, &mut out);
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The module names at `toks[at]`: one ident, or each first segment of a `{…}` group.
fn collect_after(toks: &[(usize, Tok)], at: usize, line: usize, out: &mut Vec<(usize, String)>) {
    match toks.get(at) {
        Some((_, Tok::Ident(m))) => out.push((line, m.clone())),
        Some((_, Tok::Punct('{'))) => {
            let mut depth = 0;
            let mut expect_item = true;
            for (l, t) in &toks[at..] {
                match t {
                    Tok::Punct('{') => {
                        depth += 1;
                        expect_item = depth == 1;
                    }
                    Tok::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Tok::Punct(',') if depth == 1 => expect_item = true,
                    Tok::Ident(m) if depth == 1 && expect_item => {
                        out.push((*l, m.clone()));
                        expect_item = false;
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

/// Uses of the I/O crates: `kube::…`, `use sqlx…`, `tokio::…` and `::tokio::…`.
fn io_uses(text: &str) -> Vec<(usize, String)> {
    let toks = tokens(&strip(text));
    let mut out = Vec::new();
    for (i, (line, t)) in toks.iter().enumerate() {
        let Tok::Ident(name) = t else { continue };
        if !IO_CRATES.contains(&name.as_str()) {
            continue;
        }
        let prev = i.checked_sub(1).map(|p| &toks[p].1);
        let next = toks.get(i + 1).map(|t| &t.1);
        let after_sep = prev == Some(&Tok::PathSep);
        let rooted = after_sep && (i < 2 || !matches!(toks[i - 2].1, Tok::Ident(_)));
        let used = matches!(prev, Some(Tok::Ident(u)) if u == "use") || next == Some(&Tok::PathSep);
        if (used && !after_sep) || rooted {
            out.push((*line, name.clone()));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every violation in the tree at `src`, as `file:line: message`.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let (module, depth) = module_of(src, &file);
        let text = std::fs::read_to_string(&file).expect("read source");
        let shown = file
            .strip_prefix(src.parent().unwrap_or(src))
            .unwrap_or(&file);
        let Some(own) = layer_of(&module) else {
            out.push(format!(
                "{}: module {module} is not in the layer table of tests/layering.rs",
                shown.display()
            ));
            continue;
        };
        for (line, target) in references(depth, &text) {
            if target == module || target == "self" {
                continue;
            }
            match layer_of(&target) {
                // Not a module (an item of the crate root, a macro path): nothing to check.
                None => {}
                Some(l) if l < own => {}
                Some(_) => out.push(format!(
                    "{}:{line}: {module} imports {target}, which is not below it",
                    shown.display()
                )),
            }
        }
        if own == 0 {
            for (line, krate) in io_uses(&text) {
                out.push(format!(
                    "{}:{line}: the core ({module}) uses {krate}",
                    shown.display()
                ));
            }
        }
    }
    out
}

#[test]
fn no_module_imports_a_module_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src);
    assert!(
        found.is_empty(),
        "{} layering violations (table in tests/layering.rs):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn every_top_level_module_is_in_the_table() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("read src") {
        let name = entry.expect("dir entry").file_name();
        let name = name.to_string_lossy();
        let module = name.trim_end_matches(".rs").to_owned();
        seen.insert(module.clone(), layer_of(&module));
    }
    let missing: Vec<_> = seen.iter().filter(|(_, l)| l.is_none()).collect();
    assert!(missing.is_empty(), "not in LAYERS: {missing:?}");
}

/// The checker itself, on sources written to show each rule.
#[test]
fn the_checker_sees_what_it_must() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("domain")).unwrap();
    std::fs::create_dir_all(src.join("sweep")).unwrap();
    std::fs::write(
        src.join("domain/mod.rs"),
        "//! crate::sweep in a comment is fine\nuse crate::{\n    sweep::x,\n};\nfn f() { let s = \"crate::sweep\"; tokio::spawn(); }\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::mcp::Y;\n}\n",
    )
    .unwrap();
    std::fs::write(
        src.join("sweep/act.rs"),
        "use super::Row;\nuse super::super::checkpoint::Z;\nuse crate::controller::C;\nfn g<'a>(c: char) -> bool { c == '{' }\n",
    )
    .unwrap();
    let found = violations(&src);
    assert_eq!(
        found,
        [
            "src/domain/mod.rs:3: domain imports sweep, which is not below it",
            "src/domain/mod.rs:9: domain imports mcp, which is not below it",
            "src/domain/mod.rs:5: the core (domain) uses tokio",
            "src/sweep/act.rs:3: sweep imports controller, which is not below it",
        ]
    );
}
