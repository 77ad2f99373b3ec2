//! Host networking on Linux: the underlay's addresses, and the DHCP that
//! tells each guest its own.
//!
//! The host allocates every guest's underlay address (so it is known at
//! boot) and the guest learns it by DHCP from a responder the agent runs
//! on that guest's tap; no address is baked into the seed.

pub mod addresses;
pub mod cidr;
pub mod dhcp;
pub mod host;
pub mod packet;
pub mod snoop;
pub mod underlay;
