//! The OpenAI-compatible request bodies the picker reads: `/v1/completions` (`prompt`, a
//! string or token ids) and `/v1/chat/completions` (`messages`). Anything else is routed by
//! load, never rejected: the gateway forwards the body unchanged either way.

use serde::Deserialize;

/// What a request body asks for, as far as routing cares.
#[derive(Debug)]
pub enum InferenceRequest {
    /// `prompt` as text, to tokenize with special tokens.
    CompletionText {
        model: Option<String>,
        prompt: String,
    },
    /// `prompt` as token ids, routed as given.
    CompletionTokens {
        model: Option<String>,
        token_ids: Vec<u32>,
    },
    /// `messages`, to render through the chat template.
    Chat {
        model: Option<String>,
        messages: minijinja::Value,
        tools: Option<minijinja::Value>,
        chat_template_kwargs: Option<minijinja::Value>,
    },
}

impl InferenceRequest {
    pub fn model(&self) -> Option<&str> {
        match self {
            Self::CompletionText { model, .. }
            | Self::CompletionTokens { model, .. }
            | Self::Chat { model, .. } => model.as_deref(),
        }
    }
}

/// Why a request is routed by load only (no cache credit). Each is a label of
/// `kv_select_ext_proc_load_only_picks_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LoadOnlyReason {
    /// The request had no body.
    NoBody,
    /// The body is not JSON (or not an object).
    NotJson,
    /// JSON, but neither a completion nor a chat request.
    UnknownShape,
    /// A completion with a list of prompts (one pick serves the whole batch).
    BatchPrompt,
    /// No `--tokenizer` for the request's model.
    NoTokenizer,
    /// A chat request for a model whose tokenizer has no chat template.
    NoChatTemplate,
    /// The chat template failed on these messages.
    TemplateError,
    /// The tokenizer failed on the text.
    TokenizeError,
    /// The service refused the prompt (over `--max-prompt-tokens`, say).
    PromptRejected,
    /// STREAMED body mode without `send_body_without_waiting_for_header_response`: the
    /// headers must be answered before the body is seen.
    StreamedBodyMode,
}

impl LoadOnlyReason {
    pub const ALL: [Self; 10] = [
        Self::NoBody,
        Self::NotJson,
        Self::UnknownShape,
        Self::BatchPrompt,
        Self::NoTokenizer,
        Self::NoChatTemplate,
        Self::TemplateError,
        Self::TokenizeError,
        Self::PromptRejected,
        Self::StreamedBodyMode,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoBody => "no_body",
            Self::NotJson => "not_json",
            Self::UnknownShape => "unknown_shape",
            Self::BatchPrompt => "batch_prompt",
            Self::NoTokenizer => "no_tokenizer",
            Self::NoChatTemplate => "no_chat_template",
            Self::TemplateError => "template_error",
            Self::TokenizeError => "tokenize_error",
            Self::PromptRejected => "prompt_rejected",
            Self::StreamedBodyMode => "streamed_body_mode",
        }
    }
}

#[derive(Deserialize)]
struct Wire {
    model: Option<String>,
    prompt: Option<PromptWire>,
    messages: Option<minijinja::Value>,
    tools: Option<minijinja::Value>,
    chat_template_kwargs: Option<minijinja::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptWire {
    Text(String),
    Tokens(Vec<u32>),
    Other(serde::de::IgnoredAny),
}

/// Reads a request body. `Err` names why it is routed by load; the model, when the body
/// names one, comes back with it (it still picks the partition).
pub fn parse(body: &[u8]) -> Result<InferenceRequest, (LoadOnlyReason, Option<String>)> {
    if body.is_empty() {
        return Err((LoadOnlyReason::NoBody, None));
    }
    let wire: Wire = serde_json::from_slice(body).map_err(|_| (LoadOnlyReason::NotJson, None))?;
    let model = wire.model;
    if let Some(messages) = wire.messages {
        if messages.kind() != minijinja::value::ValueKind::Seq {
            return Err((LoadOnlyReason::UnknownShape, model));
        }
        return Ok(InferenceRequest::Chat {
            model,
            messages,
            tools: wire.tools.filter(|t| !t.is_none()),
            chat_template_kwargs: wire.chat_template_kwargs,
        });
    }
    match wire.prompt {
        Some(PromptWire::Text(prompt)) => Ok(InferenceRequest::CompletionText { model, prompt }),
        Some(PromptWire::Tokens(token_ids)) if !token_ids.is_empty() => {
            Ok(InferenceRequest::CompletionTokens { model, token_ids })
        }
        Some(PromptWire::Other(_)) => Err((LoadOnlyReason::BatchPrompt, model)),
        _ => Err((LoadOnlyReason::UnknownShape, model)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(body: &str, expected: Result<&str, (LoadOnlyReason, Option<&str>)>) {
        let got = match parse(body.as_bytes()) {
            Ok(InferenceRequest::CompletionText { .. }) => Ok("text"),
            Ok(InferenceRequest::CompletionTokens { .. }) => Ok("tokens"),
            Ok(InferenceRequest::Chat { .. }) => Ok("chat"),
            Err((r, m)) => Err((r, m)),
        };
        let expected = expected.map_err(|(r, m)| (r, m.map(str::to_owned)));
        assert_eq!(got, expected, "{body}");
    }

    #[test]
    fn bodies_are_read_by_shape() {
        check(r#"{"model":"m","prompt":"hi"}"#, Ok("text"));
        check(r#"{"model":"m","prompt":[1,2,3]}"#, Ok("tokens"));
        check(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            Ok("chat"),
        );
        check("", Err((LoadOnlyReason::NoBody, None)));
        check("not json", Err((LoadOnlyReason::NotJson, None)));
        check("[1,2]", Err((LoadOnlyReason::NotJson, None)));
        check(
            r#"{"model":"m","prompt":["a","b"]}"#,
            Err((LoadOnlyReason::BatchPrompt, Some("m"))),
        );
        check(
            r#"{"model":"m","prompt":[]}"#,
            Err((LoadOnlyReason::UnknownShape, Some("m"))),
        );
        check(
            r#"{"model":"m","input":"x"}"#,
            Err((LoadOnlyReason::UnknownShape, Some("m"))),
        );
        check(
            r#"{"model":"m","messages":"hi"}"#,
            Err((LoadOnlyReason::UnknownShape, Some("m"))),
        );
    }
}
