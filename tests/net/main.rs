//! The host network against real clients in network namespaces the tests
//! make (DHCP, snooping, the underlay, published ports), one module each, in one test crate.

mod activity;
mod dhcp;
mod interfaces;
mod publish;
mod sleepers;
mod snoop;
mod underlay;
