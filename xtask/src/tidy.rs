//! Repository-wide invariants, checked as plain tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::root;

mod imports;

/// Which workspace crates each crate may depend on (normal dependencies). Mirrors the
/// layering of docs/architecture.md: siblings never depend on each other, only
/// service-builder joins them, the app stands on service-builder.
fn allowed_edges() -> BTreeMap<&'static str, &'static [&'static str]> {
    const LEAF: &[&str] = &["kv-types"];
    BTreeMap::from([
        ("kv-types", &[][..]),
        ("zmq-monitor", &[][..]),
        ("digit-scan", &[][..]),
        ("kv-events", &["digit-scan", "kv-types", "zmq-monitor"][..]),
        ("kv-index", LEAF),
        ("load-accounting", LEAF),
        ("selection-policy", LEAF),
        ("replica-sync", &["kv-types", "zmq-monitor"][..]),
        ("testkit", LEAF),
        (
            "service-builder",
            &[
                "kv-types",
                "kv-events",
                "kv-index",
                "load-accounting",
                "selection-policy",
                "replica-sync",
            ][..],
        ),
        ("ext-proc", &["service-builder"][..]),
        (
            "select-server",
            &[
                "service-builder",
                "ext-proc",
                "kv-types",
                "selection-policy",
                "replica-sync",
                "digit-scan",
            ][..],
        ),
    ])
}

/// Crates that may depend on anything (dev tooling, not shipped).
const UNRESTRICTED: &[&str] = &["benches", "xtask", "examples", "custom-scorer"];

/// The standard output of `cargo ARGS` in the workspace root; fails the test if cargo does.
fn cargo_stdout(args: &[&str]) -> Vec<u8> {
    let out = Command::new("cargo")
        .args(args)
        .current_dir(root())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn metadata() -> Value {
    let out = cargo_stdout(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]);
    serde_json::from_slice(&out).expect("cargo metadata prints JSON")
}

struct Package {
    name: String,
    manifest_dir: PathBuf,
    normal_deps: Vec<String>,
    is_lib: bool,
}

fn packages() -> Vec<Package> {
    let meta = metadata();
    let members: BTreeSet<String> = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();
    meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let manifest = PathBuf::from(p["manifest_path"].as_str().unwrap_or_default());
            let normal_deps = p["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .map(str::to_owned)
                .collect::<Vec<_>>();
            let is_lib = p["targets"].as_array().into_iter().flatten().any(|t| {
                t["kind"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k == "lib")
            });
            let name = p["name"].as_str().unwrap_or_default().to_owned();
            Package {
                manifest_dir: manifest.parent().map(Path::to_path_buf).unwrap_or_default(),
                normal_deps: normal_deps.into_iter().collect(),
                is_lib,
                name,
            }
        })
        .filter(|p| members.contains(&p.name))
        .collect()
}

fn is_library_crate(p: &Package) -> bool {
    p.manifest_dir.starts_with(root().join("crates"))
}

#[test]
fn every_lib_rs_starts_with_a_crate_doc() {
    for p in packages().iter().filter(|p| p.is_lib) {
        let lib = p.manifest_dir.join("src/lib.rs");
        let text = std::fs::read_to_string(&lib).unwrap_or_default();
        assert!(
            text.starts_with("//!"),
            "{} must start with a //! crate doc",
            lib.display()
        );
    }
}

#[test]
fn library_crates_do_not_use_anyhow() {
    for p in packages().iter().filter(|p| is_library_crate(p)) {
        assert!(
            !p.normal_deps.iter().any(|d| d == "anyhow"),
            "{} is a library and must return typed errors, not anyhow",
            p.name
        );
    }
}

#[test]
fn dependency_edges_follow_the_layering() {
    let edges = allowed_edges();
    let pkgs = packages();
    let workspace: BTreeSet<&str> = pkgs.iter().map(|p| p.name.as_str()).collect();
    for p in &pkgs {
        if UNRESTRICTED.contains(&p.name.as_str()) {
            continue;
        }
        let allowed = edges
            .get(p.name.as_str())
            .unwrap_or_else(|| panic!("crate {} is missing from the layering table", p.name));
        for dep in p
            .normal_deps
            .iter()
            .filter(|d| workspace.contains(d.as_str()))
        {
            assert!(
                allowed.contains(&dep.as_str()),
                "{} may not depend on {dep} (allowed: {allowed:?})",
                p.name
            );
        }
    }
}

/// The names `[workspace.dependencies]` of the root manifest declares, read line by line:
/// the table holds one `name = ...` per line and comments, nothing the test must parse
/// deeper.
fn declared_workspace_dependencies() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).expect("root Cargo.toml");
    text.lines()
        .skip_while(|l| l.trim() != "[workspace.dependencies]")
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter_map(|l| {
            let l = l.trim();
            let (name, _) = l.split_once('=')?;
            (!l.starts_with('#')).then(|| name.trim().to_owned())
        })
        .collect()
}

#[test]
fn every_workspace_dependency_is_used() {
    let meta = metadata();
    let used: BTreeSet<&str> = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["dependencies"].as_array().into_iter().flatten())
        .filter_map(|d| d["rename"].as_str().or_else(|| d["name"].as_str()))
        .collect();
    let unused: Vec<String> = declared_workspace_dependencies()
        .into_iter()
        .filter(|d| !used.contains(d.as_str()))
        .collect();
    assert!(
        unused.is_empty(),
        "the root Cargo.toml declares workspace dependencies no crate uses: {unused:?}"
    );
}

/// `package|features` of every package `cargo tree` resolves for `args` (the host
/// platform's graph), deduplicated.
fn resolved_features(args: &[&str]) -> BTreeSet<String> {
    let tree = [
        "tree",
        "--offline",
        "--prefix",
        "none",
        "--format",
        "{p}|{f}",
    ];
    let out = cargo_stdout(&[&tree[..], args].concat());
    String::from_utf8_lossy(&out)
        .lines()
        .map(|l| l.trim_end_matches(" (*)").to_owned())
        .collect()
}

/// xtask's feature pins (xtask/Cargo.toml) are complete: every package xtask's own build
/// resolves has a feature set the whole workspace's build also gives it, so the build
/// `cargo xtask` starts with is reused by clippy and the tests rather than redone.
#[test]
fn xtask_dependencies_have_the_workspace_features() {
    let workspace = resolved_features(&["--workspace", "--edges", "normal,build,dev"]);
    let xtask = resolved_features(&["--package", "xtask", "--edges", "normal,build"]);
    let differing: Vec<&String> = xtask.difference(&workspace).collect();
    assert!(
        differing.is_empty(),
        "xtask alone resolves these packages with other features than the workspace does; \
         pin the workspace's features in xtask/Cargo.toml: {differing:#?}"
    );
}

#[test]
fn no_environment_reads_under_crates() {
    let mut offenders = Vec::new();
    visit(&root().join("crates"), &mut |path| {
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            for needle in ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("] {
                if text.contains(needle) {
                    offenders.push(format!("{}: {needle}", path.display()));
                }
            }
        }
    });
    assert!(
        offenders.is_empty(),
        "only the app reads the environment: {offenders:#?}"
    );
}

/// `unsafe` stays where digit-scan's crate doc says it is: every other crate takes the
/// workspace lints (`unsafe_code = "forbid"`), and no file but digit-scan's simd.rs,
/// msgpack.rs and msgpack_sse.rs allows it.
#[test]
fn unsafe_code_is_confined_to_digit_scan_simd() {
    const CRATE: &str = "digit-scan";
    const FILES: [&str; 3] = [
        "crates/digit-scan/src/simd.rs",
        "crates/digit-scan/src/msgpack.rs",
        "crates/digit-scan/src/msgpack_sse.rs",
    ];
    let off_workspace_lints: Vec<String> = packages()
        .into_iter()
        .filter(|p| p.name != CRATE)
        .filter(|p| {
            let manifest =
                std::fs::read_to_string(p.manifest_dir.join("Cargo.toml")).unwrap_or_default();
            !manifest.contains("[lints]\nworkspace = true")
        })
        .map(|p| p.name)
        .collect();
    assert!(
        off_workspace_lints.is_empty(),
        "crates without `[lints] workspace = true`: {off_workspace_lints:?}"
    );
    let mut allowing = Vec::new();
    for dir in ["crates", "apps", "benches", "xtask", "examples", "fuzz"] {
        visit(&root().join(dir), &mut |path| {
            let text = if path.extension().is_some_and(|e| e == "rs") {
                std::fs::read_to_string(path).unwrap_or_default()
            } else {
                String::new()
            };
            if text.contains(concat!("allow(", "unsafe_code)"))
                && !FILES.iter().any(|f| path.ends_with(f))
            {
                allowing.push(path.display().to_string());
            }
        });
    }
    assert!(
        allowing.is_empty(),
        "only {FILES:?} may allow unsafe code: {allowing:?}"
    );
}

fn visit(dir: &Path, f: &mut dyn FnMut(&Path)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            visit(&path, f);
        } else {
            f(&path);
        }
    }
}
