//! Interop with SGLang's real publisher (`sglang==0.5.23`, loaded by file without torch):
//! the listener must decode exactly the blocks the engine code sent. Runs in every
//! `cargo test`; the venv is created once under the target dir. A failed install fails the
//! test loudly: this is the guard against wire-format drift.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use kv_events::{KvEventListener, ListenerConfig};
use kv_types::{BlockHash, ExternalHash, KvOperationKind, StorageTier, StoredBlock, WorkerKey};

use crate::Collector;

const SGLANG: &str = "sglang==0.5.23";

/// The venv with SGLang's wheel unpacked (no deps) plus the publisher's light deps, pinned
/// like the engine itself so a new release of a dependency cannot turn this guard red (or
/// green) on its own.
fn venv() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-events-sglang-venv");
    let python = testkit::python_venv(
        &dir,
        &[
            "msgspec==0.23.0",
            "pyzmq==27.3.0",
            "pydantic==2.14.4",
            "psutil==7.2.2",
        ],
    );
    let ready = dir.join(".installed-sglang-0.5.23");
    if !ready.exists() {
        testkit::run(
            Command::new(&python)
                .args(testkit::PIP_INSTALL)
                .args(["--no-deps", SGLANG]),
            "pip install --no-deps sglang==0.5.23",
        );
        std::fs::write(&ready, b"ok").expect("marker file");
    }
    let out = testkit::run(
        Command::new(&python).args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ]),
        "venv python",
    );
    let site = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        site.join("sglang/srt/disaggregation/kv_events.py").exists(),
        "sglang's kv_events.py missing under {}",
        site.display()
    );
    (python, site)
}

/// Kills the publisher if the test panics before closing its stdin.
struct Publisher(Child);

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sglang_real_publisher_is_decoded_exactly() {
    let (python, site) = venv();
    let (pub_port, replay_port) = (testkit::free_port(), testkit::free_port());
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(
        WorkerKey::new(7, 0),
        format!("tcp://127.0.0.1:{pub_port}"),
        4,
    )
    .with_replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"));
    let listener = KvEventListener::start(config, Arc::clone(&sink)).expect("listener starts");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/sglang_publisher.py");
    let mut publisher = Publisher(
        Command::new(&python)
            .arg(script)
            .arg(&site)
            .arg(pub_port.to_string())
            .arg(replay_port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("publisher starts"),
    );

    // The publisher follows the script with empty keep-alive batches (see the script).
    let batches: Vec<_> = std::iter::repeat_with(|| rx.next())
        .filter(|b| !b.is_empty())
        .take(5)
        .collect();
    let ids: Vec<u64> = batches.iter().map(|b| b[0].event_id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3, 4]);
    let only = |i: usize| {
        assert_eq!(batches[i].len(), 1, "batch {i}: {:?}", batches[i]);
        batches[i][0].clone()
    };
    let block = |e: u64, t: u64| StoredBlock::new(ExternalHash(e), BlockHash(t));

    let b0 = only(0);
    assert_eq!(
        (b0.worker, b0.tier),
        (WorkerKey::new(7, 0), StorageTier::Device)
    );
    assert_eq!(
        b0.kind,
        KvOperationKind::Stored {
            parent_hash: None,
            blocks: vec![
                block(1, 14643705804678351452),
                block(2, 16777012769546811212)
            ],
        }
    );
    let b1 = only(1);
    assert_eq!(b1.tier, StorageTier::HostPinned);
    assert_eq!(
        b1.kind,
        KvOperationKind::Stored {
            parent_hash: Some(ExternalHash(2)),
            blocks: vec![block(u64::MAX - 2, 483935686894639516)],
        }
    );
    assert_eq!(
        only(2).kind,
        KvOperationKind::Removed {
            block_hashes: vec![ExternalHash(2)]
        }
    );
    assert_eq!(only(3).kind, KvOperationKind::Cleared);
    assert_eq!(
        only(4).kind,
        KvOperationKind::Stored {
            parent_hash: None,
            blocks: vec![block(401, 5738685477468498325)],
        }
    );

    if let Some(mut stdin) = publisher.0.stdin.take() {
        let _ = stdin.write_all(b"done\n");
    }
    drop(publisher);
    assert_eq!(listener.stats().dropped_total(), 0);
    rx.assert_quiet_except_empty();
}
