//! What can fail when the endpoint picker is set up. Serving a request never fails this
//! way: a request the picker cannot route is answered on its stream (503, 429).

use std::path::PathBuf;

/// Why a model's tokenizer could not be loaded (startup fails naming the directory).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    #[error("cannot load tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("cannot read {}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("the chat template of {} does not compile: {message}", dir.display())]
    Template { dir: PathBuf, message: String },
    #[error("model {model} has more than one tokenizer")]
    Duplicate { model: String },
}

/// Why the gRPC server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("cannot read the TLS {what} file {}: {source}", path.display())]
    TlsFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid TLS configuration: {0}")]
    Tls(#[source] tonic::transport::Error),
    #[error("the ext_proc gRPC server failed: {0}")]
    Transport(#[source] tonic::transport::Error),
}
