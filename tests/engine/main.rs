//! The engine against the fake provisioner (DESIGN.md, layer 2), one module
//! per concern, in one test crate: one link instead of eight.

#[path = "../common/mod.rs"]
mod common;

mod create;
mod lifecycle;
mod lifecycle_table;
mod logging;
mod resize;
mod step;
mod suspend;
mod tenant;
