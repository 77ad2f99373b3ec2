//! Keys that sign desired state, and the signatures they make.
//!
//! A control plane (or an operator's pipeline, for a desired file) signs the
//! exact bytes of desired state with an ed25519 key; each host pins the
//! public halves it trusts in a file (`--trusted-keys`), one per line, each
//! with an id, so a key can be rotated: pin the new one beside the old,
//! move the signer over, then drop the old line.
//!
//! A signature covers [`CONTEXT`] followed by the bytes: a key used for
//! desired state then signs nothing another protocol could take for its own
//! message, and a signature made for something else is no signature here.
//!
//! Three small text formats, each one line of space-separated words, so an
//! operator can read, diff and paste them:
//!
//! | file | line |
//! |---|---|
//! | trusted keys (`--trusted-keys`) | `ed25519 KEY-ID PUBLIC-KEY-BASE64`, `#` comments |
//! | a signing key (secret, 0600) | `eitri-signing-key ed25519 KEY-ID SEED-BASE64` |
//! | a detached signature (`FILE.sig`) | `ed25519 KEY-ID SIGNATURE-BASE64` |

use std::fmt;
use std::io::Read;
use std::path::Path;

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

/// What every signature covers before the signed bytes.
pub const CONTEXT: &[u8] = b"eitri.agent.v1.Snapshot\n";

const ALGORITHM: &str = "ed25519";
const SECRET_TAG: &str = "eitri-signing-key";
/// Keys a host may pin: enough for any rotation, few enough to try each.
const MAX_KEYS: usize = 64;

/// Why a key id is not one.
fn check_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a key id (1-64 letters, digits, '.', '_' or '-')",
            crate::quote::text(id)
        ))
    }
}

/// The public keys this host trusts, by id, and the file they were read
/// from (read again on SIGHUP, see [`TrustedKeys::reload`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustedKeys {
    keys: Vec<(String, VerifyingKey)>,
    origin: Option<std::path::PathBuf>,
}

/// Why signed desired state was refused. Nothing in it was acted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No signature at all where one is required.
    Unsigned { why: String },
    /// Signed by a key this host does not pin.
    UnknownKey { key_id: String },
    /// The signature does not verify with the key it names: the bytes were
    /// changed, or signed by another key under that id.
    BadSignature { key_id: String },
    /// Signed, but for another host.
    OtherHost {
        key_id: String,
        named: String,
        this_host: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Unsigned { why } => write!(
                f,
                "it is not signed ({why}), and this host takes only desired state signed by a key in --trusted-keys"
            ),
            Refusal::UnknownKey { key_id } => write!(
                f,
                "it is signed by key {}, which this host does not trust: pin it in --trusted-keys, or sign with a pinned key",
                crate::quote::text(key_id)
            ),
            Refusal::BadSignature { key_id } => write!(
                f,
                "its signature does not verify with key {}: the bytes were changed after signing, or another key signed them",
                crate::quote::text(key_id)
            ),
            Refusal::OtherHost {
                key_id,
                named,
                this_host,
            } => write!(
                f,
                "it is signed (key {}) for host {}, not this host ({}): sign a snapshot naming this host in host_id",
                crate::quote::text(key_id),
                crate::quote::text(named),
                crate::quote::text(this_host)
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// What `verify` found: the key that signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub key_id: String,
}

impl TrustedKeys {
    /// Reads and parses a trusted-keys file. The file decides what this
    /// host obeys, so one that others may write is refused.
    pub fn load(path: &Path) -> Result<TrustedKeys, String> {
        use std::os::unix::fs::MetadataExt;
        let shown = crate::quote::path(path);
        let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        if meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{shown} may be written by group or others (mode {:04o}): anyone who can add a line to it can sign this host's desired state; chmod go-w {shown}",
                meta.mode() & 0o7777
            ));
        }
        let mut text = String::new();
        file.take(64 << 10)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        let mut keys = TrustedKeys::parse(&text).map_err(|e| format!("{shown}: {e}"))?;
        keys.origin = Some(path.to_path_buf());
        Ok(keys)
    }

    /// Reads the keys' file again (SIGHUP): a rotation needs no restart. A
    /// file that no longer loads (unreadable, writable by others, no key
    /// left, a bad line) changes nothing: the keys in force stay, and the
    /// log says why. Keys from no file (tests) stay as they are.
    pub fn reload(&mut self) {
        let Some(origin) = &self.origin else {
            return;
        };
        match TrustedKeys::load(origin) {
            Ok(keys) if keys == *self => {}
            Ok(keys) => {
                log::info!(
                    "pinned keys are now {} (were {})",
                    keys.ids().collect::<Vec<_>>().join(", "),
                    self.ids().collect::<Vec<_>>().join(", ")
                );
                *self = keys;
            }
            Err(why) => log::error!(
                "kept the pinned keys {}: {why}",
                self.ids().collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// Parses `ed25519 KEY-ID PUBLIC-KEY` lines; blank lines and `#`
    /// comments are skipped.
    pub fn parse(text: &str) -> Result<TrustedKeys, String> {
        let mut keys: Vec<(String, VerifyingKey)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |e: String| format!("line {}: {e}", n + 1);
            let (id, bytes) = words(line, ALGORITHM).map_err(at)?;
            let bytes: [u8; 32] = bytes
                .try_into()
                .map_err(|_| at("a public key is 32 bytes".into()))?;
            let key = VerifyingKey::from_bytes(&bytes)
                .map_err(|_| at("not an ed25519 public key".into()))?;
            if keys.iter().any(|(other, _)| *other == id) {
                return Err(at(format!(
                    "key id {} is pinned twice",
                    crate::quote::text(&id)
                )));
            }
            keys.push((id, key));
        }
        if keys.is_empty() {
            return Err(
                "no keys: pin at least one `ed25519 KEY-ID PUBLIC-KEY` line (eitri-agent keygen prints one)"
                    .into(),
            );
        }
        if keys.len() > MAX_KEYS {
            return Err(format!("{} keys, at most {MAX_KEYS}", keys.len()));
        }
        Ok(TrustedKeys { keys, origin: None })
    }

    /// The ids pinned, in file order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(id, _)| id.as_str())
    }

    /// Checks that `key_id`, pinned here, signed [`CONTEXT`] then `bytes`.
    pub fn verify(
        &self,
        key_id: &str,
        signature: &[u8],
        bytes: &[u8],
    ) -> Result<Verified, Refusal> {
        let Some((_, key)) = self.keys.iter().find(|(id, _)| id == key_id) else {
            return Err(Refusal::UnknownKey {
                key_id: key_id.to_owned(),
            });
        };
        let bad = || Refusal::BadSignature {
            key_id: key_id.to_owned(),
        };
        let signature = Signature::from_slice(signature).map_err(|_| bad())?;
        key.verify(&signed_message(bytes), &signature)
            .map_err(|_| bad())?;
        Ok(Verified {
            key_id: key_id.to_owned(),
        })
    }
}

fn signed_message(bytes: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(CONTEXT.len() + bytes.len());
    message.extend_from_slice(CONTEXT);
    message.extend_from_slice(bytes);
    message
}

/// `TAG KEY-ID BASE64`: the id and the decoded bytes.
fn words(line: &str, tag: &str) -> Result<(String, Vec<u8>), String> {
    let mut words = line.split_whitespace();
    let (Some(first), Some(id), Some(b64), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(format!("expected `{tag} KEY-ID BASE64`"));
    };
    if first != tag {
        return Err(format!(
            "{} is not {tag}: only ed25519 keys are taken",
            crate::quote::text(first)
        ));
    }
    check_id(id)?;
    let bytes = crate::base64::decode(b64).ok_or_else(|| "the key is not base64".to_owned())?;
    Ok((id.to_owned(), bytes))
}

/// A signing key: the control plane's or a pipeline's secret.
pub struct SecretKey {
    id: String,
    key: SigningKey,
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key itself, not even in a debug print.
        f.debug_struct("SecretKey").field("id", &self.id).finish()
    }
}

impl SecretKey {
    /// A new key named `id`, from the kernel's randomness.
    pub fn generate(id: &str) -> Result<SecretKey, String> {
        check_id(id)?;
        let mut seed = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut r| r.read_exact(&mut seed))
            .map_err(|e| format!("cannot gather randomness: {e}"))?;
        Ok(SecretKey::from_seed(id, seed))
    }

    /// The key of a 32-byte seed (tests and benchmarks name their keys).
    pub fn from_seed(id: &str, seed: [u8; 32]) -> SecretKey {
        SecretKey {
            id: id.to_owned(),
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// Parses a secret key file's line.
    pub fn parse(text: &str) -> Result<SecretKey, String> {
        let line = text.trim();
        let rest = line
            .strip_prefix(SECRET_TAG)
            .ok_or_else(|| format!("not a signing key (it starts with `{SECRET_TAG}`)"))?;
        let (id, seed) = words(rest.trim(), ALGORITHM)?;
        let seed: [u8; 32] = seed
            .try_into()
            .map_err(|_| "a signing key's seed is 32 bytes".to_owned())?;
        Ok(SecretKey::from_seed(&id, seed))
    }

    /// Reads a secret key file, refusing one others may read.
    pub fn load(path: &Path) -> Result<SecretKey, String> {
        use std::os::unix::fs::MetadataExt;
        let shown = crate::quote::path(path);
        let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        if meta.mode() & 0o077 != 0 {
            return Err(format!(
                "{shown} may be read by group or others (mode {:04o}): a signing key is a secret; chmod 600 {shown}",
                meta.mode() & 0o7777
            ));
        }
        let mut text = String::new();
        file.take(4 << 10)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        SecretKey::parse(&text).map_err(|e| format!("{shown}: {e}"))
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The secret key file's line.
    pub fn secret_line(&self) -> String {
        format!(
            "{SECRET_TAG} {ALGORITHM} {} {}\n",
            self.id,
            crate::base64::encode(self.key.as_bytes())
        )
    }

    /// The line a host pins in `--trusted-keys`.
    pub fn public_line(&self) -> String {
        format!(
            "{ALGORITHM} {} {}\n",
            self.id,
            crate::base64::encode(self.key.verifying_key().as_bytes())
        )
    }

    /// The signature over [`CONTEXT`] then `bytes`.
    pub fn sign(&self, bytes: &[u8]) -> Vec<u8> {
        self.key.sign(&signed_message(bytes)).to_bytes().to_vec()
    }

    /// A detached signature file's line for `bytes`.
    pub fn signature_line(&self, bytes: &[u8]) -> String {
        format!(
            "{ALGORITHM} {} {}\n",
            self.id,
            crate::base64::encode(&self.sign(bytes))
        )
    }
}

/// Parses a detached signature file's line: (key id, signature).
pub fn parse_signature_line(text: &str) -> Result<(String, Vec<u8>), String> {
    words(text.trim(), ALGORITHM)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, n: u8) -> SecretKey {
        SecretKey::from_seed(id, [n; 32])
    }

    fn pinned(keys: &[&SecretKey]) -> TrustedKeys {
        let text: String = keys.iter().map(|k| k.public_line()).collect();
        TrustedKeys::parse(&text).expect("trusted keys")
    }

    #[test]
    fn a_signature_by_a_pinned_key_verifies() {
        let k = key("cp-2026", 1);

        let verified = pinned(&[&k]).verify("cp-2026", &k.sign(b"desired"), b"desired");

        assert_eq!(
            verified,
            Ok(Verified {
                key_id: "cp-2026".into()
            })
        );
    }

    #[test]
    fn one_changed_byte_fails_naming_the_key() {
        let k = key("cp", 1);

        let refused = pinned(&[&k]).verify("cp", &k.sign(b"desired"), b"desirEd");

        assert_eq!(
            refused,
            Err(Refusal::BadSignature {
                key_id: "cp".into()
            })
        );
    }

    #[test]
    fn a_signature_without_the_context_is_refused() {
        let k = key("cp", 1);
        let bare = k.key.sign(b"desired").to_bytes();

        assert!(pinned(&[&k]).verify("cp", &bare, b"desired").is_err());
    }

    #[test]
    fn another_key_under_a_pinned_id_is_refused() {
        let (pinned_key, forger) = (key("cp", 1), key("cp", 2));

        let refused = pinned(&[&pinned_key]).verify("cp", &forger.sign(b"x"), b"x");

        assert!(matches!(refused, Err(Refusal::BadSignature { .. })));
    }

    #[test]
    fn an_unpinned_id_is_refused_naming_it() {
        let k = key("other", 1);

        let refused = pinned(&[&key("cp", 1)]).verify("other", &k.sign(b"x"), b"x");

        assert_eq!(
            refused,
            Err(Refusal::UnknownKey {
                key_id: "other".into()
            })
        );
    }

    #[test]
    fn a_secret_key_line_round_trips() {
        let k = key("pipeline", 7);

        let back = SecretKey::parse(&k.secret_line()).expect("parse");

        assert_eq!(back.public_line(), k.public_line());
    }

    #[test]
    fn a_signature_line_round_trips() {
        let k = key("pipeline", 7);

        let (id, sig) = parse_signature_line(&k.signature_line(b"file")).expect("parse");

        assert!(pinned(&[&k]).verify(&id, &sig, b"file").is_ok());
    }

    #[test]
    fn a_key_pinned_twice_is_an_error() {
        let k = key("cp", 1);
        let text = format!("{}{}", k.public_line(), k.public_line());

        let err = TrustedKeys::parse(&text).expect_err("twice");

        assert!(err.contains("pinned twice"), "{err}");
    }

    #[test]
    fn comments_and_blank_lines_are_skipped() {
        let k = key("cp", 1);
        let text = format!("# the control plane\n\n{}", k.public_line());

        let keys = TrustedKeys::parse(&text).expect("parse");

        assert_eq!(keys.ids().collect::<Vec<_>>(), vec!["cp"]);
    }

    #[test]
    fn an_empty_file_is_an_error_naming_keygen() {
        let err = TrustedKeys::parse("# nothing\n").expect_err("empty");

        assert!(err.contains("keygen"), "{err}");
    }
}
