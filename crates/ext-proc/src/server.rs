//! The gRPC server: `envoy.service.ext_proc.v3.ExternalProcessor` and `grpc.health.v1`
//! on one listener, plain or TLS.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::server::NamedService;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::error::ServeError;
use crate::picker::Picker;
use crate::stream::StreamState;

/// The largest gateway message accepted: a buffered request body arrives in one message.
const MAX_MESSAGE_BYTES: usize = 16 << 20;
/// How often health follows the service's readiness.
const READINESS_POLL: Duration = Duration::from_millis(250);

/// PEM files of the server's certificate chain and private key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The `ExternalProcessor` service over a [`Picker`].
#[derive(Clone, Debug)]
pub struct ExtProcService {
    picker: Arc<Picker>,
}

impl ExtProcService {
    pub fn new(picker: Arc<Picker>) -> Self {
        Self { picker }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let picker = Arc::clone(&self.picker);
        tokio::spawn(async move {
            // Dropped with the task: a live booking is freed however the stream ends.
            let mut state = StreamState::new(picker);
            let mut out = Vec::new();
            loop {
                let msg = tokio::select! {
                    m = inbound.message() => m,
                    () = tx.closed() => break,
                };
                let msg = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "ext_proc stream ended with an error");
                        break;
                    }
                };
                // A pick waiting in the admission queue is abandoned when the gateway
                // goes away meanwhile.
                tokio::select! {
                    () = state.handle(msg, &mut out) => {}
                    () = tx.closed() => break,
                }
                for r in out.drain(..) {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Serves ext_proc and health on `listener` until `shutdown` resolves.
///
/// Health: `liveness` is SERVING while the server runs; `readiness` and
/// `envoy.service.ext_proc.v3.ExternalProcessor` are SERVING while the service is ready
/// (as `GET /ready`: not shut down, at least one schedulable worker).
pub async fn serve(
    listener: TcpListener,
    picker: Arc<Picker>,
    tls: Option<TlsFiles>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut builder = Server::builder();
    if let Some(tls) = &tls {
        let read = |what: &'static str, path: &PathBuf| {
            std::fs::read(path).map_err(|source| ServeError::TlsFile {
                what,
                path: path.clone(),
                source,
            })
        };
        let identity = Identity::from_pem(read("certificate", &tls.cert)?, read("key", &tls.key)?);
        builder = builder
            .tls_config(ServerTlsConfig::new().identity(identity))
            .map_err(ServeError::Tls)?;
    }
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let ext_proc_name = <ExternalProcessorServer<ExtProcService> as NamedService>::NAME;
    let core = Arc::clone(picker.service().core());
    let readiness = async move {
        let mut last = None;
        loop {
            let ready = core.ready().ready;
            if last != Some(ready) {
                let status = if ready {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                reporter.set_service_status("readiness", status).await;
                reporter.set_service_status(ext_proc_name, status).await;
                last = Some(ready);
            }
            tokio::time::sleep(READINESS_POLL).await;
        }
    };
    let ext_proc = ExternalProcessorServer::new(ExtProcService::new(picker))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let server: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        Box::pin(
            builder
                .add_service(health)
                .add_service(ext_proc)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown),
        );
    tokio::select! {
        r = server => r.map_err(ServeError::Transport),
        () = readiness => Ok(()),
    }
}
