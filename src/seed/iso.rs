//! A minimal ISO 9660 writer with Joliet: one root directory of small files.
//!
//! cloud-init's NoCloud reads its seed from a filesystem labelled `cidata`
//! holding lowercase names (`meta-data`, `user-data`, …). Plain ISO 9660
//! names are uppercase 8.3, so the image carries a Joliet tree too (UCS-2
//! names), which Linux mounts by default.
//!
//! Layout, in 2048-byte sectors:
//! ```text
//! 0-15   system area (zeros)
//! 16     primary volume descriptor      17  Joliet supplementary descriptor
//! 18     descriptor set terminator
//! 19-22  path tables: primary L and M, Joliet L and M (one entry: the root)
//! 23     primary root directory         24  Joliet root directory
//! 25…    file data, each file starting on its own sector
//! ```

use std::time::SystemTime;

const SECTOR: usize = 2048;
const ROOT_PRIMARY: u32 = 23;
const ROOT_JOLIET: u32 = 24;
const FIRST_DATA: u32 = 25;

/// One file of the image: a Joliet name (any case) and its bytes.
pub struct File<'a> {
    pub name: &'a str,
    pub data: &'a [u8],
}

/// Builds the image in memory. Files must fit one directory sector per tree
/// (a dozen small files do; a seed has four or five).
pub fn build(volume_id: &str, files: &[File<'_>], now: SystemTime) -> Vec<u8> {
    let date = Date::from(now);
    let mut placed: Vec<(usize, u32)> = Vec::new(); // (index into files, first sector)
    let mut next = FIRST_DATA;
    for (i, f) in files.iter().enumerate() {
        placed.push((i, next));
        next += sectors(f.data.len());
    }
    let total = next;
    let mut img = vec![0u8; total as usize * SECTOR];

    let primary_names: Vec<String> = files.iter().map(|f| primary_name(f.name)).collect();
    let joliet_names: Vec<Vec<u8>> = files.iter().map(|f| ucs2(f.name)).collect();

    let primary_root = directory(
        ROOT_PRIMARY,
        &placed,
        files,
        |i| primary_names[i].as_bytes().to_vec(),
        &date,
    );
    let joliet_root = directory(
        ROOT_JOLIET,
        &placed,
        files,
        |i| joliet_names[i].clone(),
        &date,
    );

    descriptor(
        &mut img[16 * SECTOR..17 * SECTOR],
        1,
        volume_id,
        total,
        19,
        20,
        &date,
        false,
    );
    descriptor(
        &mut img[17 * SECTOR..18 * SECTOR],
        2,
        volume_id,
        total,
        21,
        22,
        &date,
        true,
    );
    let term = &mut img[18 * SECTOR..19 * SECTOR];
    term[0] = 255;
    term[1..6].copy_from_slice(b"CD001");
    term[6] = 1;
    for (sector, root, big_endian) in [
        (19, ROOT_PRIMARY, false),
        (20, ROOT_PRIMARY, true),
        (21, ROOT_JOLIET, false),
        (22, ROOT_JOLIET, true),
    ] {
        path_table(&mut img[sector * SECTOR..], root, big_endian);
    }
    img[ROOT_PRIMARY as usize * SECTOR..][..primary_root.len()].copy_from_slice(&primary_root);
    img[ROOT_JOLIET as usize * SECTOR..][..joliet_root.len()].copy_from_slice(&joliet_root);
    for (i, at) in &placed {
        img[*at as usize * SECTOR..][..files[*i].data.len()].copy_from_slice(files[*i].data);
    }
    img
}

fn sectors(len: usize) -> u32 {
    len.div_ceil(SECTOR).max(1) as u32
}

fn both32(out: &mut [u8], v: u32) {
    out[..4].copy_from_slice(&v.to_le_bytes());
    out[4..8].copy_from_slice(&v.to_be_bytes());
}

fn both16(out: &mut [u8], v: u16) {
    out[..2].copy_from_slice(&v.to_le_bytes());
    out[2..4].copy_from_slice(&v.to_be_bytes());
}

/// An uppercase 8.3 d-character name with version, for the primary tree.
fn primary_name(name: &str) -> String {
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .map(|c| c.to_ascii_uppercase())
        .take(8)
        .collect();
    format!("{clean}.;1")
}

fn ucs2(text: &str) -> Vec<u8> {
    text.encode_utf16().flat_map(u16::to_be_bytes).collect()
}

/// A field of `len` bytes holding `text`, padded with spaces (in UCS-2 for
/// Joliet descriptors).
fn padded(text: &str, len: usize, joliet: bool) -> Vec<u8> {
    let mut out = if joliet {
        ucs2(text)
    } else {
        text.as_bytes().to_vec()
    };
    out.truncate(len);
    while out.len() < len {
        if joliet && out.len() + 1 < len {
            out.extend_from_slice(&[0, b' ']);
        } else {
            out.push(b' ');
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn descriptor(
    d: &mut [u8],
    kind: u8,
    volume_id: &str,
    total: u32,
    l_table: u32,
    m_table: u32,
    date: &Date,
    joliet: bool,
) {
    d[0] = kind;
    d[1..6].copy_from_slice(b"CD001");
    d[6] = 1;
    d[8..40].copy_from_slice(&padded("LINUX", 32, joliet));
    d[40..72].copy_from_slice(&padded(volume_id, 32, joliet));
    both32(&mut d[80..88], total);
    if joliet {
        // UCS-2 level 3.
        d[88..91].copy_from_slice(b"%/E");
    }
    both16(&mut d[120..124], 1);
    both16(&mut d[124..128], 1);
    both16(&mut d[128..132], SECTOR as u16);
    both32(&mut d[132..140], 10);
    d[140..144].copy_from_slice(&l_table.to_le_bytes());
    d[148..152].copy_from_slice(&m_table.to_be_bytes());
    let root = ROOT_PRIMARY + u32::from(joliet);
    d[156..190].copy_from_slice(&record(root, SECTOR as u32, true, &[0], date));
    for (at, len) in [
        (190, 128),
        (318, 128),
        (446, 128),
        (574, 128),
        (702, 37),
        (739, 37),
        (776, 37),
    ] {
        d[at..at + len].copy_from_slice(&padded("", len, joliet));
    }
    let stamp = date.long();
    d[813..830].copy_from_slice(&stamp);
    d[830..847].copy_from_slice(&stamp);
    d[847..864].copy_from_slice(&unset_long());
    d[864..881].copy_from_slice(&stamp);
    d[881] = 1;
}

/// A directory record.
fn record(extent: u32, len: u32, dir: bool, name: &[u8], date: &Date) -> Vec<u8> {
    let size = 33 + name.len() + (name.len() + 1) % 2;
    let mut r = vec![0u8; size];
    r[0] = size as u8;
    both32(&mut r[2..10], extent);
    both32(&mut r[10..18], len);
    r[18..25].copy_from_slice(&date.short());
    r[25] = if dir { 2 } else { 0 };
    both16(&mut r[28..32], 1);
    r[32] = name.len() as u8;
    r[33..33 + name.len()].copy_from_slice(name);
    r
}

/// The root directory: `.`, `..`, then the files sorted by their name in
/// this tree, as ISO 9660 requires.
fn directory(
    root: u32,
    placed: &[(usize, u32)],
    files: &[File<'_>],
    name: impl Fn(usize) -> Vec<u8>,
    date: &Date,
) -> Vec<u8> {
    let mut out = record(root, SECTOR as u32, true, &[0], date);
    out.extend(record(root, SECTOR as u32, true, &[1], date));
    let mut entries: Vec<(Vec<u8>, u32, u32)> = placed
        .iter()
        .map(|(i, at)| (name(*i), *at, files[*i].data.len() as u32))
        .collect();
    entries.sort();
    for (n, at, len) in entries {
        out.extend(record(at, len, false, &n, date));
    }
    assert!(
        out.len() <= SECTOR,
        "a seed's files fit one directory sector"
    );
    out
}

fn path_table(out: &mut [u8], root: u32, big_endian: bool) {
    out[0] = 1; // length of the root's name
    let (extent, parent) = if big_endian {
        (root.to_be_bytes(), 1u16.to_be_bytes())
    } else {
        (root.to_le_bytes(), 1u16.to_le_bytes())
    };
    out[2..6].copy_from_slice(&extent);
    out[6..8].copy_from_slice(&parent);
}

/// A UTC calendar time (see [`crate::human::Utc`]).
type Date = crate::human::Utc;

/// The ISO 9660 forms of a time.
trait IsoDate {
    fn short(&self) -> [u8; 7];
    fn long(&self) -> [u8; 17];
}

impl IsoDate for Date {
    /// The 7-byte form of directory records.
    fn short(&self) -> [u8; 7] {
        [
            (self.year - 1900).clamp(0, 255) as u8,
            self.month as u8,
            self.day as u8,
            self.hour as u8,
            self.minute as u8,
            self.second as u8,
            0,
        ]
    }

    /// The 17-byte form of volume descriptors: digits, then the zone.
    fn long(&self) -> [u8; 17] {
        let text = format!(
            "{:04}{:02}{:02}{:02}{:02}{:02}00",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        );
        let mut out = [0u8; 17];
        out[..16].copy_from_slice(&text.as_bytes()[..16]);
        out
    }
}

/// The 17-byte form of a time not set.
fn unset_long() -> [u8; 17] {
    let mut out = [b'0'; 17];
    out[16] = 0;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn civil_dates() {
        let d = Date::from(UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000));

        assert_eq!(
            (d.year, d.month, d.day, d.hour, d.minute, d.second),
            (2027, 1, 15, 8, 0, 0)
        );
    }

    #[test]
    fn primary_names_are_d_characters() {
        assert_eq!(primary_name("meta-data"), "METADATA.;1");
        assert_eq!(primary_name("network-config"), "NETWORKC.;1");
    }

    #[test]
    fn records_have_even_length() {
        let d = Date::from(UNIX_EPOCH);

        assert_eq!(record(1, 2, false, b"AB", &d).len() % 2, 0);
        assert_eq!(record(1, 2, false, b"ABC", &d).len() % 2, 0);
    }
}
