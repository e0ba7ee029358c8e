//! A small but real Hugging Face tokenizer directory for the endpoint picker's tests and
//! bench: a byte-level BPE trained here with the `tokenizers` trainer (so nothing is
//! downloaded), and a `tokenizer_config.json` with a ChatML chat template written the way
//! Hugging Face models ship theirs.
//!
//! [`chatml_text`] writes the text that template renders, by hand, so a test can compare
//! what the picker renders and tokenizes against an independent rendering.

use std::collections::HashSet;
use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

/// The template's beginning-of-text token (`bos_token`).
pub const BOS: &str = "<|endoftext|>";
/// Opens a ChatML turn.
pub const IM_START: &str = "<|im_start|>";
/// Ends a ChatML turn; also the model's `eos_token`.
pub const IM_END: &str = "<|im_end|>";
/// The system turn the template adds when a chat does not start with one.
pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

/// A ChatML template as chat models ship it in `tokenizer_config.json`: the bos token, a
/// default system turn, one `<|im_start|>role\ncontent<|im_end|>\n` per message (content
/// stripped, with Python's `str.strip`), an error for an unknown role, and the assistant
/// header when `add_generation_prompt` is set.
pub const CHATML_TEMPLATE: &str = "{{ bos_token }}\
{% for message in messages %}\
{% if loop.first and message['role'] != 'system' %}\
{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\
{% endif %}\
{% if message['role'] not in ['system', 'user', 'assistant'] %}\
{{ raise_exception('Unknown role: ' + message['role']) }}\
{% endif %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Text the BPE is trained on: enough English and chat markup for merges longer than bytes.
const CORPUS: &str = "\
You are a helpful assistant. The user asks questions and the assistant answers them.
What is the capital of France? The capital of France is Paris, a city on the Seine.
Explain how a key-value cache speeds up transformer inference for long prompts.
The cache stores the attention keys and values of every token already processed, so a
request whose prompt starts with a cached prefix only computes the new tokens.
Routing requests to the worker that already holds their prefix saves prefill time.
Write a short poem about the sea, the wind, the rain and the morning light.
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
Summarize the following document in three sentences for a busy reader.
Translate this sentence into German, French and Spanish, then explain the grammar.
system user assistant system user assistant tool function call arguments result
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42, and punctuation: ; : ! ? ( ) [ ] { }
";

/// Writes `tokenizer.json` (a byte-level BPE trained on a fixed text, with the ChatML
/// special tokens) and `tokenizer_config.json` (bos/eos tokens and [`CHATML_TEMPLATE`])
/// into `dir`, which must exist. Training is deterministic: the same ids every run.
pub fn chat_tokenizer(dir: &Path) {
    let specials: Vec<AddedToken> = [BOS, IM_START, IM_END]
        .into_iter()
        .map(|t| AddedToken::from(t, true))
        .collect();
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(800)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(alphabet)
        .build();
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
    .with_post_processor(Some(ByteLevel::default().trim_offsets(false).into()))
    .with_decoder(Some(ByteLevel::default().into()))
    .build()
    .unwrap_or_else(|e| panic!("building the BPE tokenizer: {e}"));
    let lines: Vec<String> = CORPUS
        .lines()
        .chain(CHATML_SAMPLE.lines())
        .map(str::to_owned)
        .collect();
    tokenizer
        .train(&mut trainer, lines.into_iter())
        .unwrap_or_else(|e| panic!("training the BPE tokenizer: {e}"));
    let tokenizer: Tokenizer = tokenizer.into();
    let path = dir.join("tokenizer.json");
    tokenizer
        .save(&path, false)
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));

    // As transformers writes it: AddedToken objects for some tokens, plain strings for others.
    let config = serde_json::json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS,
            "lstrip": false,
            "normalized": false,
            "rstrip": false,
            "single_word": false
        },
        "eos_token": IM_END,
        "pad_token": BOS,
        "unk_token": null,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 32768,
        "tokenizer_class": "PreTrainedTokenizerFast"
    });
    let path = dir.join("tokenizer_config.json");
    let text = serde_json::to_string_pretty(&config)
        .unwrap_or_else(|e| panic!("serializing tokenizer_config.json: {e}"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Chat markup in the corpus, so the BPE learns merges for the role headers.
const CHATML_SAMPLE: &str = "\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
";

/// The text [`CHATML_TEMPLATE`] renders for `messages` (`(role, content)` pairs), written
/// out by hand: an independent rendering to compare the picker's against.
pub fn chatml_text(messages: &[(&str, &str)], add_generation_prompt: bool) -> String {
    let mut out = String::from(BOS);
    if messages.first().is_some_and(|(role, _)| *role != "system") {
        out.push_str(&format!("{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"));
    }
    for (role, content) in messages {
        out.push_str(&format!("{IM_START}{role}\n{}{IM_END}\n", content.trim()));
    }
    if add_generation_prompt {
        out.push_str(&format!("{IM_START}assistant\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trained_tokenizer_loads_and_keeps_special_tokens_whole() {
        let dir = std::env::temp_dir().join(format!("testkit-chat-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        chat_tokenizer(&dir);
        let tok =
            Tokenizer::from_file(dir.join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}"));
        let text = chatml_text(&[("user", "What is the capital of France?")], true);
        let ids = tok
            .encode(text.as_str(), false)
            .unwrap_or_else(|e| panic!("{e}"))
            .get_ids()
            .to_vec();
        let start = tok
            .token_to_id(IM_START)
            .unwrap_or_else(|| panic!("no {IM_START}"));
        let bos = tok.token_to_id(BOS).unwrap_or_else(|| panic!("no {BOS}"));
        assert_eq!(ids.first(), Some(&bos));
        assert_eq!(ids.iter().filter(|&&i| i == start).count(), 3, "{ids:?}");
        // Merges were learnt: fewer tokens than bytes.
        assert!(
            ids.len() * 2 < text.len(),
            "{} ids for {} bytes",
            ids.len(),
            text.len()
        );
        let decoded = tok.decode(&ids, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decoded, text);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
