//! Turning an OpenAI request into the token ids the engine will see: the model's
//! `tokenizer.json` through the Hugging Face `tokenizers` crate, and for chat requests the
//! model's chat template rendered with minijinja as transformers renders it
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`, a `tojson`
//! that writes what Python's `json.dumps` writes).
//!
//! The engines (vLLM, SGLang) render a chat with `add_generation_prompt=True` and tokenize
//! the result without adding special tokens (the template writes them); a completion's
//! string prompt is tokenized with them. Doing the same here is what makes the block hashes
//! of a routed request equal those of the engine's KV events.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::ValueKind;
use minijinja::{Environment, Value};

use crate::error::TokenizerError;

/// The name the chat template is stored under in its environment.
const CHAT: &str = "chat";

/// One model's tokenizer and chat template, loaded from a local directory.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// `None` when the directory has no chat template: chat requests are then routed by
    /// load only.
    chat: Option<Environment<'static>>,
    /// `bos_token`, `eos_token`, ... of `tokenizer_config.json`, passed to the template.
    special_tokens: BTreeMap<String, String>,
    dir: PathBuf,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("chat_template", &self.chat.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a request's prompt could not be turned into token ids (it is then routed by load).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("rendering the chat template failed: {0}")]
    Template(String),
    #[error("tokenizing failed: {0}")]
    Tokenize(String),
}

impl ModelTokenizer {
    /// Loads `DIR/tokenizer.json` and, when present, the chat template: `DIR/chat_template.jinja`
    /// if that file exists, else `chat_template` of `DIR/tokenizer_config.json` (a string, or
    /// a list of named templates of which `default` is used).
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            TokenizerError::Tokenizer {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            }
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TokenizerError::Config {
                path: config_path.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => {
                return Err(TokenizerError::Config {
                    path: config_path,
                    message: e.to_string(),
                });
            }
        };
        let mut special_tokens = BTreeMap::new();
        for name in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            // A plain string, or an AddedToken object with its text in `content`.
            let text = match config.get(name) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => {
                    o.get("content").and_then(|c| c.as_str()).map(str::to_owned)
                }
                _ => None,
            };
            if let Some(text) = text {
                special_tokens.insert(name.to_owned(), text);
            }
        }
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                chat_template_of(&config, &config_path)?
            }
            Err(e) => {
                return Err(TokenizerError::Config {
                    path: jinja_path,
                    message: e.to_string(),
                });
            }
        };
        let chat = source
            .map(|src| {
                chat_environment(src).map_err(|message| TokenizerError::Template {
                    dir: dir.to_owned(),
                    message,
                })
            })
            .transpose()?;
        Ok(Self {
            tokenizer,
            chat,
            special_tokens,
            dir: dir.to_owned(),
        })
    }

    /// Whether chat requests can be tokenized.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// A completion's string prompt, with the tokenizer's special tokens (as the engines
    /// tokenize `/v1/completions`).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, EncodeError> {
        self.tokenizer
            .encode_fast(prompt, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EncodeError::Tokenize(e.to_string()))
    }

    /// The chat template's text for `messages` (a generation prompt added), with `tools`
    /// and `chat_template_kwargs` of the request in the template's context.
    pub fn render_chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Value>,
    ) -> Result<String, EncodeError> {
        let env = self.chat.as_ref().ok_or(EncodeError::NoChatTemplate)?;
        let mut ctx: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), Value::from(true));
        if let Some(tools) = tools {
            ctx.insert("tools".into(), tools.clone());
        }
        if let Some(kwargs) = kwargs
            && kwargs.kind() == ValueKind::Map
            && let Ok(keys) = kwargs.try_iter()
        {
            for key in keys {
                if let (Some(name), Ok(value)) = (key.as_str(), kwargs.get_item(&key)) {
                    ctx.insert(name.to_owned(), value);
                }
            }
        }
        env.get_template(CHAT)
            .and_then(|t| t.render(ctx))
            .map_err(|e| EncodeError::Template(error_chain(&e)))
    }

    /// A chat request's token ids: the rendered template, tokenized without adding special
    /// tokens (the template writes them).
    pub fn encode_chat(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: Option<&Value>,
    ) -> Result<Vec<u32>, EncodeError> {
        let text = self.render_chat(messages, tools, kwargs)?;
        self.tokenizer
            .encode_fast(text.as_str(), false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EncodeError::Tokenize(e.to_string()))
    }
}

fn chat_template_of(
    config: &serde_json::Value,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => {
            let default = named.iter().find_map(|t| {
                (t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .then(|| t.get("template").and_then(|s| s.as_str()))
                    .flatten()
            });
            match default {
                Some(s) => Ok(Some(s.to_owned())),
                None => Err(TokenizerError::Config {
                    path: path.to_owned(),
                    message: "chat_template is a list without a template named \"default\"".into(),
                }),
            }
        }
        Some(_) => Err(TokenizerError::Config {
            path: path.to_owned(),
            message: "chat_template is neither a string nor a list of named templates".into(),
        }),
    }
}

fn chat_environment(source: String) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    env.add_template_owned(CHAT, source)
        .map_err(|e| error_chain(&e))?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// so `", "` and `": "` between items without an indent, keys in their given order.
fn tojson(value: Value, indent: Option<usize>) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Ok(f) = f64::try_from(v.clone()) {
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            } else {
                let _ = write!(out, "{v}");
            }
        }
        ValueKind::String | ValueKind::Bytes => write_json_str(out, v.as_str().unwrap_or("")),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map | ValueKind::Plain => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(s) => write_json_str(out, s),
                    None => write_json_str(out, &key.to_string()),
                }
                out.push_str(": ");
                write_json(out, &v.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(out, &v.to_string()),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A minijinja error with its causes, on one line.
fn error_chain(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

/// The tokenizers of every model named by `--tokenizer MODEL=DIR`.
#[derive(Clone, Debug, Default)]
pub struct Tokenizers {
    by_model: BTreeMap<String, Arc<ModelTokenizer>>,
}

impl Tokenizers {
    /// Loads each `(model, dir)`; the first directory that fails stops the load.
    pub fn load<'a>(
        models: impl IntoIterator<Item = (&'a str, &'a Path)>,
    ) -> Result<Self, TokenizerError> {
        let mut by_model = BTreeMap::new();
        for (model, dir) in models {
            if by_model.contains_key(model) {
                return Err(TokenizerError::Duplicate {
                    model: model.to_owned(),
                });
            }
            by_model.insert(model.to_owned(), Arc::new(ModelTokenizer::load(dir)?));
        }
        Ok(Self { by_model })
    }

    pub fn get(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        self.by_model.get(model)
    }

    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_json(input: &str, indent: Option<usize>, expected: &str) {
        // Parsed straight into a template value, as request bodies are: key order kept.
        let v: Value = serde_json::from_str(input).unwrap_or_default();
        assert_eq!(tojson(v, indent).unwrap_or_default(), expected);
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        check_json(
            r#"{"name": "f", "n": [1, 2.5, true, null], "s": "é\"\n"}"#,
            None,
            r#"{"name": "f", "n": [1, 2.5, true, null], "s": "é\"\n"}"#,
        );
        check_json(r#"{"a": [1]}"#, Some(2), "{\n  \"a\": [\n    1\n  ]\n}");
        check_json("[]", None, "[]");
    }

    #[test]
    fn chat_template_is_read_from_a_string_or_the_default_of_a_list() {
        let p = Path::new("tokenizer_config.json");
        let one = serde_json::json!({"chat_template": "x"});
        assert_eq!(
            chat_template_of(&one, p).ok().flatten().as_deref(),
            Some("x")
        );
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]});
        assert_eq!(
            chat_template_of(&named, p).ok().flatten().as_deref(),
            Some("d")
        );
        let none = serde_json::json!({});
        assert!(matches!(chat_template_of(&none, p), Ok(None)));
        let bad = serde_json::json!({"chat_template": 3});
        assert!(chat_template_of(&bad, p).is_err());
    }

    #[test]
    fn templates_get_python_methods_and_raise_exception() {
        let env = chat_environment(
            "{% for m in messages %}{{ m.role.upper() }}:{{ m.content.strip() }}\n{% endfor %}\
             {% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
                .into(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let t = env.get_template(CHAT).unwrap_or_else(|e| panic!("{e}"));
        let msgs = Value::from_serialize(serde_json::json!([{"role": "user", "content": " hi "}]));
        let out = t
            .render(minijinja::context! { messages => msgs })
            .unwrap_or_default();
        assert_eq!(out, "USER:hi\n");
        let m = serde_json::json!({"role": "user", "content": "x"});
        let three = Value::from_serialize(serde_json::json!([m, m, m]));
        let err = t.render(minijinja::context! { messages => three });
        assert!(err.is_err_and(|e| error_chain(&e).contains("too many")));
    }
}
