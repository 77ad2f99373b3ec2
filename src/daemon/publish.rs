//! What the main loop publishes, and where: each report to the exchange
//! and to `report.json` (readiness after the first), the metrics file
//! after each tick, and the last accepted snapshot, persisted so an agent
//! restarted during an outage keeps converging.

use std::time::Instant;

use super::event_loop::Daemon;
use super::last;
use crate::pb::{self, convert};
use crate::status::ReportFile;

impl Daemon {
    /// Reports `report`; `tick` says it is a tick's (not a change's), when
    /// the slower details (the hypervisors' pids) are looked up too.
    pub(super) fn publish(
        &mut self,
        report: &crate::model::Report,
        reflects: Option<u64>,
        tick: bool,
    ) {
        let mut wire = convert::report_to_wire(report);
        if self.fenced.is_some() {
            wire.fence_violation = true;
        }
        if let Some(digest) = self.last.as_ref().and_then(|(d, _)| d.digest) {
            wire.answers_sha256 = digest.to_vec();
        }
        self.link.publish(wire.clone(), reflects);
        self.write_report(wire, tick);
        self.written = Some(Instant::now());
        self.dirty = false;
    }

    /// Persists the last accepted snapshot (see `accept` for when).
    pub(super) fn persist_last(&self) {
        let Some((desired, _)) = &self.last else {
            return;
        };
        let path = self.store.layout().last_snapshot();
        match last::save(&path, &desired.wire) {
            Ok(()) => crate::crash::point("snapshot.persisted"),
            Err(e) => {
                self.logs.error(
                    "persist",
                    &format!(
                        "cannot persist the last snapshot to {}: {e}",
                        path.display()
                    ),
                );
            }
        }
    }

    pub(super) fn write_report(&mut self, report: pb::Report, tick: bool) {
        let mut details = self
            .details
            .update(&report, &self.store, &self.engine, tick);
        if let Some(usage) = &self.usage {
            usage.running(
                report
                    .vms
                    .iter()
                    .filter(|row| row.power_state == "running")
                    .filter_map(|row| crate::model::Id::parse(&row.vm_id).ok())
                    .collect(),
            );
            let figures = usage.figures();
            for (vm, detail) in &mut details {
                detail.usage = figures.get(vm).cloned();
            }
        }
        let mut notes = self.notes.clone();
        if let Some(why) = &self.refused_epoch {
            notes.push(why.clone());
        }
        if let Some(lacks) = self.engine.host_condition() {
            notes.push(format!(
                "this host cannot run guests until it is fixed: {lacks}"
            ));
        }
        let file = ReportFile {
            notes,
            tick_ms: u64::try_from(self.tick.as_millis()).unwrap_or(u64::MAX),
            details,
            quota: self.engine.quota(),
            agents_dir: self.agents_dir.clone(),
            agent_pid: std::process::id(),
            agent_started_at_ms: self.started_at_ms,
            ..ReportFile::new(
                self.host.clone(),
                self.source.clone(),
                self.link.contact(),
                report,
            )
        };
        match file.write(self.store.root()) {
            Ok(()) => {
                if self.logs.clear("report") {
                    log::info!("report.json is written again");
                }
                if let Some(readiness) = self.readiness.take() {
                    readiness.signal();
                }
            }
            Err(e) => {
                self.logs.error(
                    "report",
                    &format!(
                        "cannot write report.json: {e}; it goes stale until this is fixed (status shows its age)"
                    ),
                );
            }
        }
    }

    /// Writes `--metrics-file`, if asked for, after a tick's step that began
    /// at `started`.
    pub(super) fn write_metrics(&self, report: &crate::model::Report, started: Instant) {
        let Some(m) = &self.metrics else {
            return;
        };
        let usage = self
            .usage
            .as_ref()
            .map(crate::usage::Sampler::figures)
            .unwrap_or_default();
        let usage: &std::collections::HashMap<_, _> = &usage;
        let text = m.render(
            &self.host,
            &self.engine,
            report,
            self.store.epoch(),
            &super::metrics::Kept {
                contact_failures: self.link.failures(),
                epoch_refusals: &self.epoch_refusals,
                usage,
            },
        );
        match m.write(&text) {
            Ok(()) => {
                if self.logs.clear("metrics") {
                    log::info!("{} is written again", m.path.display());
                }
            }
            Err(e) => {
                self.logs.error(
                    "metrics",
                    &format!("cannot write the metrics file {}: {e}", m.path.display()),
                );
            }
        }
        m.tick_took(started.elapsed());
    }
}
