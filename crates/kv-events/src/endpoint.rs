//! Endpoint syntax validation before connecting (`spec/kv-events.md` §2.2).

/// Why an endpoint string was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    #[error("endpoint {endpoint:?} has no scheme (expected tcp://, ipc:// or inproc://)")]
    MissingScheme { endpoint: String },
    #[error("endpoint {endpoint:?} uses unsupported scheme {scheme:?}")]
    UnsupportedScheme { endpoint: String, scheme: String },
    #[error("endpoint {endpoint:?} has an empty address")]
    EmptyAddress { endpoint: String },
    #[error("endpoint {endpoint:?}: missing TCP port")]
    MissingTcpPort { endpoint: String },
    #[error("endpoint {endpoint:?}: empty TCP host")]
    EmptyHost { endpoint: String },
    #[error("endpoint {endpoint:?}: bracketed IPv6 host is not closed")]
    UnclosedIpv6Host { endpoint: String },
    #[error("endpoint {endpoint:?}: invalid TCP port {port:?}")]
    InvalidPort { endpoint: String, port: String },
}

/// Checks `scheme://address` as the reference does. Wildcards (`tcp://*:5558`) and port 0
/// are syntactically valid and accepted.
pub fn validate_endpoint(endpoint: &str) -> Result<(), EndpointError> {
    let owned = || endpoint.to_owned();
    let Some((scheme, address)) = endpoint.split_once("://") else {
        return Err(EndpointError::MissingScheme { endpoint: owned() });
    };
    if address.is_empty() {
        return Err(EndpointError::EmptyAddress { endpoint: owned() });
    }
    match scheme {
        "ipc" | "inproc" => Ok(()),
        "tcp" => {
            let Some((host, port)) = address.rsplit_once(':') else {
                return Err(EndpointError::MissingTcpPort { endpoint: owned() });
            };
            if host.is_empty() {
                return Err(EndpointError::EmptyHost { endpoint: owned() });
            }
            if host.starts_with('[') {
                if !host.ends_with(']') || host.len() < 2 {
                    return Err(EndpointError::UnclosedIpv6Host { endpoint: owned() });
                }
            } else if host.contains(':') {
                return Err(EndpointError::MissingTcpPort { endpoint: owned() });
            }
            port.parse::<u16>()
                .map(|_| ())
                .map_err(|_| EndpointError::InvalidPort {
                    endpoint: owned(),
                    port: port.to_owned(),
                })
        }
        other => Err(EndpointError::UnsupportedScheme {
            endpoint: owned(),
            scheme: other.to_owned(),
        }),
    }
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
            "tcp://host.example:65535",
            "ipc:///tmp/kv.sock",
            "inproc://events",
        ] {
            assert_eq!(validate_endpoint(ep), Ok(()), "{ep}");
        }
    }

    #[test]
    fn rejected_endpoints() {
        let check = |ep: &str, ok: fn(&EndpointError) -> bool| {
            let err = validate_endpoint(ep).expect_err(ep);
            assert!(ok(&err), "{ep}: {err:?}");
        };
        check("udp://127.0.0.1:5557", |e| {
            matches!(e, EndpointError::UnsupportedScheme { .. })
        });
        check("127.0.0.1:5557", |e| {
            matches!(e, EndpointError::MissingScheme { .. })
        });
        check("tcp://", |e| {
            matches!(e, EndpointError::EmptyAddress { .. })
        });
        check("ipc://", |e| {
            matches!(e, EndpointError::EmptyAddress { .. })
        });
        check("tcp://127.0.0.1", |e| {
            matches!(e, EndpointError::MissingTcpPort { .. })
        });
        check("tcp://::1:5557", |e| {
            matches!(e, EndpointError::MissingTcpPort { .. })
        });
        check("tcp://:5557", |e| {
            matches!(e, EndpointError::EmptyHost { .. })
        });
        check("tcp://[::1:5557", |e| {
            matches!(e, EndpointError::UnclosedIpv6Host { .. })
        });
        check("tcp://127.0.0.1:65536", |e| {
            matches!(e, EndpointError::InvalidPort { .. })
        });
        check("tcp://127.0.0.1:abc", |e| {
            matches!(e, EndpointError::InvalidPort { .. })
        });
    }
}
