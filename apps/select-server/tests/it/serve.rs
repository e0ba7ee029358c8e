//! The real server loop on a loopback port, and startup helpers.

use std::sync::Arc;
use std::time::Duration;

use select_server::{BodyLimits, EdgeOptions, read_workers_file, router, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::harness::Harness;

async fn roundtrip(addr: std::net::SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("write request");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("response within 10 s")
        .expect("read response");
    String::from_utf8(out).expect("UTF-8 response")
}

#[tokio::test]
async fn serves_http1_on_loopback() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let backend = Arc::clone(&Harness::new().backend);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = EdgeOptions {
        limits: BodyLimits {
            body_timeout: Duration::from_millis(300),
            ..BodyLimits::default()
        },
        ..EdgeOptions::default()
    };
    let server = tokio::spawn(serve(
        listener,
        router(Arc::clone(&backend), options),
        Duration::from_millis(300),
        async {
            let _ = stopped.await;
        },
    ));

    // Silent, half-sent and idle keep-alive connections are closed after the head
    // timeout (slowloris); a request within it is answered.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let mut partial = TcpStream::connect(addr).await.expect("connect");
    partial
        .write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        .await
        .expect("write");
    let mut kept = TcpStream::connect(addr).await.expect("connect");
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    for stream in [&mut silent, &mut partial, &mut kept] {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
            .await
            .expect("closed by the server within 10 s")
            .expect("read");
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 200 OK"),
            "{text}"
        );
    }

    // A whole head, then a body that stops short: 408 and the connection is closed
    // (it could not carry another request); the backend never sees it.
    let resp = roundtrip(
        addr,
        "POST /workers HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: 40\r\n\r\n{\"worker_id\":",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 408 Request Timeout"), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("connection: close"),
        "{resp}"
    );
    assert!(
        resp.contains("the request body did not arrive within"),
        "{resp}"
    );

    let resp = roundtrip(
        addr,
        "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
    assert!(resp.ends_with(r#"{"status":"ok"}"#), "{resp}");

    let body = r#"{"worker_id":3}"#;
    let resp = roundtrip(
        addr,
        &format!(
            "POST /workers HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 201 Created"), "{resp}");
    assert!(
        resp.to_ascii_lowercase()
            .contains("content-type: application/json")
    );

    // Every response so far, by status, the 408 the service never saw included.
    let resp = roundtrip(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    .await;
    for line in [
        r#"kv_select_http_responses_total{status="200"} 2"#,
        r#"kv_select_http_responses_total{status="201"} 1"#,
        r#"kv_select_http_responses_total{status="408"} 1"#,
        "# TYPE kv_select_http_responses_total counter",
    ] {
        assert!(resp.lines().any(|l| l == line), "no `{line}` in {resp}");
    }

    stop.send(()).expect("server still running");
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("server stops")
        .expect("no panic")
        .expect("no io error");
    assert_eq!(backend.calls().len(), 1);
}

#[test]
fn workers_file_is_an_array_of_worker_records() {
    let dir = std::env::temp_dir().join(format!("select-server-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let good = dir.join("workers.json");
    std::fs::write(
        &good,
        r#"[{"worker_id":1,"endpoint":"http://a","block_size":16},{"worker_id":2,"model_name":"m"}]"#,
    )
    .expect("write");
    let workers = read_workers_file(&good).expect("parses");
    assert_eq!(workers.len(), 2);
    assert_eq!(workers[1].model_name, "m");
    assert_eq!(workers[0].routing_group, "default");

    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"worker_id":1}"#).expect("write");
    let err = read_workers_file(&bad).unwrap_err().to_string();
    assert!(err.contains("not a JSON array"), "{err}");
    assert!(read_workers_file(&dir.join("missing.json")).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn workers_file_may_be_a_yaml_list_by_extension() {
    let dir = std::env::temp_dir().join(format!("select-server-it-yaml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let yaml = "\
# two workers, the second one data-parallel
- worker_id: 1
  endpoint: http://a
  block_size: 16
  taints: [gpu-a100]
- worker_id: 2
  model_name: m
  data_parallel_size: 2
  kv_events_endpoints:
    0: tcp://10.0.0.2:5557
    1: tcp://10.0.0.2:5558
  topology_domains: {rack: r1}
";
    let json = r#"[
        {"worker_id":1,"endpoint":"http://a","block_size":16,"taints":["gpu-a100"]},
        {"worker_id":2,"model_name":"m","data_parallel_size":2,
         "kv_events_endpoints":{"0":"tcp://10.0.0.2:5557","1":"tcp://10.0.0.2:5558"},
         "topology_domains":{"rack":"r1"}}
    ]"#;
    let json_path = dir.join("workers.json");
    std::fs::write(&json_path, json).expect("write");
    let from_json = read_workers_file(&json_path).expect("json parses");
    for name in ["workers.yaml", "workers.YML"] {
        let path = dir.join(name);
        std::fs::write(&path, yaml).expect("write");
        let workers = read_workers_file(&path).expect("yaml parses");
        assert_eq!(workers, from_json, "{name}");
    }
    assert_eq!(from_json[1].kv_events_endpoints.len(), 2);

    // The extension decides: YAML content in a .json file is a JSON error, and a YAML
    // mapping is not a list.
    let misnamed = dir.join("yaml-content.json");
    std::fs::write(&misnamed, yaml).expect("write");
    let err = read_workers_file(&misnamed).unwrap_err().to_string();
    assert!(err.contains("not a JSON array"), "{err}");
    let mapping = dir.join("mapping.yml");
    std::fs::write(&mapping, "worker_id: 1\n").expect("write");
    let err = read_workers_file(&mapping).unwrap_err().to_string();
    assert!(err.contains("not a YAML list"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Connections handed to the serving threads keep their keep-alive, their head timeout and
/// their answers; stopping the threads closes the connections they still hold.
#[tokio::test]
async fn serves_connections_on_its_own_threads() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let routes = router(Arc::clone(&Harness::new().backend), EdgeOptions::default());
    let threads = select_server::HttpThreads::start(
        std::num::NonZeroUsize::new(2).expect("2 > 0"),
        routes,
        Duration::from_millis(300),
    )
    .expect("start the threads");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        select_server::serve_on_threads(listener, &threads, async {
            let _ = stopped.await;
        })
        .await
        .expect("serve");
        threads
    });

    // Five connections (more than threads), two requests each on the same connection.
    let mut conns = Vec::new();
    for _ in 0..5 {
        conns.push(TcpStream::connect(addr).await.expect("connect"));
    }
    for round in 0..2 {
        for c in &mut conns {
            c.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .expect("write");
            let mut buf = vec![0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
                .await
                .expect("answered within 10 s")
                .expect("read");
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(text.starts_with("HTTP/1.1 200 OK"), "round {round}: {text}");
            assert!(
                text.ends_with(r#"{"status":"ok"}"#),
                "round {round}: {text}"
            );
        }
    }
    // A silent connection is closed after the head timeout, on its thread too.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut out))
        .await
        .expect("closed by the server within 10 s")
        .expect("read");
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));

    let _ = stop.send(());
    let threads = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the accept loop stops")
        .expect("join");
    tokio::task::spawn_blocking(move || drop(threads))
        .await
        .expect("the threads stop");
    for c in &mut conns {
        let mut rest = Vec::new();
        let got = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest))
            .await
            .expect("closed within 10 s");
        assert!(got.is_ok_and(|n| n == 0) || rest.is_empty(), "{rest:?}");
    }
}
