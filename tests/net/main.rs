//! The host network against real clients in network namespaces the tests
//! make (DHCP, snooping, the underlay), one module each, in one test crate.

mod dhcp;
mod snoop;
mod underlay;
