//! Guest SSH host keys: load-or-create an ed25519 key per VM.
//!
//! The private key is written in OpenSSH's own format ("openssh-key-v1",
//! unencrypted) at mode 0600, the form sshd and ssh-keygen read. The
//! public line goes up in the report, for the control plane to certify.
//! Load-or-create, not create: a VM waiting for its certificate must present
//! the same key after an agent restart, and after a rebuild of its seed.

use std::fs;
use std::io::Read;
use std::path::Path;

use ed25519_dalek::SigningKey;

use crate::base64;
use crate::error::{BoxFailure, Outcome, Simple};
use crate::state::atomic::write_atomic;

const KEY_TYPE: &str = "ssh-ed25519";
const MAGIC: &[u8] = b"openssh-key-v1\0";
const BEGIN: &str = "-----BEGIN OPENSSH PRIVATE KEY-----";
const END: &str = "-----END OPENSSH PRIVATE KEY-----";

/// A guest SSH host key: the public line is reported for certification, the
/// private PEM goes into the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostKey {
    pub public_line: String,
    pub private_pem: String,
}

/// Host keys on the local disk, made from the kernel's random source.
pub struct LocalHostKeys;

impl LocalHostKeys {
    /// The key stored at `path`, or a new one made and stored there.
    pub fn load_or_create(&self, path: &Path) -> Outcome<HostKey> {
        match fs::read_to_string(path) {
            Ok(pem) => parse(&pem).ok_or_else(|| {
                Simple::permanent(format!(
                    "{} is not an unencrypted OpenSSH ed25519 key; move it away to have a new one made",
                    path.display()
                ))
                .into()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => create(path),
            Err(e) => Err(Simple::transient(format!("cannot read {}: {e}", path.display())).into()),
        }
    }
}

fn create(path: &Path) -> Outcome<HostKey> {
    let io = |what: &str, e: std::io::Error| -> BoxFailure {
        Simple::transient(format!("cannot {what} {}: {e}", path.display())).into()
    };
    let mut seed = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut seed))
        .map_err(|e| io("gather randomness for", e))?;
    let mut check = [0u8; 4];
    fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut check))
        .map_err(|e| io("gather randomness for", e))?;
    let comment = path.parent().and_then(|p| p.file_name()).map_or_else(
        || "eitri-guest".to_owned(),
        |n| format!("eitri-guest-{}", n.to_string_lossy()),
    );
    let key = encode(&seed, u32::from_be_bytes(check), &comment);
    if let Some(dir) = path.parent() {
        crate::state::perms::make_dir(dir).map_err(|e| io("create the directory of", e))?;
    }
    write_atomic(path, key.private_pem.as_bytes()).map_err(|e| io("write", e))?;
    Ok(key)
}

/// SSH wire "string": a big-endian u32 length, then the bytes.
fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn public_blob(public: &[u8; 32]) -> Vec<u8> {
    let mut blob = Vec::new();
    put(&mut blob, KEY_TYPE.as_bytes());
    put(&mut blob, public);
    blob
}

/// Builds the key pair for `seed` in OpenSSH's formats.
fn encode(seed: &[u8; 32], check: u32, comment: &str) -> HostKey {
    let public = SigningKey::from_bytes(seed).verifying_key().to_bytes();
    let blob = public_blob(&public);

    let mut private = Vec::new();
    private.extend_from_slice(&check.to_be_bytes());
    private.extend_from_slice(&check.to_be_bytes());
    put(&mut private, KEY_TYPE.as_bytes());
    put(&mut private, &public);
    let mut secret = Vec::with_capacity(64);
    secret.extend_from_slice(seed);
    secret.extend_from_slice(&public);
    put(&mut private, &secret);
    put(&mut private, comment.as_bytes());
    // Unencrypted keys are padded to the 8-byte block of cipher "none".
    let mut pad = 1u8;
    while !private.len().is_multiple_of(8) {
        private.push(pad);
        pad += 1;
    }

    let mut file = MAGIC.to_vec();
    put(&mut file, b"none"); // cipher
    put(&mut file, b"none"); // kdf
    put(&mut file, b""); // kdf options
    file.extend_from_slice(&1u32.to_be_bytes());
    put(&mut file, &blob);
    put(&mut file, &private);

    let body = base64::encode(&file);
    let mut pem = format!("{BEGIN}\n");
    for line in body.as_bytes().chunks(70) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str(END);
    pem.push('\n');
    HostKey {
        public_line: format!("{KEY_TYPE} {} {comment}", base64::encode(&blob)),
        private_pem: pem,
    }
}

/// Reads a key written by [`encode`] (or by ssh-keygen, unencrypted), and
/// checks that its public half matches its secret.
pub fn parse(pem: &str) -> Option<HostKey> {
    let body: String = pem
        .lines()
        .skip_while(|l| l.trim() != BEGIN)
        .skip(1)
        .take_while(|l| l.trim() != END)
        .collect();
    let file = base64::decode(&body)?;
    let mut r = Reader(file.strip_prefix(MAGIC)?);
    let (cipher, kdf) = (r.string()?, r.string()?);
    if cipher != b"none" || kdf != b"none" {
        return None;
    }
    r.string()?; // kdf options
    if r.u32()? != 1 {
        return None;
    }
    let blob = r.string()?.to_vec();
    let mut p = Reader(r.string()?);
    if p.u32()? != p.u32()? || p.string()? != KEY_TYPE.as_bytes() {
        return None;
    }
    let public: [u8; 32] = p.string()?.try_into().ok()?;
    let secret = p.string()?;
    let comment = String::from_utf8(p.string()?.to_vec()).ok()?;
    let seed: [u8; 32] = secret.get(..32)?.try_into().ok()?;
    if SigningKey::from_bytes(&seed).verifying_key().to_bytes() != public
        || blob != public_blob(&public)
    {
        return None;
    }
    Some(HostKey {
        public_line: format!("{KEY_TYPE} {} {comment}", base64::encode(&blob))
            .trim_end()
            .to_owned(),
        private_pem: pem.to_owned(),
    })
}

/// A public key line's fingerprint as OpenSSH prints it: `SHA256:` and the
/// unpadded base64 of the SHA-256 of its blob; `None` if the line is not
/// `<type> <base64> [comment]`.
pub fn fingerprint(public_line: &str) -> Option<String> {
    use sha2::{Digest, Sha256};
    let blob = base64::decode(public_line.split_whitespace().nth(1)?)?;
    let digest = base64::encode(&Sha256::digest(&blob));
    Some(format!("SHA256:{}", digest.trim_end_matches('=')))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn u32(&mut self) -> Option<u32> {
        let (head, rest) = self.0.split_at_checked(4)?;
        self.0 = rest;
        Some(u32::from_be_bytes(head.try_into().ok()?))
    }

    fn string(&mut self) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        let (head, rest) = self.0.split_at_checked(len)?;
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_key_parses_back_to_itself() {
        let key = encode(&[7u8; 32], 0xdead_beef, "eitri-guest-vm-1");

        let back = parse(&key.private_pem).expect("parses");

        assert_eq!(back, key);
    }

    #[test]
    fn a_key_whose_secret_does_not_match_its_public_half_is_refused() {
        let key = encode(&[7u8; 32], 1, "c");
        let body: String = key
            .private_pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let mut file = base64::decode(&body).expect("base64");
        // The secret's seed sits just before its public copy, the comment
        // and the padding at the end of the file.
        let at = file.len() - 8 - 5 - 32 - 1;
        file[at] ^= 0xff;
        let tampered = format!("{BEGIN}\n{}\n{END}\n", base64::encode(&file));

        assert!(parse(&tampered).is_none());
    }
}
