//! What the engine counts, for the metrics file: steps, create attempts
//! and how they ended, boots, VMs lost (their hypervisor gone without a
//! stop asked), suspends and resumes (and the resumes that had to boot
//! from the disks instead, and what their guest agents made of them), VMs
//! destroyed, and probes failed and the
//! restarts they caused. A VM's own series are dropped when it is
//! destroyed.

use crate::metrics::{BOOT_BUCKETS, Counter, CounterVec, FAST_BUCKETS, Histogram};

#[derive(Debug)]
pub struct Counts {
    /// How long `Engine::step` took.
    pub steps: Histogram,
    pub create_attempts: Counter,
    /// Failed creates, by `permanent`, `transient` or `host` (a host
    /// condition: no attempt spent).
    pub create_failures: CounterVec,
    /// Attempts given back (the pass ran out of time, not the VM).
    pub refunds: Counter,
    /// Booted again after an unasked death, per VM.
    pub lost: CounterVec,
    /// Successful boots: from asking the hypervisor to its saying running.
    pub boots: Histogram,
    /// Successful suspends: from asking the backend to its committed save.
    pub suspends: Histogram,
    /// Successful resumes: from asking the backend to its guest running.
    pub resumes: Histogram,
    /// Suspended VMs booted from their disks instead of resumed, by why:
    /// `gone`, `unusable` (torn, or other disks), `failed` (a resume that
    /// did not end running), `interrupted` (a crash mid-suspend or
    /// mid-resume left nothing to continue).
    pub cold_boots: CounterVec,
    pub destroyed: Counter,
    /// Wakes on traffic: from the first frame for a sleeping guest to its
    /// guest running.
    pub wakes: Histogram,
    /// Running VMs suspended by the agent because their NICs were idle.
    pub idle_suspends: Counter,
    /// Wakes that ended a sleep shorter than the VM's idle time: a wake
    /// loop, which stretches its next idle time.
    pub wake_loops: Counter,
    /// Resumed guests made whole by their guest agent (entropy, clock), by
    /// how it went: `done`, `no_agent`, `failed`.
    pub made_whole: CounterVec,
    /// From a resumed guest running to its guest agent's answer.
    pub guest_after_resume: Histogram,
    /// Probes failed by a VM past its grace or after it was ready, per VM.
    pub unhealthy: CounterVec,
    /// VMs booted again by their probe's `restart_after`, per VM.
    pub probe_restarts: CounterVec,
    /// Kernel panics seen on a VM's console, per VM.
    pub guest_panics: CounterVec,
    /// What each VM is held to now, by its id: its pass's last word.
    pub held: parking_lot::Mutex<std::collections::BTreeMap<String, Held>>,
}

/// What one VM is held to, for the metrics file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The limits it runs with; `None` where the backend holds none.
    pub limits: Option<crate::model::VmLimits>,
    /// Ranges in its own egress lists held on the host.
    pub deny: usize,
    pub allow: usize,
    /// Whether its readiness probe answers now; `None` without a probe or
    /// a running guest.
    pub answering: Option<bool>,
}

impl Default for Counts {
    fn default() -> Counts {
        let create_failures = CounterVec::default();
        create_failures.touch("permanent");
        create_failures.touch("transient");
        create_failures.touch("host");
        let cold_boots = CounterVec::default();
        for why in ["gone", "unusable", "failed", "interrupted"] {
            cold_boots.touch(why);
        }
        let made_whole = CounterVec::default();
        for how in ["done", "no_agent", "failed"] {
            made_whole.touch(how);
        }
        Counts {
            steps: Histogram::new(FAST_BUCKETS),
            create_attempts: Counter::default(),
            create_failures,
            refunds: Counter::default(),
            lost: CounterVec::default(),
            boots: Histogram::new(BOOT_BUCKETS),
            suspends: Histogram::new(BOOT_BUCKETS),
            resumes: Histogram::new(BOOT_BUCKETS),
            cold_boots,
            destroyed: Counter::default(),
            wakes: Histogram::new(BOOT_BUCKETS),
            idle_suspends: Counter::default(),
            wake_loops: Counter::default(),
            made_whole,
            guest_after_resume: Histogram::new(FAST_BUCKETS),
            unhealthy: CounterVec::default(),
            probe_restarts: CounterVec::default(),
            guest_panics: CounterVec::default(),
            held: parking_lot::Mutex::default(),
        }
    }
}
