//! Base images must be raw. cloud-hypervisor is told every disk is raw
//! (`image_type=raw,backing_files=off`), but an image in another format
//! would still reach a guest as garbage, and a control plane handing over a
//! QCOW2 file is more likely a mistake than an intent: it is refused by its
//! magic, naming the format and the conversion.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// Formats told by the first bytes of the file.
const HEADERS: &[(&[u8], &str)] = &[
    (b"QFI\xfb", "QCOW2"),
    (b"vhdxfile", "VHDX"),
    (b"conectix", "VHD"),
    (b"KDMV", "VMDK"),
    (b"QED\0", "QED"),
];

/// A fixed-size VHD is raw data with this footer in its last 512 bytes.
const VHD_FOOTER: &[u8] = b"conectix";

/// The format `path` is in, if it is not raw.
pub fn foreign_format(path: &Path) -> io::Result<Option<&'static str>> {
    let mut file = File::open(path)?;
    let mut head = [0u8; 8];
    let n = read_up_to(&mut file, &mut head)?;
    if let Some((_, name)) = HEADERS
        .iter()
        .find(|(magic, _)| head[..n].starts_with(magic))
    {
        return Ok(Some(name));
    }
    let len = file.metadata()?.len();
    if len >= 512 {
        file.seek(SeekFrom::Start(len - 512))?;
        let mut footer = [0u8; 8];
        let n = read_up_to(&mut file, &mut footer)?;
        if footer[..n].starts_with(VHD_FOOTER) {
            return Ok(Some("VHD (fixed)"));
        }
    }
    Ok(None)
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("image");
        std::fs::write(&path, bytes).expect("write");
        (dir, path)
    }

    #[test]
    fn a_qcow2_header_is_refused_by_name() {
        let mut bytes = b"QFI\xfb\0\0\0\x03".to_vec();
        bytes.resize(4096, 0);
        let (_dir, path) = image(&bytes);

        assert_eq!(foreign_format(&path).expect("read"), Some("QCOW2"));
    }

    #[test]
    fn a_fixed_vhd_is_told_by_its_footer() {
        let mut bytes = vec![0u8; 4096];
        bytes[4096 - 512..4096 - 504].copy_from_slice(b"conectix");
        let (_dir, path) = image(&bytes);

        assert_eq!(foreign_format(&path).expect("read"), Some("VHD (fixed)"));
    }

    #[test]
    fn raw_bytes_are_raw_however_short() {
        for bytes in [&b""[..], b"QF", &[0x5a; 4096][..]] {
            let (_dir, path) = image(bytes);

            assert_eq!(foreign_format(&path).expect("read"), None, "{bytes:?}");
        }
    }
}
