//! The `tls` feature, built and run by `make test` so it does not rot: an
//! `https://` control plane and image are spoken to in TLS, and the token
//! never crosses the wire in clear. The peer here is a plain TCP listener
//! that records the first bytes it gets: a TLS client's first record is a
//! handshake (type 22), where a plaintext client would send `POST`.

use std::io::Read;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::deadline::Deadline;
use eitri_agent::image::{ImageCache, ImageOptions, Reach};
use eitri_agent::model::IpRange;
use eitri_agent::pb;
use eitri_agent::source::{ControlPlane, HttpSource, SnapshotLimits, Source};

const TOKEN: &str = "tls-test-token-1234";
/// The TLS record type of a handshake, a ClientHello's first byte.
const HANDSHAKE: u8 = 22;

/// What the first connection to a fresh listener sends, read on a thread
/// while `client` runs.
fn first_bytes(client: impl FnOnce(u16)) -> Vec<u8> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = vec![0u8; 4096];
        let n = conn.read(&mut buf).unwrap_or(0);
        buf.truncate(n);
        buf
    });
    client(port);
    server.join().expect("server")
}

#[test]
fn an_https_control_plane_gets_a_tls_handshake_and_never_the_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");

    let sent = first_bytes(|port| {
        let mut source = HttpSource::new(
            ControlPlane {
                base_url: format!("https://127.0.0.1:{port}"),
                token_file: Some(token.clone()),
                connect_timeout: Duration::from_secs(2),
                request_timeout: Duration::from_secs(2),
            },
            SnapshotLimits::default(),
            None,
            None,
        );
        let answer = source.fetch(&pb::HostInfo::default());
        assert!(answer.is_err(), "no TLS server answered");
    });

    assert_eq!(
        sent.first(),
        Some(&HANDSHAKE),
        "{:?}",
        String::from_utf8_lossy(&sent)
    );
    let text = String::from_utf8_lossy(&sent);
    assert!(!text.contains(TOKEN) && !text.contains("POST"), "{text}");
}

#[test]
fn an_https_image_is_fetched_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = ImageCache::with(
        dir.path().to_path_buf(),
        &ImageOptions {
            reach: Reach {
                allow: vec![IpRange::parse("127.0.0.1").expect("range")],
                ..Reach::default()
            },
            ..ImageOptions::default()
        },
    );

    let sent = first_bytes(|port| {
        let result = cache.resolve(
            &format!("https://127.0.0.1:{port}/a.raw"),
            &"0".repeat(64),
            1 << 30,
            Deadline::after(Duration::from_secs(10)),
            Arc::new(|_, _| {}),
        );
        let err = result.expect_err("no TLS server answered");
        assert!(!err.to_string().contains("no TLS"), "{err}");
    });

    assert_eq!(
        sent.first(),
        Some(&HANDSHAKE),
        "{:?}",
        String::from_utf8_lossy(&sent)
    );
}

#[test]
fn an_https_control_plane_is_taken_by_the_command_line() {
    let args: Vec<String> = [
        "run",
        "--control-plane",
        "https://cp.internal:8443",
        "--desired=",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();

    let parsed = eitri_agent::config::parse(&args, &Default::default());

    assert!(
        matches!(parsed, Ok(eitri_agent::config::Command::Run(_))),
        "{parsed:?}"
    );
}
