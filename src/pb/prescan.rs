//! Counting a snapshot's entries before decoding it.
//!
//! Decoding allocates a struct per entry, and an entry can be two bytes on
//! the wire (a tag and a zero length): 16 MiB of them is 8 million VM
//! entries and gigabytes of memory before any check could run. The scan
//! walks the top-level fields with no allocation, so a snapshot with more
//! entries than the agent will take is refused at the cost of reading it.

use prost::bytes::Buf;
use prost::encoding::{WireType, decode_key, decode_varint};

/// `Snapshot.vms` and `Snapshot.volumes` in `proto/eitri/agent/v1/agent.proto`.
const VMS_FIELD: u32 = 2;
const VOLUMES_FIELD: u32 = 4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryCounts {
    pub vms: usize,
    pub volumes: usize,
}

/// How many VM and volume entries an encoded `Snapshot` holds; an error
/// says why the bytes are not a message.
pub fn count_snapshot_entries(mut buf: &[u8]) -> Result<EntryCounts, String> {
    let mut counts = EntryCounts::default();
    while buf.has_remaining() {
        let (field, wire_type) = decode_key(&mut buf).map_err(|e| e.to_string())?;
        let skip = match wire_type {
            WireType::Varint => {
                decode_varint(&mut buf).map_err(|e| e.to_string())?;
                0
            }
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(|e| e.to_string())?;
                let len = usize::try_from(len).map_err(|_| "a field length overflows")?;
                match field {
                    VMS_FIELD => counts.vms += 1,
                    VOLUMES_FIELD => counts.volumes += 1,
                    _ => {}
                }
                len
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err("a snapshot has no groups".into());
            }
        };
        if skip > buf.remaining() {
            return Err("a field runs past the end of the message".into());
        }
        buf.advance(skip);
    }
    Ok(counts)
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
        };

        let counts = count_snapshot_entries(&snap.encode_to_vec()).expect("scan");

        assert_eq!(counts, EntryCounts { vms: 3, volumes: 2 });
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
