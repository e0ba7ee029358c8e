//! The token ids the picker computes for a chat are those the same `tokenizer.json` gives
//! through the `tokenizers` library for the chat's rendering, written out by hand here
//! (`testkit::chatml_text`) rather than rendered by the template under test.

#![expect(
    clippy::unwrap_used,
    reason = "test fixtures fail loudly on a broken setup"
)]

use std::path::PathBuf;

use ext_proc::{EncodeError, ModelTokenizer};
use serde_json::json;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("ext-proc-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        testkit::chat_tokenizer(&dir);
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn messages(turns: &[(&str, &str)]) -> minijinja::Value {
    let list: Vec<_> = turns
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    minijinja::Value::from_serialize(&list)
}

#[test]
fn chat_token_ids_equal_the_tokenizers_library_on_the_hand_written_rendering() {
    let dir = Dir::new("chat-ids");
    let picker_side = ModelTokenizer::load(&dir.0).unwrap();
    assert!(picker_side.has_chat_template());
    let library = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();

    let chats: [&[(&str, &str)]; 4] = [
        &[("user", "What is the capital of France?")],
        &[
            ("system", "You answer in one sentence."),
            ("user", "  Explain the key-value cache.  "),
        ],
        &[
            ("user", "Write a short poem about the sea."),
            ("assistant", "The sea, the wind, the morning light."),
            (
                "user",
                "Now translate it into German, bitte: Grüße aus Köln 🌊",
            ),
        ],
        &[("user", "")],
    ];
    for turns in chats {
        let expected_text = testkit::chatml_text(turns, true);
        let rendered = picker_side
            .render_chat(&messages(turns), None, None)
            .unwrap();
        assert_eq!(rendered, expected_text, "{turns:?}");
        let ids = picker_side
            .encode_chat(&messages(turns), None, None)
            .unwrap();
        let expected = library.encode(expected_text.as_str(), false).unwrap();
        assert_eq!(ids, expected.get_ids(), "{turns:?}");
        // The template's special tokens are single ids, not spelled out in bytes.
        let start = library.token_to_id(testkit::IM_START).unwrap();
        let turns_rendered = turns.len() + usize::from(turns[0].0 != "system") + 1;
        assert_eq!(
            ids.iter().filter(|&&i| i == start).count(),
            turns_rendered,
            "{turns:?}"
        );
        assert_eq!(ids[0], library.token_to_id(testkit::BOS).unwrap());
    }
}

#[test]
fn a_completion_prompt_is_tokenized_with_special_tokens_as_the_library_does() {
    let dir = Dir::new("prompt-ids");
    let picker_side = ModelTokenizer::load(&dir.0).unwrap();
    let library = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();
    let prompt = "<|im_start|>user\nThe quick brown fox<|im_end|>\n";
    assert_eq!(
        picker_side.encode_prompt(prompt).unwrap(),
        library.encode(prompt, true).unwrap().get_ids()
    );
}

#[test]
fn an_unknown_role_fails_in_the_template() {
    let dir = Dir::new("bad-role");
    let picker_side = ModelTokenizer::load(&dir.0).unwrap();
    let err = picker_side
        .encode_chat(&messages(&[("wizard", "hello")]), None, None)
        .unwrap_err();
    assert!(
        matches!(&err, EncodeError::Template(m) if m.contains("Unknown role: wizard")),
        "{err}"
    );
}
