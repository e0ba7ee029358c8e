//! One pick: read the body, tokenize it as the engine will, select and book a worker,
//! and hold the booking until the response is done. No gRPC here: `stream.rs` drives it.

use std::sync::Arc;
use std::time::Instant;

use service_builder::{
    PartitionKey, PromptInput, ReservationRequest, SelectRequest, SelectionCore, SelectionService,
};

use crate::endpoint::endpoint_address;
use crate::metrics::{ExtProcMetrics, PickOutcome, StreamEvent};
use crate::request::{self, InferenceRequest, LoadOnlyReason};
use crate::tokenize::{EncodeError, Tokenizers};

/// Where a request's partition comes from.
#[derive(Clone, Debug)]
pub struct PickerConfig {
    /// Request header naming the routing group (absent: `default`).
    pub routing_group_header: String,
    /// Request header naming the model when the body does not (absent too: `default`).
    pub model_header: String,
    /// Endpoints sent after the pick as an ordered fallback list: the next-best eligible
    /// workers (within the subset hint), chosen by advisory selections and not booked.
    pub fallbacks: usize,
}

impl Default for PickerConfig {
    fn default() -> Self {
        Self {
            routing_group_header: "x-kv-select-routing-group".into(),
            model_header: "x-gateway-model-name".into(),
            fallbacks: 0,
        }
    }
}

/// The endpoint picker over a running [`SelectionService`]: the same catalog, ledger and
/// index the HTTP API uses.
#[derive(Debug)]
pub struct Picker {
    service: Arc<SelectionService>,
    tokenizers: Tokenizers,
    metrics: ExtProcMetrics,
    config: PickerConfig,
}

/// What the picker sees of one request.
#[derive(Debug, Default)]
pub struct PickInput<'a> {
    /// Request headers, names in lower case (HTTP/2 and Envoy send them so).
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
    /// The gateway's subset hint (`ip:port` each); `None` when it sent none.
    pub subset: Option<Vec<String>>,
    /// Route by load whatever the body holds (the body was not seen).
    pub load_only: Option<LoadOnlyReason>,
}

/// Why no endpoint was picked; the gateway answers the client with its status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickError {
    /// 503: no ready endpoint.
    #[error("{0}")]
    Unavailable(String),
    /// 429: shed by the admission queue.
    #[error("{0}")]
    Shed(String),
}

impl PickError {
    pub fn http_status(&self) -> u16 {
        match self {
            Self::Unavailable(_) => 503,
            Self::Shed(_) => 429,
        }
    }
}

impl Picker {
    pub fn new(
        service: Arc<SelectionService>,
        tokenizers: Tokenizers,
        metrics: ExtProcMetrics,
        config: PickerConfig,
    ) -> Self {
        Self {
            service,
            tokenizers,
            metrics,
            config,
        }
    }

    pub fn metrics(&self) -> &ExtProcMetrics {
        &self.metrics
    }

    pub fn service(&self) -> &Arc<SelectionService> {
        &self.service
    }

    /// The models of the catalog's workers that have no tokenizer, sorted, each once: their
    /// text and chat prompts are routed by load only (the host names them at startup).
    pub fn models_without_tokenizer(&self) -> Vec<String> {
        let mut models: Vec<String> = self
            .service
            .core()
            .list_workers(None, None)
            .into_iter()
            .map(|r| r.worker.model_name)
            .filter(|m| self.tokenizers.get(m).is_none())
            .collect();
        models.sort_unstable();
        models.dedup();
        models
    }

    fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }

    /// Tokenizes, selects and books. The booking is freed when the returned guard drops.
    pub async fn pick(&self, input: PickInput<'_>) -> Result<Booking, PickError> {
        let parsed = match input.load_only {
            Some(reason) => Err((reason, None)),
            None => request::parse(input.body),
        };
        let body_model = match &parsed {
            Ok(r) => r.model().map(str::to_owned),
            Err((_, m)) => m.clone(),
        };
        let model = body_model
            .or_else(|| Self::header(input.headers, &self.config.model_header).map(str::to_owned))
            .unwrap_or_else(|| "default".to_owned());
        let group = Self::header(input.headers, &self.config.routing_group_header)
            .unwrap_or("default")
            .to_owned();
        let tokens = match parsed {
            Ok(req) => self.tokens(&model, req).await,
            Err((reason, _)) => Err(reason),
        };
        let partition = PartitionKey::new(model, group);
        let allowed = match &input.subset {
            Some(subset) => match self.workers_in_subset(&partition, subset) {
                Ok(ids) => Some(ids),
                Err(e) => {
                    self.metrics.pick(PickOutcome::Unavailable);
                    return Err(e);
                }
            },
            None => None,
        };
        let isl_estimate = (input.body.len() as u64 / 4).max(1);
        // Why the pick goes by load alone, counted only once it is a pick: a 503 or 429 is
        // counted by its outcome, not as a load-only pick.
        let (result, load_only) = match tokens {
            Ok(token_ids) => {
                let prompt = PromptInput {
                    token_ids: Some(token_ids),
                    ..PromptInput::default()
                };
                match self.book(&partition, prompt, allowed.clone()).await {
                    Err(BookError::PromptRejected) => (
                        self.book(&partition, load_only_prompt(isl_estimate), allowed)
                            .await,
                        Some(LoadOnlyReason::PromptRejected),
                    ),
                    other => (other, None),
                }
            }
            Err(reason) => {
                tracing::debug!(reason = reason.as_str(), "routing by load only");
                (
                    self.book(&partition, load_only_prompt(isl_estimate), allowed)
                        .await,
                    Some(reason),
                )
            }
        };
        if let (Ok(_), Some(reason)) = (&result, load_only) {
            self.metrics.load_only(reason);
        }
        let mut result = result.map_err(|e| match e {
            BookError::Pick(p) => p,
            BookError::PromptRejected => {
                PickError::Unavailable("the service refused a load-only prompt".into())
            }
        });
        if let Ok(booking) = &mut result
            && self.config.fallbacks > 0
        {
            booking.fallbacks = self.fallbacks(booking, input.subset.is_some()).await;
        }
        self.metrics.pick(match &result {
            Ok(_) => PickOutcome::Picked,
            Err(PickError::Unavailable(_)) => PickOutcome::Unavailable,
            Err(PickError::Shed(_)) => PickOutcome::Shed,
        });
        result
    }

    /// The request's token ids, or why it is routed by load.
    async fn tokens(&self, model: &str, req: InferenceRequest) -> Result<Vec<u32>, LoadOnlyReason> {
        if let InferenceRequest::CompletionTokens { token_ids, .. } = req {
            return Ok(token_ids);
        }
        let tokenizer = Arc::clone(
            self.tokenizers
                .get(model)
                .ok_or(LoadOnlyReason::NoTokenizer)?,
        );
        let started = Instant::now();
        // Milliseconds of CPU for a long prompt: off the async workers.
        let encoded = tokio::task::spawn_blocking(move || match req {
            InferenceRequest::CompletionText { prompt, .. } => tokenizer.encode_prompt(&prompt),
            InferenceRequest::Chat {
                messages,
                tools,
                chat_template_kwargs,
                ..
            } => tokenizer.encode_chat(&messages, tools.as_ref(), chat_template_kwargs.as_ref()),
            InferenceRequest::CompletionTokens { token_ids, .. } => Ok(token_ids),
        })
        .await;
        self.metrics.tokenize_time(started.elapsed());
        match encoded {
            Ok(Ok(ids)) => Ok(ids),
            Ok(Err(EncodeError::NoChatTemplate)) => Err(LoadOnlyReason::NoChatTemplate),
            Ok(Err(EncodeError::Template(e))) => {
                tracing::debug!(error = %e, "chat template failed");
                Err(LoadOnlyReason::TemplateError)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "tokenizing failed");
                Err(LoadOnlyReason::TokenizeError)
            }
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer task failed");
                Err(LoadOnlyReason::TokenizeError)
            }
        }
    }

    /// Up to `fallbacks` endpoints after the booked one, best first: each an advisory
    /// selection (no booking, no admission queue) over the eligible workers not yet listed,
    /// with the booked prompt. Eligible: schedulable, in the subset hint when there is one.
    async fn fallbacks(&self, booking: &Booking, subset: bool) -> Vec<String> {
        let mut remaining: Vec<u64> = self
            .service
            .core()
            .list_workers(
                Some(&booking.partition.model_name),
                Some(&booking.partition.routing_group),
            )
            .iter()
            .filter(|r| r.is_schedulable() && r.worker.worker_id != booking.worker_id)
            .filter(|r| !subset || booking.allowed.contains(&r.worker.worker_id))
            .map(|r| r.worker.worker_id)
            .collect();
        let mut out: Vec<String> = Vec::new();
        while out.len() < self.config.fallbacks && !remaining.is_empty() {
            let req = SelectRequest {
                partition: booking.partition.clone(),
                prompt: booking.prompt.clone(),
                allowed_worker_ids: Some(remaining.clone()),
                advisory: true,
                ..SelectRequest::default()
            };
            let Ok(r) = self.service.select(req).await else {
                break;
            };
            remaining.retain(|&id| id != r.worker_id);
            let address = endpoint_address(&r.endpoint);
            // DP ranks and workers can share an address: each address once.
            if address != booking.endpoint && !out.iter().any(|e| e == address) {
                out.push(address.to_owned());
            }
        }
        out
    }

    /// Worker ids of the partition whose endpoint is in the subset hint.
    fn workers_in_subset(
        &self,
        partition: &PartitionKey,
        subset: &[String],
    ) -> Result<Vec<u64>, PickError> {
        let records = self
            .service
            .core()
            .list_workers(Some(&partition.model_name), Some(&partition.routing_group));
        let ids: Vec<u64> = records
            .iter()
            .filter(|r| {
                r.worker.endpoint.as_deref().is_some_and(|e| {
                    let addr = endpoint_address(e);
                    subset.iter().any(|s| s.trim() == addr)
                })
            })
            .map(|r| r.worker.worker_id)
            .collect();
        if ids.is_empty() {
            return Err(PickError::Unavailable(if subset.is_empty() {
                "the gateway's endpoint subset is empty".into()
            } else {
                "no worker of the partition is in the gateway's endpoint subset".into()
            }));
        }
        Ok(ids)
    }

    async fn book(
        &self,
        partition: &PartitionKey,
        prompt: PromptInput,
        allowed: Option<Vec<u64>>,
    ) -> Result<Booking, BookError> {
        let has_tokens = prompt.token_ids.is_some();
        let kept = prompt.clone();
        let allowed_ids = allowed.clone().unwrap_or_default();
        let req = SelectRequest {
            partition: partition.clone(),
            prompt,
            allowed_worker_ids: allowed,
            ..SelectRequest::default()
        };
        match self.service.select_and_reserve(req).await {
            Ok(r) => {
                let Some(selection_id) = r.selection_id else {
                    return Err(BookError::Pick(PickError::Unavailable(
                        "the service booked without a selection id".into(),
                    )));
                };
                Ok(Booking {
                    allowed: allowed_ids,
                    fallbacks: Vec::new(),
                    core: Arc::clone(self.service.core()),
                    service: Arc::clone(&self.service),
                    metrics: self.metrics.clone(),
                    partition: partition.clone(),
                    prompt: kept,
                    selection_id,
                    endpoint: endpoint_address(&r.endpoint).to_owned(),
                    worker_id: r.worker_id,
                    dp_rank: r.dp_rank,
                    prefill_done: false,
                    live: true,
                    moves: 0,
                })
            }
            Err(e) => match e.status_code() {
                429 => Err(BookError::Pick(PickError::Shed(e.message().to_owned()))),
                400 | 413 | 422 if has_tokens => Err(BookError::PromptRejected),
                _ => Err(BookError::Pick(PickError::Unavailable(
                    e.message().to_owned(),
                ))),
            },
        }
    }
}

enum BookError {
    Pick(PickError),
    PromptRejected,
}

fn load_only_prompt(isl: u64) -> PromptInput {
    PromptInput {
        block_hashes: Some(Vec::new()),
        sequence_hashes: Some(Vec::new()),
        isl_tokens: Some(isl),
        ..PromptInput::default()
    }
}

/// A live booking of one request. Dropping it before [`Booking::finish`] (the stream
/// broke, was cancelled, or ended early) frees it, so no load leaks.
#[derive(Debug)]
pub struct Booking {
    core: Arc<SelectionCore>,
    service: Arc<SelectionService>,
    metrics: ExtProcMetrics,
    partition: PartitionKey,
    /// Kept to book the served worker if the gateway sends the request elsewhere.
    prompt: PromptInput,
    selection_id: String,
    endpoint: String,
    worker_id: u64,
    dp_rank: u32,
    prefill_done: bool,
    live: bool,
    moves: u32,
    /// The subset hint's workers (empty without a hint).
    allowed: Vec<u64>,
    /// Unbooked endpoints sent after this one, best first.
    fallbacks: Vec<String>,
}

impl Booking {
    /// The booked worker's `ip:port`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn worker_id(&self) -> u64 {
        self.worker_id
    }

    /// The fallback endpoints sent after the booked one (`PickerConfig::fallbacks`).
    pub fn fallbacks(&self) -> &[String] {
        &self.fallbacks
    }

    /// The decision as sent to the gateway: the booked `ip:port`, then the fallbacks, comma
    /// separated.
    pub fn destination(&self) -> String {
        let mut out = self.endpoint.clone();
        for f in &self.fallbacks {
            out.push(',');
            out.push_str(f);
        }
        out
    }

    pub fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    pub fn selection_id(&self) -> &str {
        &self.selection_id
    }

    /// The first response byte: the engine has run the prefill.
    pub fn prefill_complete(&mut self) {
        if self.prefill_done || !self.live {
            return;
        }
        self.prefill_done = true;
        match self.core.prefill_complete(&self.selection_id) {
            Ok(()) => self.metrics.stream(StreamEvent::PrefillComplete),
            Err(e) => tracing::debug!(id = %self.selection_id, error = %e, "prefill_complete"),
        }
    }

    /// The response is done: frees the booking.
    pub fn finish(&mut self) {
        if !self.live {
            return;
        }
        self.live = false;
        match self.core.free_reservation(&self.selection_id) {
            Ok(()) => self.metrics.stream(StreamEvent::Completed),
            Err(e) => tracing::debug!(id = %self.selection_id, error = %e, "free on completion"),
        }
    }

    /// The gateway served the request from `served` (`ip:port`): when that is not the
    /// booked worker, the load moves to the worker registered there. There is no move
    /// operation in the service, so this frees the booking and books the served worker
    /// explicitly (its first rank) with the same prompt. An address that names no worker
    /// of the partition leaves the booking where it is.
    pub async fn move_to(&mut self, served: &str) {
        let served = endpoint_address(served);
        if !self.live || served.is_empty() || served == self.endpoint {
            return;
        }
        let target = self
            .core
            .list_workers(
                Some(&self.partition.model_name),
                Some(&self.partition.routing_group),
            )
            .into_iter()
            .find(|r| {
                r.is_schedulable()
                    && r.worker.endpoint.as_deref().map(endpoint_address) == Some(served)
            });
        let Some(target) = target else {
            self.metrics.stream(StreamEvent::MoveUnknownEndpoint);
            tracing::debug!(%served, booked = %self.endpoint, "served endpoint names no worker");
            return;
        };
        if let Err(e) = self.core.free_reservation(&self.selection_id) {
            tracing::debug!(id = %self.selection_id, error = %e, "free before move");
        }
        self.live = false;
        self.moves += 1;
        let id = format!("{}.served{}", self.selection_id, self.moves);
        let rank = target.worker.data_parallel_start_rank.unwrap_or(0);
        let req = ReservationRequest {
            partition: self.partition.clone(),
            selection_id: id,
            worker_id: Some(target.worker.worker_id),
            dp_rank: Some(rank),
            prompt: self.prompt.clone(),
            ..ReservationRequest::default()
        };
        match self.service.create_reservation(req).await {
            Ok(r) => {
                self.selection_id = r.selection_id;
                self.endpoint = served.to_owned();
                self.worker_id = r.worker_id;
                self.dp_rank = r.dp_rank;
                self.live = true;
                self.metrics.stream(StreamEvent::Moved);
                if self.prefill_done {
                    self.prefill_done = false;
                    self.prefill_complete();
                }
            }
            Err(e) => {
                tracing::warn!(%served, error = %e, "booking the served worker failed");
            }
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        self.live = false;
        self.metrics.stream(StreamEvent::Cancelled);
        if let Err(e) = self.core.free_reservation(&self.selection_id) {
            tracing::debug!(id = %self.selection_id, error = %e, "free on a broken stream");
        }
    }
}
