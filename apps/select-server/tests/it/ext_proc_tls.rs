//! `--ext-proc-tls-cert/--ext-proc-tls-key`: the ext_proc port speaks TLS with the given
//! (here self-signed) certificate; a client trusting it picks and checks health, a
//! plaintext client gets nothing.

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::ext_proc::{BODY, BUFFERED, Server, Stream, body, destination, headers, runtime};
use crate::ext_proc_kv::TempDir;

#[test]
fn the_ext_proc_port_serves_tls_and_refuses_plaintext() {
    let dir = TempDir::new("ext-proc-tls");
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert_pem = certified.cert.pem();
    let (cert, key) = (dir.0.join("cert.pem"), dir.0.join("key.pem"));
    std::fs::write(&cert, &cert_pem).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let server = Server::start_with(
        &[
            "--ext-proc-tls-cert",
            cert.to_str().unwrap(),
            "--ext-proc-tls-key",
            key.to_str().unwrap(),
        ],
        &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
    );
    server.register_pair();
    runtime().block_on(async {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&cert_pem))
            .domain_name("localhost");
        let channel = Channel::from_shared(format!("https://127.0.0.1:{}", server.grpc))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel.clone());
        let live = health
            .check(HealthCheckRequest {
                service: "liveness".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(live.status, ServingStatus::Serving as i32);

        let mut client = ExternalProcessorClient::new(channel);
        let mut s = Stream::open(&mut client).await;
        s.send(headers(Some(BUFFERED), false, None)).await;
        s.recv().await;
        s.send(body(BODY.as_bytes(), true)).await;
        let chosen = destination(&s.recv().await, s.last_metadata.as_ref());
        assert!(
            chosen == "127.0.0.1:9001" || chosen == "127.0.0.1:9002",
            "{chosen}"
        );
        assert_eq!(server.active_requests(), 1, "the pick over TLS booked");
        drop(s);
        server.wait_idle("the TLS stream ended").await;

        // Plaintext HTTP/2 against the TLS port: the connection or the call fails.
        let plaintext = async {
            let channel = Channel::from_shared(format!("http://127.0.0.1:{}", server.grpc))
                .unwrap()
                .connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(5))
                .connect()
                .await?;
            HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: "liveness".into(),
                })
                .await
                .map(|_| ())
                .map_err(|s| s.into())
        };
        let outcome: Result<(), Box<dyn std::error::Error>> =
            tokio::time::timeout(Duration::from_secs(10), plaintext)
                .await
                .expect("the plaintext attempt ends within 10 s");
        assert!(outcome.is_err(), "a plaintext client must not be served");
    });
}
