//! A VM's tap as the underlay's guard sees it: what the nft rule text
//! (every platform) and the netlink elements (Linux) are made from.

use std::net::Ipv4Addr;

use crate::model::Mac;

/// A VM's tap as the guard knows it.
#[derive(Clone, Copy, Debug)]
pub struct Port<'a> {
    pub tap: &'a str,
    pub mac: Mac,
    /// Its underlay address; `None` on a site network, whose addresses the
    /// site's own DHCP grants (the MAC is held there, not the address).
    pub ip: Option<Ipv4Addr>,
}
