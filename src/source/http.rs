//! The control-plane client: two POSTs a tick, protobuf both ways.
//!
//! 1. `POST {base}/v1/agent/snapshot` with a `SnapshotRequest` → `Snapshot`.
//! 2. `POST {base}/v1/agent/report` with a `ReportRequest` → `ReportResponse`.
//!
//! Both carry `Authorization: Bearer` from the token file (re-read each
//! time, so a rotated token is picked up without a restart; refused while
//! group or others can read it), both have a connect and a whole-request
//! timeout, and every answer is read with a size cap and its entries
//! counted before it is decoded: a misbehaving control plane can slow the
//! exchange down, never wedge the agent or exhaust its memory.
//!
//! Redirects are refused, not followed: a redirected POST comes back as a
//! GET without its body or token, possibly from another host, and its
//! answer would be taken as desired state. Proxies come from `--proxy`
//! only, never from `http_proxy` and friends in the environment: an agent
//! started with a stray variable must not send its token elsewhere.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use prost::Message;

use super::{Desired, SnapshotLimits, Source, SourceError};
use crate::pb;
use crate::trust::{Refusal, SecretKey, TrustedKeys, Verified};

/// Where the control plane is and how to talk to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlane {
    pub base_url: String,
    pub token_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// The IPv4 addresses `url`'s host names now (a literal, or resolved
/// once); nothing when it names none. Guests are kept from these.
pub fn url_addresses(url: &str) -> Vec<std::net::Ipv4Addr> {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host_port.starts_with('[') {
        return Vec::new(); // IPv6: guests have none
    }
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().unwrap_or(80)),
        None => (host_port, 80),
    };
    let mut out: Vec<std::net::Ipv4Addr> = (host, port)
        .to_socket_addrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| match a.ip() {
                    std::net::IpAddr::V4(ip) => Some(ip),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out.dedup();
    out
}

pub struct HttpSource {
    agent: ureq::Agent,
    cp: ControlPlane,
    limits: SnapshotLimits,
    /// `--trusted-keys`: with them, only a verified `SignedSnapshot` is
    /// desired state.
    trust: Option<TrustedKeys>,
    /// The host's own key, which signs each report (see the proto).
    host_key: Option<SecretKey>,
}

const PROTOBUF: &str = "application/x-protobuf";
/// What an agent with pinned keys asks for (see the proto's header).
const SIGNED: &str = "application/x-protobuf; signed=ed25519";

impl HttpSource {
    /// `proxy`: the operator's `--proxy`, already checked; `None` goes
    /// direct whatever the environment says.
    pub fn new(
        cp: ControlPlane,
        limits: SnapshotLimits,
        proxy: Option<&str>,
        trust: Option<TrustedKeys>,
    ) -> HttpSource {
        let proxy = proxy.and_then(|p| ureq::Proxy::new(p).ok());
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(cp.connect_timeout))
            .timeout_global(Some(cp.request_timeout))
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(proxy)
            .user_agent(format!("eitri-agent/{}", crate::version::AGENT_VERSION))
            .build()
            .into();
        HttpSource {
            agent,
            cp,
            limits,
            trust,
            host_key: None,
        }
    }

    /// Signs each report with `key`, the host's own (see the proto).
    pub fn signing_reports(mut self, key: SecretKey) -> HttpSource {
        self.host_key = Some(key);
        self
    }

    fn limits(&self) -> SnapshotLimits {
        self.limits
    }

    fn token(&self) -> Result<Option<String>, SourceError> {
        let Some(path) = &self.cp.token_file else {
            return Ok(None);
        };
        check_token_mode(path)?;
        let token = fs::read_to_string(path).map_err(|source| SourceError::Token {
            path: path.clone(),
            source,
        })?;
        Ok(Some(token.trim().to_owned()))
    }

    fn post(&self, path: &str, body: Vec<u8>, accept: &str) -> Result<Vec<u8>, SourceError> {
        self.post_signed(path, body, accept, None)
    }

    /// [`HttpSource::post`], with the body's signature in its header when
    /// there is one.
    fn post_signed(
        &self,
        path: &str,
        body: Vec<u8>,
        accept: &str,
        signature: Option<&str>,
    ) -> Result<Vec<u8>, SourceError> {
        let target = format!("{}{path}", self.cp.base_url);
        // What errors name: the address without any credentials in it.
        let url = crate::quote::url(&target).into_owned();
        let token = self.token()?;
        let mut request = self
            .agent
            .post(&target)
            .header("Content-Type", PROTOBUF)
            .header("Accept", accept);
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        if let Some(signature) = signature {
            request = request.header(crate::trust::REPORT_SIGNATURE_HEADER, signature);
        }
        let unreachable = |e: ureq::Error| SourceError::Unreachable {
            url: url.clone(),
            source: Box::new(e),
        };
        let mut response = request.send(&body[..]).map_err(unreachable)?;
        let status = response.status().as_u16();
        match status {
            200..=299 => {}
            300..=399 => {
                let location = response
                    .headers()
                    .get("location")
                    .and_then(|v| v.to_str().ok())
                    .map_or("nowhere".into(), crate::quote::url)
                    .into_owned();
                return Err(SourceError::Redirected {
                    url,
                    status,
                    location,
                });
            }
            401 | 403 => return Err(SourceError::TokenRejected { url, status }),
            _ => return Err(SourceError::Status { url, status }),
        }
        response
            .body_mut()
            .with_config()
            .limit(self.limits().max_bytes)
            .read_to_vec()
            .map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(limit) => SourceError::TooLarge {
                    url: url.clone(),
                    limit,
                },
                other => unreachable(other),
            })
    }
}

impl Source for HttpSource {
    fn fetch(&mut self, host: &pb::HostInfo) -> Result<Option<Desired>, SourceError> {
        let body = pb::SnapshotRequest {
            host: Some(host.clone()),
        }
        .encode_to_vec();
        let accept = if self.trust.is_some() {
            SIGNED
        } else {
            PROTOBUF
        };
        let answer = self.post("/v1/agent/snapshot", body, accept)?;
        let url =
            crate::quote::url(&format!("{}/v1/agent/snapshot", self.cp.base_url)).into_owned();
        let refused = |why| SourceError::Refused {
            from: url.clone(),
            why,
        };
        // With pinned keys, the signature is checked before any other byte
        // of the answer is read, the entry count included.
        let (bytes, signed_by) = match &self.trust {
            None => (answer, None),
            Some(keys) => {
                let (bytes, verified) = open_envelope(keys, &answer).map_err(refused)?;
                (bytes, Some(verified.key_id))
            }
        };
        let garbage = |problem: String| SourceError::Garbage {
            url: url.clone(),
            problem,
        };
        let counts = pb::count_snapshot_entries(&bytes).map_err(|e| garbage(e.to_string()))?;
        self.limits().check(&url, counts.vms, counts.volumes)?;
        let wire = pb::Snapshot::decode(bytes.as_slice()).map_err(|e| garbage(e.to_string()))?;
        super::admissible(signed_by.as_deref(), &wire, &host.host_id).map_err(refused)?;
        Ok(Some(Desired {
            wire,
            signed_by,
            digest: Some(super::digest_of(&bytes)),
            ..Desired::default()
        }))
    }

    fn send_report(&mut self, host: &pb::HostInfo, report: &pb::Report) -> Result<(), SourceError> {
        let sent_at_unix_ms = crate::human::unix_ms(std::time::SystemTime::now());
        let body = pb::ReportRequest {
            host: Some(host.clone()),
            report: Some(report.clone()),
            sent_at_unix_ms,
        }
        .encode_to_vec();
        let signature = self
            .host_key
            .as_ref()
            .map(|key| key.report_signature(&body));
        self.post_signed("/v1/agent/report", body, PROTOBUF, signature.as_deref())
            .map(drop)
    }

    fn is_remote(&self) -> bool {
        true
    }

    /// The next contact comes at once anyway (SIGHUP asks for one): only
    /// the pinned keys are read again.
    fn reload(&mut self) {
        if let Some(keys) = &mut self.trust {
            keys.reload();
        }
    }

    fn describe(&self) -> String {
        format!("control plane {}", crate::quote::url(&self.cp.base_url))
    }
}

/// The snapshot bytes a `SignedSnapshot` carries, once its signature
/// verified with a pinned key.
fn open_envelope(keys: &TrustedKeys, answer: &[u8]) -> Result<(Vec<u8>, Verified), Refusal> {
    let unsigned = |why: &str| Refusal::Unsigned { why: why.into() };
    let envelope = pb::SignedSnapshot::decode(answer)
        .map_err(|_| unsigned("the answer is not a SignedSnapshot"))?;
    if envelope.key_id.is_empty() || envelope.signature.is_empty() {
        return Err(unsigned("the SignedSnapshot has no key id or no signature"));
    }
    let verified = keys.verify(&envelope.key_id, &envelope.signature, &envelope.snapshot)?;
    Ok((envelope.snapshot, verified))
}

/// Refuses signed desired state that names another host (or none): a
/// snapshot signed for one host must not be replayed to another.
pub(super) fn for_this_host(key_id: &str, named: &str, this_host: &str) -> Result<(), Refusal> {
    if named == this_host {
        return Ok(());
    }
    Err(Refusal::OtherHost {
        key_id: key_id.to_owned(),
        named: if named.is_empty() {
            "(none: host_id is empty)".into()
        } else {
            named.to_owned()
        },
        this_host: this_host.to_owned(),
    })
}

/// Refuses a token file that group or others can read: the token is the
/// host's identity to the control plane, and anyone on this host who can
/// read it can speak as this agent.
pub fn check_token_mode(path: &std::path::Path) -> Result<(), SourceError> {
    let meta = fs::metadata(path).map_err(|source| SourceError::Token {
        path: path.to_path_buf(),
        source,
    })?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SourceError::TokenMode {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::url_addresses;
    use std::net::Ipv4Addr;

    #[test]
    fn a_literal_host_is_its_address() {
        assert_eq!(
            url_addresses("http://192.0.2.5:8080/v1/agents"),
            vec![Ipv4Addr::new(192, 0, 2, 5)]
        );
    }

    #[test]
    fn user_info_is_not_taken_for_the_host() {
        assert_eq!(
            url_addresses("http://agent@198.51.100.7/"),
            vec![Ipv4Addr::new(198, 51, 100, 7)]
        );
    }

    #[test]
    fn an_ipv6_host_names_no_ipv4_address() {
        assert!(url_addresses("http://[2001:db8::1]:80/").is_empty());
    }
}
