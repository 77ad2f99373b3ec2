//! `eitri-agent keygen` and `eitri-agent sign`: the signer's side of signed
//! desired state (see [`crate::trust`]), so an operator or a pipeline needs
//! no other tool to make a key or sign a desired file.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::process::ExitCode;

use crate::source::FileSource;
use crate::trust::SecretKey;

/// Makes a key named `id`, writes its secret to `out` (0600, never over an
/// existing file) and prints the line a host pins in `--trusted-keys`.
pub(super) fn keygen(id: &str, out: &Path) -> ExitCode {
    let key = match SecretKey::generate(id) {
        Ok(key) => key,
        Err(e) => return refuse(&e.to_string()),
    };
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .and_then(|mut f| {
            f.write_all(key.secret_line().as_bytes())?;
            f.sync_all()
        });
    if let Err(e) = written {
        return refuse(&format!(
            "cannot write the new key to {}: {e} (an existing key is never overwritten)",
            out.display()
        ));
    }
    eprintln!(
        "eitri-agent: wrote the signing key {} to {}; pin the line below in each host's --trusted-keys file",
        key.id(),
        out.display()
    );
    print!("{}", key.public_line());
    ExitCode::SUCCESS
}

/// Signs `file`'s exact bytes with the key in `key_file`, writing the
/// signature beside it (`FILE.sig`), or with `embed` as the file's own
/// first line; either replaced atomically. With `valid_for`, the file's
/// top-level `not_after_unix_ms` is set (or replaced) to now and that
/// first, in its text, and the file written back with it.
pub(super) fn sign(
    key_file: &Path,
    file: &Path,
    embed: bool,
    valid_for: Option<std::time::Duration>,
) -> ExitCode {
    let key = match SecretKey::load(key_file) {
        Ok(key) => key,
        Err(e) => return refuse(&e.to_string()),
    };
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) => return refuse(&format!("cannot read {}: {e}", file.display())),
    };
    let (carried, body) = crate::trust::split_embedded(&text);
    if carried.is_some() && !embed {
        return refuse(&format!(
            "{} carries its own signature (its first line); sign it again with --embed, which replaces that line",
            file.display()
        ));
    }
    if let Err(why) = names_its_host(body.as_bytes()) {
        return refuse(&format!("will not sign {}: {why}", file.display()));
    }
    let stamped;
    let body = match valid_for {
        Some(valid_for) => {
            let until = crate::human::unix_ms(std::time::SystemTime::now() + valid_for);
            stamped = match with_expiry(body, until) {
                Ok(stamped) => stamped,
                Err(why) => return refuse(&format!("will not sign {}: {why}", file.display())),
            };
            if !embed && let Err(e) = crate::state::atomic::write_atomic(file, stamped.as_bytes()) {
                return refuse(&format!("cannot write {}: {e}", file.display()));
            }
            stamped.as_str()
        }
        None => body,
    };
    let line = key.signature_line(body.as_bytes());
    let (written, into) = if embed {
        let signed = format!("{line}{body}");
        (
            crate::state::atomic::write_atomic(file, signed.as_bytes()),
            file.to_path_buf(),
        )
    } else {
        let sig_path = FileSource::signature_path(file);
        (
            crate::state::atomic::write_atomic(&sig_path, line.as_bytes()),
            sig_path,
        )
    };
    if let Err(e) = written {
        return refuse(&format!("cannot write {}: {e}", into.display()));
    }
    eprintln!(
        "eitri-agent: signed {} with key {}: {}",
        file.display(),
        key.id(),
        if embed {
            "its first line".to_owned()
        } else {
            into.display().to_string()
        }
    );
    ExitCode::SUCCESS
}

/// `body` (a desired file's JSON) with its top-level `not_after_unix_ms`
/// set to `until`: its value replaced where it has one, else the key put
/// first in the object, on its first line, so every other line keeps its
/// number (errors in a desired file name lines).
fn with_expiry(body: &str, until: u64) -> Result<String, String> {
    use serde_json::value::RawValue;
    const KEY: &str = "not_after_unix_ms";
    let top: std::collections::BTreeMap<&str, &RawValue> =
        serde_json::from_str(body).map_err(|e| format!("it is not a JSON object: {e}"))?;
    if let Some(value) = top.get(KEY) {
        // The value is a slice of `body`: where it lies in it.
        let text = value.get();
        let at = (text.as_ptr() as usize)
            .checked_sub(body.as_ptr() as usize)
            .filter(|at| at + text.len() <= body.len())
            .ok_or("its not_after_unix_ms could not be found in its text")?;
        return Ok(format!(
            "{}{until}{}",
            &body[..at],
            &body[at + text.len()..]
        ));
    }
    let open = body.find('{').ok_or("it is not a JSON object")?;
    let empty = top.is_empty();
    let (head, tail) = body.split_at(open + 1);
    let sep = if empty { "" } else { ", " };
    Ok(format!("{head}\"{KEY}\": {until}{sep}{tail}"))
}

/// Prints the public line of the host's own key in `state_dir` (see
/// [`SecretKey::host_key`]), for its control plane to pin.
pub(super) fn host_key(state_dir: &Path) -> ExitCode {
    let path = crate::state::Layout::new(state_dir).host_signing_key();
    // As the agent makes it: a jailed VMM reaches its own files by name.
    let made = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(state_dir);
    if let Err(e) = made {
        return refuse(&format!("cannot make {}: {e}", state_dir.display()));
    }
    match SecretKey::host_key(&path) {
        Ok(key) => {
            print!("{}", key.public_line());
            ExitCode::SUCCESS
        }
        Err(e) => refuse(&e.to_string()),
    }
}

/// Whether desired state `bytes` names the host it is for: every host
/// refuses a signed snapshot that does not name it, so a signature on one
/// that names none is of no use, and the mistake is said here, not later
/// on each host.
fn names_its_host(bytes: &[u8]) -> Result<(), Unsignable> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(Unsignable::NotJson)?;
    match value.get("host_id").and_then(|h| h.as_str()) {
        Some(host) if !host.trim().is_empty() => Ok(()),
        _ => Err(Unsignable::NoHost),
    }
}

/// Why a file is not signed: a signature on it would be of no use.
#[derive(Debug)]
enum Unsignable {
    NotJson(serde_json::Error),
    NoHost,
}

impl std::fmt::Display for Unsignable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unsignable::NotJson(e) => write!(f, "it is not desired state (JSON): {e}"),
            Unsignable::NoHost => f.write_str(
                "it names no host_id, and a host refuses a signed snapshot that does not name it (so one host's cannot be replayed to another); add \"host_id\": \"<the host's id, as `eitri-agent status` shows it>\"",
            ),
        }
    }
}

impl std::error::Error for Unsignable {}

fn refuse(why: &str) -> ExitCode {
    eprintln!("eitri-agent: error: {why}");
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_goes_first_in_the_object_keeping_every_line() {
        let body = "{\n  \"epoch\": 3,\n  \"host_id\": \"h\"\n}\n";

        let stamped = with_expiry(body, 1234).expect("stamped");

        assert_eq!(
            stamped,
            "{\"not_after_unix_ms\": 1234, \n  \"epoch\": 3,\n  \"host_id\": \"h\"\n}\n"
        );
        assert_eq!(stamped.lines().count(), body.lines().count());
    }

    #[test]
    fn an_expiry_already_there_is_replaced() {
        let body = "{\"epoch\": 3, \"not_after_unix_ms\": 99, \"host_id\": \"h\"}";

        let stamped = with_expiry(body, 1234).expect("stamped");

        assert_eq!(
            stamped,
            "{\"epoch\": 3, \"not_after_unix_ms\": 1234, \"host_id\": \"h\"}"
        );
    }

    #[test]
    fn an_empty_object_takes_the_expiry_alone() {
        assert_eq!(
            with_expiry("{}", 7).expect("stamped"),
            "{\"not_after_unix_ms\": 7}"
        );
    }
}
