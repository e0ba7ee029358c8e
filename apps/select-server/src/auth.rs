//! Bearer-token access control: token files, constant-time lookup, and which routes a
//! read-only token may use.
//!
//! Only BLAKE3 digests of the configured tokens are kept. A presented token is hashed once
//! and compared with *every* configured digest (`blake3::Hash` equality is constant time, and
//! the loop has no early exit), so neither the position of a match nor the number of matching
//! leading bytes shows in the response time. The token itself never reaches a log line or a
//! `Debug` rendering.

use std::fmt;
use std::path::{Path, PathBuf};

/// Shortest accepted token, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// What a presented token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Every route (`--auth-token-file`).
    Full,
    /// Read-only routes only (`--auth-read-only-token-file`); see `routes::is_read_only`.
    ReadOnly,
}

/// The configured tokens, as digests. The default (no full tokens) disables authentication.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AccessTokens {
    full: Vec<blake3::Hash>,
    read_only: Vec<blake3::Hash>,
}

impl fmt::Debug for AccessTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessTokens")
            .field("full", &self.full.len())
            .field("read_only", &self.read_only.len())
            .finish()
    }
}

/// Why a token file was rejected. Messages name the flag, the file and the line, never a
/// token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenFileError {
    #[error("{flag} {}: cannot read the file: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {}: no tokens (only blank lines and # comments)", path.display())]
    Empty { flag: &'static str, path: PathBuf },
    #[error(
        "{flag} {}: line {line}: token is {len} bytes; at least {MIN_TOKEN_LEN} are required",
        path.display()
    )]
    TooShort {
        flag: &'static str,
        path: PathBuf,
        line: usize,
        len: usize,
    },
    #[error(
        "{flag} {}: line {line}: token contains a byte that cannot appear in a bearer header \
         (only visible ASCII without spaces is allowed)",
        path.display()
    )]
    InvalidByte {
        flag: &'static str,
        path: PathBuf,
        line: usize,
    },
    #[error(
        "{flag} {}: line {line}: this token is also in --auth-token-file; \
         a token is either full or read-only",
        path.display()
    )]
    AlsoFull {
        flag: &'static str,
        path: PathBuf,
        line: usize,
    },
}

impl AccessTokens {
    /// Builds the token sets from raw tokens (tests and embedding). Tokens are not
    /// validated here; [`Self::load`] validates file contents.
    pub fn from_tokens<'a>(
        full: impl IntoIterator<Item = &'a str>,
        read_only: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let digests = |tokens: &mut dyn Iterator<Item = &'a str>| {
            tokens
                .map(|t| blake3::hash(t.as_bytes()))
                .collect::<Vec<_>>()
        };
        Self {
            full: digests(&mut full.into_iter()),
            read_only: digests(&mut read_only.into_iter()),
        }
    }

    /// Reads `--auth-token-file` and, optionally, `--auth-read-only-token-file`.
    pub fn load(full: &Path, read_only: Option<&Path>) -> Result<Self, TokenFileError> {
        let read = |flag: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TokenFileError::Read {
                flag,
                path: path.to_owned(),
                source,
            })
        };
        let full_digests = parse_token_file(FULL_FLAG, full, &read(FULL_FLAG, full)?)?;
        let mut read_only_digests = Vec::new();
        if let Some(path) = read_only {
            let lines = parse_lines(READ_ONLY_FLAG, path, &read(READ_ONLY_FLAG, path)?)?;
            for (line, digest) in lines {
                if full_digests.contains(&digest) {
                    return Err(TokenFileError::AlsoFull {
                        flag: READ_ONLY_FLAG,
                        path: path.to_owned(),
                        line,
                    });
                }
                if !read_only_digests.contains(&digest) {
                    read_only_digests.push(digest);
                }
            }
        }
        Ok(Self {
            full: full_digests,
            read_only: read_only_digests,
        })
    }

    /// Whether requests must present a token.
    pub fn enabled(&self) -> bool {
        !self.full.is_empty() || !self.read_only.is_empty()
    }

    /// Number of (full, read-only) tokens, for the startup log.
    pub fn counts(&self) -> (usize, usize) {
        (self.full.len(), self.read_only.len())
    }

    /// What `presented` may do; `None` when it matches no configured token.
    pub fn check(&self, presented: &[u8]) -> Option<Access> {
        let digest = blake3::hash(presented);
        // No early exit: every digest is compared whatever matched before.
        let mut full = false;
        for d in &self.full {
            full |= *d == digest;
        }
        let mut read_only = false;
        for d in &self.read_only {
            read_only |= *d == digest;
        }
        if full {
            Some(Access::Full)
        } else if read_only {
            Some(Access::ReadOnly)
        } else {
            None
        }
    }
}

/// The bearer token this server presents to `--indexer-peers` when it fetches their `/dump`
/// (`--indexer-peers-token-file`: the first token of a file in the format above). Peers that
/// require tokens answer 401 without it. `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerToken(String);

impl PeerToken {
    /// Reads and validates the file.
    pub fn load(path: &Path) -> Result<Self, TokenFileError> {
        let contents = std::fs::read(path).map_err(|source| TokenFileError::Read {
            flag: PEER_FLAG,
            path: path.to_owned(),
            source,
        })?;
        let lines = token_lines(PEER_FLAG, path, &contents)?;
        // Validated as visible ASCII, so this is UTF-8; the first token is the one used.
        let token = lines
            .first()
            .map(|(_, t)| String::from_utf8_lossy(t).into_owned())
            .unwrap_or_default();
        Ok(Self(token))
    }

    /// The `Authorization` header value.
    pub fn header_value(&self) -> String {
        format!("Bearer {}", self.0)
    }
}

impl fmt::Debug for PeerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerToken(<redacted>)")
    }
}

const PEER_FLAG: &str = "--indexer-peers-token-file";
const FULL_FLAG: &str = "--auth-token-file";
const READ_ONLY_FLAG: &str = "--auth-read-only-token-file";

fn parse_token_file(
    flag: &'static str,
    path: &Path,
    contents: &[u8],
) -> Result<Vec<blake3::Hash>, TokenFileError> {
    let mut out: Vec<blake3::Hash> = Vec::new();
    for (_, digest) in parse_lines(flag, path, contents)? {
        if !out.contains(&digest) {
            out.push(digest);
        }
    }
    Ok(out)
}

/// One token per line: surrounding whitespace trimmed, blank lines and lines starting with
/// `#` skipped. Returns (1-based line, digest) pairs; an empty result is an error.
fn parse_lines(
    flag: &'static str,
    path: &Path,
    contents: &[u8],
) -> Result<Vec<(usize, blake3::Hash)>, TokenFileError> {
    Ok(token_lines(flag, path, contents)?
        .into_iter()
        .map(|(line, token)| (line, blake3::hash(token)))
        .collect())
}

/// The validated tokens of a token file with their 1-based lines; none is an error.
fn token_lines<'a>(
    flag: &'static str,
    path: &Path,
    contents: &'a [u8],
) -> Result<Vec<(usize, &'a [u8])>, TokenFileError> {
    let mut out = Vec::new();
    for (index, raw) in contents.split(|&b| b == b'\n').enumerate() {
        let line = index + 1;
        let token = raw.trim_ascii();
        if token.is_empty() || token.starts_with(b"#") {
            continue;
        }
        if !token.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(TokenFileError::InvalidByte {
                flag,
                path: path.to_owned(),
                line,
            });
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(TokenFileError::TooShort {
                flag,
                path: path.to_owned(),
                line,
                len: token.len(),
            });
        }
        out.push((line, token));
    }
    if out.is_empty() {
        return Err(TokenFileError::Empty {
            flag,
            path: path.to_owned(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "token-a-0123456789";
    const B: &str = "token-b-0123456789";
    const R: &str = "read-only-0123456789";

    fn parse(text: &str) -> Result<Vec<blake3::Hash>, TokenFileError> {
        parse_token_file(FULL_FLAG, Path::new("tokens.txt"), text.as_bytes())
    }

    #[test]
    fn token_files_skip_blanks_and_comments_and_trim() {
        let digests = parse(&format!("# ops tokens\n\n  {A}  \r\n\t{B}\n#{A}x\n{A}\n")).unwrap();
        assert_eq!(
            digests,
            [blake3::hash(A.as_bytes()), blake3::hash(B.as_bytes())]
        );
    }

    #[test]
    fn bad_token_files_name_the_flag_and_line_but_not_the_token() {
        let e = parse("# only a comment\n\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--auth-token-file tokens.txt: no tokens (only blank lines and # comments)"
        );
        let e = parse(&format!("{A}\n\nshort-secret\n")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--auth-token-file tokens.txt: line 3: token is 12 bytes; at least 16 are required"
        );
        assert!(!e.to_string().contains("short-secret"));
        let e = parse("has a space in the middle\n").unwrap_err();
        assert!(
            e.to_string().contains("line 1: token contains a byte"),
            "{e}"
        );
        let e = parse("caf\u{e9}-0123456789abcdef\n").unwrap_err();
        assert!(
            matches!(e, TokenFileError::InvalidByte { line: 1, .. }),
            "{e}"
        );
    }

    #[test]
    fn lookup_distinguishes_full_read_only_and_unknown() {
        let t = AccessTokens::from_tokens([A, B], [R]);
        assert!(t.enabled());
        assert_eq!(t.check(A.as_bytes()), Some(Access::Full));
        assert_eq!(t.check(B.as_bytes()), Some(Access::Full));
        assert_eq!(t.check(R.as_bytes()), Some(Access::ReadOnly));
        assert_eq!(t.check(b"token-a-012345678"), None);
        assert_eq!(t.check(b""), None);
        assert!(!AccessTokens::default().enabled());
        assert_eq!(AccessTokens::default().check(A.as_bytes()), None);
    }

    #[test]
    fn debug_shows_counts_only() {
        let t = AccessTokens::from_tokens([A], [R]);
        let text = format!("{t:?}");
        assert_eq!(text, "AccessTokens { full: 1, read_only: 1 }");
    }
}
