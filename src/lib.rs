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
//! - [`reconcile`]: the engine: `Engine::step` routes a snapshot to one
//!   worker thread per VM and aggregates their results into a report.
//! - [`provision`]: the hypervisor backend seam.
//! - [`deadline`], [`error`]: what every blocking, fallible call shares.
//! - [`version`]: release ordering for the snapshot's version floor.
//! - [`testkit`]: fakes of every seam, for engine tests and benchmarks.

pub mod base64;
pub mod cli;
pub mod config;
pub mod console;
pub mod crash;
pub mod daemon;
pub mod deadline;
pub mod disk;
pub mod error;
pub mod hex;
pub mod hostkey;
pub mod human;
pub mod image;
pub mod logonce;
pub mod metrics;
pub mod model;
pub mod net;
pub mod pb;
pub mod programs;
pub mod provision;
pub mod quote;
pub mod reconcile;
pub mod seed;
pub mod source;
pub mod stages;
pub mod state;
pub mod status;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod threads;
pub mod version;
