//! Startup recovery from `--indexer-peers` (`spec/replica-sync.md` §9.2): fetch a peer's
//! `/dump` and replay it into the local index before serving. Failures are logged and the
//! next peer is tried; no failure aborts startup.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use service_builder::SelectionCore;

use crate::auth::PeerToken;

/// Per-peer deadline of the whole GET.
const PEER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest snapshot accepted from a peer.
const MAX_DUMP_BYTES: usize = 1 << 30;

/// Tries `peers` in order after `settle` (the spec's 1 s slow-joiner wait), presenting
/// `token` if given; returns the peer whose snapshot was applied, if any.
pub async fn recover_from_peers(
    core: &SelectionCore,
    peers: &[String],
    settle: Duration,
    token: Option<&PeerToken>,
) -> Option<String> {
    if peers.is_empty() {
        return None;
    }
    tokio::time::sleep(settle).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    for peer in peers {
        let url = format!("{}/dump", peer.trim_end_matches('/'));
        let fetched = tokio::time::timeout(PEER_TIMEOUT, fetch(&client, &url, token)).await;
        let body = match fetched {
            Ok(Ok(body)) => body,
            Ok(Err(e)) => {
                tracing::warn!(peer = %peer, error = %e, "indexer recovery: peer failed");
                continue;
            }
            Err(_) => {
                tracing::warn!(peer = %peer, "indexer recovery: peer timed out after 10 s");
                continue;
            }
        };
        match core.restore_from_dump(&body) {
            Ok(n) => {
                tracing::info!(peer = %peer, events = n, "indexer recovery: snapshot applied");
                return Some(peer.clone());
            }
            Err(e) => tracing::warn!(peer = %peer, error = %e, "indexer recovery: peer failed"),
        }
    }
    tracing::warn!("indexer recovery: no peer answered; starting with empty state");
    None
}

async fn fetch(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
    token: Option<&PeerToken>,
) -> Result<Bytes, String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("invalid peer URL {url:?}: {e}"))?;
    let mut request = http::Request::get(uri);
    if let Some(t) = token {
        request = request.header(http::header::AUTHORIZATION, t.header_value());
    }
    let request = request
        .body(Empty::new())
        .map_err(|e| format!("cannot build the request: {e}"))?;
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("status {}", response.status()));
    }
    Limited::new(response.into_body(), MAX_DUMP_BYTES)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| format!("reading the body failed: {e}"))
}
