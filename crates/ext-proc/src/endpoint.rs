//! How the gateway names a worker: `ip:port`, the authority of the worker's registered
//! `endpoint` (`http://10.0.0.7:8000` and `10.0.0.7:8000` both name `10.0.0.7:8000`).

/// The `host:port` part of a registered endpoint: any `scheme://` prefix and any path
/// after the authority dropped.
pub fn endpoint_address(endpoint: &str) -> &str {
    let rest = match endpoint.find("://") {
        Some(i) => &endpoint[i + 3..],
        None => endpoint,
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    rest[..end].trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_named_by_their_authority() {
        for (input, expected) in [
            ("http://10.0.0.7:8000", "10.0.0.7:8000"),
            ("https://10.0.0.7:8443/v1", "10.0.0.7:8443"),
            ("10.0.0.7:8000", "10.0.0.7:8000"),
            ("http://[::1]:9000/", "[::1]:9000"),
            ("grpc://pod-a:50051?x=1", "pod-a:50051"),
            ("", ""),
        ] {
            assert_eq!(endpoint_address(input), expected, "{input}");
        }
    }
}
