//! The state dir: the store's crash-safety and locking rules, and the
//! daemon's start-up recovery of what a killed agent left, one module each,
//! in one test crate.

mod recover;
mod store;
