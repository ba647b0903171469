//! README.md names files and library items as the place a rule lives; a rename must not leave it
//! pointing at nothing. These checks read the repository only (no peers).

use std::path::Path;

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md")
}

/// Backticked spans of README, the way a reader sees code.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_repository_path_readme_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    let text = readme();
    for span in code_spans(&text) {
        for word in span.split_whitespace() {
            let word = word.trim_end_matches([',', ';', ':', ')']);
            let tracked = ["src/", "tests/", "deploy/", "charts/", "crds/", "fuzz/"];
            if !tracked.iter().any(|prefix| word.starts_with(prefix))
                || word.contains(['*', '<', '{'])
            {
                continue;
            }
            if !root.join(word).exists() {
                missing.push(word.to_owned());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "README.md names paths that do not exist: {missing:?}"
    );
}

#[test]
fn every_library_item_readme_names_is_defined_where_it_says() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    let text = readme();
    for span in code_spans(&text) {
        // a span may wrap across lines of the Markdown source
        let span: String = span.split_whitespace().collect();
        let Some(path) = span.strip_prefix("custody::") else {
            continue;
        };
        let mut parts: Vec<&str> = path.split("::").collect();
        let item = parts.pop().expect("an item after custody::");
        let module = parts.join("/");
        let candidates = [
            root.join(format!("{module}.rs")),
            root.join(&module).join("mod.rs"),
        ];
        let defined = candidates.iter().any(|file| {
            std::fs::read_to_string(file).is_ok_and(|source| {
                ["fn", "struct", "enum", "const", "trait", "type", "mod"]
                    .iter()
                    .any(|kind| source.contains(&format!("pub {kind} {item}")))
            })
        });
        if !defined {
            wrong.push(span.clone());
        }
    }
    assert!(
        wrong.is_empty(),
        "README.md names library items not defined there: {wrong:?}"
    );
}

/// The quickstart shows cargo's progress (a cold build takes minutes: `--quiet` showed nothing)
/// and builds the binary README's local-mode section runs, so a reader needs one build.
#[test]
fn the_quickstart_and_the_next_step_share_one_build() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = std::fs::read_to_string(root.join("tests/quickstart.sh")).unwrap();
    let builds: Vec<&str> = script
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo build"))
        .collect();
    assert_eq!(
        builds,
        ["cargo build"],
        "tests/quickstart.sh builds with {builds:?}"
    );
    assert!(
        script.contains("custody=\"${CARGO_TARGET_DIR:-target}/debug/custody\""),
        "tests/quickstart.sh runs another binary"
    );
    let text = readme();
    let local = text
        .split("## Running it on your own checkpoints (local mode)")
        .nth(1)
        .expect("README has the local-mode section");
    let block = local.split("```").nth(1).expect("a code block");
    assert!(
        block
            .lines()
            .any(|l| l.split('#').next().unwrap().trim() == "cargo build")
            && block.contains("target/debug/custody sweep"),
        "README's local-mode commands use another build:\n{block}"
    );
}

/// README gives the optional indexes' statements exactly as custody detects them (by the names
/// they create, on the tables they name).
#[test]
fn readme_gives_the_parked_indexes_custody_detects() {
    let text = readme().split_whitespace().collect::<Vec<_>>().join(" ");
    for (_, _, create) in custody::checkpoint::PARKED_INDEXES {
        assert!(
            text.contains(&format!("{create};")),
            "README lacks {create};"
        );
    }
}
