//! No import circle between the files of a crate: every path `crate::a::b` or `super::c`
//! that a file names is an edge to the file defining that module, and the graph of each
//! crate's `src/` must be acyclic. A `mod` declaration is not an edge (a parent declares its
//! children), so a child may build on its parent's types while the parent only declares it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::root;

/// The module path of `file` under `src` (`src/core/select.rs` -> `["core", "select"]`;
/// `lib.rs`, `main.rs` and `mod.rs` name their folder).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("lib" | "main" | "mod")
    ) {
        parts.pop();
    }
    parts
}

/// The file of the longest prefix of `path` that is a module of the crate. The crate root
/// is no target: `crate::Item` names a re-export of `lib.rs`, whose job is to gather them.
fn file_of(modules: &BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<PathBuf> {
    (1..=path.len())
        .rev()
        .find_map(|n| modules.get(&path[..n]).cloned())
}

/// The paths of `use` statements that start with a child module of `here` (`use
/// select::Attempt;` in `core/mod.rs`), as full module paths.
fn child_uses(
    text: &str,
    here: &[String],
    modules: &BTreeMap<Vec<String>, PathBuf>,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let Some(rest) = t.strip_prefix("use ") else {
            continue;
        };
        let first: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let mut full = here.to_vec();
        full.push(first);
        if modules.contains_key(&full) {
            out.push(full);
        }
    }
    out
}

/// Identifiers of the paths that follow `crate::` or `super::` in `text`, expanded over one
/// level of braces: `crate::{a::X, b}` gives `[a, X]` and `[b]`.
fn named_paths(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let ident = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|seg| {
                seg.trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|seg| !seg.is_empty())
            .collect()
    };
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        // Not part of a longer identifier (`my_crate::`).
        let before = rest[..at].chars().next_back();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                out.push(ident(item));
            }
        } else {
            out.push(ident(rest));
        }
    }
    out
}

/// The import edges of one crate's `src/`, file to file.
fn edges(src: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    super::visit(src, &mut |p| {
        if p.extension().is_some_and(|e| e == "rs") {
            files.push(p.to_path_buf());
        }
    });
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        // Unit tests reach into their own file's parent freely; only shipped code counts.
        let text = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        // Doc links (`[`crate::codec`]`) and comments name modules without importing them.
        let text: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let text = text.as_str();
        let here = module_of(src, file);
        // `super` of `a/b.rs` is `a`; of `a/b/mod.rs` it is `a` too.
        let parent: Vec<String> = here[..here.len().saturating_sub(1)].to_vec();
        let mut targets = BTreeSet::new();
        for path in named_paths(text, "crate::") {
            if let Some(t) = file_of(&modules, &path) {
                targets.insert(t);
            }
        }
        for path in child_uses(text, &here, &modules) {
            if let Some(t) = file_of(&modules, &path) {
                targets.insert(t);
            }
        }
        for path in named_paths(text, "super::") {
            let mut full = parent.clone();
            full.extend(path);
            if let Some(t) = file_of(&modules, &full) {
                targets.insert(t);
            }
        }
        targets.remove(file);
        graph.insert(file.clone(), targets);
    }
    graph
}

/// One cycle of `graph`, if it has any.
fn find_cycle(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Option<Vec<PathBuf>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn walk(
        n: &PathBuf,
        g: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        marks: &mut BTreeMap<PathBuf, Mark>,
        stack: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        match marks.get(n) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = stack.iter().position(|s| s == n).unwrap_or(0);
                let mut cycle = stack[start..].to_vec();
                cycle.push(n.clone());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(n.clone(), Mark::Open);
        stack.push(n.clone());
        for next in g.get(n).into_iter().flatten() {
            if let Some(c) = walk(next, g, marks, stack) {
                return Some(c);
            }
        }
        stack.pop();
        marks.insert(n.clone(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|n| walk(n, graph, &mut marks, &mut Vec::new()))
}

#[test]
fn no_import_circle_between_the_files_of_a_crate() {
    let mut circles = Vec::new();
    for top in ["crates", "apps", "examples"] {
        let Ok(entries) = std::fs::read_dir(root().join(top)) else {
            continue;
        };
        for entry in entries.flatten() {
            let src = entry.path().join("src");
            if !src.is_dir() {
                continue;
            }
            if let Some(cycle) = find_cycle(&edges(&src)) {
                let names: Vec<String> = cycle
                    .iter()
                    .map(|p| p.strip_prefix(root()).unwrap_or(p).display().to_string())
                    .collect();
                circles.push(names.join(" -> "));
            }
        }
    }
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}

#[test]
fn the_checker_sees_a_circle_and_follows_braces() {
    let paths = named_paths("use crate::{a::X, b};\nfoo(super::c::d);", "crate::");
    assert_eq!(paths, [vec!["a", "X"], vec!["b"]]);
    let a = PathBuf::from("a.rs");
    let b = PathBuf::from("b.rs");
    let g = BTreeMap::from([
        (a.clone(), BTreeSet::from([b.clone()])),
        (b.clone(), BTreeSet::from([a.clone()])),
    ]);
    assert!(find_cycle(&g).is_some());
    let g = BTreeMap::from([
        (a.clone(), BTreeSet::from([b.clone()])),
        (b, BTreeSet::new()),
    ]);
    assert!(find_cycle(&g).is_none());
}
