//! What each running VM uses: CPU, memory, disk and network, sampled by
//! the agent every `--usage-interval` on its `usage` thread (never by a
//! CLI poking VMM sockets), for `top`, `status VM` and the metrics file.
//!
//! The backend reads running totals ([`Reading`]); a VM's figures are the
//! rates between its last two readings of one hypervisor process, so a
//! VMM started again (a repair, a resume) begins anew rather than showing
//! a negative rate, and a total that fell (a VMM that lies) shows no rate
//! until it rises again. The main loop tells the sampler which VMs run
//! with each report it writes, and copies the latest figures into it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::model::Id;
use crate::provision::{Lifecycle, NetSource, Reading};
use crate::threads::{OwnedThread, StopFlag};

/// One VM's figures: rates over `over_ms` before `sampled_at_ms`, and the
/// totals they came from (for the metrics file's counters). A rate is
/// `None` until two readings of one VMM stand apart, and where a total
/// could not be read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// When the last reading was taken (Unix ms), and how long before it
    /// the one the rates compare with was.
    pub sampled_at_ms: u64,
    pub over_ms: u64,
    /// CPU time spent per second, in thousandths of a core (1000: one
    /// core busy all the time).
    pub cpu_millis: Option<u64>,
    /// Memory its VMM holds resident.
    pub resident_bytes: Option<u64>,
    /// Its disks, per second.
    pub disk_read_bps: Option<u64>,
    pub disk_write_bps: Option<u64>,
    pub disk_read_iops: Option<u64>,
    pub disk_write_iops: Option<u64>,
    /// Its NICs, per second, as its guest sees them: `rx` taken in.
    pub net_rx_bps: Option<u64>,
    pub net_tx_bps: Option<u64>,
    /// Who counted the network: `vmm`, or `taps` when the VMM did not
    /// answer.
    pub net_from: String,
    pub totals: Totals,
}

/// Running totals since the VMM started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    pub cpu_ns: Option<u64>,
    pub disk_read_bytes: Option<u64>,
    pub disk_write_bytes: Option<u64>,
    pub disk_read_ops: Option<u64>,
    pub disk_write_ops: Option<u64>,
    pub net_rx_bytes: Option<u64>,
    pub net_tx_bytes: Option<u64>,
}

impl Totals {
    fn of(r: &Reading) -> Totals {
        Totals {
            cpu_ns: r.cpu_ns,
            disk_read_bytes: r.disk.map(|d| d.read_bytes),
            disk_write_bytes: r.disk.map(|d| d.write_bytes),
            disk_read_ops: r.disk.map(|d| d.read_ops),
            disk_write_ops: r.disk.map(|d| d.write_ops),
            net_rx_bytes: r.net.map(|n| n.rx_bytes),
            net_tx_bytes: r.net.map(|n| n.tx_bytes),
        }
    }
}

/// A VM's last reading, and when it was taken.
#[derive(Clone, Debug)]
struct Taken {
    at: Instant,
    at_ms: u64,
    reading: Reading,
}

/// The figures of `now` against `before`, when both are of one VMM.
fn figures(before: Option<&Taken>, now: &Taken) -> Usage {
    let totals = Totals::of(&now.reading);
    let mut usage = Usage {
        sampled_at_ms: now.at_ms,
        resident_bytes: now.reading.resident_bytes,
        net_from: match now.reading.net_from {
            NetSource::Vmm => "vmm",
            NetSource::Taps => "taps",
        }
        .to_owned(),
        ..Usage::default()
    };
    let Some(before) = before
        .filter(|b| b.reading.pid == now.reading.pid && b.reading.started == now.reading.started)
    else {
        usage.totals = totals;
        return usage;
    };
    let over = now.at.saturating_duration_since(before.at);
    if over.is_zero() {
        usage.totals = totals;
        return usage;
    }
    usage.over_ms = u64::try_from(over.as_millis()).unwrap_or(u64::MAX);
    let then = Totals::of(&before.reading);
    // Per second (or, for CPU, thousandths of a core): a total that fell
    // has no rate.
    let rate = |old: Option<u64>, new: Option<u64>, per: f64| -> Option<u64> {
        let grown = new?.checked_sub(old?)?;
        Some((grown as f64 * per / over.as_secs_f64()).round() as u64)
    };
    usage.cpu_millis = rate(then.cpu_ns, totals.cpu_ns, 1e-6);
    usage.disk_read_bps = rate(then.disk_read_bytes, totals.disk_read_bytes, 1.0);
    usage.disk_write_bps = rate(then.disk_write_bytes, totals.disk_write_bytes, 1.0);
    usage.disk_read_iops = rate(then.disk_read_ops, totals.disk_read_ops, 1.0);
    usage.disk_write_iops = rate(then.disk_write_ops, totals.disk_write_ops, 1.0);
    if before.reading.net_from == now.reading.net_from {
        usage.net_rx_bps = rate(then.net_rx_bytes, totals.net_rx_bytes, 1.0);
        usage.net_tx_bps = rate(then.net_tx_bytes, totals.net_tx_bytes, 1.0);
    }
    usage.totals = totals;
    usage
}

#[derive(Default)]
struct Shared {
    /// The VMs to sample: those the last report said run.
    running: Vec<Id>,
    /// The last round's figures, by VM: replaced whole, so a reader
    /// shares them rather than copying them (every report and every
    /// metrics file reads them).
    figures: Arc<HashMap<String, Usage>>,
    /// Set when `running` gained a VM: sampled at once, not at the next
    /// round, so its first rate comes one interval after it started.
    newcomers: bool,
}

/// What the main loop and the `usage` thread share: the running VMs and
/// the figures, and the bell that says newcomers came.
#[derive(Default)]
struct Board {
    shared: Mutex<Shared>,
    bell: Condvar,
}

/// The `usage` thread and what it found.
pub struct Sampler {
    board: Arc<Board>,
    _thread: OwnedThread,
}

/// The longest the thread waits before it looks at its stop flag.
const GLANCE: Duration = Duration::from_secs(1);

impl Sampler {
    /// Starts sampling every `every`; `None` when the backend cannot read
    /// what VMs use, or the thread cannot start (said).
    pub fn start(backend: Arc<dyn Lifecycle>, every: Duration) -> Option<Sampler> {
        backend.meters()?;
        let board = Arc::new(Board::default());
        let thread = {
            let board = Arc::clone(&board);
            OwnedThread::spawn("usage".into(), 256 * 1024, None, move |stop| {
                sample(&*backend, &board, every, &stop);
            })
        };
        match thread {
            Ok(thread) => Some(Sampler {
                board,
                _thread: thread,
            }),
            Err(e) => {
                log::warn!("cannot start the usage thread: {e}; top and status show no usage");
                None
            }
        }
    }

    /// The VMs that run now (from a report): the ones sampled.
    pub fn running(&self, ids: Vec<Id>) {
        let mut shared = self.board.shared.lock();
        if shared.running != ids {
            let known: std::collections::HashSet<&Id> = shared.running.iter().collect();
            if ids.iter().any(|id| !known.contains(id)) {
                shared.newcomers = true;
                self.board.bell.notify_one();
            }
            shared.running = ids;
        }
    }

    /// The latest figures, by VM id.
    pub fn figures(&self) -> Arc<HashMap<String, Usage>> {
        Arc::clone(&self.board.shared.lock().figures)
    }
}

/// The thread's body: a round over every running VM each `every`, and a
/// reading of each newcomer as soon as it is seen.
fn sample(backend: &dyn Lifecycle, board: &Board, every: Duration, stop: &StopFlag) {
    let Some(meters) = backend.meters() else {
        return;
    };
    let mut last: HashMap<Id, Taken> = HashMap::new();
    let mut next_round = Instant::now();
    while !stop.stopped() {
        let (ids, round) = {
            let mut s = board.shared.lock();
            let round = Instant::now() >= next_round;
            if !round && !s.newcomers {
                let wait = next_round.saturating_duration_since(Instant::now());
                board.bell.wait_for(&mut s, wait.min(GLANCE));
                continue;
            }
            s.newcomers = false;
            let ids: Vec<Id> = if round {
                s.running.clone()
            } else {
                s.running
                    .iter()
                    .filter(|id| !last.contains_key(*id))
                    .cloned()
                    .collect()
            };
            (ids, round)
        };
        if round {
            next_round = Instant::now() + every;
            last.retain(|id, _| ids.contains(id));
        }
        let mut found = Vec::with_capacity(ids.len());
        for id in ids {
            if stop.stopped() {
                return;
            }
            let Some(reading) = meters.read(&id) else {
                last.remove(&id);
                continue;
            };
            let now = Taken {
                at: Instant::now(),
                at_ms: crate::human::unix_ms(std::time::SystemTime::now()),
                reading,
            };
            found.push((id.to_string(), figures(last.get(&id), &now)));
            last.insert(id, now);
        }
        let mut s = board.shared.lock();
        let mut figures = if round {
            HashMap::with_capacity(found.len())
        } else {
            HashMap::clone(&s.figures)
        };
        figures.extend(found);
        s.figures = Arc::new(figures);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provision::{DiskCounts, NetCounts};

    fn taken(at: Instant, pid: u32, cpu_ns: u64, read_bytes: u64, rx: u64) -> Taken {
        Taken {
            at,
            at_ms: 0,
            reading: Reading {
                pid,
                started: 7,
                cpu_ns: Some(cpu_ns),
                resident_bytes: Some(1 << 20),
                disk: Some(DiskCounts {
                    read_bytes,
                    write_bytes: 0,
                    read_ops: read_bytes / 4096,
                    write_ops: 0,
                }),
                net: Some(NetCounts {
                    rx_bytes: rx,
                    tx_bytes: 0,
                }),
                net_from: NetSource::Vmm,
            },
        }
    }

    #[test]
    fn rates_are_what_grew_over_the_time_between_two_readings() {
        let t0 = Instant::now();
        let before = taken(t0, 10, 0, 0, 0);
        let now = taken(
            t0 + Duration::from_secs(2),
            10,
            1_000_000_000,
            8 << 20,
            2000,
        );

        let usage = figures(Some(&before), &now);

        assert_eq!(usage.cpu_millis, Some(500));
        assert_eq!(usage.disk_read_bps, Some(4 << 20));
        assert_eq!(usage.disk_read_iops, Some(1024));
        assert_eq!(usage.net_rx_bps, Some(1000));
        assert_eq!(usage.over_ms, 2000);
    }

    #[test]
    fn a_new_hypervisor_process_starts_its_rates_anew() {
        let t0 = Instant::now();
        let before = taken(t0, 10, 5_000_000_000, 1 << 30, 0);
        let now = taken(t0 + Duration::from_secs(2), 11, 1_000_000, 4096, 0);

        let usage = figures(Some(&before), &now);

        assert_eq!((usage.cpu_millis, usage.disk_read_bps), (None, None));
        assert_eq!(usage.totals.disk_read_bytes, Some(4096));
    }

    #[test]
    fn a_total_that_fell_has_no_rate() {
        let t0 = Instant::now();
        let before = taken(t0, 10, 5_000_000_000, 1 << 30, 0);
        let now = taken(t0 + Duration::from_secs(1), 10, 6_000_000_000, 0, 0);

        let usage = figures(Some(&before), &now);

        assert_eq!(usage.disk_read_bps, None);
        assert_eq!(usage.cpu_millis, Some(1000));
    }
}
