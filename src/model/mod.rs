//! The agent's domain types: what the engine reasons about.
//!
//! Wire types (`crate::pb`) are raw input from the network or a file; these
//! are the checked form. Conversion (`crate::pb::convert`) validates once, so
//! everything below it can trust an [`Id`] to be safe as a path component and
//! a [`PowerState`] to be one of three values.

mod cidr;
mod id;
mod mac;
mod publish;
mod quota;
mod report;
mod saved;
mod spec;

pub use cidr::{Cidr, CidrError, IpRange};
pub use id::{Id, IdError, MAX_ID_LEN};
pub use mac::Mac;
pub use publish::{HostPort, PortRange, Publish, Transport, unpublishable};
pub use quota::{Committed, Quota};
pub use report::{
    ANSWERED, GUEST_AGENT_READY, GuestMemory, HYPERVISOR_ONLY, QuarantinedVm, Report, Rows,
    UNHEALTHY, VmStatus, VolumeState, VolumeStatus, is_unhealthy,
};
pub use saved::Saved;
pub use spec::{
    Check, DesiredVm, Egress, LimitDefaults, Limits, OnPanic, Phase, PowerState, Readiness,
    Rejected, Sleep, Snapshot, SpecError, VmLimits, VmSpec, VolumeSpec, WantedVm, WantedVolume,
    is_hostname,
};
