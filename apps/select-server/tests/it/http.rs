//! Plain HTTP/1.1 over a loopback socket, for the black-box tests of the real binary
//! (`binary.rs`, `mesh.rs`): no client library between the test and the wire.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub(crate) use testkit::free_port;

/// Starts the real binary on `127.0.0.1:port` with `args` and `env` (`RUST_LOG=warn`,
/// stderr to `stderr`) and waits up to 20 s for it to listen. `None` when it exits first
/// or never listens (it is then killed): the caller reports or retries.
///
/// A port from [`free_port`] can be taken by another test's process before the server
/// binds it; then a connection succeeds (to the other process, often a ZMQ socket) while
/// this server exits on its bind error, possibly only after its startup recovery. So the
/// port counts only once it answers `GET /health` over HTTP and the child is still alive a
/// moment later.
pub(crate) fn spawn_server(
    port: u16,
    args: &[&str],
    env: &[(&str, &str)],
    stderr: Stdio,
) -> Option<Child> {
    let child = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("binary starts");
    wait_until_listening(child, port)
}

/// Waits up to 20 s for `child` to listen on `port` (see [`spawn_server`]); kills it and
/// answers `None` when it exits first or never listens.
pub(crate) fn wait_until_listening(mut child: Child, port: u16) -> Option<Child> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
        // Another test's server can answer on a port taken from under this one while this
        // child is still recovering (it binds HTTP only afterwards): the port counts only
        // once this child holds its listening socket.
        match listens_on(child.id(), port) {
            Some(false) => {}
            Some(true) | None if answers_health(port) => {
                std::thread::sleep(Duration::from_millis(100));
                if child.try_wait().unwrap().is_none()
                    && listens_on(child.id(), port) != Some(false)
                {
                    return Some(child);
                }
                break;
            }
            Some(true) | None => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Whether process `pid` holds a TCP socket listening on `port` (from `/proc`); `None`
/// where `/proc` cannot tell (not Linux).
fn listens_on(pid: u32, port: u16) -> Option<bool> {
    let mut inodes = Vec::new();
    let mut readable = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        readable = true;
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is ADDR:PORT in hex; state 0A is LISTEN; field 9 the inode.
            let listening = f.get(3) == Some(&"0A");
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if listening && local_port == Some(port) {
                inodes.extend(f.get(9).map(|i| format!("socket:[{i}]")));
            }
        }
    }
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    if !readable {
        return None;
    }
    Some(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    }))
}

/// Whether `port` answers `GET /health` with an HTTP 200 (a bounded wait).
fn answers_health(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// [`spawn_server`] on a free port, with up to three fresh ports when one was lost to a
/// race; `stderr` is called once per attempt.
pub(crate) fn spawn_on_free_port(
    args: &[&str],
    env: &[(&str, &str)],
    stderr: impl Fn(u16) -> Stdio,
) -> Option<(Child, u16)> {
    (0..3).find_map(|_| {
        let port = free_port();
        spawn_server(port, args, env, stderr(port)).map(|child| (child, port))
    })
}

/// One request on a fresh connection; the body is JSON when it parses, else a JSON string.
pub(crate) fn call(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let (status, text) = raw(
        port,
        method,
        path,
        Some("application/json"),
        body.as_bytes(),
    );
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// One request on a fresh connection with `body` as given and a `content-type` header only
/// when one is named; the status and the body text.
pub(crate) fn raw(
    port: u16,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let content_type = content_type
        .map(|t| format!("content-type: {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{content_type}content-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // A server that refuses an oversized body answers before reading it all and closes;
    // what matters is its answer, so a failed write is not the test's failure.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let status: u16 = raw[9..12].parse().unwrap();
    let text = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, text.to_owned())
}

/// The engine block hashes of `worker_id`'s stores in one partition of a `GET /dump`
/// answer, in dump order.
pub(crate) fn dumped_block_hashes(dump: &Value, partition: &str, worker_id: u64) -> Vec<u64> {
    let mut out = Vec::new();
    for e in dump[partition]["events"].as_array().into_iter().flatten() {
        if e["worker_id"] == worker_id {
            for b in e["event"]["data"]["stored"]["blocks"]
                .as_array()
                .into_iter()
                .flatten()
            {
                out.push(b["block_hash"].as_u64().unwrap());
            }
        }
    }
    out
}
