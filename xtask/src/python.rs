//! The Python part of `cargo xtask ci`: the `kv_select` client (`clients/python`) and the Ray
//! example (`examples/ray-select-then-reserve`), both against the workspace's debug
//! `select-server`.
//!
//! The venv is `target/python-ci/venv`, made from pinned requirement files and kept between
//! runs: a stamp records the interpreter and the files it was made from, and the venv is
//! rebuilt only when they change (Ray is a large wheel; a rebuilt venv is about 370 MB).
//! Every run reinstalls the client from source without build isolation (no download), so the
//! tests see the package as `pip install` builds it. Then, each bounded in time: `mypy
//! --strict` over the package, its tests and the example; the client's pytest suite, which
//! starts a server per test on a free loopback port; the example's engine test (its KV events
//! as the index sees them); and the Ray example in a small configuration, which fails unless
//! every reservation was freed and kv-select's prefix-hit ratio beats round-robin on the same
//! workload.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Files whose content decides what the venv holds.
const REQUIREMENTS: [&str; 3] = [
    "clients/python/requirements-dev.txt",
    "examples/ray-select-then-reserve/requirements.txt",
    "clients/python/constraints-ci.txt",
];

const PIP_INSTALL: [&str; 5] = [
    "-m",
    "pip",
    "install",
    "--quiet",
    "--disable-pip-version-check",
];

/// Creating the venv downloads Ray; the other steps finish in well under their limits on a
/// 2-core machine (measured: the whole Python part 26 s with the venv in place, 38 s
/// creating it from a warm pip cache; the Ray example 10-15 s of that).
const INSTALL_LIMIT: Duration = Duration::from_secs(900);
const MYPY_LIMIT: Duration = Duration::from_secs(300);
const PYTEST_LIMIT: Duration = Duration::from_secs(300);
const RAY_LIMIT: Duration = Duration::from_secs(300);

pub(crate) fn ci(root: &Path) -> Result<()> {
    let python = ci_venv(root)?;
    checks(root, &python)
}

/// The interpreter of the checks' venv, which is made or reused as its stamp says. It needs
/// only python3 and the requirement files, so `cargo xtask ci` makes it while cargo builds.
pub(crate) fn ci_venv(root: &Path) -> Result<PathBuf> {
    venv(root, &work_dir(root).join("venv"))
}

/// Where the checks keep their venv and caches: the workspace's own target dir, as the
/// other tasks use (CI sets no CARGO_TARGET_DIR).
fn work_dir(root: &Path) -> PathBuf {
    root.join("target").join("python-ci")
}

/// The checks themselves, with the venv's interpreter `python`.
pub(crate) fn checks(root: &Path, python: &Path) -> Result<()> {
    let started = Instant::now();
    let server = root.join("target").join("debug").join("select-server");
    if !server.is_file() {
        bail!(
            "{} is missing: `cargo test --workspace` builds it (before `cargo xtask python`, run \
             `cargo build -p select-server`)",
            server.display()
        );
    }
    let work = work_dir(root);
    step(
        "install kv_select",
        Command::new(python)
            .args(PIP_INSTALL)
            .args(["--no-deps", "--no-build-isolation", "--force-reinstall"])
            .arg(root.join("clients/python")),
        INSTALL_LIMIT,
    )?;
    step(
        "mypy --strict",
        python_command(python)
            .args(["-m", "mypy", "--config-file"])
            .arg(root.join("clients/python/pyproject.toml"))
            .arg("--cache-dir")
            .arg(work.join("mypy-cache"))
            .env("MYPYPATH", root.join("clients/python/src"))
            .args([
                "clients/python/src",
                "clients/python/tests",
                "examples/ray-select-then-reserve",
            ])
            .current_dir(root),
        MYPY_LIMIT,
    )?;
    step(
        "pytest clients/python",
        python_command(python)
            .args(["-m", "pytest", "-q"])
            .env("KV_SELECT_SERVER", &server)
            .current_dir(root.join("clients/python")),
        PYTEST_LIMIT,
    )?;
    step(
        "pytest examples/ray-select-then-reserve",
        python_command(python)
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "test_engine.py",
            ])
            .env("KV_SELECT_SERVER", &server)
            .current_dir(root.join("examples/ray-select-then-reserve")),
        PYTEST_LIMIT,
    )?;
    step(
        "Ray select-then-reserve example",
        python_command(python)
            .arg("driver.py")
            .arg("--server-binary")
            .arg(&server)
            .args(["--engines", "3", "--requests", "300", "--concurrency", "4"])
            .arg("--check")
            // No usage reports from CI runs.
            .env("RAY_USAGE_STATS_ENABLED", "0")
            .current_dir(root.join("examples/ray-select-then-reserve")),
        RAY_LIMIT,
    )?;
    eprintln!("xtask: python checks passed in {:.1?}", started.elapsed());
    Ok(())
}

/// A command of the venv's interpreter that leaves no `__pycache__` in the source tree.
fn python_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.env("PYTHONDONTWRITEBYTECODE", "1");
    cmd
}

/// The venv's interpreter, creating the venv first unless its stamp matches.
fn venv(root: &Path, dir: &Path) -> Result<PathBuf> {
    let python = dir.join("bin").join("python");
    let stamp_path = dir.join(".kv-select-stamp");
    let stamp = stamp(root)?;
    if std::fs::read_to_string(&stamp_path).ok().as_deref() == Some(stamp.as_str()) {
        return Ok(python);
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    step(
        "python3 -m venv",
        Command::new("python3").args(["-m", "venv"]).arg(dir),
        INSTALL_LIMIT,
    )?;
    let mut pip = Command::new(&python);
    pip.args(PIP_INSTALL);
    for (flag, file) in [
        ("-r", REQUIREMENTS[0]),
        ("-r", REQUIREMENTS[1]),
        ("-c", REQUIREMENTS[2]),
    ] {
        pip.arg(flag).arg(root.join(file));
    }
    step("pip install (pinned)", &mut pip, INSTALL_LIMIT)?;
    std::fs::write(&stamp_path, &stamp)
        .with_context(|| format!("writing {}", stamp_path.display()))?;
    Ok(python)
}

/// The interpreter version and every requirement file, verbatim.
fn stamp(root: &Path) -> Result<String> {
    let version = Command::new("python3")
        .arg("--version")
        .output()
        .context("running python3 --version (the Python checks need python3 >= 3.10)")?;
    let mut stamp = String::from_utf8_lossy(&version.stdout).into_owned();
    for file in REQUIREMENTS {
        let path = root.join(file);
        stamp.push_str(&format!("--- {file}\n"));
        stamp.push_str(
            &std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?,
        );
    }
    Ok(stamp)
}

/// Runs `cmd` in its own process group and fails unless it succeeds within `limit`; on
/// timeout the whole group is killed (the Ray example's driver has Ray's daemons under it).
fn step(what: &str, cmd: &mut Command, limit: Duration) -> Result<()> {
    use std::os::unix::process::CommandExt;
    eprintln!("xtask: python: {what}");
    let started = Instant::now();
    let mut child = cmd
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for {what}"))?
        {
            break status;
        }
        if started.elapsed() > limit {
            kill_group(&mut child);
            bail!("{what} did not finish within {limit:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    eprintln!("xtask: python: {what}: ok in {:.1?}", started.elapsed());
    Ok(())
}

fn kill_group(child: &mut Child) {
    // The group id is the child's pid (process_group(0)); `kill -KILL -<pgid>` reaches every
    // process in it.
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.kill();
    let _ = child.wait();
}
