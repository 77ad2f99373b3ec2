//! Guest host keys, checked by OpenSSH's own ssh-keygen.

use std::os::unix::fs::PermissionsExt;

use eitri_agent::hostkey::LocalHostKeys;

fn ssh_keygen(args: &[&str], key: &std::path::Path) -> String {
    let out = eitri_agent::testkit::tools::tool("ssh-keygen")
        .args(args)
        .arg(key)
        .output()
        .expect("ssh-keygen (openssh-client)");
    assert!(
        out.status.success(),
        "ssh-keygen {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ssh_keygen_derives_the_reported_public_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vm-1/ssh_host_ed25519_key");

    let key = LocalHostKeys.load_or_create(&path).expect("created");

    let derived = ssh_keygen(&["-y", "-f"], &path);
    let mut ours = key.public_line.split(' ');
    let mut theirs = derived.trim().split(' ');
    assert_eq!((ours.next(), ours.next()), (theirs.next(), theirs.next()));
}

#[test]
fn ssh_keygen_fingerprints_it_as_ed25519() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vm-1/ssh_host_ed25519_key");
    LocalHostKeys.load_or_create(&path).expect("created");

    let fingerprint = ssh_keygen(&["-l", "-f"], &path);

    assert!(
        fingerprint.contains("SHA256:") && fingerprint.contains("(ED25519)"),
        "{fingerprint}"
    );
}

#[test]
fn the_private_key_is_readable_by_its_owner_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vm-1/ssh_host_ed25519_key");

    LocalHostKeys.load_or_create(&path).expect("created");

    let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn the_same_key_comes_back_on_the_next_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vm-1/ssh_host_ed25519_key");
    let first = LocalHostKeys.load_or_create(&path).expect("created");

    let again = LocalHostKeys.load_or_create(&path).expect("loaded");

    assert_eq!(again, first);
}

#[test]
fn a_key_made_by_ssh_keygen_is_loaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("key");
    let made = eitri_agent::testkit::tools::tool("ssh-keygen")
        .args([
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "made-elsewhere",
            "-f",
        ])
        .arg(&path)
        .status()
        .expect("ssh-keygen");
    assert!(made.success());

    let key = LocalHostKeys.load_or_create(&path).expect("loaded");

    let public = std::fs::read_to_string(dir.path().join("key.pub")).expect("pub");
    assert_eq!(key.public_line, public.trim());
}

#[test]
fn a_file_that_is_not_a_key_is_a_permanent_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("key");
    std::fs::write(&path, "not a key").expect("write");

    let err = LocalHostKeys.load_or_create(&path).expect_err("refused");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("move it away"), "{err}");
}
