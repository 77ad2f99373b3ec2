//! The engine against the fake provisioner (the README's "Test", layer 2), and the
//! daemon's main loop over it, one module per concern, in one test crate:
//! one link instead of ten.

#[path = "../common/mod.rs"]
mod common;

mod capabilities;
mod clones;
mod create;
mod daemon;
mod lifecycle;
mod lifecycle_table;
mod logging;
mod resize;
mod step;
mod suspend;
mod tenant;
mod volumes;
