//! Arbitrary bytes as a `POST /select` body through the `token_ids` fast path. Must never
//! panic; whenever it accepts a body whose rest serde accepts (what the route requires), serde
//! must agree on the whole body: the same ids and the same other members.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Some((tokens, rest)) = select_server::split_token_ids(data) else {
        return;
    };
    let Ok(Value::Object(rest)) = serde_json::from_slice::<Value>(&rest) else {
        return;
    };
    let Ok(Value::Object(mut whole)) = serde_json::from_slice::<Value>(data) else {
        panic!("fast path accepted a body serde rejects");
    };
    let ids: Vec<u32> = serde_json::from_value(whole.remove("token_ids").unwrap_or_default())
        .expect("serde reads the same ids");
    assert_eq!(ids, tokens);
    assert_eq!(whole, rest);
});
