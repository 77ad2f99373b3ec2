//! Counting a snapshot's entries before decoding it.
//!
//! Decoding allocates a struct per entry, and an entry can be two bytes on
//! the wire (a tag and a zero length): 16 MiB of them is 8 million VM
//! entries and gigabytes of memory before any check could run. The scan
//! walks the top-level fields with no allocation, so a snapshot with more
//! entries than the agent will take is refused at the cost of reading it.
//! So with the lists inside a VM entry (its volume ids, its user CA keys,
//! its egress ranges, its published ports):
//! each VM entry is walked too, and one with more of either than a VM may
//! have refuses the snapshot before a string of it is made.

use prost::bytes::Buf;
use prost::encoding::{WireType, decode_key, decode_varint};

use crate::model::Limits;

/// `Snapshot.vms` and `Snapshot.volumes` in `proto/eitri/agent/v1/agent.proto`.
const VMS_FIELD: u32 = 2;
const VOLUMES_FIELD: u32 = 4;
/// `VMSpec.volume_ids`, `VMSpec.ssh_user_ca_authorized_keys`,
/// `VMSpec.egress_allow`, `VMSpec.egress_deny` and
/// `VMSpec.published_ports`.
const VOLUME_IDS_FIELD: u32 = 8;
const CA_KEYS_FIELD: u32 = 16;
const EGRESS_ALLOW_FIELD: u32 = 17;
const EGRESS_DENY_FIELD: u32 = 18;
const PUBLISHED_PORTS_FIELD: u32 = 25;

/// Why a snapshot's bytes are refused before they are decoded.
#[derive(Debug)]
pub enum PrescanError {
    /// A field's key or length is not protobuf.
    Decode(prost::DecodeError),
    FieldLengthOverflows,
    Group,
    PastTheEnd,
    /// The `entry`-th VM entry (from 0) has more of a list than a VM may.
    TooMany {
        entry: usize,
        what: &'static str,
        count: usize,
        cap: usize,
    },
}

impl std::fmt::Display for PrescanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrescanError::Decode(e) => e.fmt(f),
            PrescanError::FieldLengthOverflows => f.write_str("a field length overflows"),
            PrescanError::Group => f.write_str("a snapshot has no groups"),
            PrescanError::PastTheEnd => f.write_str("a field runs past the end of the message"),
            PrescanError::TooMany {
                entry,
                what,
                count,
                cap,
            } => write!(f, "VM entry {entry} has {count} {what}, at most {cap}"),
        }
    }
}

impl std::error::Error for PrescanError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PrescanError::Decode(e) => Some(e),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryCounts {
    pub vms: usize,
    pub volumes: usize,
}

/// How many VM and volume entries an encoded `Snapshot` holds; an error
/// says why the bytes are not a message, or which VM entry holds more of a
/// list than a VM may have.
pub fn count_snapshot_entries(buf: &[u8]) -> Result<EntryCounts, PrescanError> {
    let mut counts = EntryCounts::default();
    walk(buf, |field, body| {
        match field {
            VMS_FIELD => {
                check_vm_entry(body, counts.vms)?;
                counts.vms += 1;
            }
            VOLUMES_FIELD => counts.volumes += 1,
            _ => {}
        }
        Ok(())
    })?;
    Ok(counts)
}

/// Refuses the `n`-th VM entry if it holds more volume ids, user CA keys,
/// egress ranges or published ports than a VM may have.
fn check_vm_entry(entry: &[u8], n: usize) -> Result<(), PrescanError> {
    let (mut volumes, mut keys, mut allowed, mut denied) = (0usize, 0usize, 0usize, 0usize);
    let mut published = 0usize;
    walk(entry, |field, _| {
        match field {
            VOLUME_IDS_FIELD => volumes += 1,
            CA_KEYS_FIELD => keys += 1,
            EGRESS_ALLOW_FIELD => allowed += 1,
            EGRESS_DENY_FIELD => denied += 1,
            PUBLISHED_PORTS_FIELD => published += 1,
            _ => {}
        }
        Ok(())
    })?;
    let over = |what, count, cap| PrescanError::TooMany {
        entry: n,
        what,
        count,
        cap,
    };
    if volumes > Limits::MAX_VOLUMES_PER_VM {
        return Err(over("volume_ids", volumes, Limits::MAX_VOLUMES_PER_VM));
    }
    if keys > Limits::MAX_USER_CA_KEYS {
        return Err(over(
            "ssh_user_ca_authorized_keys",
            keys,
            Limits::MAX_USER_CA_KEYS,
        ));
    }
    for (what, count) in [("egress_allow", allowed), ("egress_deny", denied)] {
        if count > Limits::MAX_EGRESS_RULES {
            return Err(over(what, count, Limits::MAX_EGRESS_RULES));
        }
    }
    if published > Limits::MAX_PUBLISHED_PORTS {
        return Err(over(
            "published_ports",
            published,
            Limits::MAX_PUBLISHED_PORTS,
        ));
    }
    Ok(())
}

/// Calls `each` with every length-delimited field of the message in `buf`
/// (its number and bytes), skipping the rest; an error says why the bytes
/// are not a message, or is `each`'s.
fn walk(
    mut buf: &[u8],
    mut each: impl FnMut(u32, &[u8]) -> Result<(), PrescanError>,
) -> Result<(), PrescanError> {
    while buf.has_remaining() {
        let (field, wire_type) = decode_key(&mut buf).map_err(PrescanError::Decode)?;
        let (skip, delimited) = match wire_type {
            WireType::Varint => {
                decode_varint(&mut buf).map_err(PrescanError::Decode)?;
                (0, false)
            }
            WireType::SixtyFourBit => (8, false),
            WireType::ThirtyTwoBit => (4, false),
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(PrescanError::Decode)?;
                let len = usize::try_from(len).map_err(|_| PrescanError::FieldLengthOverflows)?;
                (len, true)
            }
            WireType::StartGroup | WireType::EndGroup => return Err(PrescanError::Group),
        };
        if skip > buf.remaining() {
            return Err(PrescanError::PastTheEnd);
        }
        if delimited {
            each(field, &buf[..skip])?;
        }
        buf.advance(skip);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;
    use prost::Message;

    #[test]
    fn counts_what_the_generated_code_encodes() {
        let snap = pb::Snapshot {
            epoch: 7,
            min_agent_version: "1.0.0".into(),
            vms: vec![pb::VmSpec::default(); 3],
            volumes: vec![pb::VolumeSpec::default(); 2],
            ..pb::Snapshot::default()
        };

        let counts = count_snapshot_entries(&snap.encode_to_vec()).expect("scan");

        assert_eq!(counts, EntryCounts { vms: 3, volumes: 2 });
    }

    #[test]
    fn a_vm_entry_with_more_volume_ids_than_a_vm_may_have_is_refused_before_decoding() {
        let snap = pb::Snapshot {
            vms: vec![
                pb::VmSpec::default(),
                pb::VmSpec {
                    volume_ids: vec![String::new(); Limits::MAX_VOLUMES_PER_VM + 1],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };

        let scanned = count_snapshot_entries(&snap.encode_to_vec());

        assert_eq!(
            scanned.map_err(|e| e.to_string()),
            Err(format!(
                "VM entry 1 has {} volume_ids, at most {}",
                Limits::MAX_VOLUMES_PER_VM + 1,
                Limits::MAX_VOLUMES_PER_VM
            ))
        );
    }

    /// Scans a snapshot of the one VM entry `vm`, and checks that it is
    /// refused naming `field`.
    fn refused_naming(vm: pb::VmSpec, field: &str) {
        let snap = pb::Snapshot {
            vms: vec![vm],
            ..Default::default()
        };

        let scanned = count_snapshot_entries(&snap.encode_to_vec());

        assert!(
            scanned
                .as_ref()
                .is_err_and(|e| e.to_string().contains(field)),
            "{scanned:?}"
        );
    }

    #[test]
    fn a_vm_entry_with_more_user_ca_keys_than_a_vm_may_have_is_refused_before_decoding() {
        refused_naming(
            pb::VmSpec {
                ssh_user_ca_authorized_keys: vec![String::new(); Limits::MAX_USER_CA_KEYS + 1],
                ..Default::default()
            },
            "ssh_user_ca_authorized_keys",
        );
    }

    #[test]
    fn a_vm_entry_with_more_egress_ranges_than_a_vm_may_have_is_refused_before_decoding() {
        refused_naming(
            pb::VmSpec {
                egress_allow: vec![String::new(); Limits::MAX_EGRESS_RULES + 1],
                ..Default::default()
            },
            "egress_allow",
        );
    }

    #[test]
    fn a_vm_entry_with_more_published_ports_than_a_vm_may_have_is_refused_before_decoding() {
        refused_naming(
            pb::VmSpec {
                published_ports: vec![
                    pb::PublishedPort::default();
                    Limits::MAX_PUBLISHED_PORTS + 1
                ],
                ..Default::default()
            },
            "published_ports",
        );
    }

    #[test]
    fn a_truncated_message_is_refused() {
        let snap = pb::Snapshot {
            vms: vec![pb::VmSpec {
                vm_id: "vm-1".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let bytes = snap.encode_to_vec();

        let scanned = count_snapshot_entries(&bytes[..bytes.len() - 1]);

        assert!(scanned.is_err());
    }
}
