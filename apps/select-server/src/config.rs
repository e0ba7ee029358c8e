//! Command line and environment, parsed once into a typed [`ServerConfig`].
//!
//! This is the only module of the workspace that reads environment variables
//! (`service-semantics.md` §15, `scheduling.md` §8.1). Flags win over their environment
//! fallbacks. Invalid values stop startup with a clap error naming the flag or variable
//! (exit code 2) — deliberately stricter than the reference, which silently keeps the default
//! for unparsable numbers. Empty variables count as unset. Two variables keep the reference's
//! documented fallback instead (`DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`,
//! `DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`); their warnings land in
//! [`ServerConfig::warnings`] for `main` to log once tracing is up.

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use kv_types::{TrackingConfigError, TrackingHashAlgorithm, TrackingHasher};
use selection_policy::RouterConfig;

/// Largest `--session-affinity-ttl-secs` (one year).
pub const MAX_SESSION_AFFINITY_TTL_SECS: u64 = 31_536_000;

/// Fallback of `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`.
pub const DEFAULT_ACTIVE_REQUEST_EXPIRY: Duration = Duration::from_secs(300);

/// Default of `DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`.
pub const DEFAULT_OVERLAP_REFRESH_AFTER: Duration = Duration::from_secs(10);

const ENV_HELP: &str = "\
Environment (router configuration, read once at startup; defaults in parentheses):
  DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS (300)   booking expiry; unparsable or 0 -> 300 with a warning
  DYN_ROUTER_USE_KV_EVENTS / DYN_USE_KV_EVENTS (true)
  DYN_ROUTER_REPLICA_SYNC (false)
  DYN_ROUTER_TRACK_ACTIVE_BLOCKS (true), DYN_ROUTER_TRACK_OUTPUT_BLOCKS (false)
  DYN_ROUTER_TRACK_PREFILL_TOKENS (true), DYN_ROUTER_ASSUME_KV_REUSE (true)
  DYN_ROUTER_TRACKING_HASH (public-xxh3-v1), DYN_ROUTER_TRACKING_KEY_FILE, DYN_ROUTER_TRACKING_KEY_ID
  DYN_ROUTER_PREFILL_LOAD_MODEL (none: none|ais|aic)
  DYN_ROUTER_TTL_SECS (120), DYN_ROUTER_APPROXIMATE_CACHE_POLICY (ttl: ttl|lru)
  DYN_ROUTER_PREDICTED_TTL_SECS (unset)
  DYN_ROUTER_HOST_CACHE_HIT_WEIGHT (0.75), DYN_ROUTER_DISK_CACHE_HIT_WEIGHT (0.25)
  DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT (1.0), DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY (0)
  DYN_ROUTER_PREFILL_LOAD_SCALE (1.0), DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT (0)
  DYN_ROUTER_TEMPERATURE (0), DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT / DYN_OVERLAP_SCORE_WEIGHT (legacy)
  DYN_SHARED_CACHE_TYPE (none: none|hicache), DYN_SHARED_CACHE_MULTIPLIER (unset, [0,1])
  DYN_ROUTER_POLICY_CONFIG (unset: YAML policy file)
  DYN_ROUTER_QUEUE_THRESHOLD (unset), DYN_ROUTER_QUEUE_POLICY (fcfs: fcfs|lcfs|wspt)
  DYN_ROUTER_WORKER_SELECTION_POLICY, DYN_ROUTER_PREFILL_POLICY, DYN_ROUTER_DECODE_POLICY (unset)
  DYN_ROUTER_EVENT_THREADS (4), DYN_USE_REMOTE_INDEXER (false)
  DYN_ROUTER_CONDITIONAL_DISAGG (false), DYN_ROUTER_CONDITIONAL_DISAGG_POLICY (isl_bounding)
  DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD (2048)
  DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_RATIO_THRESHOLD (0.7)
  DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD (unset)
  DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD (unset)
  DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS (10; 0, negative or non-finite disables)
  DYN_ROUTER_MIN_INITIAL_WORKERS (0)
Booleans accept 1/true/on/yes and 0/false/off/no; an empty variable counts as unset.";

/// `--kv-ingest-nice` with a writer thread (`--kv-index-writer thread`, the default), unless
/// given: on 2 cores it
/// took the client's `/select` p99 to 0.65-0.75x at 16 publishers and 0.32x at 2,048, for
/// the same or a higher ingest rate (docs/hot-path.md, "ingest threads at a lower priority").
const WRITER_THREAD_INGEST_NICE: u8 = 10;

/// Who applies KV events to a two-copy index (`--kv-index-writer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum KvIndexWriter {
    /// A writer thread per partition, which the listener threads hand their batches to.
    Thread,
    /// The listener threads, each in its own write sections.
    Listeners,
}

/// How log lines are written (`--log-format`).

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `tracing`'s text lines: timestamp, level, target, message, `key=value` fields.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (with `message`).
    Json,
}

/// The `select-server` command line (`service-semantics.md` §15.1 plus kv-select's own flags).
#[derive(Debug, Parser)]
#[command(
    name = "select-server",
    version,
    about = "kv-select: picks the inference worker (and DP rank) for each prompt",
    after_help = "Run with --help for the environment variables.",
    after_long_help = ENV_HELP
)]
struct Cli {
    /// HTTP bind address.
    #[arg(long, default_value = "0.0.0.0", value_name = "ADDR")]
    host: IpAddr,

    /// HTTP port.
    #[arg(long, default_value_t = 8092)]
    port: u16,

    /// KV indexer threads.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,

    /// Comma-separated HTTP base URLs of peers to recover the KV index from (`/dump`) at startup.
    #[arg(long, value_delimiter = ',', value_name = "URLS")]
    indexer_peers: Vec<String>,

    /// File whose first bearer token (format of --auth-token-file) is sent to the
    /// --indexer-peers when fetching their /dump, for peers that require tokens.
    #[arg(long, requires = "indexer_peers", value_name = "PATH")]
    indexer_peers_token_file: Option<PathBuf>,

    /// Replica-sync ZMQ PUB port, bound as tcp://*:PORT (1-65535). Enables the replica mesh.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..), value_name = "PORT")]
    replica_sync_port: Option<u16>,

    /// Comma-separated ZMQ endpoints of replica peers (requires --replica-sync-port).
    #[arg(
        long,
        value_delimiter = ',',
        requires = "replica_sync_port",
        value_name = "ENDPOINTS"
    )]
    replica_sync_peers: Vec<String>,

    /// File with the replica-sync pre-shared key (32+ raw bytes, or 64+ hex digits). Every
    /// replica message then carries a keyed BLAKE3 MAC; messages without a valid one are
    /// dropped. All replicas need the same key. Requires --replica-sync-port.
    #[arg(long, requires = "replica_sync_port", value_name = "PATH")]
    replica_sync_key_file: Option<PathBuf>,

    /// Session-affinity TTL in seconds (1-31536000); enables session tables.
    #[arg(long, value_parser = parse_affinity_ttl, value_name = "SECS")]
    session_affinity_ttl_secs: Option<Duration>,

    /// Pending-selection cache TTL in seconds (fractional accepted).
    #[arg(long, default_value = "120", value_parser = parse_secs_f64, value_name = "SECS")]
    selection_cache_ttl_secs: Duration,

    /// Pending-selection cache entry limit.
    #[arg(long, default_value_t = 4096)]
    selection_cache_max_entries: usize,

    /// Pending-selection cache byte limit.
    #[arg(long, default_value_t = 268_435_456)]
    selection_cache_max_bytes: u64,

    /// Tracking-hash algorithm: public-xxh3-v1 or keyed-xxh3-v1 [env: DYN_ROUTER_TRACKING_HASH].
    #[arg(long, value_parser = parse_tracking_hash, value_name = "ALGORITHM")]
    router_tracking_hash: Option<TrackingHashAlgorithm>,

    /// File with the 32 raw key bytes of keyed-xxh3-v1 [env: DYN_ROUTER_TRACKING_KEY_FILE].
    #[arg(long, value_name = "PATH")]
    router_tracking_key_file: Option<PathBuf>,

    /// Key id (epoch label) of keyed-xxh3-v1 [env: DYN_ROUTER_TRACKING_KEY_ID].
    #[arg(long, value_name = "ID")]
    router_tracking_key_id: Option<String>,

    /// Use real tracking hashes (KV reuse assumed) [env: DYN_ROUTER_ASSUME_KV_REUSE, default true].
    #[arg(long, conflicts_with = "no_router_assume_kv_reuse")]
    router_assume_kv_reuse: bool,

    /// Use random tracking hashes (no KV reuse assumed).
    #[arg(long)]
    no_router_assume_kv_reuse: bool,

    /// YAML router policy file: `router:` overrides, policy `classes`, `worker_selection`
    /// instances (see docs/operations.md) [env: DYN_ROUTER_POLICY_CONFIG].
    #[arg(long, value_name = "PATH")]
    router_policy_config: Option<PathBuf>,

    /// File with a list of worker records (POST /workers bodies): YAML when named *.yaml or
    /// *.yml, else JSON. Registered at startup, then polled and reconciled.
    #[arg(long, value_name = "PATH")]
    workers_file: Option<PathBuf>,

    /// Log line format on stderr: `text` (key=value fields) or `json` (one object per line,
    /// for log pipelines). The level comes from RUST_LOG (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// File of bearer tokens, one per line (blank lines and # comments ignored, at least 16
    /// bytes each); when given, every route except /health requires
    /// `Authorization: Bearer <token>` with one of them.
    #[arg(long, value_name = "PATH")]
    auth_token_file: Option<PathBuf>,

    /// File of read-only bearer tokens (same format), accepted only on GET routes,
    /// /potential_loads and /overlap_scores. Requires --auth-token-file.
    #[arg(long, requires = "auth_token_file", value_name = "PATH")]
    auth_read_only_token_file: Option<PathBuf>,

    /// Upper bound on live reservations (default: unbounded).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), value_name = "N")]
    max_active_reservations: Option<u64>,

    /// Longest prompt accepted, in tokens (`token_ids` or multimodal routing tokens); longer
    /// prompts are rejected with 413 before any hashing.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..), value_name = "N")]
    max_prompt_tokens: u64,

    /// Seconds an HTTP connection may take to send a whole request head, idle keep-alive
    /// time included, and again to send its body; slower (or silent) connections are
    /// closed, a stalled body with 408 (fractional accepted).
    #[arg(long, default_value = "30", value_parser = parse_positive_secs, value_name = "SECS")]
    http_header_timeout_secs: Duration,

    /// Threads serving HTTP connections, each with a single-threaded runtime that keeps a
    /// connection from accept to close (default: one per available core). On a host that
    /// also runs the clients or engines, fewer threads than cores avoid contending for them.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024), value_name = "N")]
    http_threads: Option<u64>,

    /// Threads that receive, decode and index KV events, each serving up to 1,024 (worker,
    /// rank) listeners (default: one per available core; one fewer, at least one, with a
    /// writer thread, --kv-index-writer). Where engines' events and
    /// `/select` share few cores, one fewer than the cores leaves the HTTP threads a core
    /// during event bursts: a shorter `/select` tail for a lower peak ingest rate.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024), value_name = "N")]
    kv_listener_threads: Option<u64>,

    /// Microseconds a KV listener thread applies events before it steps aside at the next
    /// write-section boundary: it releases the index lock and yields its core, so the
    /// scheduler takes a busy listener's core between sections rather than inside one, and
    /// `/select` waits less for both. 0 never steps aside.
    #[arg(long, default_value = "250", value_parser = clap::value_parser!(u64).range(0..=1_000_000), value_name = "US")]
    kv_writer_step_aside_us: u64,

    /// Nice value increment (0-19) of the threads that receive and decode KV events (the
    /// listener threads and ZMQ's I/O threads), so that on shared cores the HTTP threads
    /// and the index's writer thread (--kv-index-writer) get the larger share. Raising a
    /// nice value needs no privilege; a thread that cannot lower itself runs as before,
    /// with a warning. Default: 10 with a writer thread, else 0 (the listeners then write
    /// the index themselves, and lowering them lowers the ingest rate).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=19), value_name = "N")]
    kv_ingest_nice: Option<u8>,

    /// Copies of each partition's prefix index. 2: the index and a lookup-only mirror, so
    /// lookups never wait for an event write, for about 60 % more index memory (the mirror
    /// holds the trie again). 1: lookups wait for the write in progress (microseconds,
    /// longer when its writer loses its core inside it), and the listener threads write.
    #[arg(long, default_value = "2", value_parser = clap::value_parser!(u8).range(1..=2), value_name = "N")]
    kv_index_copies: u8,

    /// Who applies KV events to a two-copy index. thread (the default with two copies): a
    /// writer thread per partition applies the batches the listener threads hand over, so
    /// decoding and the index write run on two cores at once; a batch reaches lookups once
    /// that thread has applied it (a few milliseconds later at most). It also sets two
    /// defaults: one listener thread fewer than the cores (--kv-listener-threads) and the
    /// ingest threads at nice 10 (--kv-ingest-nice), so that the writer and the HTTP
    /// threads get the larger share of a contended core. listeners: each listener thread
    /// writes the index itself, in turns (the only writer of a one-copy index).
    /// docs/operations.md compares them.
    #[arg(long, value_enum, value_name = "WHO")]
    kv_index_writer: Option<KvIndexWriter>,

    /// Messages each KV listener queues unread before it stops reading its engine's
    /// connection (ZMQ_RCVHWM). With the largest accepted message, this bounds the memory
    /// a stalled server gives to event backlogs; past it the engine drops, and the gap is
    /// replayed or counted lost.
    #[arg(long, default_value_t = service_builder::DEFAULT_RECEIVE_HWM, value_parser = clap::value_parser!(i32).range(1..=1_000_000), value_name = "MESSAGES")]
    kv_receive_hwm: i32,

    /// Seconds a KV listener waits for an engine's gap replay before abandoning it (the
    /// missing batches are then counted lost) and going on with live events (fractional
    /// accepted).
    #[arg(long, default_value = "5", value_parser = parse_positive_secs, value_name = "SECS")]
    kv_replay_timeout_secs: Duration,

    /// Serve the Gateway API Inference Extension endpoint-picker protocol (Envoy ext_proc v3
    /// over gRPC, with grpc.health.v1) on this port, beside the HTTP API. 0 binds a free port.
    #[arg(long, value_name = "PORT")]
    ext_proc_port: Option<u16>,

    /// PEM certificate chain for the ext_proc port (TLS; requires --ext-proc-tls-key).
    #[arg(long, requires_all = ["ext_proc_port", "ext_proc_tls_key"], value_name = "PATH")]
    ext_proc_tls_cert: Option<PathBuf>,

    /// PEM private key for the ext_proc port (requires --ext-proc-tls-cert).
    #[arg(long, requires = "ext_proc_tls_cert", value_name = "PATH")]
    ext_proc_tls_key: Option<PathBuf>,

    /// Request header naming the routing group of an endpoint-picker request (absent:
    /// `default`).
    #[arg(long, default_value = "x-kv-select-routing-group", value_name = "NAME")]
    ext_proc_routing_group_header: String,

    /// How many fallback endpoints follow the pick in `x-gateway-destination-endpoint`
    /// (`ip:port,ip:port,...`): the next-best eligible workers, not booked. 0 sends the pick
    /// alone.
    #[arg(
        long,
        default_value = "0",
        requires = "ext_proc_port",
        value_name = "N"
    )]
    ext_proc_fallbacks: usize,

    /// MODEL=DIR: the local tokenizer of MODEL for the endpoint picker (DIR holds
    /// tokenizer.json and tokenizer_config.json with the chat template). Repeatable. A
    /// model without one is routed by load only.
    #[arg(long = "tokenizer", value_parser = parse_tokenizer_arg, value_name = "MODEL=DIR")]
    tokenizers: Vec<(String, PathBuf)>,
}

fn parse_tokenizer_arg(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((model, dir)) if !model.is_empty() && !dir.is_empty() => {
            Ok((model.to_owned(), PathBuf::from(dir)))
        }
        _ => Err(format!("expected MODEL=DIR, got {s:?}")),
    }
}

/// `--ext-proc-*` and `--tokenizer`: the endpoint picker's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtProcSettings {
    pub port: u16,
    /// `(cert, key)` PEM files: TLS on.
    pub tls: Option<(PathBuf, PathBuf)>,
    pub routing_group_header: String,
    /// Fallback endpoints after the pick.
    pub fallbacks: usize,
    /// `(model, dir)` in flag order.
    pub tokenizers: Vec<(String, PathBuf)>,
}

/// Everything the process was configured with. Plain data; `Default` equals the spec defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    pub threads: u32,
    pub indexer_peers: Vec<String>,
    /// `--indexer-peers-token-file`, loaded and validated at parse time.
    pub indexer_peers_token: Option<crate::auth::PeerToken>,
    pub replica_sync_port: Option<u16>,
    pub replica_sync_peers: Vec<String>,
    pub session_affinity_ttl: Option<Duration>,
    pub selection_cache_ttl: Duration,
    pub selection_cache_max_entries: usize,
    pub selection_cache_max_bytes: u64,
    pub tracking: TrackingSettings,
    pub workers_file: Option<PathBuf>,
    /// `--log-format`.
    pub log_format: LogFormat,
    pub auth_token_file: Option<PathBuf>,
    pub auth_read_only_token_file: Option<PathBuf>,
    /// The tokens of both files, loaded and validated at parse time (digests only).
    pub auth: crate::auth::AccessTokens,
    /// `--replica-sync-key-file`, loaded and validated at parse time.
    pub replica_sync_key: Option<replica_sync::ReplicaKey>,
    pub max_active_reservations: Option<u64>,
    /// `--max-prompt-tokens`.
    pub max_prompt_tokens: u64,
    /// `--http-header-timeout-secs`.
    pub http_header_timeout: Duration,
    /// `--http-threads` (`None`: one per available core).
    pub http_threads: Option<std::num::NonZeroUsize>,
    /// `--kv-replay-timeout-secs`.
    pub kv_replay_timeout: Duration,
    /// `--kv-listener-threads` (`None`: one per available core).
    pub kv_listener_threads: Option<std::num::NonZeroUsize>,
    /// `--kv-writer-step-aside-us` (`None`: 0, never).
    pub kv_writer_step_aside: Option<Duration>,
    pub kv_ingest_nice: u8,
    /// `--kv-index-copies`.
    pub kv_index_copies: service_builder::IndexCopies,
    /// `--kv-index-writer`.
    pub kv_index_writer: service_builder::IndexWriter,
    /// `--kv-receive-hwm`.
    pub kv_receive_hwm: i32,
    /// Router configuration (§8.1); tracking fields are filled from [`Self::tracking`].
    pub router: RouterConfig,
    pub policy_names: PolicyNames,
    /// Policy classes of the policy file (`None`: the synthetic class of
    /// `router_queue_threshold` / `router_queue_policy`).
    pub policy_classes: Option<selection_policy::PolicyClasses>,
    /// The worker-selection instance chosen by `DYN_ROUTER_WORKER_SELECTION_POLICY`, as
    /// `(name, its router configuration, its policy kind)`; `None` = the default policy over
    /// [`Self::router`].
    pub worker_selection: Option<(String, RouterConfig, selection_policy::BuiltinPolicy)>,
    /// `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`.
    pub active_request_expiry: Duration,
    /// `DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`; `None` = refresh disabled.
    pub overlap_refresh_after: Option<Duration>,
    /// `DYN_ROUTER_MIN_INITIAL_WORKERS`.
    pub min_initial_workers: u64,
    /// The endpoint picker; `None` without `--ext-proc-port`.
    pub ext_proc: Option<ExtProcSettings>,
    /// Non-fatal notes produced while parsing (deprecated names, fallbacks), to be logged.
    pub warnings: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::from([0, 0, 0, 0]),
            port: 8092,
            threads: 4,
            indexer_peers: Vec::new(),
            indexer_peers_token: None,
            replica_sync_port: None,
            replica_sync_peers: Vec::new(),
            session_affinity_ttl: None,
            selection_cache_ttl: Duration::from_secs(120),
            selection_cache_max_entries: 4096,
            selection_cache_max_bytes: 268_435_456,
            tracking: TrackingSettings::default(),
            workers_file: None,
            log_format: LogFormat::Text,
            auth_token_file: None,
            auth_read_only_token_file: None,
            auth: crate::auth::AccessTokens::default(),
            replica_sync_key: None,
            max_active_reservations: None,
            max_prompt_tokens: 1_000_000,
            http_header_timeout: Duration::from_secs(30),
            http_threads: None,
            kv_replay_timeout: Duration::from_secs(5),
            kv_listener_threads: None,
            kv_writer_step_aside: Some(service_builder::DEFAULT_KV_WRITER_STEP_ASIDE),
            kv_ingest_nice: WRITER_THREAD_INGEST_NICE,
            kv_index_copies: service_builder::IndexCopies::Two,
            kv_index_writer: service_builder::IndexWriter::Thread,
            kv_receive_hwm: service_builder::DEFAULT_RECEIVE_HWM,
            router: RouterConfig::default(),
            policy_names: PolicyNames::default(),
            policy_classes: None,
            worker_selection: None,
            active_request_expiry: DEFAULT_ACTIVE_REQUEST_EXPIRY,
            overlap_refresh_after: Some(DEFAULT_OVERLAP_REFRESH_AFTER),
            min_initial_workers: 0,
            ext_proc: None,
            warnings: Vec::new(),
        }
    }
}

/// The three tracking-hash settings (`hashing.md` §5), validated by [`Self::hasher`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrackingSettings {
    pub algorithm: TrackingHashAlgorithm,
    pub key_file: Option<PathBuf>,
    pub key_id: Option<String>,
}

impl TrackingSettings {
    /// Startup validation and key loading (a failure is a startup error, exit 1).
    pub fn hasher(&self) -> Result<TrackingHasher, TrackingConfigError> {
        TrackingHasher::from_settings(
            Some(self.algorithm.as_str()),
            self.key_file.as_deref(),
            self.key_id.as_deref(),
            |p| std::fs::read(p),
        )
    }
}

/// Names of configured policy instances (`DYN_ROUTER_*_POLICY`); the rest of the router
/// configuration is `selection_policy::RouterConfig`, whose `Default` is the spec's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyNames {
    pub worker_selection_policy: Option<String>,
    pub prefill_policy: Option<String>,
    pub decode_policy: Option<String>,
}

// One definition of the router enums: selection-policy owns them (and their spellings).
pub use selection_policy::{
    ApproximateCachePolicy, ConditionalDisaggPolicy, PrefillLoadModel, QueuePolicy, SharedCacheType,
};

impl ServerConfig {
    /// Parses the process's arguments and environment; prints the error and exits
    /// (code 2; 0 for `--help`/`--version`) when they are invalid.
    pub fn from_process() -> Self {
        match Self::parse_from(std::env::args_os(), process_env) {
            Ok(cfg) => cfg,
            Err(e) => e.exit(),
        }
    }

    /// Parses `args` (including the program name) with `env` as the environment.
    pub fn parse_from<I, T>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let cli = Cli::try_parse_from(args)?;
        let mut env = EnvReader {
            get: &env,
            warnings: Vec::new(),
        };
        let result = Self::build(cli, &mut env);
        result.map_err(|msg| {
            let mut cmd = Cli::command();
            clap::Error::raw(ErrorKind::InvalidValue, msg).format(&mut cmd)
        })
    }

    fn build(cli: Cli, env: &mut EnvReader<'_>) -> Result<Self, String> {
        let (mut router, policy_names) = env.router_settings()?;
        let policy_path = cli
            .router_policy_config
            .or_else(|| router.router_policy_config.clone());
        router.router_policy_config = policy_path.clone();
        let file = match &policy_path {
            Some(path) => {
                let f = crate::policy_file::load(path)?;
                f.apply_router(&mut router)
                    .map_err(|e| format!("invalid router policy file {}: {e}", path.display()))?;
                Some(f)
            }
            None => None,
        };
        let worker_selection = match &policy_names.worker_selection_policy {
            None => None,
            Some(name) => {
                let instance = match &file {
                    Some(f) => f.instance(name),
                    None if name == "default" => {
                        Some(crate::policy_file::WorkerSelectionInstance::default())
                    }
                    None => None,
                };
                let instance = instance.ok_or_else(|| {
                    format!(
                        "invalid value '{name}' for environment variable \
                         DYN_ROUTER_WORKER_SELECTION_POLICY: no such worker_selection instance \
                         (define it in the router policy file, or use 'default')"
                    )
                })?;
                Some((name.clone(), instance.apply(&router), instance.policy))
            }
        };
        for (var, set) in [
            ("DYN_ROUTER_PREFILL_POLICY", &policy_names.prefill_policy),
            ("DYN_ROUTER_DECODE_POLICY", &policy_names.decode_policy),
        ] {
            if set.is_some() {
                env.warnings.push(format!(
                    "{var} is ignored: this service serves aggregated workers only"
                ));
            }
        }
        if cli.router_assume_kv_reuse {
            router.router_assume_kv_reuse = true;
        } else if cli.no_router_assume_kv_reuse {
            router.router_assume_kv_reuse = false;
        }
        let algorithm = match cli.router_tracking_hash {
            Some(a) => a,
            None => env
                .parsed("DYN_ROUTER_TRACKING_HASH", |s| {
                    s.parse::<TrackingHashAlgorithm>()
                        .map_err(|e| e.to_string())
                })?
                .unwrap_or_default(),
        };
        let tracking = TrackingSettings {
            algorithm,
            key_file: cli
                .router_tracking_key_file
                .or_else(|| env.get("DYN_ROUTER_TRACKING_KEY_FILE").map(PathBuf::from)),
            // Not trimmed: surrounding whitespace in a key id is a startup error (§5.1).
            key_id: cli
                .router_tracking_key_id
                .or_else(|| env.raw("DYN_ROUTER_TRACKING_KEY_ID")),
        };
        // Secrets are read here, not in main, so that a bad file is a usage error (exit 2)
        // naming the flag, like any other invalid flag.
        let auth = match &cli.auth_token_file {
            Some(full) => {
                crate::auth::AccessTokens::load(full, cli.auth_read_only_token_file.as_deref())
                    .map_err(|e| e.to_string())?
            }
            None => crate::auth::AccessTokens::default(),
        };
        let indexer_peers_token = cli
            .indexer_peers_token_file
            .as_deref()
            .map(crate::auth::PeerToken::load)
            .transpose()
            .map_err(|e| e.to_string())?;
        let replica_sync_key = match &cli.replica_sync_key_file {
            Some(path) => {
                let bytes = std::fs::read(path).map_err(|e| {
                    format!(
                        "--replica-sync-key-file {}: cannot read the file: {e}",
                        path.display()
                    )
                })?;
                let key = replica_sync::ReplicaKey::from_file_contents(&bytes)
                    .map_err(|e| format!("--replica-sync-key-file {}: {e}", path.display()))?;
                Some(key)
            }
            None => None,
        };
        let active_request_expiry = env.active_request_expiry();
        let overlap_refresh_after = env.overlap_refresh_after();
        let min_initial_workers = env
            .parsed("DYN_ROUTER_MIN_INITIAL_WORKERS", |s| {
                s.parse::<u64>()
                    .map_err(|_| "expected a non-negative integer".to_owned())
            })?
            .unwrap_or(0);
        let writer_thread = match (cli.kv_index_writer, cli.kv_index_copies) {
            (Some(KvIndexWriter::Thread), 1) => {
                return Err(
                    "--kv-index-writer thread needs --kv-index-copies 2: a one-copy index is \
                     written by its listeners, in short sections its lookups wait for"
                        .to_owned(),
                );
            }
            (Some(writer), _) => writer == KvIndexWriter::Thread,
            (None, copies) => copies == 2,
        };
        let ext_proc = cli.ext_proc_port.map(|port| ExtProcSettings {
            port,
            tls: cli
                .ext_proc_tls_cert
                .clone()
                .zip(cli.ext_proc_tls_key.clone()),
            routing_group_header: cli.ext_proc_routing_group_header.clone(),
            fallbacks: cli.ext_proc_fallbacks,
            tokenizers: cli.tokenizers.clone(),
        });
        Ok(Self {
            ext_proc,
            host: cli.host,
            port: cli.port,
            threads: cli.threads,
            indexer_peers: non_empty(cli.indexer_peers),
            indexer_peers_token,
            replica_sync_port: cli.replica_sync_port,
            replica_sync_peers: non_empty(cli.replica_sync_peers),
            session_affinity_ttl: cli.session_affinity_ttl_secs,
            selection_cache_ttl: cli.selection_cache_ttl_secs,
            selection_cache_max_entries: cli.selection_cache_max_entries,
            selection_cache_max_bytes: cli.selection_cache_max_bytes,
            tracking,
            workers_file: cli.workers_file,
            log_format: cli.log_format,
            auth_token_file: cli.auth_token_file,
            auth_read_only_token_file: cli.auth_read_only_token_file,
            auth,
            replica_sync_key,
            max_active_reservations: cli.max_active_reservations,
            max_prompt_tokens: cli.max_prompt_tokens,
            http_header_timeout: cli.http_header_timeout_secs,
            http_threads: cli
                .http_threads
                .and_then(|n| usize::try_from(n).ok())
                .and_then(std::num::NonZeroUsize::new),
            kv_replay_timeout: cli.kv_replay_timeout_secs,
            kv_listener_threads: cli
                .kv_listener_threads
                .and_then(|n| usize::try_from(n).ok())
                .and_then(std::num::NonZeroUsize::new),
            kv_writer_step_aside: (cli.kv_writer_step_aside_us > 0)
                .then(|| Duration::from_micros(cli.kv_writer_step_aside_us)),
            kv_ingest_nice: cli.kv_ingest_nice.unwrap_or(if writer_thread {
                WRITER_THREAD_INGEST_NICE
            } else {
                0
            }),
            kv_index_copies: match cli.kv_index_copies {
                2 => service_builder::IndexCopies::Two,
                _ => service_builder::IndexCopies::One,
            },
            kv_index_writer: if writer_thread {
                service_builder::IndexWriter::Thread
            } else {
                service_builder::IndexWriter::Listeners
            },
            kv_receive_hwm: cli.kv_receive_hwm,
            router,
            policy_names,
            policy_classes: file.and_then(|f| f.classes),
            worker_selection,
            active_request_expiry,
            overlap_refresh_after,
            min_initial_workers,
            warnings: std::mem::take(&mut env.warnings),
        })
    }
}

fn non_empty(v: Vec<String>) -> Vec<String> {
    v.into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

#[expect(
    clippy::disallowed_methods,
    reason = "the app's config module is the one place that reads the environment"
)]
fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// Whole seconds. A number outside 1..=[`MAX_SESSION_AFFINITY_TTL_SECS`] parses: the service
/// builder rejects it at startup, which exits 1 as the reference does (transcript, "Startup
/// flags"); only a value that is not a number is a usage error (exit 2).
fn parse_affinity_ttl(s: &str) -> Result<Duration, String> {
    s.trim()
        .parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| {
            format!(
                "session affinity TTL must be between 1 and {MAX_SESSION_AFFINITY_TTL_SECS} seconds"
            )
        })
}

fn parse_secs_f64(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| "expected a number of seconds".to_owned())?;
    if !(secs.is_finite() && secs >= 0.0) {
        return Err("must be finite and non-negative".to_owned());
    }
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

fn parse_positive_secs(s: &str) -> Result<Duration, String> {
    let d = parse_secs_f64(s)?;
    if d.is_zero() {
        return Err("must be greater than 0".to_owned());
    }
    Ok(d)
}

fn parse_tracking_hash(s: &str) -> Result<TrackingHashAlgorithm, String> {
    s.parse().map_err(|e: TrackingConfigError| e.to_string())
}

/// Reads and validates environment variables; errors are full sentences naming the variable.
struct EnvReader<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
    warnings: Vec<String>,
}

impl EnvReader<'_> {
    /// The raw value, `None` when unset or empty.
    fn raw(&self, name: &str) -> Option<String> {
        (self.get)(name).filter(|v| !v.trim().is_empty())
    }

    /// The trimmed value, `None` when unset or empty.
    fn get(&self, name: &str) -> Option<String> {
        self.raw(name).map(|v| v.trim().to_owned())
    }

    fn parsed<T>(
        &self,
        name: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => parse(&v).map(Some).map_err(|why| {
                format!("invalid value '{v}' for environment variable {name}: {why}")
            }),
        }
    }

    fn deprecated(&mut self, name: &str) {
        if self.get(name).is_some() {
            self.warnings.push(format!(
                "{name} is deprecated (removal planned in v1.7); use the router policy file"
            ));
        }
    }

    fn bool(&self, name: &str, default: bool) -> Result<bool, String> {
        Ok(self.parsed(name, parse_bool)?.unwrap_or(default))
    }

    fn f64(&self, name: &str, check: Check) -> Result<Option<f64>, String> {
        self.parsed(name, |s| {
            let x: f64 = s.parse().map_err(|_| "expected a number".to_owned())?;
            check.apply(x)?;
            Ok(x)
        })
    }

    fn enumeration<T>(&self, name: &str) -> Result<Option<T>, String>
    where
        T: FromStr<Err = selection_policy::ParseEnumError>,
    {
        self.parsed(name, |s| {
            s.parse()
                .map_err(|e: selection_policy::ParseEnumError| e.to_string())
        })
    }

    fn router_settings(&mut self) -> Result<(RouterConfig, PolicyNames), String> {
        let d = RouterConfig::default();
        for name in [
            "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
            "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
            "DYN_ROUTER_PREFILL_LOAD_SCALE",
            "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
            "DYN_OVERLAP_SCORE_WEIGHT",
            "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
            "DYN_ROUTER_TEMPERATURE",
            "DYN_ROUTER_QUEUE_THRESHOLD",
            "DYN_ROUTER_QUEUE_POLICY",
            "DYN_SHARED_CACHE_MULTIPLIER",
        ] {
            self.deprecated(name);
        }
        let nn = Check::NonNegative;
        let unit = Check::UnitInterval;
        let mut s = RouterConfig {
            overlap_score_credit: self
                .f64("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", nn)?
                .unwrap_or(d.overlap_score_credit),
            overlap_score_credit_decay: self
                .f64("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", nn)?
                .unwrap_or(d.overlap_score_credit_decay),
            prefill_load_scale: self
                .f64("DYN_ROUTER_PREFILL_LOAD_SCALE", nn)?
                .unwrap_or(d.prefill_load_scale),
            decode_active_request_weight: self
                .f64("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", nn)?
                .unwrap_or(d.decode_active_request_weight),
            router_temperature: self
                .f64("DYN_ROUTER_TEMPERATURE", nn)?
                .unwrap_or(d.router_temperature),
            host_cache_hit_weight: self
                .f64("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", unit)?
                .unwrap_or(d.host_cache_hit_weight),
            disk_cache_hit_weight: self
                .f64("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", unit)?
                .unwrap_or(d.disk_cache_hit_weight),
            use_kv_events: match self.get("DYN_ROUTER_USE_KV_EVENTS") {
                Some(_) => self.bool("DYN_ROUTER_USE_KV_EVENTS", d.use_kv_events)?,
                None => self.bool("DYN_USE_KV_EVENTS", d.use_kv_events)?,
            },
            router_replica_sync: self.bool("DYN_ROUTER_REPLICA_SYNC", d.router_replica_sync)?,
            router_track_active_blocks: self.bool(
                "DYN_ROUTER_TRACK_ACTIVE_BLOCKS",
                d.router_track_active_blocks,
            )?,
            router_track_output_blocks: self.bool(
                "DYN_ROUTER_TRACK_OUTPUT_BLOCKS",
                d.router_track_output_blocks,
            )?,
            router_assume_kv_reuse: self
                .bool("DYN_ROUTER_ASSUME_KV_REUSE", d.router_assume_kv_reuse)?,
            router_track_prefill_tokens: self.bool(
                "DYN_ROUTER_TRACK_PREFILL_TOKENS",
                d.router_track_prefill_tokens,
            )?,
            router_prefill_load_model: self
                .enumeration("DYN_ROUTER_PREFILL_LOAD_MODEL")?
                .unwrap_or(d.router_prefill_load_model),
            router_ttl_secs: self
                .f64("DYN_ROUTER_TTL_SECS", nn)?
                .unwrap_or(d.router_ttl_secs),
            router_approximate_cache_policy: self
                .enumeration("DYN_ROUTER_APPROXIMATE_CACHE_POLICY")?
                .unwrap_or(d.router_approximate_cache_policy),
            router_predicted_ttl_secs: self.f64("DYN_ROUTER_PREDICTED_TTL_SECS", nn)?,
            router_queue_threshold: self.f64("DYN_ROUTER_QUEUE_THRESHOLD", nn)?,
            router_queue_policy: self
                .enumeration("DYN_ROUTER_QUEUE_POLICY")?
                .unwrap_or(d.router_queue_policy),
            router_policy_config: self.get("DYN_ROUTER_POLICY_CONFIG").map(PathBuf::from),
            router_event_threads: self
                .parsed("DYN_ROUTER_EVENT_THREADS", |s| {
                    s.parse::<u32>()
                        .map_err(|_| "expected a positive integer".to_owned())
                })?
                .unwrap_or(d.router_event_threads),
            use_remote_indexer: self.bool("DYN_USE_REMOTE_INDEXER", d.use_remote_indexer)?,
            shared_cache_type: self
                .enumeration("DYN_SHARED_CACHE_TYPE")?
                .unwrap_or(d.shared_cache_type),
            shared_cache_multiplier: self.f64("DYN_SHARED_CACHE_MULTIPLIER", unit)?,
            conditional_disagg_enabled: self.bool(
                "DYN_ROUTER_CONDITIONAL_DISAGG",
                d.conditional_disagg_enabled,
            )?,
            conditional_disagg_policy: d.conditional_disagg_policy,
            conditional_disagg_eff_isl_threshold: self
                .parsed("DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD", |s| {
                    s.parse::<u64>()
                        .map_err(|_| "expected a non-negative integer".to_owned())
                })?
                .unwrap_or(d.conditional_disagg_eff_isl_threshold),
            conditional_disagg_eff_isl_ratio_threshold: self
                .f64(
                    "DYN_ROUTER_CONDITIONAL_DISAGG_EFF_ISL_RATIO_THRESHOLD",
                    unit,
                )?
                .unwrap_or(d.conditional_disagg_eff_isl_ratio_threshold),
            conditional_disagg_prefill_busy_threshold: self
                .f64("DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD", nn)?,
            conditional_disagg_decode_busy_threshold: self
                .f64("DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD", nn)?,
            router_tracking_hash: d.router_tracking_hash,
            router_tracking_key_file: None,
            router_tracking_key_id: None,
            serve_indexer: d.serve_indexer,
        };
        let names = PolicyNames {
            worker_selection_policy: self.get("DYN_ROUTER_WORKER_SELECTION_POLICY"),
            prefill_policy: self.get("DYN_ROUTER_PREFILL_POLICY"),
            decode_policy: self.get("DYN_ROUTER_DECODE_POLICY"),
        };

        // The reference ignores an unparsable policy name here (and only here).
        if let Some(v) = self.get("DYN_ROUTER_CONDITIONAL_DISAGG_POLICY") {
            match v.parse() {
                Ok(p) => s.conditional_disagg_policy = p,
                Err(why) => self.warnings.push(format!(
                    "ignoring DYN_ROUTER_CONDITIONAL_DISAGG_POLICY='{v}' ({why}); using isl_bounding"
                )),
            }
        }

        // Legacy weight, applied after the three fields it overrides.
        let weight = match self.f64("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", nn)? {
            Some(w) => Some(w),
            None => self.f64("DYN_OVERLAP_SCORE_WEIGHT", nn)?,
        };
        if let Some(w) = weight {
            s.prefill_load_scale = w;
            if w == 0.0 {
                s.overlap_score_credit = 0.0;
            }
        }

        if s.router_track_output_blocks && !s.router_track_active_blocks {
            return Err(
                "router_track_output_blocks requires router_track_active_blocks=true".to_owned(),
            );
        }
        if s.router_prefill_load_model != PrefillLoadModel::None && !s.router_track_prefill_tokens {
            return Err(
                "router_prefill_load_model requires router_track_prefill_tokens=true".to_owned(),
            );
        }
        if s.router_predicted_ttl_secs.is_some() && !s.use_kv_events {
            return Err("router_predicted_ttl_secs requires use_kv_events=true".to_owned());
        }
        if s.router_event_threads < 1 {
            return Err("router_event_threads must be at least 1".to_owned());
        }
        if s.conditional_disagg_enabled
            && s.conditional_disagg_policy != ConditionalDisaggPolicy::IslBounding
            && s.conditional_disagg_prefill_busy_threshold.is_none()
            && s.router_queue_threshold.is_none()
        {
            return Err("a load-based conditional_disagg_policy requires \
                 DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD or DYN_ROUTER_QUEUE_THRESHOLD"
                .to_owned());
        }
        Ok((s, names))
    }

    /// Positive integer seconds; absent → 300; unparsable or 0 → 300 with a warning.
    fn active_request_expiry(&mut self) -> Duration {
        const NAME: &str = "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS";
        match self.get(NAME) {
            None => DEFAULT_ACTIVE_REQUEST_EXPIRY,
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => Duration::from_secs(n),
                _ => {
                    self.warnings.push(format!(
                        "{NAME}='{v}' is not a positive integer; using 300 seconds"
                    ));
                    DEFAULT_ACTIVE_REQUEST_EXPIRY
                }
            },
        }
    }

    /// Seconds; 0, negative or non-finite disables; unparsable → 10 with a warning.
    fn overlap_refresh_after(&mut self) -> Option<Duration> {
        const NAME: &str = "DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS";
        match self.get(NAME) {
            None => Some(DEFAULT_OVERLAP_REFRESH_AFTER),
            Some(v) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Duration::try_from_secs_f64(x).ok(),
                Ok(_) => None,
                Err(_) => {
                    self.warnings
                        .push(format!("{NAME}='{v}' is not a number; using 10 seconds"));
                    Some(DEFAULT_OVERLAP_REFRESH_AFTER)
                }
            },
        }
    }
}

#[derive(Clone, Copy)]
enum Check {
    NonNegative,
    UnitInterval,
}

impl Check {
    fn apply(self, x: f64) -> Result<(), String> {
        match self {
            Check::NonNegative if !(x.is_finite() && x >= 0.0) => {
                Err("must be finite and non-negative".to_owned())
            }
            Check::UnitInterval if !(0.0..=1.0).contains(&x) => {
                Err("must be between 0 and 1".to_owned())
            }
            _ => Ok(()),
        }
    }
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err("expected one of 1, true, on, yes, 0, false, off, no".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<ServerConfig, clap::Error> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let argv = std::iter::once("select-server").chain(args.iter().copied());
        ServerConfig::parse_from(argv, |k| env.get(k).cloned())
    }

    fn err(args: &[&str], env: &[(&str, &str)]) -> String {
        let e = parse(args, env).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
        e.to_string()
    }

    #[test]
    fn http_threads_default_to_the_cores_and_refuse_zero() {
        assert_eq!(parse(&[], &[]).unwrap().http_threads, None);
        let cfg = parse(&["--http-threads", "3"], &[]).unwrap();
        assert_eq!(cfg.http_threads.map(std::num::NonZeroUsize::get), Some(3));
        assert!(err(&["--http-threads", "0"], &[]).contains("--http-threads"));
    }

    #[test]
    fn kv_ingest_nice_defaults_to_ten_with_a_writer_thread_and_stops_at_nineteen() {
        // With a writer thread (the default), the ingest threads run lowered unless told
        // otherwise; without one they write the index and run at the server's priority.
        assert_eq!(parse(&[], &[]).unwrap().kv_ingest_nice, 10);
        assert_eq!(ServerConfig::default().kv_ingest_nice, 10);
        let nice = |args: &[&str]| parse(args, &[]).unwrap().kv_ingest_nice;
        assert_eq!(nice(&["--kv-ingest-nice", "0"]), 0);
        assert_eq!(nice(&["--kv-index-writer", "listeners"]), 0);
        assert_eq!(nice(&["--kv-index-copies", "1"]), 0);
        assert_eq!(
            nice(&["--kv-index-copies", "1", "--kv-ingest-nice", "10"]),
            10
        );
        assert!(err(&["--kv-ingest-nice", "20"], &[]).contains("--kv-ingest-nice"));
        assert!(err(&["--kv-ingest-nice=-1"], &[]).contains("--kv-ingest-nice"));
    }

    #[test]
    fn kv_listener_threads_default_to_the_cores_and_refuse_zero() {
        assert_eq!(parse(&[], &[]).unwrap().kv_listener_threads, None);
        let cfg = parse(&["--kv-listener-threads", "1"], &[]).unwrap();
        assert_eq!(
            cfg.kv_listener_threads.map(std::num::NonZeroUsize::get),
            Some(1)
        );
        assert!(err(&["--kv-listener-threads", "0"], &[]).contains("--kv-listener-threads"));
    }

    #[test]
    fn kv_writer_step_aside_defaults_to_250_us_and_0_turns_it_off() {
        assert_eq!(
            parse(&[], &[]).unwrap().kv_writer_step_aside,
            Some(Duration::from_micros(250))
        );
        let cfg = parse(&["--kv-writer-step-aside-us", "80"], &[]).unwrap();
        assert_eq!(cfg.kv_writer_step_aside, Some(Duration::from_micros(80)));
        let cfg = parse(&["--kv-writer-step-aside-us", "0"], &[]).unwrap();
        assert_eq!(cfg.kv_writer_step_aside, None);
        assert!(
            err(&["--kv-writer-step-aside-us", "2000000"], &[])
                .contains("--kv-writer-step-aside-us")
        );
    }

    #[test]
    fn kv_index_copies_default_to_two_and_accept_only_one_or_two() {
        let copies = |args: &[&str]| parse(args, &[]).unwrap().kv_index_copies;
        assert_eq!(copies(&[]), service_builder::IndexCopies::Two);
        assert_eq!(
            ServerConfig::default().kv_index_copies,
            service_builder::IndexCopies::Two
        );
        assert_eq!(
            copies(&["--kv-index-copies", "2"]),
            service_builder::IndexCopies::Two
        );
        assert_eq!(
            copies(&["--kv-index-copies", "1"]),
            service_builder::IndexCopies::One
        );
        for bad in ["0", "3", "two"] {
            assert!(err(&["--kv-index-copies", bad], &[]).contains("--kv-index-copies"));
        }
    }

    #[test]
    fn a_writer_thread_is_the_default_with_two_copies_only() {
        use service_builder::IndexWriter::{Listeners, Thread};
        let writer = |args: &[&str]| parse(args, &[]).unwrap().kv_index_writer;
        assert_eq!(writer(&[]), Thread);
        assert_eq!(ServerConfig::default().kv_index_writer, Thread);
        assert_eq!(writer(&["--kv-index-writer", "thread"]), Thread);
        assert_eq!(writer(&["--kv-index-writer", "listeners"]), Listeners);
        assert_eq!(writer(&["--kv-index-copies", "1"]), Listeners);
        assert_eq!(
            writer(&["--kv-index-copies", "1", "--kv-index-writer", "listeners"]),
            Listeners
        );
        let e = err(
            &["--kv-index-copies", "1", "--kv-index-writer", "thread"],
            &[],
        );
        assert!(e.contains("--kv-index-copies 2"), "{e}");
        assert!(err(&["--kv-index-writer", "both"], &[]).contains("--kv-index-writer"));
    }

    #[test]
    fn kv_receive_hwm_defaults_to_100_and_refuses_zero() {
        assert_eq!(parse(&[], &[]).unwrap().kv_receive_hwm, 100);
        assert_eq!(
            parse(&["--kv-receive-hwm", "50"], &[])
                .unwrap()
                .kv_receive_hwm,
            50
        );
        for bad in ["0", "-1", "2000000", "many"] {
            let flag = format!("--kv-receive-hwm={bad}");
            assert!(err(&[&flag], &[]).contains("--kv-receive-hwm"), "{bad}");
        }
    }

    #[test]
    fn defaults_equal_the_spec() {
        let cfg = parse(&[], &[]).unwrap();
        assert_eq!(cfg, ServerConfig::default());
        assert_eq!(cfg.port, 8092);
        assert_eq!(cfg.threads, 4);
        assert_eq!(cfg.host.to_string(), "0.0.0.0");
        assert_eq!(cfg.selection_cache_ttl, Duration::from_secs(120));
        assert_eq!(cfg.selection_cache_max_entries, 4096);
        assert_eq!(cfg.selection_cache_max_bytes, 268_435_456);
        assert_eq!(cfg.tracking.algorithm, TrackingHashAlgorithm::PublicXxh3V1);
        assert!(cfg.router.router_assume_kv_reuse);
        assert!(cfg.router.use_kv_events);
        assert!(cfg.router.router_track_prefill_tokens);
        assert_eq!(cfg.router.host_cache_hit_weight, 0.75);
        assert_eq!(cfg.router.disk_cache_hit_weight, 0.25);
        assert_eq!(cfg.active_request_expiry, Duration::from_secs(300));
        assert_eq!(cfg.overlap_refresh_after, Some(Duration::from_secs(10)));
        assert_eq!(cfg.kv_replay_timeout, Duration::from_secs(5));
        assert!(cfg.warnings.is_empty());
    }

    #[test]
    fn kv_replay_timeout_takes_positive_fractional_seconds() {
        let cfg = parse(&["--kv-replay-timeout-secs", "0.5"], &[]).unwrap();
        assert_eq!(cfg.kv_replay_timeout, Duration::from_millis(500));
        err(&["--kv-replay-timeout-secs", "0"], &[]);
        err(&["--kv-replay-timeout-secs", "soon"], &[]);
    }

    #[test]
    fn flags_parse() {
        let cfg = parse(
            &[
                "--host",
                "127.0.0.1",
                "--port",
                "1234",
                "--indexer-peers",
                "http://a:1,http://b:2",
                "--replica-sync-port",
                "9092",
                "--replica-sync-peers",
                "tcp://x:1,tcp://y:2",
                "--session-affinity-ttl-secs",
                "60",
                "--selection-cache-ttl-secs",
                "0.5",
                "--no-router-assume-kv-reuse",
                "--max-active-reservations",
                "10",
            ],
            &[("DYN_ROUTER_ASSUME_KV_REUSE", "true")],
        )
        .unwrap();
        assert_eq!(cfg.port, 1234);
        assert_eq!(cfg.indexer_peers, ["http://a:1", "http://b:2"]);
        assert_eq!(cfg.replica_sync_peers, ["tcp://x:1", "tcp://y:2"]);
        assert_eq!(cfg.session_affinity_ttl, Some(Duration::from_secs(60)));
        assert_eq!(cfg.selection_cache_ttl, Duration::from_millis(500));
        assert!(!cfg.router.router_assume_kv_reuse);
        assert_eq!(cfg.max_active_reservations, Some(10));
    }

    #[test]
    fn log_format_is_text_or_json() {
        assert_eq!(parse(&[], &[]).unwrap().log_format, LogFormat::Text);
        let cfg = parse(&["--log-format", "json"], &[]).unwrap();
        assert_eq!(cfg.log_format, LogFormat::Json);
        let msg = err(&["--log-format", "xml"], &[]);
        assert!(msg.contains("--log-format"), "{msg}");
    }

    #[test]
    fn replica_peers_require_the_sync_port() {
        let msg = err(&["--replica-sync-peers", "tcp://127.0.0.1:1"], &[]);
        assert!(msg.contains("--replica-sync-port"), "{msg}");
    }

    #[test]
    fn affinity_ttl_range() {
        // In range for the CLI; the service builder refuses them (exit 1, tested with the
        // binary).
        for out_of_range in ["0", "31536001"] {
            let arg = format!("--session-affinity-ttl-secs={out_of_range}");
            assert!(parse(&[&arg], &[]).is_ok(), "{arg}");
        }
        for bad in ["-1", "x"] {
            let arg = format!("--session-affinity-ttl-secs={bad}");
            let msg = err(&[&arg], &[]);
            assert!(
                msg.contains("session affinity TTL must be between 1 and 31536000 seconds"),
                "{msg}"
            );
        }
        let cfg = parse(&["--session-affinity-ttl-secs", "31536000"], &[]).unwrap();
        assert_eq!(
            cfg.session_affinity_ttl,
            Some(Duration::from_secs(31_536_000))
        );
    }

    #[test]
    fn invalid_flags_name_the_flag() {
        let msg = err(&["--router-tracking-hash", "md5"], &[]);
        assert!(msg.contains("--router-tracking-hash"), "{msg}");
        assert!(msg.contains("public-xxh3-v1 or keyed-xxh3-v1"), "{msg}");
        for (flag, value) in [
            ("--port", "70000"),
            ("--threads", "0"),
            ("--replica-sync-port", "0"),
            ("--selection-cache-ttl-secs", "-1"),
            ("--selection-cache-max-entries", "many"),
            ("--host", "not-an-ip"),
        ] {
            let arg = format!("{flag}={value}");
            let msg = err(&[&arg], &[]);
            assert!(msg.contains(flag), "{flag}: {msg}");
        }
        let msg = err(
            &["--router-assume-kv-reuse", "--no-router-assume-kv-reuse"],
            &[],
        );
        assert!(msg.contains("cannot be used with"), "{msg}");
    }

    #[test]
    fn invalid_env_values_name_the_variable() {
        for (name, value) in [
            ("DYN_ROUTER_TEMPERATURE", "-1"),
            ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", "1.5"),
            ("DYN_ROUTER_USE_KV_EVENTS", "maybe"),
            ("DYN_ROUTER_QUEUE_POLICY", "random"),
            ("DYN_ROUTER_MIN_INITIAL_WORKERS", "-3"),
            ("DYN_ROUTER_TRACKING_HASH", "md5"),
            ("DYN_ROUTER_TTL_SECS", "abc"),
        ] {
            let msg = err(&[], &[(name, value)]);
            assert!(msg.contains(name), "{name}: {msg}");
        }
    }

    #[test]
    fn env_values_apply_and_flags_win() {
        let cfg = parse(
            &["--router-tracking-hash", "public-xxh3-v1"],
            &[
                ("DYN_ROUTER_TRACKING_HASH", "keyed-xxh3-v1"),
                ("DYN_ROUTER_TRACKING_KEY_ID", "epoch-1"),
                ("DYN_USE_KV_EVENTS", "off"),
                ("DYN_ROUTER_TRACK_PREFILL_TOKENS", " No "),
                ("DYN_ROUTER_QUEUE_THRESHOLD", "0.5"),
                ("DYN_ROUTER_APPROXIMATE_CACHE_POLICY", "LRU"),
                ("DYN_ROUTER_PREFILL_POLICY", ""),
                ("DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD", "0.9"),
            ],
        )
        .unwrap();
        assert_eq!(cfg.tracking.algorithm, TrackingHashAlgorithm::PublicXxh3V1);
        assert_eq!(cfg.tracking.key_id.as_deref(), Some("epoch-1"));
        assert!(!cfg.router.use_kv_events);
        assert!(!cfg.router.router_track_prefill_tokens);
        assert_eq!(cfg.router.router_queue_threshold, Some(0.5));
        assert_eq!(
            cfg.router.router_approximate_cache_policy,
            ApproximateCachePolicy::Lru
        );
        assert_eq!(cfg.policy_names.prefill_policy, None);
        assert_eq!(
            cfg.router.conditional_disagg_decode_busy_threshold,
            Some(0.9)
        );
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.contains("DYN_ROUTER_QUEUE_THRESHOLD"))
        );
        // public mode with a key id is rejected at startup (exit 1), not by the parser
        assert!(cfg.tracking.hasher().is_err());
    }

    #[test]
    fn legacy_overlap_weight() {
        let cfg = parse(&[], &[("DYN_OVERLAP_SCORE_WEIGHT", "0")]).unwrap();
        assert_eq!(cfg.router.prefill_load_scale, 0.0);
        assert_eq!(cfg.router.overlap_score_credit, 0.0);
        let cfg = parse(
            &[],
            &[
                ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "2"),
                ("DYN_OVERLAP_SCORE_WEIGHT", "0"),
                ("DYN_ROUTER_PREFILL_LOAD_SCALE", "5"),
            ],
        )
        .unwrap();
        assert_eq!(cfg.router.prefill_load_scale, 2.0);
        assert_eq!(cfg.router.overlap_score_credit, 1.0);
    }

    #[test]
    fn cross_field_rules() {
        let msg = err(
            &[],
            &[
                ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS", "1"),
                ("DYN_ROUTER_TRACK_ACTIVE_BLOCKS", "0"),
            ],
        );
        assert!(msg.contains("router_track_output_blocks requires"), "{msg}");
        let msg = err(
            &[],
            &[
                ("DYN_ROUTER_PREDICTED_TTL_SECS", "5"),
                ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            ],
        );
        assert!(msg.contains("router_predicted_ttl_secs requires"), "{msg}");
        let msg = err(&[], &[("DYN_ROUTER_EVENT_THREADS", "0")]);
        assert!(
            msg.contains("router_event_threads must be at least 1"),
            "{msg}"
        );
    }

    #[test]
    fn expiry_and_refresh_fallbacks() {
        let check = |v: &str, want: u64, warns: bool| {
            let cfg = parse(&[], &[("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", v)]).unwrap();
            assert_eq!(cfg.active_request_expiry, Duration::from_secs(want), "{v}");
            assert_eq!(!cfg.warnings.is_empty(), warns, "{v}");
        };
        check("60", 60, false);
        check("0", 300, true);
        check("abc", 300, true);
        check("-5", 300, true);
        check("", 300, false);

        let refresh = |v: &str| {
            parse(&[], &[("DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS", v)])
                .unwrap()
                .overlap_refresh_after
        };
        assert_eq!(refresh("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(refresh("0"), None);
        assert_eq!(refresh("-1"), None);
        assert_eq!(refresh("inf"), None);
        assert_eq!(refresh("soon"), Some(Duration::from_secs(10)));
    }

    fn temp_policy_file(tag: &str, yaml: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "kv-select-policy-{}-{tag}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, yaml).unwrap();
        path
    }

    #[test]
    fn policy_file_from_flag_or_env() {
        let path = temp_policy_file(
            "ok",
            "router: {router_temperature: 0.5}\n\
             classes: [{name: a, prefill_busy_threshold: 100}]\n\
             worker_selection: {hot: {kind: default, overlap_score_credit: 3}}\n",
        );
        let p = path.to_str().unwrap();
        let cfg = parse(
            &[],
            &[
                ("DYN_ROUTER_POLICY_CONFIG", p),
                ("DYN_ROUTER_TEMPERATURE", "0.2"),
                ("DYN_ROUTER_WORKER_SELECTION_POLICY", "hot"),
                ("DYN_ROUTER_PREFILL_POLICY", "x"),
            ],
        )
        .unwrap();
        // The file's router section wins over the environment.
        assert_eq!(cfg.router.router_temperature, 0.5);
        assert_eq!(
            cfg.router.router_policy_config.as_deref(),
            Some(path.as_path())
        );
        let classes = cfg.policy_classes.as_ref().unwrap();
        assert_eq!(classes.default_class().name, "a");
        let (name, instance, policy) = cfg.worker_selection.as_ref().unwrap();
        assert_eq!(name, "hot");
        assert_eq!(*policy, selection_policy::BuiltinPolicy::Default);
        assert_eq!(
            (instance.overlap_score_credit, instance.router_temperature),
            (3.0, 0.5)
        );
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.contains("DYN_ROUTER_PREFILL_POLICY is ignored"))
        );
        let cfg = parse(&["--router-policy-config", p], &[]).unwrap();
        assert!(cfg.policy_classes.is_some());
        // Without a file only the built-in `default` instance exists.
        let cfg = parse(&[], &[("DYN_ROUTER_WORKER_SELECTION_POLICY", "default")]).unwrap();
        assert_eq!(cfg.worker_selection.as_ref().unwrap().1, cfg.router);
        let msg = err(&[], &[("DYN_ROUTER_WORKER_SELECTION_POLICY", "hot")]);
        assert!(msg.contains("DYN_ROUTER_WORKER_SELECTION_POLICY"), "{msg}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_kv_bounded_instance_without_parameters_gets_the_recommended_ones() {
        let path = temp_policy_file(
            "bounded",
            "router: {host_cache_hit_weight: 0.5}\n\
             worker_selection: {cache_first: {kind: kv-bounded}, tight: {kind: kv-bounded, slack: 1, decode_weight: 0}}\n",
        );
        let p = path.to_str().unwrap();
        for (name, want) in [
            ("cache_first", selection_policy::KvBoundedConfig::default()),
            (
                "tight",
                selection_policy::KvBoundedConfig {
                    slack: 1.0,
                    decode_weight: 0.0,
                },
            ),
        ] {
            let cfg = parse(
                &[],
                &[
                    ("DYN_ROUTER_POLICY_CONFIG", p),
                    ("DYN_ROUTER_WORKER_SELECTION_POLICY", name),
                ],
            )
            .unwrap();
            let (_, router, policy) = cfg.worker_selection.as_ref().unwrap();
            assert_eq!(*policy, selection_policy::BuiltinPolicy::KvBounded(want));
            assert_eq!(router.host_cache_hit_weight, 0.5);
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_bad_policy_file_names_the_file_and_the_field() {
        let path = temp_policy_file("bad", "classes: [{name: a, quantum: 0}]\n");
        let p = path.to_str().unwrap();
        let msg = err(&["--router-policy-config", p], &[]);
        assert!(msg.contains(p), "{msg}");
        assert!(msg.contains("classes[0].quantum"), "{msg}");
        std::fs::write(&path, "router: {prefill_load_scale: -2}\n").unwrap();
        let msg = err(&[], &[("DYN_ROUTER_POLICY_CONFIG", p)]);
        assert!(
            msg.contains("router: prefill_load_scale must be finite and non-negative"),
            "{msg}"
        );
        std::fs::remove_file(&path).unwrap();
        let msg = err(&["--router-policy-config", p], &[]);
        assert!(msg.contains("cannot read router policy file"), "{msg}");
    }

    #[test]
    fn help_documents_every_flag_and_variable() {
        let help = Cli::command().render_long_help().to_string();
        for flag in [
            "--host",
            "--port",
            "--threads",
            "--indexer-peers",
            "--replica-sync-port",
            "--replica-sync-peers",
            "--session-affinity-ttl-secs",
            "--selection-cache-ttl-secs",
            "--selection-cache-max-entries",
            "--selection-cache-max-bytes",
            "--router-tracking-hash",
            "--router-tracking-key-file",
            "--router-tracking-key-id",
            "--router-assume-kv-reuse",
            "--no-router-assume-kv-reuse",
            "--workers-file",
            "--auth-token-file",
            "--auth-read-only-token-file",
            "--replica-sync-key-file",
            "--max-active-reservations",
            "--router-policy-config",
            "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS",
            "DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD",
            "DYN_ROUTER_MIN_INITIAL_WORKERS",
        ] {
            assert!(help.contains(flag), "{flag} missing from --help");
        }
    }
}
