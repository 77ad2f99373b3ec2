//! The control-plane client: two POSTs a tick, protobuf both ways.
//!
//! 1. `POST {base}/v1/agent/snapshot` with a `SnapshotRequest` → `Snapshot`.
//! 2. `POST {base}/v1/agent/report` with a `ReportRequest` → `ReportResponse`.
//!
//! Both carry `Authorization: Bearer` from the token file (re-read each
//! time, so a rotated token is picked up without a restart), both have a
//! connect and a whole-request timeout, and every answer is read with a size
//! cap: a misbehaving control plane can slow a tick down, never wedge the
//! agent or exhaust its memory.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use prost::Message;

use super::{Source, SourceError};
use crate::config::ControlPlane;
use crate::pb;

pub struct HttpSource {
    agent: ureq::Agent,
    cp: ControlPlane,
    warned_token_mode: bool,
}

const PROTOBUF: &str = "application/x-protobuf";

impl HttpSource {
    pub fn new(cp: ControlPlane) -> HttpSource {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(cp.connect_timeout))
            .timeout_global(Some(cp.request_timeout))
            .http_status_as_error(false)
            .user_agent(format!("eitri-agent/{}", crate::version::AGENT_VERSION))
            .build()
            .into();
        HttpSource {
            agent,
            cp,
            warned_token_mode: false,
        }
    }

    fn token(&mut self) -> Result<Option<String>, SourceError> {
        let Some(path) = &self.cp.token_file else {
            return Ok(None);
        };
        let token_err = |source| SourceError::Token {
            path: path.clone(),
            source,
        };
        let meta = fs::metadata(path).map_err(token_err)?;
        if meta.permissions().mode() & 0o077 != 0 && !self.warned_token_mode {
            log::warn!(
                "the token file {} is readable by group or others; chmod 600 it",
                path.display()
            );
            self.warned_token_mode = true;
        }
        let token = fs::read_to_string(path).map_err(token_err)?;
        Ok(Some(token.trim().to_owned()))
    }

    fn post(&mut self, path: &str, body: Vec<u8>) -> Result<Vec<u8>, SourceError> {
        let url = format!("{}{path}", self.cp.base_url);
        let token = self.token()?;
        let mut request = self
            .agent
            .post(&url)
            .header("Content-Type", PROTOBUF)
            .header("Accept", PROTOBUF);
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        let unreachable = |e: ureq::Error| SourceError::Unreachable {
            url: url.clone(),
            source: Box::new(e),
        };
        let mut response = request.send(&body[..]).map_err(unreachable)?;
        let status = response.status().as_u16();
        match status {
            200..=299 => {}
            401 | 403 => return Err(SourceError::TokenRejected { url, status }),
            _ => return Err(SourceError::Status { url, status }),
        }
        response
            .body_mut()
            .with_config()
            .limit(self.cp.max_response_bytes)
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
    fn fetch(&mut self, host: &pb::HostInfo) -> Result<Option<pb::Snapshot>, SourceError> {
        let body = pb::SnapshotRequest {
            host: Some(host.clone()),
        }
        .encode_to_vec();
        let answer = self.post("/v1/agent/snapshot", body)?;
        pb::Snapshot::decode(answer.as_slice())
            .map(Some)
            .map_err(|e| SourceError::Garbage {
                url: format!("{}/v1/agent/snapshot", self.cp.base_url),
                problem: e.to_string(),
            })
    }

    fn send_report(&mut self, host: &pb::HostInfo, report: &pb::Report) -> Result<(), SourceError> {
        let body = pb::ReportRequest {
            host: Some(host.clone()),
            report: Some(report.clone()),
        }
        .encode_to_vec();
        self.post("/v1/agent/report", body).map(drop)
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("control plane {}", self.cp.base_url)
    }
}
