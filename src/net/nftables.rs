//! A port's guard elements, added and removed by nf_tables netlink: one
//! batch on a socket, where `nft -f` forked and exec'd a program that
//! parses the same text (3.5 ms of every create and of every VM re-guarded
//! at a restart, measured with `make bench-create`; the batch takes tens of
//! microseconds). What a batch does is exactly the `nft` text of
//! [`port_ruleset`](super::rules::port_ruleset) and
//! [`unport_ruleset`](super::rules::unport_ruleset), which the caller
//! runs with `nft` when this fails and names in its errors.
//!
//! The sets are the ones [`nft_ruleset`](super::rules::nft_ruleset)
//! declares: `macs` (ifname . ether_addr) and `addrs` (ifname .
//! ipv4_addr), and `asleep` (ifname: a sleeping VM's tap, on its wake's
//! path). A concatenated key is each field padded to
//! four bytes: an interface name is 16 bytes, zero-filled; a MAC 6 bytes
//! and 2 of padding; an IPv4 address 4 bytes in network order.

use std::io;
use std::net::Ipv4Addr;

use super::netlink::{Message, NETLINK_NETFILTER, NLM_F_ACK, Socket};
use super::port::Port;

const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NLM_F_CREATE: u16 = 0x400;
const NFPROTO_BRIDGE: u8 = 7;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
const IFNAMSIZ: usize = 16;

/// Adds `port`'s elements to the guard sets of `table`, in one batch (an
/// element already there is no error).
pub fn add(table: &str, port: &Port<'_>) -> io::Result<()> {
    let mut batch = Batch::new();
    for (set, key) in elements(port)? {
        batch.element(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, set, &key);
    }
    batch.send()
}

/// Removes `port`'s elements from the guard sets of `table`, in one batch;
/// each is added first, so one that is absent is no error.
pub fn remove(table: &str, port: &Port<'_>) -> io::Result<()> {
    let mut batch = Batch::new();
    for (set, key) in elements(port)? {
        batch.element(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, set, &key);
        batch.element(NFT_MSG_DELSETELEM, 0, table, set, &key);
    }
    batch.send()
}

/// Puts the tap `tap` in the `asleep` set of `table` (`on`), or takes it
/// out (added first, so one that is absent is no error), in one batch.
pub fn asleep(table: &str, tap: &str, on: bool) -> io::Result<()> {
    let key = ifname(tap)?;
    let mut batch = Batch::new();
    batch.element(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, "asleep", &key);
    if !on {
        batch.element(NFT_MSG_DELSETELEM, 0, table, "asleep", &key);
    }
    batch.send()
}

/// Each set `port` has an element in, with the element's key.
fn elements(port: &Port<'_>) -> io::Result<Vec<(&'static str, Vec<u8>)>> {
    let name = ifname(port.tap)?;
    let mut mac = port.mac.octets().to_vec();
    mac.extend_from_slice(&[0, 0]);
    let mut out = vec![("macs", [name.as_slice(), &mac].concat())];
    if let Some(ip) = port.ip {
        out.push(address(port.tap, ip)?);
    }
    Ok(out)
}

/// The `addrs` element that lets `tap` send from `ip`.
fn address(tap: &str, ip: Ipv4Addr) -> io::Result<(&'static str, Vec<u8>)> {
    Ok(("addrs", [ifname(tap)?.as_slice(), &ipv4(ip)].concat()))
}

/// Lets `tap` send from `ip` (a site NIC's granted address), or no longer
/// from `old`, in one batch.
pub fn rebind(
    table: &str,
    tap: &str,
    old: Option<Ipv4Addr>,
    new: Option<Ipv4Addr>,
) -> io::Result<()> {
    let mut batch = Batch::new();
    if let Some(old) = old {
        let (set, key) = address(tap, old)?;
        batch.element(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, set, &key);
        batch.element(NFT_MSG_DELSETELEM, 0, table, set, &key);
    }
    if let Some(new) = new {
        let (set, key) = address(tap, new)?;
        batch.element(NFT_MSG_NEWSETELEM, NLM_F_CREATE, table, set, &key);
    }
    batch.send()
}

fn ifname(tap: &str) -> io::Result<[u8; IFNAMSIZ]> {
    if tap.is_empty() || tap.len() >= IFNAMSIZ || tap.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{tap:?} is not an interface name"),
        ));
    }
    let mut name = [0u8; IFNAMSIZ];
    name[..tap.len()].copy_from_slice(tap.as_bytes());
    Ok(name)
}

fn ipv4(ip: Ipv4Addr) -> [u8; 4] {
    ip.octets()
}

/// An nf_tables transaction: begin, the messages, end, in one datagram.
struct Batch {
    messages: Vec<u8>,
    acked: Vec<u32>,
    seq: u32,
}

impl Batch {
    fn new() -> Batch {
        let mut batch = Batch {
            messages: Vec::new(),
            acked: Vec::new(),
            seq: 0,
        };
        batch.frame(NFNL_MSG_BATCH_BEGIN);
        batch
    }

    fn next_seq(&mut self) -> u32 {
        self.seq += 1;
        self.seq
    }

    /// A batch's begin or end: `struct nfgenmsg` naming the subsystem.
    fn frame(&mut self, kind: u16) {
        let seq = self.next_seq();
        let mut m = Message::new(kind, 0, seq);
        m.raw(&[0, 0]);
        m.raw(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
        self.messages.extend(m.finish());
    }

    fn element(&mut self, op: u16, flags: u16, table: &str, set: &str, key: &[u8]) {
        let seq = self.next_seq();
        let mut m = Message::new((NFNL_SUBSYS_NFTABLES << 8) | op, flags | NLM_F_ACK, seq);
        // struct nfgenmsg: the family, version 0, resource id 0.
        m.raw(&[NFPROTO_BRIDGE, 0, 0, 0]);
        m.attr(NFTA_SET_ELEM_LIST_TABLE, &nul_terminated(table));
        m.attr(NFTA_SET_ELEM_LIST_SET, &nul_terminated(set));
        let list = m.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
        let element = m.begin(NFTA_LIST_ELEM);
        let key_at = m.begin(NFTA_SET_ELEM_KEY);
        m.attr(NFTA_DATA_VALUE, key);
        m.end(key_at);
        m.end(element);
        m.end(list);
        self.messages.extend(m.finish());
        self.acked.push(seq);
    }

    fn send(mut self) -> io::Result<()> {
        self.frame(NFNL_MSG_BATCH_END);
        Socket::open(NETLINK_NETFILTER)?.ask_all(&self.messages, &self.acked)
    }
}

fn nul_terminated(s: &str) -> Vec<u8> {
    let mut bytes = s.as_bytes().to_vec();
    bytes.push(0);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Mac;

    #[test]
    fn a_mac_key_is_the_name_zero_filled_then_the_mac_padded() {
        let port = Port {
            tap: "et5",
            mac: Mac::from([2, 0xe1, 0, 0, 0, 7]),
            ip: None,
        };

        let keys = elements(&port).expect("elements");

        assert_eq!(keys.len(), 1);
        let (set, key) = &keys[0];
        assert_eq!(*set, "macs");
        assert_eq!(key.len(), 24);
        assert_eq!(&key[..4], b"et5\0");
        assert!(key[4..16].iter().all(|b| *b == 0));
        assert_eq!(&key[16..], &[2, 0xe1, 0, 0, 0, 7, 0, 0]);
    }

    #[test]
    fn an_underlay_port_has_its_address_in_network_order() {
        let port = Port {
            tap: "et5",
            mac: Mac::from([2, 0xe1, 0, 0, 0, 7]),
            ip: Some(Ipv4Addr::new(100, 77, 0, 9)),
        };

        let keys = elements(&port).expect("elements");

        let sets: Vec<&str> = keys.iter().map(|(s, _)| *s).collect();
        assert_eq!(sets, ["macs", "addrs"]);
        assert_eq!(&keys[1].1[16..], &[100, 77, 0, 9]);
    }

    #[test]
    fn a_name_too_long_for_an_interface_is_refused() {
        let port = Port {
            tap: "a-name-of-16-byt",
            mac: Mac::from([2, 0, 0, 0, 0, 1]),
            ip: None,
        };

        assert!(elements(&port).is_err());
    }
}
