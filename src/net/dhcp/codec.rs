//! DHCP (RFC 2131/2132) messages and the Ethernet/IPv4/UDP frames around
//! them, by hand: the card has no DHCP crate, and the subset a one-client
//! responder needs is small. Every length is checked before it is used; a
//! malformed packet is an error value, never a panic.

use std::fmt;
use std::net::Ipv4Addr;

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
const MAGIC: [u8; 4] = [99, 130, 83, 99];
/// op, htype, hlen, hops, xid, secs, flags, 4 addresses, chaddr, sname, file.
const FIXED: usize = 236;

pub mod option {
    pub const PAD: u8 = 0;
    pub const SUBNET_MASK: u8 = 1;
    pub const ROUTER: u8 = 3;
    pub const DNS: u8 = 6;
    pub const REQUESTED_IP: u8 = 50;
    pub const LEASE_TIME: u8 = 51;
    pub const MESSAGE_TYPE: u8 = 53;
    pub const SERVER_ID: u8 = 54;
    pub const RENEWAL_TIME: u8 = 58;
    pub const REBINDING_TIME: u8 = 59;
    pub const CLIENT_ID: u8 = 61;
    pub const END: u8 = 255;
}

/// DHCP message types (option 53).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Discover,
    Offer,
    Request,
    Decline,
    Ack,
    Nak,
    Release,
    Inform,
}

impl Kind {
    pub fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Discover,
            2 => Kind::Offer,
            3 => Kind::Request,
            4 => Kind::Decline,
            5 => Kind::Ack,
            6 => Kind::Nak,
            7 => Kind::Release,
            8 => Kind::Inform,
            _ => return None,
        })
    }

    pub fn byte(self) -> u8 {
        match self {
            Kind::Discover => 1,
            Kind::Offer => 2,
            Kind::Request => 3,
            Kind::Decline => 4,
            Kind::Ack => 5,
            Kind::Nak => 6,
            Kind::Release => 7,
            Kind::Inform => 8,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Malformed {
    Short(&'static str),
    NotDhcp(&'static str),
    BadOption(u8),
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Malformed::Short(what) => write!(f, "truncated {what}"),
            Malformed::NotDhcp(why) => write!(f, "not a DHCP packet: {why}"),
            Malformed::BadOption(code) => write!(f, "option {code} overruns the packet"),
        }
    }
}

impl std::error::Error for Malformed {}

/// A DHCP message (Ethernet hardware addresses only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub op: u8,
    pub xid: u32,
    pub secs: u16,
    pub flags: u16,
    pub ciaddr: Ipv4Addr,
    pub yiaddr: Ipv4Addr,
    pub siaddr: Ipv4Addr,
    pub giaddr: Ipv4Addr,
    pub chaddr: [u8; 6],
    /// In order of appearance; pads and the end marker are not kept.
    pub options: Vec<(u8, Vec<u8>)>,
}

fn ip(b: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(b[0], b[1], b[2], b[3])
}

impl Message {
    /// A message with every address unspecified and no options.
    pub fn new(op: u8, xid: u32, chaddr: [u8; 6]) -> Message {
        Message {
            op,
            xid,
            secs: 0,
            flags: 0,
            ciaddr: Ipv4Addr::UNSPECIFIED,
            yiaddr: Ipv4Addr::UNSPECIFIED,
            siaddr: Ipv4Addr::UNSPECIFIED,
            giaddr: Ipv4Addr::UNSPECIFIED,
            chaddr,
            options: Vec::new(),
        }
    }

    pub fn parse(b: &[u8]) -> Result<Message, Malformed> {
        if b.len() < FIXED + MAGIC.len() {
            return Err(Malformed::Short("BOOTP header"));
        }
        if b[1] != 1 || b[2] != 6 {
            return Err(Malformed::NotDhcp("not Ethernet"));
        }
        if b[FIXED..FIXED + 4] != MAGIC {
            return Err(Malformed::NotDhcp("no magic cookie"));
        }
        let mut chaddr = [0u8; 6];
        chaddr.copy_from_slice(&b[28..34]);
        let mut options = Vec::new();
        let mut i = FIXED + 4;
        while i < b.len() {
            match b[i] {
                option::PAD => i += 1,
                option::END => break,
                code => {
                    let len = *b.get(i + 1).ok_or(Malformed::BadOption(code))? as usize;
                    let data = b
                        .get(i + 2..i + 2 + len)
                        .ok_or(Malformed::BadOption(code))?;
                    options.push((code, data.to_vec()));
                    i += 2 + len;
                }
            }
        }
        Ok(Message {
            op: b[0],
            xid: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            secs: u16::from_be_bytes([b[8], b[9]]),
            flags: u16::from_be_bytes([b[10], b[11]]),
            ciaddr: ip(&b[12..16]),
            yiaddr: ip(&b[16..20]),
            siaddr: ip(&b[20..24]),
            giaddr: ip(&b[24..28]),
            chaddr,
            options,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; FIXED];
        b[0] = self.op;
        b[1] = 1;
        b[2] = 6;
        b[4..8].copy_from_slice(&self.xid.to_be_bytes());
        b[8..10].copy_from_slice(&self.secs.to_be_bytes());
        b[10..12].copy_from_slice(&self.flags.to_be_bytes());
        b[12..16].copy_from_slice(&self.ciaddr.octets());
        b[16..20].copy_from_slice(&self.yiaddr.octets());
        b[20..24].copy_from_slice(&self.siaddr.octets());
        b[24..28].copy_from_slice(&self.giaddr.octets());
        b[28..34].copy_from_slice(&self.chaddr);
        b.extend_from_slice(&MAGIC);
        for (code, data) in &self.options {
            // An option longer than 255 bytes cannot be encoded; the
            // responder never builds one.
            let len = data.len().min(255);
            b.push(*code);
            b.push(len as u8);
            b.extend_from_slice(&data[..len]);
        }
        b.push(option::END);
        // Some clients drop replies shorter than a BOOTP minimum.
        if b.len() < 300 {
            b.resize(300, 0);
        }
        b
    }

    pub fn option(&self, code: u8) -> Option<&[u8]> {
        self.options
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, d)| d.as_slice())
    }

    pub fn kind(&self) -> Option<Kind> {
        self.option(option::MESSAGE_TYPE)
            .and_then(|d| d.first().copied())
            .and_then(Kind::from_byte)
    }

    pub fn option_ip(&self, code: u8) -> Option<Ipv4Addr> {
        self.option(code).filter(|d| d.len() == 4).map(ip)
    }
}

/// An Ethernet frame carrying IPv4/UDP, as read from a packet socket.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src_ip: Ipv4Addr,
    pub dst_ip: Ipv4Addr,
    pub src_port: u16,
    pub dst_port: u16,
    pub payload: &'a [u8],
}

impl<'a> Frame<'a> {
    /// Parses Ethernet II → IPv4 (any header length) → UDP. Anything else
    /// (ARP, IPv6, TCP, fragments) is `NotDhcp`.
    pub fn parse(f: &'a [u8]) -> Result<Frame<'a>, Malformed> {
        if f.len() < 14 + 20 + 8 {
            return Err(Malformed::Short("frame"));
        }
        if f[12..14] != [0x08, 0x00] {
            return Err(Malformed::NotDhcp("not IPv4"));
        }
        let ipv4 = &f[14..];
        if ipv4[0] >> 4 != 4 {
            return Err(Malformed::NotDhcp("not IPv4"));
        }
        let ihl = usize::from(ipv4[0] & 0x0f) * 4;
        if ihl < 20 || ipv4.len() < ihl + 8 {
            return Err(Malformed::Short("IPv4 header"));
        }
        if ipv4[9] != 17 {
            return Err(Malformed::NotDhcp("not UDP"));
        }
        if u16::from_be_bytes([ipv4[6], ipv4[7]]) & 0x3fff != 0 {
            return Err(Malformed::NotDhcp("a fragment"));
        }
        let total = usize::from(u16::from_be_bytes([ipv4[2], ipv4[3]])).min(ipv4.len());
        let udp = ipv4
            .get(ihl..total)
            .ok_or(Malformed::Short("IPv4 packet"))?;
        if udp.len() < 8 {
            return Err(Malformed::Short("UDP header"));
        }
        let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
        let payload = udp
            .get(8..udp_len.max(8))
            .ok_or(Malformed::Short("UDP payload"))?;
        let mut src_mac = [0u8; 6];
        let mut dst_mac = [0u8; 6];
        src_mac.copy_from_slice(&f[6..12]);
        dst_mac.copy_from_slice(&f[0..6]);
        Ok(Frame {
            src_mac,
            dst_mac,
            src_ip: ip(&ipv4[12..16]),
            dst_ip: ip(&ipv4[16..20]),
            src_port: u16::from_be_bytes([udp[0], udp[1]]),
            dst_port: u16::from_be_bytes([udp[2], udp[3]]),
            payload,
        })
    }
}

/// The Internet checksum (RFC 1071) of `parts` concatenated.
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut odd: Option<u8> = None;
    for part in parts {
        for &byte in *part {
            match odd.take() {
                Some(hi) => sum += u32::from(u16::from_be_bytes([hi, byte])),
                None => odd = Some(byte),
            }
        }
    }
    if let Some(hi) = odd {
        sum += u32::from(u16::from_be_bytes([hi, 0]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Builds an Ethernet/IPv4/UDP frame with correct IP and UDP checksums
/// (some guests drop a zero or wrong UDP checksum).
pub fn build_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = (8 + payload.len()) as u16;
    let ip_len = 20 + udp_len;
    let mut frame = Vec::with_capacity(14 + usize::from(ip_len));
    frame.extend_from_slice(&dst_mac);
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&[0x08, 0x00]);
    let mut iph = [0u8; 20];
    iph[0] = 0x45;
    iph[2..4].copy_from_slice(&ip_len.to_be_bytes());
    iph[8] = 64;
    iph[9] = 17;
    iph[12..16].copy_from_slice(&src.0.octets());
    iph[16..20].copy_from_slice(&dst.0.octets());
    let ip_sum = checksum(&[&iph]);
    iph[10..12].copy_from_slice(&ip_sum.to_be_bytes());
    frame.extend_from_slice(&iph);
    let mut udph = [0u8; 8];
    udph[0..2].copy_from_slice(&src.1.to_be_bytes());
    udph[2..4].copy_from_slice(&dst.1.to_be_bytes());
    udph[4..6].copy_from_slice(&udp_len.to_be_bytes());
    let pseudo = [
        &src.0.octets()[..],
        &dst.0.octets()[..],
        &[0, 17],
        &udp_len.to_be_bytes()[..],
    ]
    .concat();
    let udp_sum = match checksum(&[&pseudo, &udph, payload]) {
        0 => 0xffff, // zero means "no checksum"; its one's-complement twin stands in
        s => s,
    };
    udph[6..8].copy_from_slice(&udp_sum.to_be_bytes());
    frame.extend_from_slice(&udph);
    frame.extend_from_slice(payload);
    frame
}

/// Verifies a frame's IPv4 header and UDP checksums (for tests and for
/// counting what arrives broken).
pub fn checksums_ok(f: &[u8]) -> bool {
    let Some(ipv4) = f.get(14..34) else {
        return false;
    };
    if checksum(&[ipv4]) != 0 {
        return false;
    }
    let Ok(frame) = Frame::parse(f) else {
        return false;
    };
    let udp_len = (8 + frame.payload.len()) as u16;
    let Some(udp) = f.get(34..34 + usize::from(udp_len)) else {
        return false;
    };
    let pseudo = [
        &frame.src_ip.octets()[..],
        &frame.dst_ip.octets()[..],
        &[0, 17],
        &udp_len.to_be_bytes()[..],
    ]
    .concat();
    checksum(&[&pseudo, udp]) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn discover() -> Message {
        Message {
            options: vec![
                (option::MESSAGE_TYPE, vec![1]),
                (option::CLIENT_ID, vec![0xff, 1, 2, 3]),
            ],
            ..Message::new(1, 0x1234_5678, [2, 0, 0, 0, 0, 1])
        }
    }

    #[test]
    fn a_message_round_trips() {
        let m = discover();

        let back = Message::parse(&m.encode()).expect("parses");

        assert_eq!(back, m);
        assert_eq!(back.kind(), Some(Kind::Discover));
    }

    #[test]
    fn a_frame_round_trips_with_valid_checksums() {
        let payload = discover().encode();

        let frame = build_frame(
            [2, 0, 0, 0, 0, 9],
            [2, 0, 0, 0, 0, 1],
            (Ipv4Addr::new(10, 0, 0, 1), 67),
            (Ipv4Addr::new(10, 0, 0, 2), 68),
            &payload,
        );

        assert!(checksums_ok(&frame));
        let parsed = Frame::parse(&frame).expect("frame");
        assert_eq!((parsed.src_port, parsed.dst_port), (67, 68));
        assert_eq!(parsed.payload, payload.as_slice());
    }

    #[test]
    fn an_option_running_past_the_end_is_malformed() {
        let mut bytes = discover().encode();
        bytes.truncate(FIXED + 4);
        bytes.extend_from_slice(&[option::CLIENT_ID, 200, 1, 2]);

        assert_eq!(
            Message::parse(&bytes),
            Err(Malformed::BadOption(option::CLIENT_ID))
        );
    }

    #[test]
    fn short_and_foreign_input_is_refused() {
        assert!(Message::parse(&[1, 1, 6]).is_err());
        assert!(Frame::parse(&[0u8; 20]).is_err());
    }
}
