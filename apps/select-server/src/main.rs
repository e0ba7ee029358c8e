//! `select-server`: parse configuration, install tracing, build the backend, bind, serve.

use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use select_server::config::{LogFormat, ServerConfig};
use select_server::{
    BodyLimits, EdgeOptions, HttpThreads, WorkersFileWatcher, build_service, recover_from_peers,
    router, serve_on_threads,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cfg = ServerConfig::from_process();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr);
    match cfg.log_format {
        // Colour codes only for a person at a terminal: in journald, container logs or a
        // file they are bytes of noise around every field.
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
    for warning in &cfg.warnings {
        tracing::warn!("{warning}");
    }
    match select_server::raise_open_file_limit() {
        Ok(l) if l.now > l.before => {
            tracing::info!(from = l.before, to = l.now, "raised the open-file limit");
        }
        Ok(l) => tracing::debug!(limit = l.now, hard = l.hard, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open-file limit"),
    }
    match run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cfg: ServerConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("failed to start the async runtime")?;
    runtime.block_on(async_main(cfg))
}

async fn async_main(cfg: ServerConfig) -> anyhow::Result<()> {
    if cfg.auth.enabled() {
        let (full, read_only) = cfg.auth.counts();
        tracing::info!(full, read_only, "bearer-token authentication enabled");
    }

    let mut backend = build_service(&cfg)?;
    let picker = match &cfg.ext_proc {
        Some(settings) => {
            let metrics = ext_proc::ExtProcMetrics::default();
            backend.register_metrics(|r| metrics.register(r));
            let tokenizers = ext_proc::Tokenizers::load(
                settings
                    .tokenizers
                    .iter()
                    .map(|(m, d)| (m.as_str(), d.as_path())),
            )
            .context("loading --tokenizer")?;
            for model in tokenizers.models() {
                tracing::info!(%model, "tokenizer loaded");
            }
            Some(Arc::new(ext_proc::Picker::new(
                Arc::clone(backend.service()),
                tokenizers,
                metrics,
                ext_proc::PickerConfig {
                    routing_group_header: settings.routing_group_header.clone(),
                    fallbacks: settings.fallbacks,
                    ..ext_proc::PickerConfig::default()
                },
            )))
        }
        None => None,
    };
    let backend = Arc::new(backend);
    // Before any worker (hence any KV listener) exists: recovered state first, live
    // events on top.
    recover_from_peers(
        backend.service().core(),
        &cfg.indexer_peers,
        std::time::Duration::from_secs(1),
        cfg.indexer_peers_token.as_ref(),
    )
    .await;
    // The workers file is the discovery source: applied once now (a bad file fails
    // startup), then watched for changes until shutdown.
    let (stop_watch, watch_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(path) = &cfg.workers_file {
        let mut watcher =
            WorkersFileWatcher::new(path.clone(), Arc::clone(backend.service().core()));
        let (watcher, applied) = tokio::task::spawn_blocking(move || {
            let r = watcher.apply_now();
            (watcher, r)
        })
        .await?;
        applied.with_context(|| format!("applying --workers-file {}", path.display()))?;
        tokio::spawn(watcher.run(async {
            let _ = watch_stopped.await;
        }));
    }

    // Models known by now (recovered from peers, in the workers file) are named one by one;
    // a model registered later without a tokenizer is counted in
    // kv_select_ext_proc_load_only_picks_total{reason="no_tokenizer"}.
    if let Some(picker) = &picker {
        for model in picker.models_without_tokenizer() {
            tracing::warn!(
                %model,
                "endpoint picker: no --tokenizer for this model; its text and chat prompts \
                 are routed by load only (no cache credit), token-id prompts are not affected"
            );
        }
    }

    let addr = SocketAddr::new(cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    // The bound address, not the requested one: `--port 0` takes a free port, and this line
    // is how an operator (or a test harness) learns which.
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "kv-select listening");
    let routes = router(
        Arc::clone(&backend),
        EdgeOptions {
            auth: cfg.auth.clone(),
            limits: BodyLimits {
                body_timeout: cfg.http_header_timeout,
                ..BodyLimits::default()
            },
        },
    );
    let threads = cfg.http_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().unwrap_or(std::num::NonZeroUsize::MIN)
    });
    let http = HttpThreads::start(threads, routes, cfg.http_header_timeout)
        .context("failed to start the HTTP threads")?;
    let (stop_grpc, grpc_stopped) = tokio::sync::oneshot::channel::<()>();
    let grpc = match (&cfg.ext_proc, picker) {
        (Some(settings), Some(picker)) => {
            let addr = SocketAddr::new(cfg.host, settings.port);
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding --ext-proc-port {addr}"))?;
            let addr = listener.local_addr()?;
            let tls = settings
                .tls
                .clone()
                .map(|(cert, key)| ext_proc::TlsFiles { cert, key });
            tracing::info!(%addr, tls = tls.is_some(), "kv-select ext_proc listening");
            Some(tokio::spawn(ext_proc::serve(
                listener,
                picker,
                tls,
                async {
                    let _ = grpc_stopped.await;
                },
            )))
        }
        _ => None,
    };
    let grpc_failed = async {
        match grpc {
            Some(task) => match task.await {
                Ok(Ok(())) => std::future::pending::<anyhow::Error>().await,
                Ok(Err(e)) => anyhow::Error::new(e),
                Err(e) => anyhow::anyhow!("the ext_proc server task failed: {e}"),
            },
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = serve_on_threads(listener, &http, shutdown_signal()) => r?,
        e = grpc_failed => return Err(e),
    }
    let _ = stop_grpc.send(());
    // Joining the threads closes the connections they hold; blocking is fine here, nothing
    // else is left to run.
    tokio::task::block_in_place(|| drop(http));
    let _ = stop_watch.send(());
    backend.service().shutdown().await;
    tracing::info!("shut down");
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
