//! Lowercase hex, the one encoder: digests (image names, socket and tap
//! names) and MAC addresses (with `:` between octets).

use std::fmt::Write;

/// `bytes` as lowercase hex, `sep` between octets.
pub fn encode_with(bytes: &[u8], sep: &str) -> String {
    let mut out = String::with_capacity(bytes.len() * (2 + sep.len()));
    for (i, b) in bytes.iter().enumerate() {
        if i > 0 {
            out.push_str(sep);
        }
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// `bytes` as lowercase hex, nothing between octets.
pub fn encode(bytes: &[u8]) -> String {
    encode_with(bytes, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowercase_with_and_without_a_separator() {
        assert_eq!(encode(&[0x0a, 0xff, 0]), "0aff00");
        assert_eq!(encode_with(&[0x02, 0xab], ":"), "02:ab");
        assert_eq!(encode(&[]), "");
    }
}
