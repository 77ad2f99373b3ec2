//! The rows the workers published, collected for a step's report, and
//! reused whole while no result changed and the workers stayed the same
//! (see the protocol in [`super`], step 4).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Workers;
use crate::model::{Id, QuarantinedVm, Rows};

/// Rows and quarantined entries collected from every worker.
pub(super) struct Collected {
    /// The published count they were collected at.
    pub(super) count: u64,
    /// The VMs whose rows were left out.
    pub(super) skipped: Vec<Id>,
    pub(super) rows: Rows,
    pub(super) quarantined: Vec<QuarantinedVm>,
}

impl Workers {
    /// Every worker's last published row, but those of the VMs in `skip`
    /// (refused entries: their rows come from elsewhere this tick), in id
    /// order; and every quarantined entry. The last step's lists, untouched,
    /// when no result changed and the workers and `skip` are the same.
    pub(crate) fn collect(&self, skip: &HashSet<&Id>) -> (Rows, Vec<QuarantinedVm>) {
        // Read before the rows: a result published after this is either
        // in them or makes the count differ next time.
        let count = self.signals.published.load(Ordering::Acquire);
        let mut collected = self.collected.lock();
        if let Some(c) = collected.as_ref()
            && c.count == count
            && c.skipped.len() == skip.len()
            && c.skipped.iter().all(|id| skip.contains(id))
        {
            return (c.rows.clone(), c.quarantined.clone());
        }
        let mut rows = Vec::with_capacity(self.live.len());
        let mut quarantined = Vec::new();
        for (id, handle) in &self.live {
            let p = handle.shared.published.lock();
            // Its row comes from elsewhere; a quarantined entry does not.
            if let Some(row) = p.row.as_ref().filter(|_| !skip.contains(id)) {
                rows.push(Arc::clone(row));
            }
            if let Some(q) = p.result.as_ref().and_then(|r| r.quarantined.as_ref()) {
                quarantined.push(q.clone());
            }
        }
        let rows = Rows::from(rows);
        *collected = Some(Collected {
            count,
            skipped: skip.iter().map(|id| (*id).clone()).collect(),
            rows: rows.clone(),
            quarantined: quarantined.clone(),
        });
        (rows, quarantined)
    }

    /// The last row `id`'s worker published, if it has a worker and one.
    pub(crate) fn row_of(&self, id: &Id) -> Option<Arc<crate::model::VmStatus>> {
        let handle = self.live.get(id)?;
        let published = handle.shared.published.lock();
        published.row.clone()
    }

    /// A worker was started, replaced or retired: the roster and the rows
    /// collected are made again when next needed.
    pub(super) fn changed_workers(&mut self) {
        self.roster = None;
        *self.collected.get_mut() = None;
    }
}
