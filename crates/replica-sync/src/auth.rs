//! Authenticated replica messages with a pre-shared key (sans-IO).
//!
//! Without a key the wire format is exactly the spec's two frames. With a key
//! (`--replica-sync-key-file`) every message carries a third frame, the *trailer*:
//!
//! ```text
//! offset  size  field
//!      0     8  sender id  (u64 big-endian; the publisher's RouterId)
//!      8     8  epoch      (u64 big-endian; random per publisher start)
//!     16     8  counter    (u64 big-endian; 1, 2, 3, ... per epoch)
//!     24    32  MAC        keyed BLAKE3 over
//!                          trailer[0..24] ‖ u32be(len topic) ‖ topic ‖ u64be(len payload) ‖ payload
//! ```
//!
//! The MAC key is `blake3::derive_key("kv-select replica-sync v1", key material)`, so the
//! raw material is never used directly and cannot collide with another use of the same file.
//! Lengths are in the MAC input so that no byte can move from one frame to the other.
//!
//! Replay protection: a [`MacVerifier`] remembers, per sender id, the current epoch and the
//! highest counter accepted in it, and accepts a message only with a higher counter (ZMQ
//! delivers one publisher's messages in order; gaps from high-water-mark drops are fine). A
//! different epoch means the sender restarted: it is adopted, and the epoch it replaces is
//! kept in a short list of retired epochs that are never accepted again. State lives only as
//! long as the receiver: a receiver that restarts accepts, once, a recording of a sender it
//! has not yet heard from (see docs/operations.md, threat model).
//!
//! The MAC authenticates; it does not encrypt. Anyone on the path still reads every booking.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::event::RouterId;

/// Length of the trailer frame.
pub const TRAILER_LEN: usize = 56;
/// Shortest accepted key material, in bytes (after hex decoding).
pub const MIN_KEY_LEN: usize = 32;
/// BLAKE3 key-derivation context of the MAC key.
pub const KEY_CONTEXT: &str = "kv-select replica-sync v1";

/// Senders remembered by one verifier; the least recently heard one is forgotten beyond this.
const MAX_SENDERS: usize = 1024;
/// Retired epochs remembered per sender.
const MAX_RETIRED_EPOCHS: usize = 8;
const HEADER_LEN: usize = 24;

/// The derived MAC key. `Debug` never shows it; equality is constant time.
#[derive(Clone)]
pub struct ReplicaKey {
    mac_key: [u8; 32],
}

impl fmt::Debug for ReplicaKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReplicaKey(<redacted>)")
    }
}

impl PartialEq for ReplicaKey {
    fn eq(&self, other: &Self) -> bool {
        // blake3::Hash equality is constant time.
        blake3::Hash::from(self.mac_key) == blake3::Hash::from(other.mac_key)
    }
}

impl Eq for ReplicaKey {}

/// Why key material was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    #[error("key material is {len} bytes; at least {min} are required")]
    TooShort { len: usize, min: usize },
    #[error(
        "key looks like hex but has an odd number of digits ({digits}); use 64 or more hex digits"
    )]
    OddHexLength { digits: usize },
}

impl ReplicaKey {
    /// Derives the MAC key from raw key material (at least [`MIN_KEY_LEN`] bytes).
    pub fn from_material(material: &[u8]) -> Result<Self, KeyError> {
        if material.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort {
                len: material.len(),
                min: MIN_KEY_LEN,
            });
        }
        Ok(Self {
            mac_key: blake3::derive_key(KEY_CONTEXT, material),
        })
    }

    /// Interprets the contents of a key file: if, with surrounding whitespace trimmed, it is
    /// nothing but hex digits, it is decoded as hex (e.g. `openssl rand -hex 32`); otherwise
    /// the bytes are used exactly as they are (e.g. `head -c 32 /dev/urandom`), since a binary
    /// key may legitimately end in a newline byte.
    pub fn from_file_contents(contents: &[u8]) -> Result<Self, KeyError> {
        let trimmed = contents.trim_ascii();
        if !trimmed.is_empty() && trimmed.iter().all(u8::is_ascii_hexdigit) {
            if !trimmed.len().is_multiple_of(2) {
                return Err(KeyError::OddHexLength {
                    digits: trimmed.len(),
                });
            }
            let decoded: Vec<u8> = trimmed
                .chunks_exact(2)
                .map(|pair| (hex_value(pair[0]) << 4) | hex_value(pair[1]))
                .collect();
            return Self::from_material(&decoded);
        }
        Self::from_material(contents)
    }

    fn mac(&self, header: &[u8; HEADER_LEN], topic: &[u8], payload: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        h.update(header);
        // A topic is at most 26 bytes; a frame over 4 GiB cannot reach us through ZMQ's
        // default limits, and saturating keeps the function total anyway.
        h.update(&u32::try_from(topic.len()).unwrap_or(u32::MAX).to_be_bytes());
        h.update(topic);
        h.update(&(payload.len() as u64).to_be_bytes());
        h.update(payload);
        h.finalize()
    }
}

fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        b'A'..=b'F' => digit - b'A' + 10,
        _ => 0,
    }
}

/// Why a message was not accepted as authentic. Every variant is counted as an
/// `unauthenticated` drop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    #[error("message has no authentication frame")]
    Missing,
    #[error("authentication frame is {len} bytes instead of {TRAILER_LEN}")]
    BadLength { len: usize },
    #[error("message authentication code does not match (wrong key or altered message)")]
    BadMac,
    #[error("replayed message from sender {sender}: counter {counter} <= last {last}")]
    Replay {
        sender: RouterId,
        counter: u64,
        last: u64,
    },
    #[error("message from sender {sender} uses retired epoch {epoch}")]
    RetiredEpoch { sender: RouterId, epoch: u64 },
    #[error("authenticated sender {sender} does not match the payload's origin {origin}")]
    SenderMismatch { sender: RouterId, origin: RouterId },
}

/// The header fields of an accepted trailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Authenticated {
    pub sender: RouterId,
    pub epoch: u64,
    pub counter: u64,
}

/// Produces trailers for one publisher: one epoch, a counter that only goes up.
#[derive(Debug)]
pub struct MacSigner {
    key: ReplicaKey,
    sender: RouterId,
    epoch: u64,
    counter: u64,
}

impl MacSigner {
    /// A signer with a fresh random epoch.
    pub fn new(key: ReplicaKey, sender: RouterId) -> Self {
        Self::with_epoch(key, sender, random_u64())
    }

    /// A signer with a given epoch (tests).
    pub fn with_epoch(key: ReplicaKey, sender: RouterId, epoch: u64) -> Self {
        Self {
            key,
            sender,
            epoch,
            counter: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The trailer frame of the next message.
    pub fn sign(&mut self, topic: &[u8], payload: &[u8]) -> [u8; TRAILER_LEN] {
        // 2^64 messages is out of reach; wrapping would only make later messages rejected.
        self.counter = self.counter.saturating_add(1);
        let mut out = [0u8; TRAILER_LEN];
        out[0..8].copy_from_slice(&self.sender.0.to_be_bytes());
        out[8..16].copy_from_slice(&self.epoch.to_be_bytes());
        out[16..24].copy_from_slice(&self.counter.to_be_bytes());
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&out[..HEADER_LEN]);
        out[HEADER_LEN..].copy_from_slice(self.key.mac(&header, topic, payload).as_bytes());
        out
    }
}

#[derive(Debug)]
struct SenderState {
    epoch: u64,
    last_counter: u64,
    retired: Vec<u64>,
    /// Verifier-local clock of the last acceptance (for eviction).
    last_seen: u64,
}

/// Checks trailers and remembers, per sender, what was accepted (replay protection).
/// Owned by the receiver thread; not shared.
#[derive(Debug)]
pub struct MacVerifier {
    key: ReplicaKey,
    senders: HashMap<u64, SenderState>,
    tick: u64,
}

impl MacVerifier {
    pub fn new(key: ReplicaKey) -> Self {
        Self {
            key,
            senders: HashMap::new(),
            tick: 0,
        }
    }

    /// Verifies `trailer` against `topic` and `payload` and, when it is authentic and fresh,
    /// records it. Nothing is recorded for a rejected message.
    pub fn verify(
        &mut self,
        topic: &[u8],
        payload: &[u8],
        trailer: &[u8],
    ) -> Result<Authenticated, AuthError> {
        let Ok(trailer) = <&[u8; TRAILER_LEN]>::try_from(trailer) else {
            return Err(AuthError::BadLength { len: trailer.len() });
        };
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&trailer[..HEADER_LEN]);
        let mut presented = [0u8; 32];
        presented.copy_from_slice(&trailer[HEADER_LEN..]);
        // Constant-time comparison (blake3::Hash's PartialEq).
        if self.key.mac(&header, topic, payload) != blake3::Hash::from(presented) {
            return Err(AuthError::BadMac);
        }
        let field = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&header[i * 8..i * 8 + 8]);
            u64::from_be_bytes(b)
        };
        let auth = Authenticated {
            sender: RouterId(field(0)),
            epoch: field(1),
            counter: field(2),
        };
        self.accept(auth)?;
        Ok(auth)
    }

    fn accept(&mut self, auth: Authenticated) -> Result<(), AuthError> {
        self.tick += 1;
        let tick = self.tick;
        if let Some(state) = self.senders.get_mut(&auth.sender.0) {
            if state.epoch == auth.epoch {
                if auth.counter <= state.last_counter {
                    return Err(AuthError::Replay {
                        sender: auth.sender,
                        counter: auth.counter,
                        last: state.last_counter,
                    });
                }
            } else if state.retired.contains(&auth.epoch) {
                return Err(AuthError::RetiredEpoch {
                    sender: auth.sender,
                    epoch: auth.epoch,
                });
            } else {
                // The sender restarted under the same id: adopt the new epoch.
                if state.retired.len() == MAX_RETIRED_EPOCHS {
                    state.retired.remove(0);
                }
                state.retired.push(state.epoch);
                state.epoch = auth.epoch;
            }
            state.last_counter = auth.counter;
            state.last_seen = tick;
            return Ok(());
        }
        if self.senders.len() >= MAX_SENDERS {
            // Rare (a new authenticated sender beyond 1024): a linear scan is fine.
            if let Some(oldest) = self
                .senders
                .iter()
                .min_by_key(|(_, s)| s.last_seen)
                .map(|(id, _)| *id)
            {
                self.senders.remove(&oldest);
            }
        }
        self.senders.insert(
            auth.sender.0,
            SenderState {
                epoch: auth.epoch,
                last_counter: auth.counter,
                retired: Vec::new(),
                last_seen: tick,
            },
        );
        Ok(())
    }
}

/// A random u64 from the standard library's randomly keyed SipHash (keys come from the OS),
/// as [`RouterId::random`] does; no extra dependency.
fn random_u64() -> u64 {
    let state = std::collections::hash_map::RandomState::new();
    let mut h = state.build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TOPIC: &[u8] = b"dynamo.slot-tracker.v1";

    fn key(byte: u8) -> ReplicaKey {
        ReplicaKey::from_material(&[byte; 32]).unwrap()
    }

    #[test]
    fn curve_capability_is_queryable() {
        // Recorded for docs/operations.md: the vendored libzmq (zeromq-src 0.2.6) enables
        // CURVE only when linked against libsodium; this build is not.
        let curve = zmq::has("curve");
        eprintln!("zmq::has(\"curve\") = {curve:?}");
        assert_ne!(curve, None, "libzmq answers capability queries");
    }

    #[test]
    fn key_files_accept_hex_or_raw_bytes() {
        let hex = "00".repeat(32);
        let from_hex = ReplicaKey::from_file_contents(format!("  {hex}\n").as_bytes()).unwrap();
        assert_eq!(from_hex, ReplicaKey::from_material(&[0; 32]).unwrap());
        let upper = ReplicaKey::from_file_contents("AB".repeat(32).as_bytes()).unwrap();
        assert_eq!(upper, ReplicaKey::from_material(&[0xab; 32]).unwrap());
        // Raw material is used as is, trailing newline included.
        let raw = b"correct horse battery staple, 32+\n";
        assert_eq!(
            ReplicaKey::from_file_contents(raw).unwrap(),
            ReplicaKey::from_material(raw).unwrap()
        );
        assert_ne!(
            ReplicaKey::from_file_contents(raw).unwrap(),
            ReplicaKey::from_material(&raw[..raw.len() - 1]).unwrap()
        );
        assert_eq!(
            ReplicaKey::from_file_contents("ab".repeat(31).as_bytes()).unwrap_err(),
            KeyError::TooShort { len: 31, min: 32 }
        );
        assert_eq!(
            ReplicaKey::from_file_contents("abc".as_bytes()).unwrap_err(),
            KeyError::OddHexLength { digits: 3 }
        );
        assert_eq!(
            ReplicaKey::from_file_contents(b"short key\n").unwrap_err(),
            KeyError::TooShort { len: 10, min: 32 }
        );
        assert!(ReplicaKey::from_file_contents(b"").is_err());
    }

    #[test]
    fn debug_never_shows_the_key() {
        let k = ReplicaKey::from_material(b"0123456789abcdef0123456789abcdef").unwrap();
        let text = format!("{k:?} {:?}", MacSigner::new(k.clone(), RouterId(1)));
        // Neither as text nor as bytes. (Not a short substring such as "0123": the random
        // epoch printed beside it contains one now and then, which failed a CI run.)
        assert!(!text.contains("0123456789abcdef"), "{text}");
        assert!(!text.contains("48, 49, 50, 51"), "{text}");
        assert!(text.contains("<redacted>"), "{text}");
    }

    #[test]
    fn a_signed_message_verifies_once() {
        let mut signer = MacSigner::with_epoch(key(1), RouterId(7), 99);
        let mut verifier = MacVerifier::new(key(1));
        let t1 = signer.sign(TOPIC, b"one");
        let t2 = signer.sign(TOPIC, b"two");
        assert_eq!(
            verifier.verify(TOPIC, b"one", &t1),
            Ok(Authenticated {
                sender: RouterId(7),
                epoch: 99,
                counter: 1
            })
        );
        assert_eq!(
            verifier.verify(TOPIC, b"one", &t1),
            Err(AuthError::Replay {
                sender: RouterId(7),
                counter: 1,
                last: 1
            })
        );
        assert_eq!(
            verifier.verify(TOPIC, b"two", &t2).map(|a| a.counter),
            Ok(2)
        );
        // An older message after a newer one is a replay too.
        assert!(matches!(
            verifier.verify(TOPIC, b"one", &t1),
            Err(AuthError::Replay { .. })
        ));
    }

    #[test]
    fn gaps_are_fine_and_restarts_start_a_new_epoch() {
        let mut first = MacSigner::with_epoch(key(1), RouterId(7), 1);
        let mut verifier = MacVerifier::new(key(1));
        let old = first.sign(TOPIC, b"a");
        let _lost = first.sign(TOPIC, b"b");
        let t3 = first.sign(TOPIC, b"c");
        assert!(verifier.verify(TOPIC, b"c", &t3).is_ok());
        // Restart: same sender id, new epoch, counter from 1 again.
        let mut second = MacSigner::with_epoch(key(1), RouterId(7), 2);
        let n1 = second.sign(TOPIC, b"x");
        assert!(verifier.verify(TOPIC, b"x", &n1).is_ok());
        // The old epoch is retired: even a message never seen before is refused.
        assert_eq!(
            verifier.verify(TOPIC, b"a", &old),
            Err(AuthError::RetiredEpoch {
                sender: RouterId(7),
                epoch: 1
            })
        );
        // Senders are independent.
        let mut other = MacSigner::with_epoch(key(1), RouterId(8), 1);
        let o1 = other.sign(TOPIC, b"a");
        assert!(verifier.verify(TOPIC, b"a", &o1).is_ok());
    }

    #[test]
    fn wrong_key_short_trailer_and_moved_bytes_are_rejected() {
        let mut signer = MacSigner::with_epoch(key(1), RouterId(7), 1);
        let t = signer.sign(TOPIC, b"payload");
        assert_eq!(
            MacVerifier::new(key(2)).verify(TOPIC, b"payload", &t),
            Err(AuthError::BadMac)
        );
        let mut v = MacVerifier::new(key(1));
        assert_eq!(
            v.verify(TOPIC, b"payload", &t[..55]),
            Err(AuthError::BadLength { len: 55 })
        );
        // The same bytes split differently between the frames do not verify.
        assert_eq!(
            v.verify(b"dynamo.slot-tracker.v1p", b"ayload", &t),
            Err(AuthError::BadMac)
        );
        // A rejected message records nothing: the genuine one still verifies.
        assert!(v.verify(TOPIC, b"payload", &t).is_ok());
    }

    #[test]
    fn forgotten_senders_are_bounded() {
        let mut v = MacVerifier::new(key(1));
        for id in 0..(MAX_SENDERS as u64 + 10) {
            let mut s = MacSigner::with_epoch(key(1), RouterId(id), 1);
            let t = s.sign(TOPIC, b"x");
            assert!(v.verify(TOPIC, b"x", &t).is_ok());
        }
        assert_eq!(v.senders.len(), MAX_SENDERS);
    }

    proptest! {
        #[test]
        fn any_flipped_bit_is_rejected(
            payload in proptest::collection::vec(any::<u8>(), 0..300),
            frame in 0usize..3,
            bit in any::<usize>(),
        ) {
            let mut signer = MacSigner::with_epoch(key(3), RouterId(5), 11);
            let trailer = signer.sign(TOPIC, &payload);
            let mut frames = [TOPIC.to_vec(), payload.clone(), trailer.to_vec()];
            prop_assume!(!frames[frame].is_empty());
            let len = frames[frame].len();
            let bit = bit % (len * 8);
            frames[frame][bit / 8] ^= 1 << (bit % 8);
            let mut verifier = MacVerifier::new(key(3));
            prop_assert!(verifier.verify(&frames[0], &frames[1], &frames[2]).is_err());
            // Unaltered, it verifies (and the rejection recorded nothing).
            prop_assert!(verifier.verify(TOPIC, &payload, &trailer).is_ok());
        }

        #[test]
        fn arbitrary_trailers_never_verify_or_panic(
            topic in proptest::collection::vec(any::<u8>(), 0..40),
            payload in proptest::collection::vec(any::<u8>(), 0..100),
            trailer in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let mut verifier = MacVerifier::new(key(3));
            prop_assert!(verifier.verify(&topic, &payload, &trailer).is_err());
        }
    }
}
