//! eitri-agent: the host agent of a microVM platform.
//!
//! It reads the host's desired state (a snapshot from a control plane or a
//! local file), drives the host toward it through a hypervisor backend, and
//! reports what the host actually has. See `DESIGN.md` in the shared docs for
//! the architecture; the module map:
//!
//! - [`model`]: checked domain types (ids, specs, power states, reports).
//! - [`pb`]: wire types generated from `proto/`, and conversion to [`model`].
//! - [`state`]: the crash-safe state directory.
//! - [`version`]: release ordering for the snapshot's version floor.

pub mod model;
pub mod pb;
pub mod state;
pub mod version;
