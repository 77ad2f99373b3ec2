//! A DHCP responder for one VM: it answers that VM's MAC, and nothing else.
//!
//! The rules, from RFC 2131 for a server that owns exactly one lease:
//! - DISCOVER → OFFER of the VM's address.
//! - REQUEST naming another server (option 54) → silence: the client chose
//!   someone else. Otherwise the requested address (option 50, or ciaddr
//!   when renewing) is ACKed if it is the VM's, NAKed if not.
//! - INFORM → ACK with the configuration and no lease.
//! - RELEASE, DECLINE, anything from another MAC → silence.
//!
//! The client is recognised by its hardware address, not its client id
//! (option 61): a guest sending a DUID still gets its MAC's address.

pub mod codec;
#[cfg(target_os = "linux")]
mod responder;

use std::net::Ipv4Addr;

use codec::{Kind, Message, option};
#[cfg(target_os = "linux")]
pub use responder::{Responder, ResponderStats};

/// What one VM is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
    pub netmask: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub dns: Vec<Ipv4Addr>,
    pub lease_secs: u32,
}

impl Lease {
    /// The server identifier: the gateway, the only host the guest talks to.
    pub fn server_id(&self) -> Ipv4Addr {
        self.gateway
    }
}

/// The reply to `req`, or `None` when the rules say nothing.
pub fn respond(lease: &Lease, req: &Message) -> Option<Message> {
    if req.op != 1 || req.chaddr != lease.mac {
        return None;
    }
    match req.kind()? {
        Kind::Discover => Some(reply(lease, req, Kind::Offer)),
        Kind::Request => {
            if let Some(server) = req.option_ip(option::SERVER_ID)
                && server != lease.server_id()
            {
                return None;
            }
            let asked = req.option_ip(option::REQUESTED_IP).unwrap_or(req.ciaddr);
            if asked == lease.ip {
                Some(reply(lease, req, Kind::Ack))
            } else {
                Some(nak(lease, req))
            }
        }
        Kind::Inform => Some(reply(lease, req, Kind::Ack)).map(|mut m| {
            // An INFORM client has its address; it gets configuration only.
            m.yiaddr = Ipv4Addr::UNSPECIFIED;
            m.options.retain(|(c, _)| {
                ![
                    option::LEASE_TIME,
                    option::RENEWAL_TIME,
                    option::REBINDING_TIME,
                ]
                .contains(c)
            });
            m
        }),
        Kind::Offer | Kind::Ack | Kind::Nak | Kind::Release | Kind::Decline => None,
    }
}

fn base(req: &Message, yiaddr: Ipv4Addr, options: Vec<(u8, Vec<u8>)>) -> Message {
    Message {
        flags: req.flags,
        ciaddr: req.ciaddr,
        yiaddr,
        giaddr: req.giaddr,
        options,
        ..Message::new(2, req.xid, req.chaddr)
    }
}

fn reply(lease: &Lease, req: &Message, kind: Kind) -> Message {
    let secs = lease.lease_secs;
    let mut options = vec![
        (option::MESSAGE_TYPE, vec![kind.byte()]),
        (option::SERVER_ID, lease.server_id().octets().to_vec()),
        (option::LEASE_TIME, secs.to_be_bytes().to_vec()),
        (option::RENEWAL_TIME, (secs / 2).to_be_bytes().to_vec()),
        (
            option::REBINDING_TIME,
            (secs / 8 * 7).to_be_bytes().to_vec(),
        ),
        (option::SUBNET_MASK, lease.netmask.octets().to_vec()),
        (option::ROUTER, lease.gateway.octets().to_vec()),
    ];
    if !lease.dns.is_empty() {
        options.push((
            option::DNS,
            lease.dns.iter().flat_map(|ip| ip.octets()).collect(),
        ));
    }
    base(req, lease.ip, options)
}

fn nak(lease: &Lease, req: &Message) -> Message {
    let mut m = base(
        req,
        Ipv4Addr::UNSPECIFIED,
        vec![
            (option::MESSAGE_TYPE, vec![Kind::Nak.byte()]),
            (option::SERVER_ID, lease.server_id().octets().to_vec()),
        ],
    );
    m.ciaddr = Ipv4Addr::UNSPECIFIED;
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    fn lease() -> Lease {
        Lease {
            mac: MAC,
            ip: Ipv4Addr::new(100, 77, 0, 9),
            netmask: Ipv4Addr::new(255, 255, 0, 0),
            gateway: Ipv4Addr::new(100, 77, 0, 1),
            dns: vec![Ipv4Addr::new(100, 77, 0, 1)],
            lease_secs: 3600,
        }
    }

    fn request(kind: Kind, options: Vec<(u8, Vec<u8>)>) -> Message {
        let mut all = vec![(option::MESSAGE_TYPE, vec![kind.byte()])];
        all.extend(options);
        Message {
            options: all,
            ..Message::new(1, 7, MAC)
        }
    }

    #[test]
    fn discover_gets_an_offer_of_the_vms_address() {
        let offer = respond(&lease(), &request(Kind::Discover, vec![])).expect("offer");

        assert_eq!(offer.kind(), Some(Kind::Offer));
        assert_eq!(offer.yiaddr, lease().ip);
        for code in [
            option::SERVER_ID,
            option::LEASE_TIME,
            option::SUBNET_MASK,
            option::ROUTER,
            option::DNS,
        ] {
            assert!(offer.option(code).is_some(), "option {code}");
        }
    }

    #[test]
    fn request_for_the_vms_address_is_acked() {
        let req = request(
            Kind::Request,
            vec![(option::REQUESTED_IP, lease().ip.octets().to_vec())],
        );

        assert_eq!(
            respond(&lease(), &req).and_then(|m| m.kind()),
            Some(Kind::Ack)
        );
    }

    #[test]
    fn request_for_another_address_is_naked() {
        let req = request(
            Kind::Request,
            vec![(option::REQUESTED_IP, vec![100, 77, 0, 99])],
        );

        assert_eq!(
            respond(&lease(), &req).and_then(|m| m.kind()),
            Some(Kind::Nak)
        );
    }

    #[test]
    fn renewal_by_ciaddr_is_acked() {
        let mut req = request(Kind::Request, vec![]);
        req.ciaddr = lease().ip;

        assert_eq!(
            respond(&lease(), &req).and_then(|m| m.kind()),
            Some(Kind::Ack)
        );
    }

    #[test]
    fn request_naming_another_server_gets_silence() {
        let req = request(
            Kind::Request,
            vec![
                (option::SERVER_ID, vec![192, 0, 2, 1]),
                (option::REQUESTED_IP, lease().ip.octets().to_vec()),
            ],
        );

        assert_eq!(respond(&lease(), &req), None);
    }

    #[test]
    fn inform_gets_configuration_without_a_lease() {
        let ack = respond(&lease(), &request(Kind::Inform, vec![])).expect("ack");

        assert_eq!(ack.kind(), Some(Kind::Ack));
        assert_eq!(ack.option(option::LEASE_TIME), None);
        assert_eq!(ack.yiaddr, Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn another_mac_gets_silence() {
        let mut req = request(Kind::Discover, vec![]);
        req.chaddr = [2, 0, 0, 0, 0, 2];

        assert_eq!(respond(&lease(), &req), None);
    }

    #[test]
    fn a_duid_client_id_still_gets_its_macs_address() {
        let duid = vec![255, 0, 0, 0, 1, 0, 2, 0, 0, 0, 1, 0x2a];
        let offer = respond(
            &lease(),
            &request(Kind::Discover, vec![(option::CLIENT_ID, duid)]),
        )
        .expect("offer");

        assert_eq!(offer.yiaddr, lease().ip);
    }

    #[test]
    fn release_and_decline_get_silence() {
        assert_eq!(respond(&lease(), &request(Kind::Release, vec![])), None);
        assert_eq!(respond(&lease(), &request(Kind::Decline, vec![])), None);
    }
}
