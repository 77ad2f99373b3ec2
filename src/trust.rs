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
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};

/// What every signature of desired state covers before the signed bytes.
pub const CONTEXT: &[u8] = b"eitri.agent.v1.Snapshot\n";
/// What a host's signature of its report covers before the request's
/// bytes: no report signature is a snapshot's, nor the other way round.
pub const REPORT_CONTEXT: &[u8] = b"eitri.agent.v1.ReportRequest\n";
/// How far past its `not_after` a snapshot is still taken: clocks of a
/// control plane and a host disagree by this much at most.
pub const SKEW: std::time::Duration = std::time::Duration::from_secs(300);

/// Refuses a snapshot whose `not_after_ms` (0: none) passed more than
/// [`SKEW`] before `now` (see the proto).
pub fn in_date(key_id: &str, not_after_ms: u64, now: std::time::SystemTime) -> Result<(), Refusal> {
    let now_ms = crate::human::unix_ms(now);
    let skew = u64::try_from(SKEW.as_millis()).unwrap_or(u64::MAX);
    if not_after_ms == 0 || now_ms <= not_after_ms.saturating_add(skew) {
        return Ok(());
    }
    Err(Refusal::Expired {
        key_id: key_id.to_owned(),
        not_after_ms,
        now_ms,
    })
}

/// The HTTP header a signed report's signature travels in.
pub const REPORT_SIGNATURE_HEADER: &str = "Eitri-Signature";

const ALGORITHM: &str = "ed25519";
const SECRET_TAG: &str = "eitri-signing-key";
/// Keys a host may pin: enough for any rotation, few enough to try each.
const MAX_KEYS: usize = 64;

/// Why a key file, a key line or a signature line is refused.
#[derive(Debug)]
pub enum KeyError {
    /// The file cannot be read.
    Read {
        path: PathBuf,
        source: io::Error,
    },
    /// A trusted-keys file others may write, or a signing key others may
    /// read: `mode` is its permission bits.
    Exposed {
        path: PathBuf,
        mode: u32,
        secret: bool,
    },
    /// What is wrong inside the file at `path`.
    In {
        path: PathBuf,
        source: Box<KeyError>,
    },
    /// What is wrong on line `line` (from 1).
    Line {
        line: usize,
        source: Box<KeyError>,
    },
    /// Not the three words `TAG KEY-ID BASE64`.
    Shape {
        tag: &'static str,
    },
    /// Another algorithm than ed25519.
    Algorithm {
        found: String,
        tag: &'static str,
    },
    Id {
        id: String,
    },
    Base64,
    PublicKeyLength,
    NotPublicKey,
    PinnedTwice {
        id: String,
    },
    NoKeys,
    TooMany {
        count: usize,
    },
    NotSigningKey,
    SeedLength,
    Randomness {
        source: io::Error,
    },
    /// A key could not be written.
    Write {
        path: PathBuf,
        source: io::Error,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use KeyError as E;
        match self {
            E::Read { path, source } => {
                write!(f, "cannot read {}: {source}", crate::quote::path(path))
            }
            E::Write { path, .. } => {
                write!(f, "cannot write the key {}", crate::quote::path(path))
            }
            E::Exposed {
                path,
                mode,
                secret: false,
            } => {
                let shown = crate::quote::path(path);
                write!(
                    f,
                    "{shown} may be written by group or others (mode {mode:04o}): anyone who can \
                     add a line to it can sign this host's desired state; chmod go-w {shown}"
                )
            }
            E::Exposed {
                path,
                mode,
                secret: true,
            } => {
                let shown = crate::quote::path(path);
                write!(
                    f,
                    "{shown} may be read by group or others (mode {mode:04o}): a signing key is \
                     a secret; chmod 600 {shown}"
                )
            }
            E::In { path, source } => write!(f, "{}: {source}", crate::quote::path(path)),
            E::Line { line, source } => write!(f, "line {line}: {source}"),
            E::Shape { tag } => write!(f, "expected `{tag} KEY-ID BASE64`"),
            E::Algorithm { found, tag } => write!(
                f,
                "{} is not {tag}: only ed25519 keys are taken",
                crate::quote::text(found)
            ),
            E::Id { id } => write!(
                f,
                "{} is not a key id (1-64 letters, digits, '.', '_' or '-')",
                crate::quote::text(id)
            ),
            E::Base64 => f.write_str("the key is not base64"),
            E::PublicKeyLength => f.write_str("a public key is 32 bytes"),
            E::NotPublicKey => f.write_str("not an ed25519 public key"),
            E::PinnedTwice { id } => {
                write!(f, "key id {} is pinned twice", crate::quote::text(id))
            }
            E::NoKeys => f.write_str(
                "no keys: pin at least one `ed25519 KEY-ID PUBLIC-KEY` line \
                 (eitri-agent keygen prints one)",
            ),
            E::TooMany { count } => write!(f, "{count} keys, at most {MAX_KEYS}"),
            E::NotSigningKey => {
                write!(f, "not a signing key (it starts with `{SECRET_TAG}`)")
            }
            E::SeedLength => f.write_str("a signing key's seed is 32 bytes"),
            E::Randomness { source } => write!(f, "cannot gather randomness: {source}"),
        }
    }
}

impl std::error::Error for KeyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KeyError::Read { source, .. }
            | KeyError::Write { source, .. }
            | KeyError::Randomness { source } => Some(source),
            KeyError::In { source, .. } | KeyError::Line { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// Why a key id is not one.
fn check_id(id: &str) -> Result<(), KeyError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(KeyError::Id { id: id.to_owned() })
    }
}

/// Opens a key file of at most `limit` bytes, refusing one whose mode has
/// any bit of `forbidden` (others may write it, or read a secret).
fn read_key_file(path: &Path, forbidden: u32, limit: u64) -> Result<String, KeyError> {
    use std::os::unix::fs::MetadataExt;
    let read = |source| KeyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let meta = file.metadata().map_err(read)?;
    if meta.mode() & forbidden != 0 {
        return Err(KeyError::Exposed {
            path: path.to_path_buf(),
            mode: meta.mode() & 0o7777,
            secret: forbidden == 0o077,
        });
    }
    let mut text = String::new();
    file.take(limit).read_to_string(&mut text).map_err(read)?;
    Ok(text)
}

/// `e`, said of the file at `path`.
fn in_file(path: &Path) -> impl Fn(KeyError) -> KeyError + '_ {
    move |e| KeyError::In {
        path: path.to_path_buf(),
        source: Box::new(e),
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
    /// Past its `not_after`, and the allowance for skew.
    Expired {
        key_id: String,
        not_after_ms: u64,
        now_ms: u64,
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
            Refusal::Expired {
                key_id,
                not_after_ms,
                now_ms,
            } => write!(
                f,
                "it expired {} s ago (not_after_unix_ms {not_after_ms}; this host's clock says {now_ms}, allowing {} s of skew){}: the control plane must send a fresh one, or this host's clock is wrong",
                now_ms.saturating_sub(*not_after_ms) / 1000,
                SKEW.as_secs(),
                if key_id.is_empty() {
                    String::new()
                } else {
                    format!(" (signed by key {})", crate::quote::text(key_id))
                }
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
    pub fn load(path: &Path) -> Result<TrustedKeys, KeyError> {
        let text = read_key_file(path, 0o022, 64 << 10)?;
        let mut keys = TrustedKeys::parse(&text).map_err(in_file(path))?;
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
    pub fn parse(text: &str) -> Result<TrustedKeys, KeyError> {
        let mut keys: Vec<(String, VerifyingKey)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |e: KeyError| KeyError::Line {
                line: n + 1,
                source: Box::new(e),
            };
            let (id, bytes) = words(line, ALGORITHM).map_err(at)?;
            let bytes: [u8; 32] = bytes
                .try_into()
                .map_err(|_| at(KeyError::PublicKeyLength))?;
            let key = VerifyingKey::from_bytes(&bytes).map_err(|_| at(KeyError::NotPublicKey))?;
            if keys.iter().any(|(other, _)| *other == id) {
                return Err(at(KeyError::PinnedTwice { id }));
            }
            keys.push((id, key));
        }
        if keys.is_empty() {
            return Err(KeyError::NoKeys);
        }
        if keys.len() > MAX_KEYS {
            return Err(KeyError::TooMany { count: keys.len() });
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

    /// Checks a host's report: `header`, its [`REPORT_SIGNATURE_HEADER`],
    /// by a key pinned here, over [`REPORT_CONTEXT`] then `body`. What a
    /// control plane does with the key `host-key` printed for the host.
    pub fn verify_report(&self, header: &str, body: &[u8]) -> Result<Verified, Refusal> {
        let (key_id, signature) = parse_signature_line(header).map_err(|e| Refusal::Unsigned {
            why: format!("the report's signature header is not a signature: {e}"),
        })?;
        let Some((_, key)) = self.keys.iter().find(|(id, _)| *id == key_id) else {
            return Err(Refusal::UnknownKey { key_id });
        };
        let bad = || Refusal::BadSignature {
            key_id: key_id.clone(),
        };
        let signature = Signature::from_slice(&signature).map_err(|_| bad())?;
        key.verify(&in_context(REPORT_CONTEXT, body), &signature)
            .map_err(|_| bad())?;
        Ok(Verified { key_id })
    }
}

/// A key's 32 bytes of seed, from the kernel's randomness.
fn random_seed() -> Result<[u8; 32], KeyError> {
    let mut seed = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut seed))
        .map_err(|source| KeyError::Randomness { source })?;
    Ok(seed)
}

fn signed_message(bytes: &[u8]) -> Vec<u8> {
    in_context(CONTEXT, bytes)
}

fn in_context(context: &[u8], bytes: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(context.len() + bytes.len());
    message.extend_from_slice(context);
    message.extend_from_slice(bytes);
    message
}

/// `TAG KEY-ID BASE64`: the id and the decoded bytes.
fn words(line: &str, tag: &'static str) -> Result<(String, Vec<u8>), KeyError> {
    let mut words = line.split_whitespace();
    let (Some(first), Some(id), Some(b64), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(KeyError::Shape { tag });
    };
    if first != tag {
        return Err(KeyError::Algorithm {
            found: first.to_owned(),
            tag,
        });
    }
    check_id(id)?;
    let bytes = crate::base64::decode(b64).ok_or(KeyError::Base64)?;
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
    pub fn generate(id: &str) -> Result<SecretKey, KeyError> {
        check_id(id)?;
        Ok(SecretKey::from_seed(id, random_seed()?))
    }

    /// The key of a 32-byte seed (tests and benchmarks name their keys).
    pub fn from_seed(id: &str, seed: [u8; 32]) -> SecretKey {
        SecretKey {
            id: id.to_owned(),
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// Parses a secret key file's line.
    pub fn parse(text: &str) -> Result<SecretKey, KeyError> {
        let line = text.trim();
        let rest = line
            .strip_prefix(SECRET_TAG)
            .ok_or(KeyError::NotSigningKey)?;
        let (id, seed) = words(rest.trim(), ALGORITHM)?;
        let seed: [u8; 32] = seed.try_into().map_err(|_| KeyError::SeedLength)?;
        Ok(SecretKey::from_seed(&id, seed))
    }

    /// Reads a secret key file, refusing one others may read.
    pub fn load(path: &Path) -> Result<SecretKey, KeyError> {
        let text = read_key_file(path, 0o077, 4 << 10)?;
        SecretKey::parse(&text).map_err(in_file(path))
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

    /// The [`REPORT_SIGNATURE_HEADER`] of a report request's `body`.
    pub fn report_signature(&self, body: &[u8]) -> String {
        let signature = self.key.sign(&in_context(REPORT_CONTEXT, body));
        format!(
            "{ALGORITHM} {} {}",
            self.id,
            crate::base64::encode(&signature.to_bytes())
        )
    }

    /// The host's own key at `path` (in its state dir), made the first
    /// time it is asked for: `host-` and the start of its public key's
    /// SHA-256 name it, so its id says which key it is. Written once,
    /// never over another (two makers at once both end with the one that
    /// landed first).
    pub fn host_key(path: &Path) -> Result<SecretKey, KeyError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        match SecretKey::load(path) {
            Err(KeyError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            loaded => return loaded,
        }
        let seed = random_seed()?;
        let public = SigningKey::from_bytes(&seed).verifying_key();
        let digest = <sha2::Sha256 as sha2::Digest>::digest(public.as_bytes());
        let key = SecretKey::from_seed(&format!("host-{}", crate::hex::encode(&digest[..6])), seed);
        let made = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .and_then(|mut f| {
                f.write_all(key.secret_line().as_bytes())?;
                f.sync_all()
            });
        match made {
            Ok(()) => Ok(key),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => SecretKey::load(path),
            Err(source) => Err(KeyError::Write {
                path: path.to_path_buf(),
                source,
            }),
        }
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

/// A file that carries its own signature: its first line is a signature
/// line, and what follows it is the signed bytes, exactly. (The line, if
/// there is one; the signed bytes.) Desired state as JSON cannot begin
/// with the algorithm's name, so a file is one or the other.
pub fn split_embedded(text: &str) -> (Option<&str>, &str) {
    match text.split_once('\n') {
        Some((line, rest))
            if line.starts_with(ALGORITHM) && line[ALGORITHM.len()..].starts_with(' ') =>
        {
            (Some(line), rest)
        }
        _ => (None, text),
    }
}

/// Parses a detached signature file's line: (key id, signature).
pub fn parse_signature_line(text: &str) -> Result<(String, Vec<u8>), KeyError> {
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
    fn a_host_key_is_made_once_secret_and_named_by_its_public_half() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("host-signing-key");

        let made = SecretKey::host_key(&path).expect("made");
        let again = SecretKey::host_key(&path).expect("loaded");

        assert_eq!(made.public_line(), again.public_line());
        let mode = std::fs::metadata(&path).expect("file").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let id = made.id();
        assert!(
            id.starts_with("host-")
                && id.len() == 17
                && id[5..].bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
    }

    #[test]
    fn a_report_signature_is_no_snapshot_signature() {
        let k = key("host-1", 1);
        let body = b"a report request";
        let header = k.report_signature(body);
        let (id, signature) = parse_signature_line(&header).expect("a signature line");

        let as_report = pinned(&[&k]).verify_report(&header, body);
        let as_snapshot = pinned(&[&k]).verify(&id, &signature, body);

        assert!(as_report.is_ok(), "{as_report:?}");
        assert!(matches!(as_snapshot, Err(Refusal::BadSignature { .. })));
    }

    #[test]
    fn a_snapshot_expires_only_past_its_not_after_and_the_skew() {
        use std::time::{Duration, UNIX_EPOCH};
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        let skew = SKEW.as_millis() as u64;

        assert!(in_date("k", 0, at(u64::MAX / 2)).is_ok(), "0 never expires");
        assert!(in_date("k", 1_000, at(1_000 + skew)).is_ok());
        assert!(matches!(
            in_date("k", 1_000, at(1_001 + skew)),
            Err(Refusal::Expired {
                not_after_ms: 1_000,
                ..
            })
        ));
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

        let err = TrustedKeys::parse(&text).expect_err("twice").to_string();

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
        let err = TrustedKeys::parse("# nothing\n")
            .expect_err("empty")
            .to_string();

        assert!(err.contains("keygen"), "{err}");
    }

    #[test]
    fn a_bad_line_is_named_by_its_file_and_line_and_keeps_its_cause() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("keys");
        let good = key("cp", 1).public_line();
        std::fs::write(&path, format!("{good}rsa cp2 AAAA\n")).expect("write");

        let err = TrustedKeys::load(&path).expect_err("refused");

        assert!(
            err.to_string()
                .ends_with(": line 2: \"rsa\" is not ed25519: only ed25519 keys are taken"),
            "{err}"
        );
        let line = std::error::Error::source(&err).expect("the line's error");
        assert!(matches!(
            std::error::Error::source(line).and_then(|e| e.downcast_ref::<KeyError>()),
            Some(KeyError::Algorithm { .. })
        ));
    }
}
