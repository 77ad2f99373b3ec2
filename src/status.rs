//! `report.json` and `eitri-agent status`.
//!
//! Every tick, in both modes, the daemon writes its report atomically as
//! `STATE_DIR/report.json`, with when it was written and how the last
//! contact with the control plane went. `status` reads that file: it takes
//! no lock, so it works beside a running agent.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::pb;
use crate::quote::inline;
use crate::state::atomic::replace_unsynced;

pub const REPORT_FILE: &str = "report.json";
const FORMAT: u32 = 1;

/// Why `status` has no report to show.
#[derive(Debug)]
pub enum StatusError {
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    NotAReport {
        path: std::path::PathBuf,
        source: serde_json::Error,
    },
}

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StatusError::Read { path, .. } => write!(
                f,
                "cannot read {}; is the agent running with --state-dir {}?",
                path.display(),
                path.parent().unwrap_or(path).display()
            ),
            StatusError::NotAReport { path, .. } => {
                write!(f, "{} is not a report", path.display())
            }
        }
    }
}

impl std::error::Error for StatusError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StatusError::Read { source, .. } => Some(source),
            StatusError::NotAReport { source, .. } => Some(source),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportFile {
    pub format: u32,
    pub written_at_unix_ms: u64,
    pub host: pb::HostInfo,
    /// Where desired state comes from.
    pub source: String,
    /// How the last contact with the source went: "ok", or why it failed.
    pub contact: String,
    pub report: pb::Report,
    /// Lasting facts about this host an operator should know (e.g. guest
    /// networking is host-only).
    #[serde(default)]
    pub notes: Vec<String>,
    /// The agent's tick: a report much older than this is stale (the agent
    /// is stopped, or cannot write).
    #[serde(default)]
    pub tick_ms: u64,
}

impl ReportFile {
    pub fn new(
        host: pb::HostInfo,
        source: String,
        contact: String,
        report: pb::Report,
    ) -> ReportFile {
        let written_at_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        ReportFile {
            format: FORMAT,
            written_at_unix_ms,
            host,
            source,
            contact,
            report,
            notes: Vec::new(),
            tick_ms: 0,
        }
    }

    /// Whether the report is older than three ticks at `now`: an agent that
    /// runs writes one at least every tick.
    pub fn is_stale(&self, now: SystemTime) -> bool {
        let written = UNIX_EPOCH + Duration::from_millis(self.written_at_unix_ms);
        let age = now.duration_since(written).unwrap_or_default();
        self.tick_ms > 0 && age > Duration::from_millis(self.tick_ms.saturating_mul(3))
    }

    /// Replaces `report.json` atomically for readers, unsynced: it is a
    /// view of memory rewritten every tick, not state (see
    /// [`replace_unsynced`]).
    pub fn write(&self, state_dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        replace_unsynced(&state_dir.join(REPORT_FILE), &json)
    }

    pub fn read(state_dir: &Path) -> Result<ReportFile, StatusError> {
        let path = state_dir.join(REPORT_FILE);
        let bytes = std::fs::read(&path).map_err(|source| StatusError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| StatusError::NotAReport { path, source })
    }

    /// The report as a table for a person. Every value from the report
    /// goes through [`inline`]: ids, names and errors can come from the
    /// wire or a guest, and must not move a terminal's cursor or start a
    /// line of their own.
    pub fn render(&self, now: SystemTime) -> String {
        let written = UNIX_EPOCH + Duration::from_millis(self.written_at_unix_ms);
        let age = now.duration_since(written).unwrap_or_default();
        let r = &self.report;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "host {} (agent {}), report written {} ago{}, epoch {}{}",
            inline(&self.host.host_id),
            inline(&self.host.agent_version),
            human(age),
            if self.is_stale(now) {
                " (STALE: the agent writes one every tick; is it running, and can it write its state dir?)"
            } else {
                ""
            },
            r.last_seen_epoch,
            if r.fence_violation {
                " (FENCED: a stale snapshot was refused)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            out,
            "desired state: {}; last contact: {}",
            inline(&self.source),
            inline(&self.contact)
        );
        for note in &self.notes {
            let _ = writeln!(out, "note: {}", inline(note));
        }
        let rows: Vec<[String; 6]> = r
            .vms
            .iter()
            .map(|v| {
                let note = [v.status_detail.as_str(), v.last_error.as_str()]
                    .iter()
                    .filter(|s| !s.is_empty())
                    .copied()
                    .collect::<Vec<_>>()
                    .join("; ");
                [
                    inline(&v.vm_id),
                    dash(&v.power_state),
                    dash(&v.phase),
                    dash(&v.ip),
                    dash(&v.network_ip),
                    inline(&note),
                ]
            })
            .collect();
        out.push('\n');
        table(
            &mut out,
            ["VM", "POWER", "PHASE", "IP", "NETWORK IP", "DETAIL / ERROR"],
            &rows,
        );
        if !r.quarantined.is_empty() {
            out.push_str("\nquarantined:\n");
            for q in &r.quarantined {
                let _ = writeln!(
                    out,
                    "  {} ({}), destroyed at unix {}",
                    inline(&q.vm_id),
                    inline(&q.name),
                    q.destroy_at_unix
                );
            }
        }
        if !r.volumes.is_empty() {
            out.push_str("\nvolumes:\n");
            for v in &r.volumes {
                let _ = writeln!(
                    out,
                    "  {} {} GiB {}{}",
                    inline(&v.volume_id),
                    v.size_gb,
                    inline(&v.state),
                    if v.last_error.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", inline(&v.last_error))
                    }
                );
            }
        }
        out
    }
}

fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { inline(s) }
}

fn table<const N: usize>(out: &mut String, head: [&str; N], rows: &[[String; N]]) {
    let mut width = head.map(str::len);
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == N {
                l.push_str(cell);
            } else {
                let _ = write!(l, "{cell:<w$}  ", w = width[i]);
            }
        }
        l.trim_end().to_owned()
    };
    let _ = writeln!(out, "{}", line(head.to_vec()));
    if rows.is_empty() {
        out.push_str("(no VMs)\n");
    }
    for row in rows {
        let _ = writeln!(out, "{}", line(row.iter().map(String::as_str).collect()));
    }
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rows_and_age() {
        let file = ReportFile {
            written_at_unix_ms: 1_000_000,
            ..ReportFile::new(
                pb::HostInfo {
                    host_id: "h1".into(),
                    agent_version: "1.0.0".into(),
                    ..Default::default()
                },
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report {
                    last_seen_epoch: 4,
                    vms: vec![pb::VmStatus {
                        vm_id: "vm-1".into(),
                        power_state: "running".into(),
                        phase: "ready".into(),
                        ip: "10.0.0.2".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            )
        };

        let text = file.render(UNIX_EPOCH + Duration::from_millis(1_042_000));

        assert!(text.contains("written 42s ago"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("vm-1") && l.contains("running") && l.contains("10.0.0.2")),
            "{text}"
        );
    }

    #[test]
    fn an_id_with_a_newline_and_an_escape_stays_on_its_row() {
        let file = ReportFile::new(
            pb::HostInfo::default(),
            "desired file /d.json".into(),
            "ok".into(),
            pb::Report {
                vms: vec![pb::VmStatus {
                    vm_id: "evil\nvm-2 running ready\u{1b}[2J".into(),
                    last_error: "vm_id: bad\r".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );

        let text = file.render(UNIX_EPOCH);

        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(!text.lines().any(|l| l.starts_with("vm-2")), "{text}");
        assert!(text.contains("evil\\nvm-2"), "{text}");
    }

    #[test]
    fn every_note_is_a_line_of_its_own() {
        let file = ReportFile {
            notes: vec![
                "stopped an orphan hypervisor (pid 4242, socket /run/eitri/x.sock)".into(),
                "guest networking is host-only".into(),
            ],
            ..ReportFile::new(
                pb::HostInfo::default(),
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report::default(),
            )
        };

        let text = file.render(UNIX_EPOCH);

        let notes: Vec<&str> = text.lines().filter(|l| l.starts_with("note: ")).collect();
        assert_eq!(
            notes,
            [
                "note: stopped an orphan hypervisor (pid 4242, socket /run/eitri/x.sock)",
                "note: guest networking is host-only"
            ]
        );
    }

    #[test]
    fn a_report_older_than_three_ticks_is_marked_stale() {
        let file = ReportFile {
            written_at_unix_ms: 1_000_000,
            tick_ms: 5_000,
            ..ReportFile::new(
                pb::HostInfo::default(),
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report::default(),
            )
        };

        let fresh = file.render(UNIX_EPOCH + Duration::from_millis(1_000_000 + 14_000));
        let stale = file.render(UNIX_EPOCH + Duration::from_millis(1_000_000 + 16_000));

        assert!(!fresh.contains("STALE"), "{fresh}");
        assert!(stale.contains("STALE"), "{stale}");
    }
}
