//! What the engine counts, for the metrics file: steps, create attempts
//! and how they ended, boots, VMs lost (their hypervisor gone without a
//! stop asked) and VMs destroyed. A VM's own series are dropped when it is
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
    pub destroyed: Counter,
}

impl Default for Counts {
    fn default() -> Counts {
        let create_failures = CounterVec::default();
        create_failures.touch("permanent");
        create_failures.touch("transient");
        create_failures.touch("host");
        Counts {
            steps: Histogram::new(FAST_BUCKETS),
            create_attempts: Counter::default(),
            create_failures,
            refunds: Counter::default(),
            lost: CounterVec::default(),
            boots: Histogram::new(BOOT_BUCKETS),
            destroyed: Counter::default(),
        }
    }
}
