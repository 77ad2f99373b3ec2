//! Learning the address of a VM's second NIC, which the site's own DHCP
//! server grants (the agent hands out nothing there).
//!
//! A snooper watches the NIC's tap and learns from:
//! - a DHCP ACK to the VM's MAC: the address, until its lease expires;
//! - a NAK to it, or a RELEASE or DECLINE from it: forget the address;
//! - ARP or IPv4 from the VM's MAC with a source address: a guest with a
//!   static address is learned from its own traffic.
//!
//! What is learned is persisted: a guest asks again only at renewal, so an
//! agent restart must not forget an address it cannot learn again for hours.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::dhcp::codec::{Frame, Kind, Message, option};
use super::packet::PacketSocket;
use crate::model::Mac;
use crate::state::atomic::write_atomic;
use crate::threads::OwnedThread;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    ip: Ipv4Addr,
    /// Unix seconds; `None` for an address learned from traffic.
    expires: Option<u64>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Learned second-NIC addresses by MAC, persisted.
pub struct Learned {
    path: PathBuf,
    map: Mutex<BTreeMap<String, Entry>>,
}

impl Learned {
    /// Loads what was learned before (absent or unreadable = nothing: a
    /// learned address is an observation, and will be observed again).
    pub fn open(path: &Path) -> Learned {
        let map = std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Learned {
            path: path.to_path_buf(),
            map: Mutex::new(map),
        }
    }

    /// The address, unless its lease has run out.
    pub fn get(&self, mac: &str) -> Option<Ipv4Addr> {
        let map = self.map.lock();
        let entry = map.get(mac)?;
        match entry.expires {
            Some(at) if at <= now_unix() => None,
            _ => Some(entry.ip),
        }
    }

    fn set(&self, mac: &str, entry: Entry) {
        let mut map = self.map.lock();
        if map.get(mac) == Some(&entry) {
            return;
        }
        map.insert(mac.to_owned(), entry);
        self.save(&map);
    }

    /// Forgets the address of `mac` (a NAK, RELEASE, DECLINE, or destroy).
    pub fn forget(&self, mac: &str) {
        let mut map = self.map.lock();
        if map.remove(mac).is_some() {
            self.save(&map);
        }
    }

    fn save(&self, map: &BTreeMap<String, Entry>) {
        let result = self
            .path
            .parent()
            .map_or(Ok(()), crate::state::perms::make_dir)
            .and_then(|()| {
                write_atomic(
                    &self.path,
                    &serde_json::to_vec_pretty(map).map_err(std::io::Error::other)?,
                )
            });
        if let Err(e) = result {
            log::warn!(
                "cannot save learned addresses to {}: {e}",
                self.path.display()
            );
        }
    }
}

/// What one frame teaches about `mac`'s address.
enum Lesson {
    Learn(Ipv4Addr, Option<u64>),
    Forget,
}

fn lesson(frame: &[u8], mac: [u8; 6]) -> Option<Lesson> {
    let ethertype = frame.get(12..14)?;
    let from_vm = frame.get(6..12)? == mac;
    if ethertype == [0x08, 0x06] {
        // ARP: sender MAC at 22..28, sender IP at 28..32.
        let arp = frame.get(14..42)?;
        let sender_ip = Ipv4Addr::new(arp[14], arp[15], arp[16], arp[17]);
        return (arp[8..14] == mac && !sender_ip.is_unspecified())
            .then_some(Lesson::Learn(sender_ip, None));
    }
    let f = Frame::parse(frame).ok()?;
    if (f.dst_port == 68 || f.dst_port == 67)
        && let Ok(m) = Message::parse(f.payload)
        && m.chaddr == mac
    {
        return match m.kind()? {
            Kind::Ack if !m.yiaddr.is_unspecified() => {
                let secs = m
                    .option(option::LEASE_TIME)
                    .filter(|d| d.len() == 4)
                    .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
                Some(Lesson::Learn(
                    m.yiaddr,
                    secs.map(|s| now_unix() + u64::from(s)),
                ))
            }
            Kind::Nak | Kind::Release | Kind::Decline => Some(Lesson::Forget),
            _ => None,
        };
    }
    (from_vm && !f.src_ip.is_unspecified()).then_some(Lesson::Learn(f.src_ip, None))
}

/// The `snoop-<tap>` thread; stopped and joined on drop.
pub struct Snooper {
    _thread: OwnedThread,
}

impl Snooper {
    pub fn start(iface: &str, mac: Mac, learned: Arc<Learned>) -> std::io::Result<Snooper> {
        let (key, mac) = (mac.to_string(), mac.octets());
        let socket = PacketSocket::open(iface, Some(Duration::from_millis(200)))?;
        let thread = OwnedThread::spawn(format!("snoop-{iface}"), 128 * 1024, None, move |stop| {
            let mut buf = vec![0u8; 2048];
            while !stop.stopped() {
                let n = match socket.recv(&mut buf) {
                    Ok(n) => n,
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                        ) =>
                    {
                        continue;
                    }
                    Err(_) => return, // the tap is gone
                };
                match lesson(&buf[..n], mac) {
                    Some(Lesson::Learn(ip, expires)) => learned.set(&key, Entry { ip, expires }),
                    Some(Lesson::Forget) => learned.forget(&key),
                    None => {}
                }
            }
        })?;
        Ok(Snooper { _thread: thread })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::dhcp::codec::build_frame;

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 5];

    fn dhcp(kind: Kind, yiaddr: Ipv4Addr) -> Vec<u8> {
        let m = Message {
            yiaddr,
            options: vec![
                (option::MESSAGE_TYPE, vec![kind.byte()]),
                (option::LEASE_TIME, 600u32.to_be_bytes().to_vec()),
            ],
            ..Message::new(2, 1, MAC)
        };
        build_frame(
            [2, 9, 9, 9, 9, 9],
            MAC,
            (Ipv4Addr::new(192, 0, 2, 1), 67),
            (yiaddr, 68),
            &m.encode(),
        )
    }

    #[test]
    fn an_ack_teaches_the_address_with_its_lease() {
        let lesson = lesson(&dhcp(Kind::Ack, Ipv4Addr::new(192, 0, 2, 7)), MAC);

        assert!(
            matches!(lesson, Some(Lesson::Learn(ip, Some(_))) if ip == Ipv4Addr::new(192, 0, 2, 7))
        );
    }

    #[test]
    fn a_nak_forgets() {
        assert!(matches!(
            lesson(&dhcp(Kind::Nak, Ipv4Addr::UNSPECIFIED), MAC),
            Some(Lesson::Forget)
        ));
    }

    #[test]
    fn an_expired_lease_reads_as_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let learned = Learned::open(&dir.path().join("l.json"));

        learned.set(
            "m",
            Entry {
                ip: Ipv4Addr::new(192, 0, 2, 9),
                expires: Some(1),
            },
        );

        assert_eq!(learned.get("m"), None);
    }
}
