//! The documentation holds together: every relative link in README.md, CHANGELOG.md and the
//! book (`docs/src`) names a file that exists and, with `#anchor`, a heading in it (mdBook's
//! anchor rule); every chapter is in `SUMMARY.md`; and the README's test command is the one
//! `.ci/run` runs.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The anchor mdBook gives a heading: lower case, spaces to `-`, only alphanumerics, `-` and
/// `_` kept (inline code marks and link syntax dropped with the other punctuation).
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| {
            if c == ' ' {
                Some('-')
            } else if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else {
                None
            }
        })
        .collect()
}

/// Lines outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut inside = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                inside = !inside;
                return false;
            }
            !inside
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .iter()
        .filter_map(|line| {
            let hashes = line.chars().take_while(|&c| c == '#').count();
            (hashes > 0 && line[hashes..].starts_with(' ')).then(|| anchor(&line[hashes..]))
        })
        .collect()
}

/// `(line number, target)` of every inline link `[text](target)` outside code blocks and
/// inline code.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut inside = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            continue;
        }
        if inside {
            continue;
        }
        // Drop inline code spans, which may hold `](` legitimately.
        let mut plain = String::new();
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                plain.push(c);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            found.push((index + 1, after[..end].to_string()));
            rest = &after[end..];
        }
    }
    found
}

fn check_file(file: &Path, problems: &mut Vec<String>) {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let dir = file.parent().expect("a file has a directory");
    for (line, target) in links(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, fragment) = match target.split_once('#') {
            Some((path, fragment)) => (path, Some(fragment)),
            None => (target.as_str(), None),
        };
        let linked = if path.is_empty() {
            file.to_path_buf()
        } else {
            dir.join(path)
        };
        let at = format!("{}:{line}: link `{target}`", file.display());
        if !linked.exists() {
            problems.push(format!("{at}: {} does not exist", linked.display()));
            continue;
        }
        if let Some(fragment) = fragment {
            let Ok(linked_text) = fs::read_to_string(&linked) else {
                problems.push(format!("{at}: an anchor into a file that is not text"));
                continue;
            };
            if !anchors(&linked_text).contains(fragment) {
                problems.push(format!(
                    "{at}: no heading in {} has the anchor #{fragment}",
                    linked.display()
                ));
            }
        }
    }
}

#[test]
fn anchors_follow_mdbook() {
    assert_eq!(anchor(" Getting started"), "getting-started");
    assert_eq!(
        anchor(" GGUF decoding beside llama.cpp"),
        "gguf-decoding-beside-llamacpp"
    );
    assert_eq!(anchor(" `KD_SIMD` levels"), "kd_simd-levels");
    assert_eq!(
        links("see [a](b.md#c) and `[x](y)`\n```\n[no](no.md)\n```\n[d](e.md)"),
        vec![(1, "b.md#c".to_string()), (5, "e.md".to_string())]
    );
}

#[test]
fn every_relative_link_resolves() {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut chapters: Vec<PathBuf> = fs::read_dir(root.join("docs/src"))
        .expect("docs/src exists")
        .map(|entry| entry.expect("a readable entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    chapters.sort();
    assert!(chapters.len() > 10, "the book has its chapters");
    files.extend(chapters);
    let mut problems = Vec::new();
    for file in &files {
        check_file(file, &mut problems);
    }
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn summary_lists_every_chapter() {
    let src = root().join("docs/src");
    let summary = fs::read_to_string(src.join("SUMMARY.md")).expect("SUMMARY.md");
    let listed: BTreeSet<String> = links(&summary).into_iter().map(|(_, t)| t).collect();
    for entry in fs::read_dir(&src).expect("docs/src") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(
                listed.contains(&name),
                "docs/src/{name} is not in SUMMARY.md"
            );
        }
    }
}

#[test]
fn readme_test_command_is_what_ci_runs() {
    let root = root();
    let readme = fs::read_to_string(root.join("README.md")).expect("README.md");
    let ci = fs::read_to_string(root.join(".ci/run")).expect(".ci/run");
    let command = readme
        .lines()
        .find(|line| line.contains("cargo test --workspace") && !line.starts_with('#'))
        .expect("the README has a test command");
    let command = command.trim();
    assert!(
        ci.lines().any(|line| line.trim().starts_with(command)),
        ".ci/run does not run the README's test command `{command}`"
    );
    // On the README's first screen: within its first 40 lines.
    let position = readme
        .lines()
        .position(|line| line.trim() == command)
        .expect("the command is on a line of its own");
    assert!(
        position < 40,
        "the test command is on line {}",
        position + 1
    );
}
