//! ZMQ endpoint syntax check with the contract's wording (`http-api.md` §4.2): one rule
//! for KV-event endpoints, replay endpoints and replica-sync peers.

/// Why an endpoint string was rejected. `Display` is the contract text after
/// ``invalid ZMQ endpoint `<ep>`: `` (see [`InvalidEndpoint`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointProblem {
    #[error("missing scheme")]
    MissingScheme,
    #[error("missing address")]
    MissingAddress,
    #[error("missing TCP port")]
    MissingTcpPort,
    #[error("missing TCP host")]
    MissingTcpHost,
    #[error("missing closing `]`")]
    MissingClosingBracket,
    #[error("invalid TCP port: {reason}")]
    InvalidTcpPort { reason: String },
    #[error("unsupported scheme `{scheme}`")]
    UnsupportedScheme { scheme: String },
}

/// A rejected endpoint: ``invalid ZMQ endpoint `<ep>`: <why>``.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid ZMQ endpoint `{endpoint}`: {problem}")]
pub struct InvalidEndpoint {
    pub endpoint: String,
    pub problem: EndpointProblem,
}

/// Checks `scheme://address`: scheme `tcp`, `ipc` or `inproc`, a non-empty address, and for
/// `tcp` a `host:port` with a non-empty host (IPv6 in brackets) and a `u16` port.
/// Wildcard hosts and port 0 are syntactically valid.
pub fn validate_endpoint(endpoint: &str) -> Result<(), InvalidEndpoint> {
    check(endpoint).map_err(|problem| InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        problem,
    })
}

fn check(endpoint: &str) -> Result<(), EndpointProblem> {
    let (scheme, address) = endpoint
        .split_once("://")
        .ok_or(EndpointProblem::MissingScheme)?;
    if scheme.is_empty() {
        return Err(EndpointProblem::MissingScheme);
    }
    if !matches!(scheme, "tcp" | "ipc" | "inproc") {
        return Err(EndpointProblem::UnsupportedScheme {
            scheme: scheme.to_owned(),
        });
    }
    if address.is_empty() {
        return Err(EndpointProblem::MissingAddress);
    }
    if scheme != "tcp" {
        return Ok(());
    }
    let port = if let Some(bracketed) = address.strip_prefix('[') {
        let (host, rest) = bracketed
            .split_once(']')
            .ok_or(EndpointProblem::MissingClosingBracket)?;
        if host.is_empty() {
            return Err(EndpointProblem::MissingTcpHost);
        }
        rest.strip_prefix(':')
            .ok_or(EndpointProblem::MissingTcpPort)?
    } else {
        // An unbracketed IPv6 literal splits at its first colon and so has no host.
        let (host, port) = address
            .split_once(':')
            .ok_or(EndpointProblem::MissingTcpPort)?;
        if host.is_empty() {
            return Err(EndpointProblem::MissingTcpHost);
        }
        port
    };
    if port.is_empty() {
        return Err(EndpointProblem::MissingTcpPort);
    }
    port.parse::<u16>()
        .map(|_| ())
        .map_err(|e| EndpointProblem::InvalidTcpPort {
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_endpoints() {
        for ep in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5558",
            "tcp://127.0.0.1:0",
            "tcp://[::1]:5557",
            "tcp://selector-b:9092",
            "tcp://host.example:65535",
            "ipc:///tmp/kv.sock",
            "inproc://events",
        ] {
            assert_eq!(validate_endpoint(ep), Ok(()), "{ep}");
        }
    }

    fn check_message(ep: &str, expected: &str) {
        let err = validate_endpoint(ep).expect_err(ep);
        assert_eq!(err.to_string(), expected, "{ep}");
        assert_eq!(err.endpoint, ep);
    }

    #[test]
    fn rejected_endpoints_use_the_contract_wording() {
        check_message(
            "127.0.0.1:5557",
            "invalid ZMQ endpoint `127.0.0.1:5557`: missing scheme",
        );
        check_message("tcp://", "invalid ZMQ endpoint `tcp://`: missing address");
        check_message("ipc://", "invalid ZMQ endpoint `ipc://`: missing address");
        check_message(
            "tcp://127.0.0.1",
            "invalid ZMQ endpoint `tcp://127.0.0.1`: missing TCP port",
        );
        check_message(
            "tcp://host:",
            "invalid ZMQ endpoint `tcp://host:`: missing TCP port",
        );
        check_message(
            "tcp://:5557",
            "invalid ZMQ endpoint `tcp://:5557`: missing TCP host",
        );
        check_message(
            "tcp://::1:5557",
            "invalid ZMQ endpoint `tcp://::1:5557`: missing TCP host",
        );
        check_message(
            "tcp://[::1:5557",
            "invalid ZMQ endpoint `tcp://[::1:5557`: missing closing `]`",
        );
        check_message(
            "tcp://[::1]5557",
            "invalid ZMQ endpoint `tcp://[::1]5557`: missing TCP port",
        );
        check_message(
            "tcp://127.0.0.1:65536",
            "invalid ZMQ endpoint `tcp://127.0.0.1:65536`: invalid TCP port: number too large to fit in target type",
        );
        check_message(
            "tcp://127.0.0.1:abc",
            "invalid ZMQ endpoint `tcp://127.0.0.1:abc`: invalid TCP port: invalid digit found in string",
        );
        check_message(
            "udp://127.0.0.1:5557",
            "invalid ZMQ endpoint `udp://127.0.0.1:5557`: unsupported scheme `udp`",
        );
    }
}
