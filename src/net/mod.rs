//! Host networking on Linux: the underlay's addresses, and the DHCP that
//! tells each guest its own. The pieces that open packet sockets (the
//! responder, the snooper, the host network that runs them) are Linux's;
//! addresses, ranges, the DHCP codec and the nft text build everywhere.
//!
//! The host allocates every guest's underlay address (so it is known at
//! boot) and the guest learns it by DHCP from a responder the agent runs
//! on that guest's tap; no address is baked into the seed.

pub mod addresses;
mod command;
#[cfg(target_os = "linux")]
pub mod conntrack;
pub mod dhcp;
#[cfg(target_os = "linux")]
pub mod host;
#[cfg(target_os = "linux")]
pub mod netlink;
#[cfg(target_os = "linux")]
pub mod nftables;
#[cfg(target_os = "linux")]
pub mod packet;
pub mod port;
#[cfg(target_os = "linux")]
pub mod publish;
#[cfg(target_os = "linux")]
pub mod rivals;
pub mod rules;
#[cfg(target_os = "linux")]
pub mod snoop;
pub mod underlay;
